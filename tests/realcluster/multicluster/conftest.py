"""The multi-cluster tests' world (tests/realcluster/mc_world.py), started once for this package and stopped when
its last test has run: its three control planes, the members' stacks and agents never run beside the other
real-cluster tests (this package is collected before them, and the session's own control plane starts only when
a test outside it first asks for it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.realcluster.mc_world import World, start_world


@pytest.fixture(scope="package")
def mc_world() -> Iterator[World]:
    yield from start_world()
