"""Status conditions as the controllers write them (workspaces, accelerator nodes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def status_differs(current: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` says something ``current`` does not: conditions compared without their
    ``lastTransitionTime`` (a write that moves only that time is no change)."""
    def strip(status: Mapping[str, Any]) -> Any:
        return {**status, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                         for c in status.get("conditions") or () if isinstance(c, Mapping)]}

    return bool(strip(current) != strip(new))
