"""Suite-wide rules: how tests that need root or a GPU behave where those are missing.

On a laptop such tests skip with the reason. With ACCELSTACK_STRICT=1 (set by .ci/run; CI runs as root) a
missing *root* turns into a failure, because CI can run those tests and must not skip them silently. Tests
marked ``realcluster`` (everything under tests/realcluster/) need the real control plane that
``KUBEBUILDER_ASSETS`` names and likewise skip, or fail under ACCELSTACK_STRICT=1. GPU
tests always skip without a GPU: neither a developer machine nor CI has one.
"""

from __future__ import annotations

import functools
import os

import pytest
from kubernetes_validate import utils as _kubernetes_validate_utils

STRICT = os.environ.get("ACCELSTACK_STRICT") == "1"

# kubernetes_validate reads and parses a kind's JSON schema and the whole _definitions.json again for every object
# it validates (24 ms an object: 4.3 s for one overlay at two versions, ~40 s of the suite). The files never change
# within a run and the validator only reads what it is given, so each (file, version) is read once.
_kubernetes_validate_utils.schema_contents = functools.cache(  # type: ignore[method-assign]
    _kubernetes_validate_utils.schema_contents)


def require_root(reason: str) -> None:
    """Skip (or, under ACCELSTACK_STRICT=1, fail) when not running as root."""
    if os.geteuid() != 0:
        if STRICT:
            pytest.fail(f"needs root and ACCELSTACK_STRICT=1 forbids skipping: {reason}")
        pytest.skip(f"needs root: {reason}")


def require_control_plane(nodeid: str) -> None:
    """Skip (or, under ACCELSTACK_STRICT=1, fail) when KUBEBUILDER_ASSETS names no real control plane."""
    if not os.environ.get("KUBEBUILDER_ASSETS", "").strip():
        why = ("KUBEBUILDER_ASSETS is unset: it names the folder with kube-apiserver, etcd and kubectl "
               "(scripts/test.sh sets it from ../shared/k8s; README 'Testing against a real control plane')")
        if STRICT:
            pytest.fail(f"{nodeid} needs the real control plane and ACCELSTACK_STRICT=1 forbids skipping: {why}")
        pytest.skip(why)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        require_root(item.nodeid)
    if item.get_closest_marker("realcluster") is not None:
        require_control_plane(item.nodeid)
