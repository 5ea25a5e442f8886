"""What kube-apiserver spends on each pod of the control-plane benchmark's path, taken apart on the real API server
(``KUBEBUILDER_ASSETS``): N pods created and bound (a Binding each, as kube-scheduler makes it) by 32 clients,
the API server's own CPU seconds (``/proc``) over that, median of interleaved rounds.

- ``--part watchers``: with K more JSON watchers of every pod beside the one a benchmark keeps (an informer each,
  in a process of its own: a list, then a watch whose events are decoded), K from ``--watchers``. What a pod
  informer of accelstack's extender or controller costs the API server.
- ``--part admission``: how a pod comes to be narrowed to reserved nodes (13 ``matchFields`` terms, one a node):
  ``plain`` (not narrowed, as the do-nothing extender's pods), ``narrowed`` (created so), ``webhook`` (a mutating
  webhook adds the terms: a JSON patch, as accelstack's pod webhook answers for a pod of an admitted GPR),
  ``policy`` (a MutatingAdmissionPolicy, CEL inside the API server, adds them from a ConfigMap of node names: no
  webhook call). One JSON pod watcher in every variant.
- ``--part gpr``: what an auto-GPR's object costs (the shipped CRD): ``create`` (N GPRs created, as the pod webhook
  creates one a bare pod), ``status`` (created, then the Admitted status the controller writes, a PUT of the whole
  object with its conditions), ``status-slim`` (the same status without conditions), ``status-min`` (the phase
  and the reservation alone: what any status write costs), ``status-patch`` (the full status as a merge patch
  instead of a PUT), ``label`` (no status: a label merge-patched onto the GPR, any write after the create),
  ``create-nocel`` and ``status-nocel`` (``create`` and ``status`` on a copy of the CRD without
  its CEL rules, group bench.accelstack.io). One JSON watcher of every GPR of either CRD.

Usage: KUBEBUILDER_ASSETS=.cache/k8s-bin python bench/bench_apiserver_cost.py --part watchers|admission|gpr
[--pods 2000] [--rounds 3] [--watchers 0,1,2,4] [--variants plain,narrowed,webhook,policy | create,status,...]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import multiprocessing as mp
import ssl
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
from real_e2e import cpu_seconds  # noqa: E402  (bench/ is on sys.path: this script's folder)

from kubeapi.client import from_config  # noqa: E402
from kubeapi.resources import GPRS, PODS, Resource  # noqa: E402
from scheduler_extender.core.gpr import GPR, Phase  # noqa: E402
from scheduler_extender.objects import gpr_codec as gr  # noqa: E402
from tests.realcluster.controlplane import ControlPlane, assets_dir, free_port, missing_assets  # noqa: E402
from tests.realcluster.shipped import render  # noqa: E402

VARIANTS = ("plain", "narrowed", "webhook", "policy")
GPR_VARIANTS = ("create", "status", "status-slim", "status-min", "status-patch", "label", "create-nocel",
                "status-nocel")
NOCEL_GROUP = "bench.accelstack.io"  # the GPR CRD copied without its x-kubernetes-validations (CEL) rules
NODES = [f"node-{k}" for k in range(13)]
TERMS = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]} for n in NODES]
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": TERMS}}}
_T = "Object.spec.affinity"
_R = f"{_T}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
POLICY_EXPRESSION = (  # the same terms, built in CEL from the ConfigMap's comma-separated node names
    f'[JSONPatch{{op: "add", path: "/spec/affinity", value: {_T}{{nodeAffinity: {_T}.nodeAffinity{{'
    f'requiredDuringSchedulingIgnoredDuringExecution: {_R}{{nodeSelectorTerms: params.data.nodes.split(",").map(n, '
    f'{_R}.nodeSelectorTerms{{matchFields: [{_R}.nodeSelectorTerms.matchFields{{key: "metadata.name", '
    f'operator: "In", values: [n]}}]}})}}}}}}}}]')


def _informer(kubeconfig: str, ready: Any, resource: Resource = PODS) -> None:
    """An informer's traffic: list every object (pods by default), then watch them, each event decoded (the
    client does)."""
    async def run() -> None:
        kube = await from_config(kubeconfig, field_manager="bench-watcher")
        _, rv = await kube.list_raw(resource)
        ready.set()
        while True:
            try:
                async for _ in kube.watch(resource, resource_version=rv, timeout_seconds=600):
                    pass
            except Exception:  # expired: list again
                _, rv = await kube.list_raw(resource)
    asyncio.run(run())


def _webhook(port: int, crt: str, key: str, ready: Any) -> None:
    """A mutating webhook that narrows every pod it is sent (one JSON patch, answered with orjson on uvloop)."""
    import uvloop
    from aiohttp import web

    patch = base64.b64encode(orjson.dumps([{"op": "add", "path": "/spec/affinity", "value": AFFINITY}])).decode()

    async def mutate(request: web.Request) -> web.Response:
        review = orjson.loads(await request.read())
        return web.Response(body=orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                               "response": {"uid": review["request"]["uid"], "allowed": True,
                                                            "patchType": "JSONPatch", "patch": patch}}),
                            content_type="application/json")

    async def serve() -> None:
        app = web.Application()
        app.add_routes([web.post("/mutate", mutate)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(crt, key)
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
        ready.set()
        await asyncio.Event().wait()
    uvloop.run(serve())


def _start(target: Any, *args: Any, **kwargs: Any) -> mp.Process:
    ready = mp.Event()
    proc = mp.Process(target=target, args=(*args, ready), kwargs=kwargs, daemon=True)
    proc.start()
    if not ready.wait(60):
        proc.terminate()
        raise RuntimeError(f"{target.__name__} did not start within 60 s")
    return proc


def _pod(i: int, narrowed: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulerName": "nobody", "automountServiceAccountToken": False, "containers": [{
        "name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "10m", "memory": "16Mi"}}}]}
    if narrowed:
        spec["affinity"] = AFFINITY
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "labels": {"app": "bench"}}, "spec": spec}


async def _load(kubeconfig: str, ns: str, variant: str, pods: int) -> None:
    """Namespace ``ns`` (labelled for the variant's admission), then ``pods`` pods created and bound, 32 at once."""
    kube = await from_config(kubeconfig, field_manager="bench-load")
    await kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": ns, "labels": {"bench-admission": variant}}})
    await kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", body={
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    await kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps", body={
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "narrow"}, "data": {"nodes": ",".join(NODES)}})
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with gate:
            await kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=_pod(i, variant == "narrowed"))
            await kube.request("POST", f"/api/v1/namespaces/{ns}/pods/p{i}/binding", body={
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": f"p{i}"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": NODES[i % len(NODES)]}})
    try:
        await asyncio.gather(*(one(i) for i in range(pods)))
    finally:
        await kube.close()


def _admitted_status(name: str, node: str, now: float, variant: str) -> dict[str, Any]:
    """The status the controller writes for a one-device GPR it admits at once (``status-slim``: without
    conditions; ``status-min``: the phase and the reservation alone)."""
    g = GPR(name=name, node_count=1, devices_per_node=1, workspace="bench")
    g.transition(Phase.ADMITTED, now, "")
    status = gr.status_body(g, queue_position=None, estimated_start=None, reservation=[{"node": node, "devices": 1}],
                            now=now, observed_generation=1)["status"]
    if variant == "status-slim":
        del status["conditions"]
    elif variant == "status-min":
        status = {"phase": status["phase"], "reservation": status["reservation"]}
    return status


async def _load_gprs(kubeconfig: str, ns: str, variant: str, count: int) -> None:
    """Namespace ``ns``, then ``count`` GPRs created (and, but for ``create``, their status written), 32 at once."""
    kube = await from_config(kubeconfig, field_manager="bench-load")
    await kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": ns}})
    group = NOCEL_GROUP if variant.endswith("-nocel") else GPRS.group
    variant = variant.removesuffix("-nocel")
    base = f"/apis/{group}/{GPRS.version}/namespaces/{ns}/{GPRS.plural}"
    gate = asyncio.Semaphore(32)
    now = time.time()

    async def one(i: int) -> None:
        name = f"auto-p{i}"
        async with gate:
            obj = await kube.request("POST", base, body=dict(gr.new_object(ns, name, {
                "resource": "nvidia.com/gpu", "devicesPerNode": 1, "nodeCount": 1, "priority": 100},
                labels={"accelstack.io/auto-gpr": "true"}), apiVersion=f"{group}/{GPRS.version}"))
            if variant == "create":
                return
            if variant == "label":
                await kube.request("PATCH", f"{base}/{name}", body={"metadata": {"labels": {"bench": "x"}}},
                                   content_type="application/merge-patch+json")
                return
            status = _admitted_status(name, NODES[i % len(NODES)], now, variant)
            if variant == "status-patch":
                await kube.request("PATCH", f"{base}/{name}/status", body={"status": status},
                                   content_type="application/merge-patch+json")
            else:
                await kube.request("PUT", f"{base}/{name}/status", body=dict(obj, status=status))
    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        await kube.close()


def _install_admission(cp: ControlPlane) -> mp.Process:
    """The webhook (namespaces labelled ``webhook``) and the policy (``policy``); the webhook's process."""
    port = free_port()
    crt, key = cp.pki.issue("bench-webhook", "/CN=bench-webhook", sans="IP:127.0.0.1")
    hook = _start(_webhook, port, str(crt), str(key))
    ca = base64.b64encode(Path(cp.pki.ca_crt).read_bytes()).decode()
    pods_rule = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    cp.create("apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "bench-narrow"},
        "webhooks": [{"name": "narrow.bench.accelstack.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                      "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate", "caBundle": ca},
                      "namespaceSelector": {"matchLabels": {"bench-admission": "webhook"}}, "rules": [pods_rule],
                      "timeoutSeconds": 10, "failurePolicy": "Fail", "reinvocationPolicy": "Never"}]})
    cp.create("apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": "bench-narrow"},
        "spec": {"paramKind": {"apiVersion": "v1", "kind": "ConfigMap"}, "failurePolicy": "Fail",
                 "reinvocationPolicy": "Never", "matchConstraints": {"resourceRules": [pods_rule]},
                 "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": POLICY_EXPRESSION}}]}})
    cp.create("apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": "bench-narrow"},
        "spec": {"policyName": "bench-narrow", "paramRef": {"name": "narrow", "parameterNotFoundAction": "Deny"},
                 "matchResources": {"namespaceSelector": {"matchLabels": {"bench-admission": "policy"}}}}})
    return hook


def _without_cel(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD under group :data:`NOCEL_GROUP`, every ``x-kubernetes-validations`` rule taken out."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node
    out = strip(crd)
    out["metadata"] = {"name": f"{GPRS.plural}.{NOCEL_GROUP}"}
    out["spec"]["group"] = NOCEL_GROUP
    return out


def _check(cp: ControlPlane, ns: str, variant: str, gprs: bool, label: str) -> None:
    """The round did what its arm says: its pods narrowed (or not), its GPRs Admitted (or without a status)."""
    if gprs:
        group = NOCEL_GROUP if variant.endswith("-nocel") else GPRS.group
        obj = cp.get(f"apis/{group}/{GPRS.version}/namespaces/{ns}/{GPRS.plural}/auto-p0") or {}
        phase = (obj.get("status") or {}).get("phase")
        if phase != (None if variant.startswith("create") or variant == "label" else "Admitted"):
            raise RuntimeError(f"{label}: GPR auto-p0 has phase {phase!r}")
        return
    terms = _terms(cp, ns)
    want = 0 if variant == "plain" else len(NODES)
    if terms != want:
        raise RuntimeError(f"{label}: a pod has {terms} node affinity terms, not {want}")


def _terms(cp: ControlPlane, ns: str) -> int:
    pod = cp.get(f"api/v1/namespaces/{ns}/pods/p0") or {}
    required = (((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    return len(required.get("nodeSelectorTerms") or [])


def run(args: argparse.Namespace, assets: Path) -> list[str]:
    cp = ControlPlane(assets).start()
    pid = cp.procs["kube-apiserver"].proc.pid  # type: ignore[union-attr]
    kubeconfig = str(cp.admin_kubeconfig)
    helpers: list[mp.Process] = []
    arms: list[tuple[str, int, str]] = (  # (label, extra watchers, admission or GPR variant)
        [(f"{k} more pod watcher(s)", k, "plain") for k in args.watchers] if args.part == "watchers"
        else [(v, 0, v) for v in args.variants])
    gprs = args.part == "gpr"
    cpu: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    try:
        if args.part == "admission":
            helpers.append(_install_admission(cp))
        if gprs:
            crd = next(o for o in render() if o.get("kind") == "CustomResourceDefinition"
                       and o["metadata"]["name"] == f"{GPRS.plural}.{GPRS.group}")
            copy = _without_cel(crd)
            cp.apply([crd, copy])
            for c in (crd, copy):
                cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{c['metadata']['name']}")
        # the benchmark's own watcher of every pod (of every GPR: the controller's)
        helpers.append(_start(_informer, kubeconfig, resource=GPRS if gprs else PODS))
        if gprs:  # and of the copy's
            helpers.append(_start(_informer, kubeconfig, resource=Resource(NOCEL_GROUP, GPRS.version, GPRS.plural,
                                                                           GPRS.kind)))
        time.sleep(2)
        n = 0
        for r in range(args.rounds):
            for label, extra, variant in arms:
                n += 1
                ns = f"round-{n}"
                watchers = [_start(_informer, kubeconfig) for _ in range(extra)]
                time.sleep(1)
                before = cpu_seconds(pid)
                asyncio.run((_load_gprs if gprs else _load)(kubeconfig, ns, variant, args.pods))
                time.sleep(1)  # the watch events of the last writes
                used = cpu_seconds(pid) - before
                for w in watchers:
                    w.terminate()
                cpu[label].append(used)
                _check(cp, ns, variant, gprs, label)
                print(f"round {r + 1}/{args.rounds} {label}: kube-apiserver {used:.2f} CPU-s", file=sys.stderr,
                      flush=True)
                group = NOCEL_GROUP if variant.endswith("-nocel") else GPRS.group
                what = f"apis/{group}/{GPRS.version}/namespaces/{ns}/{GPRS.plural}" if gprs else \
                    f"api/v1/namespaces/{ns}/pods?gracePeriodSeconds=0"
                cp.api("DELETE", what)
                time.sleep(1)
    finally:
        for h in helpers:
            h.terminate()
        cp.stop()
    base = statistics.median(cpu[arms[0][0]])
    what = (f"{args.pods:,} GPRs written as the variant says (32 clients, one JSON watcher of every GPR)" if gprs
            else f"{args.pods:,} pods created and bound (32 clients, one JSON watcher of every pod as a benchmark "
                 "keeps)")
    out = [f"kube-apiserver CPU seconds for {what}, median of {args.rounds} interleaved round(s):",
           "| arm | CPU-s (rounds) | more than the first arm | a pod |", "|---|---|---|---|"]
    for label, _, _ in arms:
        med = statistics.median(cpu[label])
        rounds = ", ".join(f"{x:.2f}" for x in cpu[label])
        out.append(f"| {label} | {med:.2f} ({rounds}) | {med - base:+.2f} | {1000 * med / args.pods:.2f} ms |")
    if gprs:
        out[1] = out[1].replace("a pod", "a GPR")
    return out


def _list(text: str, kind: type, what: str, parser: argparse.ArgumentParser) -> list[Any]:
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{what}: expected a comma-separated list, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_apiserver_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("watchers", "admission", "gpr"), required=True,
                   help="watchers: extra pod informers; admission: how pods are narrowed; gpr: an auto-GPR's writes")
    p.add_argument("--pods", type=int, default=2000, help="pods created and bound (GPRs written) a round (2000)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median; 3)")
    p.add_argument("--watchers", default="0,1,2,4", help="--part watchers: extra watchers per arm (0,1,2,4)")
    p.add_argument("--variants", help=f"--part admission: of {', '.join(VARIANTS)} (all); --part gpr: of "
                                      f"{', '.join(GPR_VARIANTS)} (all)")
    args = p.parse_args(argv)
    known = GPR_VARIANTS if args.part == "gpr" else VARIANTS
    args.variants = args.variants or ",".join(known)
    args.watchers = _list(args.watchers, int, "--watchers", p)
    args.variants = _list(args.variants, str, "--variants", p)
    if not args.watchers or min(args.watchers) < 0:
        p.error("--watchers: counts of 0 or more")
    if not args.variants or any(v not in known for v in args.variants):
        p.error(f"--variants: each one of {', '.join(known)}")
    if args.pods < 1 or args.rounds < 1:
        p.error("--pods and --rounds: at least 1")
    assets = assets_dir()
    if assets is None or missing_assets(assets):
        p.error("KUBEBUILDER_ASSETS must name a folder with kube-apiserver, etcd and kubectl (README: "
                "'Testing against a real control plane')")
    for line in run(args, assets):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
