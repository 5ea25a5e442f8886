"""A GPR read afresh (filter's catch-up read) is taken only when newer than what the watch brought, and the
watch's older events for it never step the view back."""

from __future__ import annotations

from typing import Any

from scheduler_extender.objects.cluster import ClusterView
from tests.extender.harness import gpr


def at(obj: dict[str, Any], version: int) -> dict[str, Any]:
    obj["metadata"]["resourceVersion"] = str(version)
    return obj


def test_a_fresher_read_is_taken_and_older_watch_events_are_skipped() -> None:
    view = ClusterView()
    view.on_gpr("ADDED", at(gpr("g", phase="Queued"), 10))
    assert not view.take_fresher_gpr(at(gpr("g", phase="Queued"), 10))  # not newer: nothing changes
    assert not view.take_fresher_gpr(at(gpr("g", phase="Queued"), 9))
    assert view.take_fresher_gpr(at(gpr("g", reservation={"n1": 1}), 14))
    assert view.gprs["default/g"].phase == "Admitted"
    assert view.reserved == {"n1": {"default/g": 1}}
    view.on_gpr("MODIFIED", at(gpr("g", phase="Queued"), 12))  # the watch, late: skipped
    assert view.gprs["default/g"].phase == "Admitted" and view.reserved == {"n1": {"default/g": 1}}
    view.on_gpr("MODIFIED", at(gpr("g", reservation={"n1": 1}), 14))  # the watch catches up
    view.on_gpr("MODIFIED", at(gpr("g", phase="Complete"), 20))  # and goes on as before
    assert view.gprs["default/g"].phase == "Complete" and not view.reserved.get("n1")


def test_a_deletion_after_the_read_is_taken() -> None:
    view = ClusterView()
    view.on_gpr("ADDED", at(gpr("g", phase="Queued"), 10))
    assert view.take_fresher_gpr(at(gpr("g", reservation={"n1": 1}), 14))
    view.on_gpr("DELETED", at(gpr("g", reservation={"n1": 1}), 30))
    assert "default/g" not in view.gprs and not view.reserved.get("n1")


def test_a_relist_is_the_truth_and_ends_the_skipping() -> None:
    view = ClusterView()
    view.on_gpr("ADDED", at(gpr("g", phase="Queued"), 10))
    assert view.take_fresher_gpr(at(gpr("g", reservation={"n1": 1}), 14))
    view.sync_gprs([at(gpr("g", phase="Queued"), 11)])
    assert view.gprs["default/g"].phase == "Queued"
    view.on_gpr("MODIFIED", at(gpr("g", phase="Queued"), 12))  # after a relist the watch is followed again
    assert view.gprs["default/g"].resource_version == "12"


def test_versions_that_are_not_numbers_are_never_compared() -> None:
    view = ClusterView()
    view.on_gpr("ADDED", at(gpr("g", phase="Queued"), 10))
    obj = gpr("g", reservation={"n1": 1})
    obj["metadata"]["resourceVersion"] = "opaque-token"
    assert not view.take_fresher_gpr(obj)
    assert view.gprs["default/g"].phase == "Queued"
