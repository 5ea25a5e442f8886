"""GPR model: validation, priority classes, backoff, and the transition table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_extender.core.gpr import (
    GPR,
    TRANSITIONS,
    InvalidTransition,
    Phase,
    backoff_delay,
    priority_class,
)


def test_priority_classes() -> None:
    assert [priority_class(p) for p in (1, 100, 101, 200, 201, 300)] == ["low", "low", "medium", "medium", "high", "high"]
    with pytest.raises(ValueError):
        priority_class(0)
    with pytest.raises(ValueError):
        priority_class(301)


def test_backoff_doubles_from_60s_and_caps_at_an_hour() -> None:
    assert [backoff_delay(n) for n in range(1, 9)] == [60, 120, 240, 480, 960, 1920, 3600, 3600]


@given(st.integers(1, 10_000))
def test_backoff_monotone_and_capped(n: int) -> None:
    assert backoff_delay(n) <= 3600 and backoff_delay(n) <= backoff_delay(n + 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("resource", "example.com/tpu"),
        ("devices_per_node", 0),
        ("milli_per_device", 0),
        ("milli_per_device", 1001),
        ("node_count", 0),
        ("priority", 301),
        ("exit_duration_s", 0),
        ("retry_limit", -1),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    g = GPR("x")
    setattr(g, field, value)
    with pytest.raises(ValueError):
        g.validate()


def test_fraction_only_with_one_device() -> None:
    with pytest.raises(ValueError, match="fraction"):
        GPR("x", devices_per_node=2, milli_per_device=500).validate()
    GPR("x", devices_per_node=1, milli_per_device=500).validate()


def test_every_transition_outside_the_table_is_refused() -> None:
    for src in Phase:
        for dst in Phase:
            g = GPR("x")
            g.phase = src
            if dst in TRANSITIONS[src]:
                g.transition(dst, 1.0, "r")
                assert g.phase is dst and g.history[-1] == (1.0, dst, "r")
            else:
                with pytest.raises(InvalidTransition):
                    g.transition(dst, 1.0)


def test_lifecycle_timestamps() -> None:
    g = GPR("x", exit_duration_s=100)
    g.transition(Phase.ADMITTED, 10)
    assert g.end_bound() == 110
    g.transition(Phase.RUNNING, 12)
    assert g.started_at == g.last_active_at == 12
    g.transition(Phase.FAILED, 20)
    g.transition(Phase.QUEUED, 20)
    assert g.admitted_at is None and g.end_bound() == float("inf")
