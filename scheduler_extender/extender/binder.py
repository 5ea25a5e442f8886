"""Bind: the final, locked decision that gives a pod devices on a node.

Per node, one ledger change at a time in this replica (an asyncio lock, held for the ledger's patch only, not for
the Binding), and binds to a node that arrive while its patch is in flight are decided and written together in the
next one (group commit: kube-scheduler binds several pods at once and best-fit sends a node's pods in a row, so
one round trip records them all instead of each waiting for the one before); across replicas, the node's ledger
annotation is changed only with the Node's ``resourceVersion`` as a precondition, so a concurrent change by another
replica makes the API server answer 409 and the bind re-reads and re-decides. With the view's ledger "memory"
(one active binder: :class:`.ClusterView`), the ledger is this replica's memory and the pods' allocations: a bind
records the pod there with no API call, and the Binding is the one round trip. The order is: decide (health, GPR
reservation, free devices) -> record the pod in the ledger (conditional patch) -> create the Binding -> record
the allocation on the pod (annotation ``accelstack.io/allocation``). A Binding the API server refuses takes
the ledger entry back; one that may yet land (no answer, a 5xx) keeps it while the pod is unbound. When the
node lacks room that lower-priority, preemptible work holds and the pod's GPR may evict, the bind starts those
evictions (Eviction API: PodDisruptionBudgets are respected, never bypassed) and answers with an error so the
scheduler retries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from scheduler_extender.extender.verbs import PodAsk, node_verdict, resolve
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import ClusterView, NodeView, PodView, node_view, pod_view
from scheduler_extender.objects.gpr_codec import ALLOCATION_ANNOTATION
from scheduler_extender.objects.kube import ApiError, Conflict, Kube, NotFound, TransportError

log = logging.getLogger("accelstack.extender.bind")
# what a conditional ledger write (Binder._rewrite) came to
WRITTEN, UNCHANGED, GONE, CHANGING = "written", "unchanged", "gone", "changing"


@dataclass(eq=False)
class _Waiting:
    """A bind waiting for its node's next ledger patch. ``done`` gets '' when the pod is recorded, a final answer
    (why not) as a string, or the node's (reason, whether eviction could help) verdict."""
    pod: PodView
    ask: PodAsk
    done: asyncio.Future[str | tuple[str, bool]]


class Binder:
    def __init__(self, kube: Kube, view: ClusterView, max_attempts: int = 16,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.view = view
        self.max_attempts = max_attempts
        self.clock = clock
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.conflicts = 0
        self.evictions = 0
        self.evict_every = 10.0
        self._evicting: dict[str, float] = {}  # victim pod UID -> when its eviction was requested
        self._waiting: dict[str, list[_Waiting]] = {}  # node -> binds for its next patch (a writer is running)
        self._writers: set[asyncio.Task[None]] = set()
        self.patches = 0  # ledger patches written by binds
        self.recorded = 0  # pods those patches recorded (recorded / patches: the group commit's batch size)

    async def _pod(self, namespace: str, name: str, uid: str) -> tuple[PodView | None, dict[str, Any] | None]:
        cached = self.view.pods.get(uid)
        if cached is not None and cached.name == name and cached.namespace == namespace:
            return cached, None
        obj = await self.kube.get_pod(namespace, name)
        return pod_view(obj, self.view.resources), obj

    async def _fresh_node(self, node: str) -> None:
        self.view.on_node("MODIFIED", await self.kube.get_node(node))  # the view's own path (ledger "memory")

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Bind or say why not (the extender's ``Error``). An API server that fails a read or a write on the way
        (a 5xx, a 429 past the client's retries, no answer) is a refusal the scheduler retries, not an error of
        the extender: one log line, no traceback."""
        try:
            return await self._bind(namespace, name, uid, node)
        except ApiError as exc:
            answer = f"{exc.status} {exc.reason}: {exc.message}" if exc.status else exc.message
            log.warning("bind: API call failed", extra={"pod": f"{namespace}/{name}", "node": node,
                                                       "error": answer[:300]})
            return f"cannot bind {namespace}/{name} to {node} now: the API server failed a call ({answer[:300]}); retry"

    async def _bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        try:
            pod, obj = await self._pod(namespace, name, uid)
        except NotFound:
            return f"pod {namespace}/{name} not found"
        if obj is not None and obj.get("metadata", {}).get("uid") not in (uid, None):
            return f"pod {namespace}/{name} has UID {obj['metadata'].get('uid')}, not {uid}"
        if pod is None:  # asks for no managed resource: a plain Binding
            return (await self._create_binding(namespace, name, uid, node))[0]
        record = {"node": node, "requests": pod.requests, "gpr": pod.gpr, "boundAt": round(self.clock(), 3)}
        # two round trips: the ledger (the guarantee), under the node's lock, and the Binding, which carries the
        # allocation record as an annotation the API server copies onto the pod. The Binding is made outside the
        # lock: the devices are the pod's once the ledger holds them, so the next bind to this node decides on
        # that ledger without waiting for this pod's Binding (best-fit sends a node's pods in a row)
        error = await self._record(pod, node)  # the node's ledger writer takes its lock
        if error:
            return error
        error, may_land = await self._create_binding(namespace, name, uid, node,
                                                     {ALLOCATION_ANNOTATION: orjson.dumps(record).decode()})
        if error and not may_land:
            await self.release(node, [uid])
        return error

    async def _record(self, pod: PodView, node: str) -> str:
        """Decide and record the pod in the node's ledger; '' when recorded (or already there), else why not."""
        ask = resolve(self.view, dict(pod.requests), pod.gpr, pod.priority, uid=pod.uid)
        ask.pinned = pod.pinned  # its own pin is not another pod's share
        if ask.problem:
            return f"cannot bind {pod.key}: {ask.problem}"
        if node not in self.view.nodes:
            try:
                await self._fresh_node(node)
            except NotFound:
                return f"node {node} not found"
        waiting = _Waiting(pod, ask, asyncio.get_running_loop().create_future())
        queue = self._waiting.get(node)
        if queue is not None:
            queue.append(waiting)  # the running writer takes it with the next patch
        else:
            self._waiting[node] = [waiting]
            # the writer is a task of its own: a bind whose caller goes away must not strand the others' answers
            task = asyncio.create_task(self._write_ledger(node), name=f"ledger-{node}")
            self._writers.add(task)
            task.add_done_callback(self._writers.discard)
        outcome = await waiting.done  # a caller that goes away cancels it: the writer then leaves the pod out
        if isinstance(outcome, str):
            return outcome
        reason, resolvable = outcome
        if resolvable and ask.gpr is not None and ask.gpr.enable_eviction:
            return await self._evict_for(pod, ask, node, reason)
        return f"cannot bind {pod.key} to {node}: {reason}"

    async def _write_ledger(self, node: str) -> None:
        """Drain the node's waiting binds, one conditional patch per batch, until none wait."""
        try:
            async with self.locks[node]:
                while batch := self._waiting.get(node):
                    self._waiting[node] = []
                    try:
                        await self._commit(node, batch)
                    except BaseException as exc:
                        for waiting in batch:
                            if not waiting.done.done():
                                if isinstance(exc, Exception):
                                    waiting.done.set_exception(exc)
                                else:
                                    waiting.done.cancel()
                        if not isinstance(exc, Exception):
                            raise
        finally:
            for waiting in self._waiting.pop(node, []):  # only when cancelled (shutdown): nobody waits for ever
                waiting.done.cancel()

    async def _commit(self, node: str, batch: list[_Waiting]) -> None:
        """Decide every bind of ``batch`` on the node's ledger, each seeing the ones before it, and write the
        ledger once with all that fit (:meth:`_rewrite`: on a conflict the node is read again and they are all
        decided again)."""
        live: list[_Waiting] = []
        outcomes: list[str | tuple[str, bool]] = []
        added = 0

        def change(view: NodeView) -> dict[str, ledger.Entry] | None:
            nonlocal added
            live[:] = [waiting for waiting in batch if not waiting.done.done()]  # callers gone: nothing to record
            outcomes.clear()
            added = 0
            entries = dict(view.ledger)
            judged = view
            recorded: list[str] = []
            for waiting in live:
                pod = waiting.pod
                if pod.uid in entries:  # a retried bind: the devices are already recorded for this pod
                    outcomes.append("")
                    continue
                reason, resolvable = node_verdict(self.view, waiting.ask, node, judged, recorded)
                if reason:
                    outcomes.append((reason, resolvable))
                    continue
                entries[pod.uid] = ledger.Entry(pod.uid, pod.key, dict(pod.requests), pod.gpr, self.clock())
                judged = dataclasses.replace(view, ledger=dict(entries), used={}, used_by={})
                recorded.append(pod.uid)
                outcomes.append("")
                added += 1
            return entries if added else None

        def answer(waiting: _Waiting, outcome: str | tuple[str, bool]) -> None:
            self.view.unclaim(waiting.pod.uid)  # recorded in the ledger now (the view holds it), or refused
            if not waiting.done.done():
                waiting.done.set_result(outcome)

        result = await self._rewrite(node, change)
        if result == GONE:
            live[:] = [waiting for waiting in batch if not waiting.done.done()]
            outcomes[:] = [f"node {node} not found"] * len(live)
        elif result == CHANGING:
            outcomes[:] = [f"cannot bind {w.pod.key} to {node}: node {node} kept changing ({self.max_attempts} "
                           "conflicts); retry" for w in live]
        elif result == WRITTEN:
            self.patches += 1
            self.recorded += added
        for waiting, outcome in zip(live, outcomes, strict=True):
            answer(waiting, outcome)

    async def _create_binding(self, namespace: str, name: str, uid: str, node: str,
                              annotations: dict[str, str] | None = None) -> tuple[str, bool]:
        """('', _) when the pod is bound to ``node``; else (why, whether the Binding may still land).

        A Binding refused (4xx) was not made. One that got no answer or a 5xx may have been made all the same
        (the API server finishes a write whose client gave up; etcd may commit a write answered 500 or 504),
        and may land even after a look shows the pod unbound: its ledger entry then stays (a retried bind to
        this node finds it; the sweep gives it back once the pod is bound elsewhere, gone, or left unbound),
        for a pod bound here without an entry could be given the same devices again."""
        try:
            await self.kube.bind(namespace, name, uid, node, annotations)
            return "", False
        except Conflict as exc:  # the pod is bound already (a retried bind whose first answer was lost?)
            failure, maybe = f"binding {namespace}/{name} to {node} failed: {exc}", False
        except NotFound as exc:
            return f"binding {namespace}/{name} to {node} failed: {exc}", False
        except TransportError as exc:
            failure, maybe = f"binding {namespace}/{name} to {node}: no answer ({exc.message}); retry", True
        except ApiError as exc:
            failure = f"binding {namespace}/{name} to {node} failed: {exc.status} {exc.message or exc.reason}"
            if exc.status is None or exc.status < 500:
                return failure, False
            maybe = True
        # the pod may already be on this very node, which is success
        try:
            current = await self.pod_now(namespace, name, uid)
        except ApiError:
            return failure, True  # cannot tell: keep the entry
        if current is None:
            return failure, False  # gone, or another pod of that name
        bound = (current.get("spec") or {}).get("nodeName")
        if bound == node:
            return "", False
        return failure, maybe and not bound

    async def pod_now(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        """The pod read afresh from the API server (not the informer's view, which may lag); None when it is gone
        or the name now belongs to another pod. ApiError when it cannot be read: the caller cannot tell."""
        try:
            current = await self.kube.get_pod(namespace, name)
        except NotFound:
            return None
        return current if (current.get("metadata") or {}).get("uid") == uid else None

    async def _rewrite(self, node: str, change: Callable[[NodeView], dict[str, ledger.Entry] | None]) -> str:
        """Write ``change(view)``'s entries as the node's ledger, conditional on the Node's resourceVersion; on a
        conflict re-read the node and ask ``change`` again. ``change`` returns None when there is nothing to write.
        :data:`WRITTEN`, :data:`UNCHANGED` (nothing to write), :data:`GONE` (no such node) or :data:`CHANGING`
        (a conflict at every attempt). With the view's ledger "memory" the entries are set in the view, no API call."""
        for _ in range(self.max_attempts):
            view = self.view.nodes.get(node)
            if view is None:
                return GONE
            entries = change(view)
            if entries is None:
                return UNCHANGED
            if self.view.ledger_source == "memory":  # the one active binder: its memory is the ledger
                self.view.set_ledger(node, entries)
                return WRITTEN
            body = {"metadata": {"resourceVersion": view.resource_version,
                                 "annotations": {ledger.LEDGER_ANNOTATION: ledger.render(entries)}}}
            try:
                updated = await self.kube.patch_node(node, body)
            except Conflict:
                self.conflicts += 1
                try:
                    await self._fresh_node(node)
                except NotFound:
                    return GONE
                continue
            except NotFound:
                return GONE
            self.view.update_node(node_view(updated, self.view.resources))
            return WRITTEN
        return CHANGING

    async def adopt(self, node: str, pods: list[PodView]) -> int:
        """Record pods already bound to ``node`` that its ledger lacks (bound before accelstack ran, or by another
        scheduler): the ledger must hold every device in use, even past capacity, so nothing new lands there."""
        added: list[str] = []

        def change(view: NodeView) -> dict[str, ledger.Entry] | None:
            missing = [p for p in pods if p.uid not in view.ledger]
            added[:] = [p.uid for p in missing]
            if not missing:
                return None
            entries = dict(view.ledger)
            for p in missing:
                entries[p.uid] = ledger.Entry(p.uid, p.key, dict(p.requests), p.gpr, self.clock())
            return entries

        async with self.locks[node]:
            return len(added) if await self._rewrite(node, change) == WRITTEN else 0

    async def release(self, node: str, uids: list[str]) -> int:
        """Take pods' entries out of a node's ledger (conditional patch, retried); returns how many went."""
        gone: list[str] = []

        def change(view: NodeView) -> dict[str, ledger.Entry] | None:
            gone[:] = [u for u in uids if u in view.ledger]
            return {u: e for u, e in view.ledger.items() if u not in gone} if gone else None

        try:
            async with self.locks[node]:
                return len(gone) if await self._rewrite(node, change) == WRITTEN else 0
        except ApiError as exc:  # the ledger sweep gives the entries back once their pods are unbound or gone
            log.warning("ledger release failed", extra={"node": node, "pods": uids, "error": str(exc)[:300]})
            return 0

    async def _evict_for(self, pod: PodView, ask: PodAsk, node: str, reason: str) -> str:
        """Start evicting the cheapest set of lower-priority, preemptible holders on the node."""
        view = self.view.nodes[node]
        assert ask.gpr is not None
        candidates = []
        for entry in view.ledger.values():
            victim = self.view.pods.get(entry.uid)
            victim_gpr = self.view.gprs.get(entry.gpr) if entry.gpr else None
            if victim is None or entry.gpr == pod.gpr:
                continue
            if victim_gpr is not None and (not victim_gpr.preemptible or victim_gpr.priority >= ask.gpr.priority):
                continue
            if victim_gpr is None and victim.priority >= ask.priority:
                continue
            candidates.append((victim_gpr.priority if victim_gpr else 0, entry.since, entry, victim))
        candidates.sort(key=lambda c: (c[0], -c[1]))  # lowest priority first, then the youngest (least work lost)
        need = {r: n - self.view.free_for(view, r, ask.gpr_key) for r, n in ask.requests.items()}
        chosen = []
        for _, _, entry, victim in candidates:
            if all(v <= 0 for v in need.values()):
                break
            if any(need.get(r, 0) > 0 for r in entry.requests):
                chosen.append(victim)
                for r, n in entry.requests.items():
                    need[r] = need.get(r, 0) - n
        if any(v > 0 for v in need.values()):
            return f"cannot bind {pod.key} to {node}: {reason}; eviction of lower-priority work cannot make room"
        refused = []
        now = self.clock()
        self._evicting = {uid: t for uid, t in self._evicting.items() if now - t < self.evict_every}
        for victim in chosen:
            if victim.terminating or victim.uid in self._evicting:
                continue  # already leaving, or asked a moment ago: the scheduler's retries do not re-send
            try:
                await self.kube.evict(victim.namespace, victim.name)
                self.evictions += 1
                self._evicting[victim.uid] = now
            except NotFound:
                continue
            except ApiError as exc:
                refused.append(f"{victim.key} ({exc.status} {exc.message or exc.reason})")
        if refused:
            return f"cannot bind {pod.key} to {node} yet: eviction refused for {', '.join(refused)}"
        return (f"evicting {len(chosen)} lower-priority pod(s) on {node} for {pod.key} "
                f"({', '.join(v.key for v in chosen)}); retry")
