"""What a pod asks for: Kubernetes quantities and a pod's effective request for managed resources.

A pod's effective request for a resource is the larger of the sum over its containers and the largest single
init container (the kubelet's rule); a request missing where the limit is set takes the limit, as the API
server defaults it for extended resources. Extended resources are whole numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

_SUFFIX = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ('2', '500m', '1Gi', '1e3', 4) as a Decimal; ValueError when malformed."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    text = str(value).strip()
    for suffix in ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "m", "k", "M", "G", "T", "P", "E", ""):
        if suffix and text.endswith(suffix):
            number = text[: -len(suffix)]
            break
    else:
        suffix, number = "", text
    try:
        q = Decimal(number) * _SUFFIX[suffix]
    except ArithmeticError:  # decimal's InvalidOperation, Overflow, ...
        raise ValueError(f"not a quantity: {_short(value)}") from None
    if not q.is_finite():
        raise ValueError(f"not a quantity: {_short(value)}")
    return q


MAX_WHOLE = 2**63 - 1  # a Kubernetes quantity's integer value is an int64


def whole(value: Any, what: str) -> int:
    q = parse_quantity(value)
    if q < 0 or q > MAX_WHOLE or q != q.to_integral_value():
        raise ValueError(f"{what}: extended resources must be whole numbers from 0 to {MAX_WHOLE}, "
                         f"got {_short(value)}")
    return int(q)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _container_requests(container: Any, resources: Iterable[str]) -> dict[str, int]:
    res = getattr(container, "resources", None) if not isinstance(container, Mapping) else container.get("resources")
    if res is None:
        return {}
    requests = (res.get("requests") if isinstance(res, Mapping) else res.requests) or {}
    limits = (res.get("limits") if isinstance(res, Mapping) else res.limits) or {}
    out = {}
    for name in resources:
        if name in requests:
            out[name] = whole(requests[name], f"requests[{name}]")
        elif name in limits:
            out[name] = whole(limits[name], f"limits[{name}]")
    return out


def _restarts_always(container: Any) -> bool:
    """A native sidecar: an init container with ``restartPolicy: Always`` (KEP-753, GA in Kubernetes 1.33)."""
    policy = container.get("restartPolicy") if isinstance(container, Mapping) else getattr(container, "restartPolicy", None)
    return policy == "Always"


def pod_requests(spec: Any, resources: Iterable[str]) -> dict[str, int]:
    """Effective request per managed resource (only those with a non-zero request), as kube-scheduler and the
    kubelet's device manager count it (``resource.PodRequests`` in k8s.io/component-helpers): the sum of the app
    containers plus every native sidecar (an init container with ``restartPolicy: Always``, whose devices stay
    held while the pod runs), or the most any one init container needs while it runs beside the sidecars started
    before it, whichever is larger. ``spec`` is a pod spec as a dict (API objects) or a wire struct (extender
    requests)."""
    resources = tuple(resources)
    if isinstance(spec, Mapping):
        containers, inits = spec.get("containers") or [], spec.get("initContainers") or []
    else:
        containers, inits = spec.containers or [], spec.initContainers or []
    total: dict[str, int] = {}
    for container in containers:
        for name, n in _container_requests(container, resources).items():
            total[name] = total.get(name, 0) + n
    sidecars: dict[str, int] = {}  # what the sidecars started so far hold
    peak: dict[str, int] = {}  # the most held while one init container runs
    for container in inits:
        own = _container_requests(container, resources)
        if _restarts_always(container):
            for name, n in own.items():
                sidecars[name] = sidecars.get(name, 0) + n
                total[name] = total.get(name, 0) + n
            during = sidecars
        else:
            during = {name: own.get(name, 0) + sidecars.get(name, 0) for name in own.keys() | sidecars.keys()}
        for name, n in during.items():
            peak[name] = max(peak.get(name, 0), n)
    for name, n in peak.items():
        total[name] = max(total.get(name, 0), n)
    return {k: v for k, v in total.items() if v > 0}


MIB = 1 << 20
HOST = ("cpu", "memory")


_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _cpu_milli(value: Any) -> int:
    """A CPU quantity in millicores, rounded up; 0 when malformed. Plain forms ("2", "250m") without Decimal: every
    pod event of the informer reads them."""
    if isinstance(value, str):
        if value.isdigit():
            return int(value) * 1000
        if value[-1:] == "m" and value[:-1].isdigit():
            return int(value[:-1])
    elif isinstance(value, int) and not isinstance(value, bool):
        return max(0, value * 1000)
    try:
        q = parse_quantity(value) * 1000
    except ValueError:
        return 0
    return max(0, int(q.to_integral_value(rounding="ROUND_CEILING")))


def _memory_mib(value: Any) -> int:
    """A memory quantity in MiB, rounded up; 0 when malformed (plain forms without Decimal, as for CPU)."""
    number: int | None = None
    if isinstance(value, str):
        if value.isdigit():
            number = int(value)
        elif value[-2:] in _BINARY and value[:-2].isdigit():
            number = int(value[:-2]) * _BINARY[value[-2:]]
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    if number is not None:
        return max(0, -(-number // MIB))
    try:
        q = parse_quantity(value) / MIB
    except ValueError:
        return 0
    return max(0, int(q.to_integral_value(rounding="ROUND_CEILING")))


def _host_amounts(container: Any) -> tuple[int, int]:
    """A container's (or a pod's ``resources``/``overhead``) CPU request in millicores and memory request in MiB,
    rounded up; a request missing where the limit is set takes the limit (the API server defaults it so); a
    malformed quantity (the API server refuses those) counts as none."""
    if not isinstance(container, Mapping):
        return 0, 0
    res = container.get("resources") if "resources" in container else container
    if not isinstance(res, Mapping):
        return 0, 0
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    if not isinstance(requests, Mapping) or not isinstance(limits, Mapping):
        return 0, 0
    cpu, mem = requests.get("cpu", limits.get("cpu")), requests.get("memory", limits.get("memory"))
    return (_cpu_milli(cpu) if cpu is not None else 0), (_memory_mib(mem) if mem is not None else 0)


def host_requests(spec: Mapping[str, Any]) -> tuple[int, int]:
    """A pod's effective CPU (millicores) and memory (MiB) request as kube-scheduler's NodeResourcesFit counts it
    (``resource.PodRequests``): the pod-level ``resources`` when set (PodLevelResources), else the app containers
    and native sidecars or the largest init container's peak, whichever is larger (the rule of
    :func:`pod_requests`); plus ``overhead`` (RuntimeClass)."""
    if not isinstance(spec, Mapping):
        return 0, 0
    containers, inits = spec.get("containers") or [], spec.get("initContainers") or []
    cpu = mem = 0
    for c in containers if isinstance(containers, list) else ():
        a, b = _host_amounts(c)
        cpu, mem = cpu + a, mem + b
    side_cpu = side_mem = peak_cpu = peak_mem = 0
    for c in inits if isinstance(inits, list) else ():
        a, b = _host_amounts(c)
        if isinstance(c, Mapping) and _restarts_always(c):
            side_cpu, side_mem = side_cpu + a, side_mem + b
            cpu, mem = cpu + a, mem + b
            peak_cpu, peak_mem = max(peak_cpu, side_cpu), max(peak_mem, side_mem)
        else:
            peak_cpu, peak_mem = max(peak_cpu, a + side_cpu), max(peak_mem, b + side_mem)
    cpu, mem = max(cpu, peak_cpu), max(mem, peak_mem)
    pod_level = spec.get("resources")
    if isinstance(pod_level, Mapping) and (pod_level.get("requests") or pod_level.get("limits")):
        a, b = _host_amounts(pod_level)
        cpu, mem = a or cpu, b or mem
    overhead = spec.get("overhead")
    if isinstance(overhead, Mapping):
        a, b = _host_amounts({"requests": overhead})
        cpu, mem = cpu + a, mem + b
    return cpu, mem


def host_allocatable(allocatable: Any) -> tuple[int, int] | None:
    """A node's allocatable CPU (millicores, rounded down) and memory (MiB, rounded down); None when the node
    states neither (a node the kubelet has not reported yet)."""
    if not isinstance(allocatable, Mapping) or not any(k in allocatable for k in HOST):
        return None
    out = []
    for name, scale in (("cpu", 1000), ("memory", 1)):
        value = allocatable.get(name)
        try:
            q = parse_quantity(value) * scale if value is not None else Decimal(-1)
        except ValueError:
            q = Decimal(-1)
        if name == "memory" and q > 0:
            q = q / MIB
        out.append(int(q) if q >= 0 else 1 << 40)  # a missing or malformed amount: not a limit
    return out[0], out[1]
