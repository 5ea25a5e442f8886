"""Suite-wide rules: how tests that need root or a GPU behave where those are missing.

On a laptop such tests skip with the reason. With ACCELSTACK_STRICT=1 (set by .ci/run; CI runs as root) a
missing *root* turns into a failure, because CI can run those tests and must not skip them silently. GPU
tests always skip without a GPU: neither a developer machine nor CI has one.
"""

from __future__ import annotations

import os

import pytest

STRICT = os.environ.get("ACCELSTACK_STRICT") == "1"


def require_root(reason: str) -> None:
    """Skip (or, under ACCELSTACK_STRICT=1, fail) when not running as root."""
    if os.geteuid() != 0:
        if STRICT:
            pytest.fail(f"needs root and ACCELSTACK_STRICT=1 forbids skipping: {reason}")
        pytest.skip(f"needs root: {reason}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        require_root(item.nodeid)
