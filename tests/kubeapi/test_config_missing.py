"""Every process that talks to the API server, started without a kubeconfig and outside a cluster, says so in
one line and exits 1 (issue 35.7: two printed a 40-line traceback, three said only "Expected key
current-context"; the gateway printed a traceback). The device plugin's labeller, optional, says it in one
warning and the plugin runs on: tests/device_plugin/test_process.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = {
    "extender": ["scheduler_extender.cmd.extender", "--insecure-verbs=true"],
    "controller": ["scheduler_extender.cmd.controller"],
    "inference operator": ["inference.operator.main"],
    "remediation": ["npd.remediation"],
    "gateway": ["inference.gateway.main"],
}


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_no_kubeconfig_outside_a_cluster_is_one_line_naming_what_is_missing(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "KUBECONFIG"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", *PROCESSES[name]], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    assert run.returncode == 1, (run.returncode, lines)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "no Kubernetes credentials" in lines[0] and "--kubeconfig" in lines[0], lines[0]
    assert f"{tmp_path}/.kube/config" in lines[0], lines[0]
