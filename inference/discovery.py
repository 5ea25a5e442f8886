"""From Kubernetes objects to the gateway's route table. Pure: the objects are passed in as parsed JSON.

InferenceEndpoints say which models exist, who may call them and the per-replica limits; EndpointSlices
(``discovery.k8s.io/v1``) of the Services the operator creates say which replicas are ready. The slices carry the
Service's labels (the EndpointSlice controller copies them), so ``accelstack.io/inference-endpoint`` names the
endpoint and ``accelstack.io/pool`` the pool. A slice endpoint is a replica when it is ready (an absent
``ready`` counts as ready, as upstream says) and not terminating.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from inference.access import Access
from inference.names import LABEL_ENDPOINT, LABEL_POOL, POOL_PRIMARY, POOLS, PORT_NAME
from inference.routing import ReplicaSpec

DEFAULT_MAX_INFLIGHT = 64
DEFAULT_MAX_QUEUE = 256


@dataclass(frozen=True)
class RouteSpec:
    model: str
    endpoint: str  # namespace/name
    access: Access
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    max_queue: int = DEFAULT_MAX_QUEUE
    replicas: tuple[ReplicaSpec, ...] = ()


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def replicas_of(slices: Iterable[Mapping[str, Any]], notes: list[str] | None = None) -> dict[str, list[ReplicaSpec]]:
    """namespace/endpoint-name → its ready replicas, from EndpointSlices labelled by the operator.

    An address is a replica once per endpoint: listed twice there (two slices while the EndpointSlice controller
    rewrites them) it is kept once, the first listing wins, and ``notes`` gets one line. The same address under two endpoints stays a replica of both (each
    endpoint's models route to it; dropping it from one would leave that one short with nothing said), and
    ``notes`` says so.
    """
    out: dict[str, list[ReplicaSpec]] = {}
    seen: dict[str, set[str]] = {}  # endpoint → its replica URLs
    owners: dict[str, list[str]] = {}  # replica URL → the endpoints listing it, in order
    duplicates: dict[tuple[str, str], int] = {}
    for eps in slices:
        meta = eps.get("metadata") or {}
        labels = meta.get("labels") or {}
        name = labels.get(LABEL_ENDPOINT)
        if not name:
            continue
        pool = labels.get(LABEL_POOL) or POOL_PRIMARY
        if pool not in POOLS:
            pool = POOL_PRIMARY
        port = _port(eps.get("ports") or [])
        if port is None:
            continue
        namespace = meta.get("namespace") or ""
        key = f"{namespace}/{name}"
        bucket = out.setdefault(key, [])
        known = seen.setdefault(key, set())
        for endpoint in eps.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = addresses[0]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            if url in known:
                duplicates[(key, url)] = duplicates.get((key, url), 1) + 1
                continue
            known.add(url)
            owners.setdefault(url, []).append(key)
            ref = endpoint.get("targetRef") or {}
            bucket.append(ReplicaSpec(url=url, pool=pool, pod=ref.get("name") or "",
                                      namespace=ref.get("namespace") or namespace,
                                      node=endpoint.get("nodeName") or ""))
    if notes is not None:
        notes.extend(f"replica {url} is listed {n} times for endpoint {key}; kept once"
                     for (key, url), n in sorted(duplicates.items()))
        notes.extend(f"replica {url} serves endpoints {', '.join(keys)}; kept in each"
                     for url, keys in sorted(owners.items()) if len(keys) > 1)
    return out


def _port(ports: list[Mapping[str, Any]]) -> int | None:
    named = [p for p in ports if p.get("name") == PORT_NAME and p.get("port")]
    chosen = named or [p for p in ports if p.get("port")]
    if len(chosen) != 1 and not named:
        return None
    return int(chosen[0]["port"])


def route_table(endpoints: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]],
                notes: list[str] | None = None) -> tuple[dict[str, RouteSpec], list[str]]:
    """model → RouteSpec, and one line per conflict (a model served by two endpoints: the older one keeps it).

    ``notes`` gets what is worth a log line but is no misconfiguration (``replicas_of``)."""
    ready = replicas_of(slices, notes)
    table: dict[str, RouteSpec] = {}
    problems: list[str] = []
    ordered = sorted(endpoints, key=lambda o: ((o.get("metadata") or {}).get("creationTimestamp") or "", _key(o)))
    for endpoint in ordered:
        if (endpoint.get("metadata") or {}).get("deletionTimestamp"):
            continue
        key = _key(endpoint)
        spec = endpoint.get("spec") or {}
        gateway = spec.get("gateway") or {}
        namespace = key.split("/", 1)[0]
        access = Access.from_spec(namespace, spec.get("access"))
        for model in spec.get("models") or []:
            if model in table:
                problems.append(f"model {model!r} of {key} is already served by {table[model].endpoint}; ignored")
                continue
            table[model] = RouteSpec(model=model, endpoint=key, access=access,
                                     max_inflight=int(gateway.get("maxInflightPerReplica") or DEFAULT_MAX_INFLIGHT),
                                     max_queue=int(gateway.get("maxQueue", DEFAULT_MAX_QUEUE)),
                                     replicas=tuple(ready.get(key, ())))
    return table, problems
