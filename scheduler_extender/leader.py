"""Leader election with a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

A candidate takes the Lease when it is free or its holder stopped renewing (``renewTime`` older than
``leaseDurationSeconds``), renews it every ``renew_every`` seconds, and stops leading as soon as a renewal fails
past the lease duration. Every write carries the Lease's ``resourceVersion``, so two candidates can never both
believe they won.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from scheduler_extender.kube import Conflict, Kube, NotFound, _json

log = logging.getLogger("accelstack.controller.leader")


def _micro(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> float:
    if not text:
        return 0.0
    text = text.replace("Z", "+00:00")
    return dt.datetime.fromisoformat(text).timestamp()


class LeaderElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, lease_seconds: int = 15,
                 renew_every: float = 5.0, clock: Callable[[], float] | None = None) -> None:
        import time

        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_every = renew_every
        self.clock = clock or time.time
        self.leading = asyncio.Event()
        self.transitions = 0
        self._last_renew = 0.0

    async def _get(self) -> Any:
        try:
            return await _json(self.kube.coordination.read_namespaced_lease(self.name, self.namespace,
                                                                            _preload_content=False))
        except NotFound:
            return None

    async def try_acquire(self) -> bool:
        now = self.clock()
        lease = await self._get()
        spec: dict[str, Any] = {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
                                "renewTime": _micro(now)}
        try:
            if lease is None:
                body: Any = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                             "metadata": {"name": self.name, "namespace": self.namespace},
                             "spec": {**spec, "acquireTime": _micro(now), "leaseTransitions": 0}}
                await _json(self.kube.coordination.create_namespaced_lease(self.namespace, body,
                                                                           _preload_content=False))
                return True
            current = lease.get("spec") or {}
            holder = current.get("holderIdentity")
            expired = _parse(current.get("renewTime")) + float(current.get("leaseDurationSeconds") or 0) < now
            if holder not in (self.identity, None, "") and not expired:
                return False
            if holder != self.identity:
                spec["acquireTime"] = _micro(now)
                spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + 1
            else:
                spec["acquireTime"] = current.get("acquireTime") or _micro(now)
                spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0)
            lease["spec"] = spec
            await _json(self.kube.coordination.replace_namespaced_lease(self.name, self.namespace, lease,
                                                                        _preload_content=False))
            return True
        except (Conflict, NotFound):
            return False  # someone else wrote first; look again next round

    async def release(self) -> None:
        """Give the Lease up on shutdown so a peer takes over at once, not after the lease expires."""
        with contextlib.suppress(Exception):
            lease = await self._get()
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                await _json(self.kube.coordination.replace_namespaced_lease(self.name, self.namespace, lease,
                                                                            _preload_content=False))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                won = await self.try_acquire()
            except (ApiException, OSError, Exception) as exc:
                log.warning("lease renewal failed", extra={"error": str(exc)[:200]})
                won = False
            now = self.clock()
            if won:
                self._last_renew = now
                if not self.leading.is_set():
                    self.transitions += 1
                    log.info("became leader", extra={"identity": self.identity})
                    self.leading.set()
            elif self.leading.is_set() and now - self._last_renew > self.lease_seconds:
                log.warning("lost leadership", extra={"identity": self.identity})
                self.leading.clear()
            elif self.leading.is_set() and not won and now - self._last_renew <= self.lease_seconds:
                # another holder took a lease we thought was ours (we were partitioned): step down at once
                lease = await self._get()
                if lease is not None and (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    self.leading.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.renew_every)
        if self.leading.is_set():
            self.leading.clear()
            await self.release()
