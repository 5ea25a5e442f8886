"""Leader election on a ``coordination.k8s.io/v1`` Lease with client-go's semantics.

- ``lease_duration`` > ``renew_deadline`` > ``retry_period`` (15 s, 10 s, 2 s by default, as kube-controller-
  manager uses).
- A candidate takes the Lease when it is free or expired. Expiry is judged by this replica's own monotonic clock:
  the time since it last *saw the record change*, never the holder's ``renewTime`` (another machine's clock).
- The leader renews every ``retry_period``; when it cannot renew within ``renew_deadline`` (errors, timeouts,
  conflicts), or sees another holder, it stops leading at once — before any other replica can take the Lease,
  which needs ``lease_duration`` of silence. Every call has a timeout no longer than what is left of the deadline.
- Every write carries the Lease's resourceVersion: two candidates never both win.
- ``leading`` and ``following`` are events; :func:`kubeapi.tasks.while_leading` runs leader-only work and cancels
  it when leadership ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from kubeapi.client import KubeClient
from kubeapi.errors import ApiError, Conflict, NotFound
from kubeapi.resources import LEASES

log = logging.getLogger("accelstack.kube.leader")


def micro_time(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, client: KubeClient, namespace: str, name: str, identity: str, *,
                 lease_duration: float = 15.0, renew_deadline: float = 10.0, retry_period: float = 2.0,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError(f"leader election needs lease duration > renew deadline > retry period > 0, got "
                             f"{lease_duration:g} / {renew_deadline:g} / {retry_period:g}")
        if not identity:
            raise ValueError("leader election needs an identity")
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.monotonic = monotonic
        self.wall = wall
        self.rng = rng or random.Random()
        self.leading = asyncio.Event()
        self.following = asyncio.Event()
        self.following.set()
        self.transitions = 0  # times this replica became leader
        self.observed_holder = ""
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = -float("inf")
        self._gauge = client.metrics.leader.labels(f"{namespace}/{name}")

    # ------------------------------------------------------------------------------------------ one try
    def _observe(self, spec: dict[str, Any]) -> None:
        record = (spec.get("holderIdentity"), spec.get("leaseDurationSeconds"), spec.get("acquireTime"),
                  spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.monotonic()
        self.observed_holder = str(spec.get("holderIdentity") or "")

    async def try_acquire_or_renew(self, timeout: float | None = None) -> bool:
        """One attempt; True when this replica holds the Lease afterwards. API errors propagate."""
        now = self.wall()
        try:
            lease = await self.client.get(LEASES, self.name, self.namespace, timeout=timeout)
        except NotFound:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration),
                             "acquireTime": micro_time(now), "renewTime": micro_time(now), "leaseTransitions": 0}}
            try:
                created = await self.client.create(LEASES, body, self.namespace, timeout=timeout)
            except Conflict:
                return False
            self._observe(created.get("spec") or {})
            return True
        spec = dict(lease.get("spec") or {})
        self._observe(spec)
        holder = str(spec.get("holderIdentity") or "")
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if holder and holder != self.identity and self._observed_at + duration > self.monotonic():
            return False  # held, and its holder renewed within the lease duration as we measure it
        new = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration),
               "renewTime": micro_time(now)}
        if holder == self.identity:
            new["acquireTime"] = spec.get("acquireTime") or micro_time(now)
            new["leaseTransitions"] = int(spec.get("leaseTransitions") or 0)
        else:
            new["acquireTime"] = micro_time(now)
            new["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        lease["spec"] = new
        try:
            written = await self.client.replace(LEASES, self.name, lease, self.namespace, timeout=timeout)
        except (Conflict, NotFound):
            return False
        self._observe(written.get("spec") or {})
        return True

    async def _attempt(self, budget: float | None = None) -> bool:
        timeout = max(0.05, min(self.client.timeout, budget)) if budget is not None else None
        try:
            if timeout is None:
                return await self.try_acquire_or_renew()
            return await asyncio.wait_for(self.try_acquire_or_renew(timeout), timeout)
        except (ApiError, TimeoutError) as exc:
            log.warning("lease update failed", extra={"lease": self.name, "error": str(exc)[:200] or "timeout"})
            return False

    # ------------------------------------------------------------------------------------------ the loop
    def _become(self, leading: bool, why: str = "") -> None:
        if leading:
            self.transitions += 1
            self.following.clear()
            self.leading.set()
            log.info("became leader", extra={"identity": self.identity, "lease": self.name})
        else:
            self.leading.clear()
            self.following.set()
            level = logging.INFO if why == "shutting down" else logging.WARNING
            log.log(level, "stopped leading", extra={"identity": self.identity, "lease": self.name, "why": why})
        self._gauge.set(1 if leading else 0)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                if not self.leading.is_set():
                    if await self._attempt(self.renew_deadline):
                        self._become(True)
                        last_renew = self.monotonic()
                        continue
                    await self._sleep(stop, self.retry_period * (1 + self.rng.random() * 0.2))
                    continue
                await self._sleep(stop, self.retry_period)
                if stop.is_set():
                    break
                left = last_renew + self.renew_deadline - self.monotonic()
                if left > 0 and await self._attempt(left):
                    last_renew = self.monotonic()
                elif self.observed_holder not in ("", self.identity):
                    self._become(False, f"the Lease is held by {self.observed_holder}")
                elif self.monotonic() - last_renew >= self.renew_deadline:
                    self._become(False, f"could not renew within {self.renew_deadline:g}s")
        finally:
            if self.leading.is_set():
                self._become(False, "shutting down")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.release(), self.client.timeout)

    async def release(self) -> None:
        """Give the Lease up (on shutdown) so a peer takes over at once rather than after the lease duration."""
        lease = await self.client.get(LEASES, self.name, self.namespace)
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return
        lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time(self.wall())}
        with contextlib.suppress(Conflict, NotFound):
            await self.client.replace(LEASES, self.name, lease, self.namespace)

    @staticmethod
    async def _sleep(stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
