"""What a controller pass reads and returns: the snapshot of the cluster, its configuration, and the plan of writes,
ungates, evictions and Events the controller carries out (:mod:`.gpr_controller`)."""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler_extender.core.gpr import Phase
from scheduler_extender.core.predictor import DurationPredictor
from scheduler_extender.core.scheduler import Event, SchedulerConfig
from scheduler_extender.core.waittime import Calibrator
from scheduler_extender.objects.cluster import NodeView, PodView
from scheduler_extender.objects.workspaces import WorkspaceIndex

ALLOCATED = (Phase.ADMITTED, Phase.RUNNING, Phase.EVICTING)


@dataclass(frozen=True)
class Snapshot:
    """What the informers held when the pass began (shallow copies: the pass runs off the event loop)."""

    now: float
    nodes: Mapping[str, NodeView]
    pods: Mapping[str, PodView]  # by UID
    gprs: Mapping[str, dict[str, Any]]  # by UID
    refusals: Mapping[str, str] = field(default_factory=dict)  # GPR UID -> eviction refusals the API answered
    # node -> CPU (millicores) and memory (MiB) requested by the live pods bound there, accelstack's or not
    # (ClusterView.host_used); None: from ``pods`` alone (see host_used_of)
    host: Mapping[str, tuple[int, int]] | None = None


@dataclass
class PassConfig:
    policy: str = "bestfit"
    core: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(instant_eviction=False, learn=False))
    # what the controller learned of how long work runs (scheduler_extender.controller.predictor_store); read, not changed
    predictor: DurationPredictor | None = None
    calibrator: Calibrator | None = None
    refresh_queue: bool = True  # write queue positions and estimates this pass
    estimates: bool = True  # compute wait estimates when refreshing
    # refresh also when the queue differs from this (a GPR arrived, left or moved), if allowed now
    last_queue: tuple[str, ...] | None = None
    refresh_on_change: bool = True
    orphan_grace: float = 120.0  # an auto-created GPR that no pod names is deleted after this long
    # namespace -> workspace (the core's quota unit; scheduler_extender.objects.workspaces); None: namespace = workspace
    workspaces: WorkspaceIndex | None = None
    # UIDs of GPRs whose first projection the driver keeps already (predictor_store): not projected again
    noted: Container[str] = frozenset()


@dataclass
class StatusWrite:
    uid: str
    key: str
    status: dict[str, Any]
    holding: bool = False  # the status says Admitted/Running: its gated pods may be ungated once written
    # only the queue position or the wait estimate moved (a refresh): news for the user, not a decision, so the
    # controller may pace these writes; one left unwritten is planned again at the next refresh
    queue_only: bool = False


@dataclass
class Eviction:
    pod: PodView
    why: str
    gpr_uid: str


@dataclass
class Plan:
    writes: list[StatusWrite] = field(default_factory=list)
    ungate: dict[str, list[str]] = field(default_factory=dict)  # GPR UID -> reserved node names
    evictions: list[Eviction] = field(default_factory=list)
    events: list[tuple[str, Event]] = field(default_factory=list)  # (GPR UID, core event)
    orphans: list[tuple[str, str, str]] = field(default_factory=list)  # (namespace, name, uid)
    wakeup: float = math.inf
    queued: int = 0
    holding: int = 0
    queue: tuple[str, ...] = ()
    refreshed: bool = False
    seconds: float = 0.0
    estimate_seconds: float = 0.0
    # GPR UID -> (projected start, predicted hold time, priority) of queued GPRs when estimates were refreshed,
    # but those in PassConfig.noted
    projections: dict[str, tuple[float, float, int]] = field(default_factory=dict)
