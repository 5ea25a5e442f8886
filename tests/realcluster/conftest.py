"""Fixtures for the tests against the real control plane (marker ``realcluster``).

One control plane per test run (session scope), the shipped manifests applied once, the product's extender and
controller started once (``stack``); each test gets a namespace of its own (``ns``) and removes what it made
cluster-wide (nodes) itself. Without ``KUBEBUILDER_ASSETS`` these tests skip with the reason; under
``ACCELSTACK_STRICT=1`` they fail instead (tests/conftest.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realcluster.controlplane import ApiCallError, ControlPlane, assets_dir, missing_assets
from tests.realcluster.shipped import install, render
from tests.realcluster.stack import Stack

_names = itertools.count()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.realcluster)


_planes: list[ControlPlane] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed real-cluster test's report ends with the last lines (debug left out) of every log of the run:
    the control plane's components and the product's processes, so a CI failure can be read without a rerun."""
    report = yield
    if report.failed and _planes and item.get_closest_marker("realcluster") is not None:
        plane = _planes[-1]
        for log in sorted(plane.dir.glob("*.log")):
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if '"level": "debug"' not in ln]
            report.sections.append((f"log {log.name} (last 15 lines; {plane.dir})", "\n".join(
                ln[:400] for ln in lines[-15:])))
    return report


@pytest.fixture(scope="session")
def cp() -> Iterator[ControlPlane]:
    folder = assets_dir()
    assert folder is not None  # tests/conftest.py skipped or failed the test otherwise
    missing = missing_assets(folder)
    if missing:
        pytest.fail(f"KUBEBUILDER_ASSETS={folder} lacks {', '.join(missing)} (scripts/test.sh links them)")
    plane = ControlPlane(folder)
    _planes.append(plane)
    try:
        yield plane.start()
    finally:
        keep = os.environ.get("ACCELSTACK_KEEP_CONTROL_PLANE")
        plane.stop() if keep else plane.cleanup()


@pytest.fixture(scope="session")
def shipped(cp: ControlPlane) -> list[dict[str, Any]]:
    """The rendered shipped manifests, installed (all but webhooks and what a loopback plane cannot hold)."""
    return install(cp, render())


@pytest.fixture(scope="session")
def stack(cp: ControlPlane, shipped: list[dict[str, Any]]) -> Iterator[Stack]:
    s = Stack(cp, shipped).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def ns(cp: ControlPlane, shipped: list[dict[str, Any]], request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace with its ``default`` ServiceAccount (the ServiceAccount controller may not be running)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"t{next(_names)}-{base}"
    cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:  # the ServiceAccount controller makes it too once kube-controller-manager runs
        cp.create(f"api/v1/namespaces/{name}/serviceaccounts",
                  {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    except ApiCallError as exc:
        if exc.status != 409:
            raise
    yield name
    # What the namespace controller would remove, removed now (it may not be running): GPRs first, so that no
    # queued GPR of this test competes with the next test's, then pods without grace (fake nodes have no kubelet)
    for path in (f"apis/accelstack.io/v1alpha1/namespaces/{name}/gpuprovisioningrequests",
                 f"apis/accelstack.io/v1alpha1/namespaces/{name}/inferenceendpoints"):
        cp.delete(path)
    cp.api("DELETE", f"api/v1/namespaces/{name}/pods", {"gracePeriodSeconds": 0})
    cp.delete(f"api/v1/namespaces/{name}")


class Nodes:
    """Fake nodes for one test: created with status (capacity, allocatable, Ready), deleted at the end."""

    def __init__(self, cp: ControlPlane, prefix: str) -> None:
        self.cp, self.prefix, self.names = cp, prefix, []  # type: ignore[var-annotated]

    def add(self, suffix: str, *, gpus: int = 8, cpu: str = "32", memory: str = "256Gi", nr1: int = 0,
            labels: dict[str, str] | None = None, taints: list[dict[str, Any]] | None = None) -> str:
        name = f"{self.prefix}-{suffix}"
        alloc = {"cpu": cpu, "memory": memory, "pods": "110"}
        if gpus:
            alloc["nvidia.com/gpu"] = str(gpus)
        if nr1:
            alloc["neureality.com/nr1"] = str(nr1)
        self.cp.create("api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {"taints": taints or []}})
        self.cp.patch(f"api/v1/nodes/{name}/status", {"status": {
            "capacity": alloc, "allocatable": alloc,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
        self.names.append(name)
        return name

    def cleanup(self) -> None:
        for name in self.names:
            self.cp.delete(f"api/v1/nodes/{name}")


@pytest.fixture
def nodes(cp: ControlPlane, ns: str) -> Iterator[Nodes]:
    n = Nodes(cp, ns)
    yield n
    n.cleanup()
