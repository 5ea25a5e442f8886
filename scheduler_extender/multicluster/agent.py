"""The member agent's I/O (``accelstack-member-agent``, a Deployment in each member): it watches its own cluster
and pushes its ``Cluster`` status to the hub.

- **Its own cluster**: informers on Nodes, AcceleratorNodes and GPRs (read-only rights, nothing else: the
  ClusterRole in ``manifests/member/``). Each event updates a small projection (:class:`~.clusters.NodeSummary`),
  so a summary over 5,000 nodes is a sum over small records, never a relist or a parse.
- **The hub**: one object, its own ``Cluster``, with a token whose rights name it (RBAC ``resourceNames``). The
  agent pulls nothing else and the hub never holds the member's credentials (OCM's klusterlet works the same way).
  Every ``heartbeat`` seconds, or sooner (at most every ``min_gap``) when the summary changed, it merge-patches
  ``status`` with its own fields only: ``lastHeartbeatTime`` (its clock: shown, never judged), ``versions``,
  ``inventory``, ``devices``, ``nodes``. The conditions are the hub's (:mod:`.hub`).
- **Its token**: join issues one with an expiry; past two thirds of its life the agent asks the hub for a new one
  (TokenRequest on its own ServiceAccount, the only thing its hub Role allows) and writes it into its member Secret
  (the only Secret its member Role may update), so a restarted pod starts with a live one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from kubeapi import ApiError, KubeClient, NotFound
from kubeapi.informer import Informer
from kubeapi.passes import wait_first
from kubeapi.resources import ACCELERATOR_NODES, GPRS, NODES, SECRETS, SERVICE_ACCOUNTS
from scheduler_extender.multicluster.clusters import (
    CLUSTERS,
    GPRSummary,
    NodeSummary,
    accelerator_allocated,
    inventory,
    micro_time,
    summarize_gpr,
    summarize_node,
)

log = logging.getLogger("accelstack.member_agent")
AGENT_SERVICE_ACCOUNT = "member-agent"  # on the hub, in accelstack-member-NAME
HUB_SECRET = "accelstack-hub-kubeconfig"  # on the member, in accelstack-system: keys kubeconfig, cluster


class MemberAgent:
    def __init__(self, member: KubeClient, hub: KubeClient, cluster: str, *, resources: Sequence[str],
                 heartbeat: float = 10.0, min_gap: float = 1.0, hub_namespace: str = "",
                 secret_namespace: str = "", secret_name: str = HUB_SECRET,
                 token: tuple[float, float] | None = None, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.member, self.hub, self.cluster = member, hub, cluster
        self.resources = tuple(resources)
        self.heartbeat, self.min_gap = heartbeat, min_gap
        self.hub_namespace = hub_namespace
        self.secret_namespace, self.secret_name = secret_namespace, secret_name
        # the hub token's (issued, expires), when known (:func:`token_times`): renewed past 2/3 of its life
        self._token_issued: float = token[0] if token is not None else wall()
        self.token_expiry: float | None = token[1] if token is not None else None
        self.wall, self.monotonic = wall, monotonic
        self.nodes: dict[str, NodeSummary] = {}
        self.allocated: dict[str, tuple[str, int]] = {}
        self.gprs: dict[str, GPRSummary] = {}
        self.versions: dict[str, str] = {}
        self.changed = asyncio.Event()
        self.hub_ok = False
        self.hub_error = "no status written yet"
        self.writes = 0
        self._last_sent: dict[str, Any] | None = None
        self._last_write = -float("inf")
        self.informers = [
            Informer(member, NODES, self._on_node, self._sync_nodes, name="nodes"),
            Informer(member, ACCELERATOR_NODES, self._on_accelerator_node, self._sync_accelerator_nodes,
                     name="acceleratornodes"),
            Informer(member, GPRS, self._on_gpr, self._sync_gprs, name="gprs"),
        ]

    # ---- the member's objects, projected as they come --------------------------------------------------------
    def _on_node(self, kind: str, obj: dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name") or "")
        summary = None if kind == "DELETED" else summarize_node(obj, self.resources)
        self._put(self.nodes, name, summary)

    def _sync_nodes(self, items: Sequence[dict[str, Any]]) -> None:
        self.nodes = {n: s for o in items if (s := summarize_node(o, self.resources)) is not None
                      for n in [str((o.get("metadata") or {}).get("name") or "")]}
        self.changed.set()

    def _on_accelerator_node(self, kind: str, obj: dict[str, Any]) -> None:
        held = None if kind == "DELETED" else accelerator_allocated(obj)
        name = str((obj.get("metadata") or {}).get("name") or "")
        self._put(self.allocated, name, held[1:] if held else None)

    def _sync_accelerator_nodes(self, items: Sequence[dict[str, Any]]) -> None:
        self.allocated = {h[0]: h[1:] for o in items if (h := accelerator_allocated(o)) is not None}
        self.changed.set()

    def _on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        self._put(self.gprs, key, None if kind == "DELETED" else summarize_gpr(obj))

    def _sync_gprs(self, items: Sequence[dict[str, Any]]) -> None:
        self.gprs = {f"{(o.get('metadata') or {}).get('namespace', '')}/{(o.get('metadata') or {}).get('name', '')}":
                     summarize_gpr(o) for o in items}
        self.changed.set()

    def _put(self, table: dict[str, Any], key: str, value: Any) -> None:
        if value is None:
            if table.pop(key, None) is not None:
                self.changed.set()
        elif table.get(key) != value:
            table[key] = value
            self.changed.set()

    # ---- health ---------------------------------------------------------------------------------------------
    def synced(self) -> bool:
        return all(i.synced.is_set() and i.healthy for i in self.informers)

    def ready(self) -> bool:
        """Ready: every informer of the member synced and healthy, and the last status write reached the hub."""
        return self.synced() and self.hub_ok

    def not_ready_because(self) -> str:
        broken = [f"{i.name}: {i.last_error or 'not synced'}" for i in self.informers
                  if not (i.synced.is_set() and i.healthy)]
        if not self.hub_ok:
            broken.append(f"hub: {self.hub_error}")
        return ", ".join(broken)

    # ---- the status ---------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {**inventory(self.nodes, self.allocated, self.gprs.values()), "versions": dict(self.versions)}

    async def load_versions(self, accelstack_version: str) -> None:
        try:
            answer = await self.member.request("GET", "/version", resource="version")
            self.versions = {"kubernetes": str(answer.get("gitVersion") or ""), "accelstack": accelstack_version}
        except ApiError as exc:
            log.warning("cannot read the member's version", extra={"error": str(exc)[:200]})
            self.versions = {"accelstack": accelstack_version}

    async def write_status(self, summary: dict[str, Any]) -> None:
        body = {"status": {**summary, "lastHeartbeatTime": micro_time(self.wall())}}
        try:
            await self.hub.patch(CLUSTERS, self.cluster, body, subresource="status")
        except NotFound:
            self._hub_failed(f"the hub has no Cluster {self.cluster} (left, or not joined yet)")
            return
        except ApiError as exc:
            self._hub_failed(str(exc)[:300])
            return
        if not self.hub_ok:
            log.info("status written to the hub", extra={"cluster": self.cluster})
        self.hub_ok, self.hub_error = True, ""
        self.writes += 1
        self._last_sent = summary
        self._last_write = self.monotonic()

    def _hub_failed(self, error: str) -> None:
        if error != self.hub_error:
            log.warning("cannot write the Cluster status on the hub; retrying",
                        extra={"cluster": self.cluster, "error": error})
        self.hub_ok, self.hub_error = False, error

    async def run(self, stop: asyncio.Event) -> None:
        """Write the status when the heartbeat is due, or (at most every ``min_gap``) when the summary changed."""
        while not stop.is_set():
            since = self.monotonic() - self._last_write
            synced = self.synced()
            if synced:
                summary = self.summary()
                due = since >= self.heartbeat or not self.hub_ok
                if due or (summary != self._last_sent and since >= self.min_gap):
                    self.changed.clear()
                    await self.write_status(summary)
                    since = 0.0 if self.hub_ok else since
                    await self.maybe_renew_token()
                elif summary == self._last_sent:
                    self.changed.clear()  # nothing the hub is sent changed: the heartbeat is what is next
            else:
                self.changed.clear()  # nothing is written until every informer is healthy: looked at each second
            wait = max(0.05, min(self.heartbeat - since, self.heartbeat) if self.hub_ok else min(self.heartbeat, 2.0))
            if not synced:
                wait = min(wait, 1.0)
            if self.changed.is_set() or not self.hub_ok:
                # a change to send (or one that came during the write) waits out min_gap only, and while the hub
                # refuses, every try waits out the retry gap whatever changes: waiting on the event already set
                # would turn the loop flat out, a summary of every node and GPR a turn (and a write to the hub)
                await wait_first(stop, None, min(wait, max(0.05, self.min_gap - since)) if self.hub_ok else wait)
            else:
                await wait_first(stop, self.changed, wait)

    # ---- the hub token ---------------------------------------------------------------------------------------
    async def maybe_renew_token(self) -> None:
        """Past two thirds of the token's life, a new token from the hub (TokenRequest on its own ServiceAccount)
        used from now on and stored in the member Secret. A failure is logged and tried at the next heartbeat:
        the old token still works until it expires."""
        if self.token_expiry is None or not self.hub_namespace:
            return
        now = self.wall()
        life = max(1.0, self.token_expiry - self._token_issued)
        if now < self._token_issued + life * 2 / 3:
            return
        seconds = int(max(600, life))
        try:
            answer = await self.hub.create(SERVICE_ACCOUNTS, {
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds}}, self.hub_namespace, subresource="token",
                name=AGENT_SERVICE_ACCOUNT)
        except ApiError as exc:
            log.warning("cannot renew the hub token; the current one stays until it expires",
                        extra={"cluster": self.cluster, "error": str(exc)[:200]})
            return
        token = str((answer.get("status") or {}).get("token") or "")
        if not token:
            return
        self.hub.configuration.api_key = {"BearerToken": token}
        self.hub.configuration.api_key_prefix = {"BearerToken": "Bearer"}
        self._token_issued = now
        self.token_expiry = now + seconds
        log.info("hub token renewed", extra={"cluster": self.cluster, "expires_in_s": seconds})
        await self._store_token(token)

    async def _store_token(self, token: str) -> None:
        if not self.secret_namespace:
            return
        try:
            secret = await self.member.get(SECRETS, self.secret_name, self.secret_namespace)
            data = dict(secret.get("data") or {})
            config = yaml.safe_load(base64.b64decode(data.get("kubeconfig", "")) or b"{}") or {}
            for user in config.get("users") or []:
                user.setdefault("user", {})["token"] = token
            data["kubeconfig"] = base64.b64encode(yaml.safe_dump(config).encode()).decode()
            data["expiry"] = base64.b64encode(micro_time(self.token_expiry or 0).encode()).decode()
            secret["data"] = data
            await self.member.replace(SECRETS, self.secret_name, secret, self.secret_namespace)
        except (ApiError, yaml.YAMLError, ValueError) as exc:
            log.warning("cannot store the renewed hub token in the member Secret (a restart before the next "
                        "renewal needs cluster join again)", extra={"error": str(exc)[:200]})


def token_times(kubeconfig: str) -> tuple[float, float] | None:
    """(issued, expires) of the bearer token in a kubeconfig's current user, read from the JWT's ``iat`` and
    ``exp`` claims (not verified: the agent only schedules its renewal by them); None without such a token."""
    try:
        with open(kubeconfig, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
        context = next(c.get("context") or {} for c in config.get("contexts") or []
                       if c.get("name") == config.get("current-context"))
        user = next(u.get("user") or {} for u in config.get("users") or [] if u.get("name") == context.get("user"))
        payload = str(user.get("token") or "").split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return float(claims["iat"]), float(claims["exp"])
    except (OSError, yaml.YAMLError, StopIteration, IndexError, KeyError, TypeError, ValueError, AttributeError):
        return None

