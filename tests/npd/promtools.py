"""Finding promtool/prometheus (Debian package ``prometheus``, installed by scripts/npd-deps.sh) and writing the
PrometheusRule's groups as a plain rules file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import STRICT

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} not installed (Debian package prometheus; scripts/npd-deps.sh installs it)"
        if STRICT:
            pytest.fail(message)
        pytest.skip(message)
    return path


def write_rules(target: Path) -> Path:
    rule = yaml.safe_load((MANIFESTS / "monitoring/prometheusrule.yaml").read_text())
    target.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return target
