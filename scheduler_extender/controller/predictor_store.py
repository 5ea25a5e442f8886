"""The live controller's memory of how long work runs: the duration predictor and the wait calibration, learned
from GPR objects and kept in a ConfigMap so that a restart or a new leader estimates as well as the old one.

Why a ConfigMap: the history outlives every single GPR (finished GPRs are deleted), it is small (bounded keys,
sparse counts; written only when it changed and at most every ``save_every`` seconds), and it is namespaced with
the controller (``accelstack-system``), where its Role already lives. Layout: ``data["state.json"]`` =
``{"version": 1, "predictor": ..., "calibrator": ..., "learned": [uid, ...], "first": {uid: [t, wait, class]}}``.

What is learned, exactly once per GPR (its UID is remembered until the object is gone):

- a GPR whose status says ``Complete`` with ``admittedAt`` and ``finishedAt``: one hold-time sample
  (``finishedAt - admittedAt``, capped by its ``exitDuration``) under its namespace, template (label
  ``accelstack.io/template``), workload (label ``accelstack.io/workload``, else its first owner reference with a
  generated suffix removed) and shape;
- a GPR that was projected while queued and whose status now says ``admittedAt``: how far its first projection
  was from its actual wait (the calibration behind the P10-P90 range).

The pass itself stays pure: it reads the predictor and calibrator, and this module feeds them between passes.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from scheduler_extender.core.gpr import priority_class
from scheduler_extender.core.predictor import DurationPredictor, JobKey, shape_of
from scheduler_extender.core.waittime import Calibrator
from scheduler_extender.objects import gpr_codec as gr

log = logging.getLogger("accelstack.controller.history")

CONFIGMAP = "accelstack-duration-history"
DATA_KEY = "state.json"
STATE_VERSION = 1
TEMPLATE_LABEL = "accelstack.io/template"
WORKLOAD_LABEL = "accelstack.io/workload"
MAX_BYTES = 900_000  # a ConfigMap holds at most 1 MiB
_SUFFIX = re.compile(r"-(?:[0-9]+|[a-z0-9]{5}|[a-f0-9]{8,10})$")  # Job/ReplicaSet/pod-template-hash suffixes


def workload_of(obj: Mapping[str, Any]) -> str:
    """The owner/workload a GPR belongs to: its workload label, else ``Kind/name`` of its first owner reference
    with a generated suffix (``-12345``, ``-x7f2k``, a pod-template hash) removed; "" when unknown."""
    meta = obj.get("metadata") or {}
    label = (meta.get("labels") or {}).get(WORKLOAD_LABEL)
    if isinstance(label, str) and label:
        return label
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and isinstance(ref.get("name"), str):
            return f"{ref.get('kind', '')}/{_SUFFIX.sub('', ref['name'])}"
    return ""


def job_key(obj: Mapping[str, Any], workspace_of: Callable[[str, str], str] | None = None) -> JobKey:
    """The predictor key of a GPR object; its workspace is ``workspace_of(namespace, resource)`` (the policy
    core's workspace, :meth:`workspaces.WorkspaceIndex.key`), the namespace without it."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    namespace = str(meta.get("namespace") or "default")
    template = (meta.get("labels") or {}).get(TEMPLATE_LABEL)

    def num(name: str, default: int) -> int:
        v = spec.get(name, default)
        return v if isinstance(v, int) and not isinstance(v, bool) else default

    return JobKey(
        workspace=workspace_of(namespace, str(spec.get("resource") or gr.GPU)) if workspace_of else namespace,
        template=template if isinstance(template, str) else "",
        owner=workload_of(obj),
        shape=shape_of(str(spec.get("resource") or gr.GPU), num("devicesPerNode", 1), num("milliPerDevice", 1000),
                       num("nodeCount", 1)),
    )


def _exit_s(spec: Mapping[str, Any]) -> float | None:
    raw = spec.get("exitDuration")
    if raw is None:
        return None
    try:
        value = gr.parse_duration(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


class PredictorStore:
    """Predictor + calibrator + what has been learned already; see the module docstring."""

    def __init__(self, predictor: DurationPredictor | None = None, calibrator: Calibrator | None = None) -> None:
        self.predictor = predictor if predictor is not None else DurationPredictor()  # an empty one is falsy
        self.calibrator = calibrator if calibrator is not None else Calibrator()
        self.learned: set[str] = set()  # UIDs of finished GPRs already learned from
        self.first: dict[str, tuple[float, float, str]] = {}  # UID -> first projection (when, wait, class)
        self.dirty = False

    # ------------------------------------------------------------------------------------------ learning
    def learn(self, gprs: Mapping[str, Mapping[str, Any]],
              workspace_of: Callable[[str, str], str] | None = None) -> int:
        """Learn from the GPR objects (by UID) not learned from yet; forget UIDs of objects that are gone.
        ``workspace_of``: as for :func:`job_key`. Returns how many samples were taken."""
        taken = 0
        for uid, obj in gprs.items():
            status = obj.get("status")
            if not isinstance(status, Mapping):
                continue
            admitted = gr.parse_time(status.get("admittedAt"))
            pending = self.first.get(uid)
            if pending is not None and admitted is not None:
                when, wait, cls = pending
                self.calibrator.observe(cls, wait, max(0.0, admitted - when))
                del self.first[uid]
                self.dirty = True
            if uid in self.learned or status.get("phase") != "Complete":
                continue
            finished = gr.parse_time(status.get("finishedAt"))
            if admitted is None or finished is None or finished < admitted:
                continue
            spec = obj.get("spec") or {}
            self.predictor.observe(job_key(obj, workspace_of), finished - admitted, _exit_s(spec))
            self.learned.add(uid)
            self.dirty = True
            taken += 1
        gone = [u for u in self.learned if u not in gprs] + [u for u in self.first if u not in gprs]
        for uid in gone:
            self.learned.discard(uid)
            self.first.pop(uid, None)
        return taken

    def note_projections(self, projections: Mapping[str, tuple[float, float, int]], now: float) -> None:
        """``projections``: UID -> (projected start, hold time, priority) of queued GPRs; the first one of each
        is kept until the GPR is admitted."""
        for uid, (start, _, priority) in projections.items():
            if uid not in self.first and math.isfinite(start):
                try:
                    cls = priority_class(priority)
                except ValueError:
                    continue
                self.first[uid] = (now, max(0.0, start - now), cls)
                self.dirty = True

    # ------------------------------------------------------------------------------------------ persistence
    def to_data(self) -> dict[str, str]:
        """The ConfigMap's ``data``; the predictor keeps its most recent keys so that it fits ``MAX_BYTES``."""
        keys: int | None = None
        while True:
            state = {"version": STATE_VERSION, "predictor": self.predictor.to_state(keys),
                     "calibrator": self.calibrator.to_state(), "learned": sorted(self.learned),
                     "first": {u: list(v) for u, v in sorted(self.first.items())}}
            text = orjson.dumps(state).decode()
            if len(text) <= MAX_BYTES or keys == 0:
                return {DATA_KEY: text}
            keys = len(state["predictor"]["keys"]) // 2  # type: ignore[index]

    def load_data(self, data: Mapping[str, Any]) -> None:
        """Restore from a ConfigMap's ``data``; ValueError naming what is wrong (the caller starts afresh)."""
        raw = data.get(DATA_KEY)
        if not isinstance(raw, str):
            raise ValueError(f"configmap {CONFIGMAP}: no {DATA_KEY}")
        try:
            state = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"configmap {CONFIGMAP}: {DATA_KEY} is not JSON ({exc})") from exc
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"configmap {CONFIGMAP}: version must be {STATE_VERSION}")
        predictor = DurationPredictor(min_samples=self.predictor.min_samples, max_count=self.predictor.max_count,
                                      max_keys=self.predictor.max_keys, prior_s=self.predictor.prior_s)
        predictor.load_state(state.get("predictor"))  # type: ignore[arg-type]
        calibrator = Calibrator(self.calibrator.min_samples, self.calibrator.max_count)
        calibrator.load_state(state.get("calibrator"))  # type: ignore[arg-type]
        learned = state.get("learned") or []
        first = state.get("first") or {}
        if not isinstance(learned, list) or not isinstance(first, dict):
            raise ValueError(f"configmap {CONFIGMAP}: 'learned' must be a list and 'first' an object")
        try:
            restored = {str(u): (float(v[0]), float(v[1]), str(v[2])) for u, v in first.items()}
        except (TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"configmap {CONFIGMAP}: 'first': {exc}") from exc
        self.predictor, self.calibrator = predictor, calibrator
        self.learned = {str(u) for u in learned}
        self.first = restored
        self.dirty = False

    async def load(self, kube: Any, namespace: str) -> bool:
        """Read the ConfigMap (absent: start empty). True when a state was restored."""
        from scheduler_extender.objects.kube import ApiError, NotFound

        try:
            obj = await kube.get_configmap(namespace, CONFIGMAP)
        except NotFound:
            return False
        except ApiError as exc:
            log.warning("duration history not readable; starting without it", extra={"error": str(exc)[:200]})
            return False
        try:
            self.load_data(obj.get("data") or {})
        except ValueError as exc:
            log.warning("duration history ignored", extra={"error": str(exc)[:300]})
            return False
        log.info("duration history restored", extra={"keys": len(self.predictor), "learned": len(self.learned)})
        return True

    async def save(self, kube: Any, namespace: str) -> bool:
        """Write the ConfigMap if anything changed since the last save; False (logged) when the API refused."""
        from scheduler_extender.objects.kube import ApiError

        if not self.dirty:
            return True
        try:
            await kube.put_configmap(namespace, CONFIGMAP, self.to_data(),
                                     labels={"app.kubernetes.io/part-of": "accelstack"})
        except ApiError as exc:
            log.warning("duration history not saved", extra={"error": str(exc)[:200]})
            return False
        self.dirty = False
        return True
