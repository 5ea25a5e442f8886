"""Part ``e2e`` of the control-plane benchmark, measured where users run it: the real kube-apiserver and
kube-scheduler (``KUBEBUILDER_ASSETS``, as for the suite's realcluster tests), the shipped manifests, the shipped
``accelstack-scheduler`` profile (only the extender URL and CA changed) and the product's processes under the
shipped ServiceAccount with a real token.

N one-GPU pods (default 2,000) on 5,000 fake nodes x 8 GPUs, created by 32 concurrent clients, in arms measured
in the same run and interleaved round by round:

- ``none``: the profile without an extender (kube-scheduler alone);
- ``noop``: a do-nothing extender (``bench/noop_extender.py``, filter only), and ``noop+bind`` (also a binder);
- each of those with kube-scheduler's default client limit (QPS 50 / burst 100: the profile without its
  ``clientConnection``) and raised to 500 / 1,000 (what the shipped profile sets);
- ``accelstack auto``: the shipped extender (``--auto-gpr=true``) and controller, the shipped webhooks and
  profile (kube-scheduler binds, 500 / 1,000): each pod gets a GPR of its own from the namespace's default template;
- ``accelstack auto-direct``: the same with ``--auto-gpr-direct=true`` and a template that is not preemptible: a
  bare pod is admitted at once, pinned to a node with free devices, with no GPR object, while no GPR waits;
  ``auto-direct-other`` (only when named) the same with every webhook call answered by a second replica that does
  not bind, which holds each pod at the gate for the binder to pin (the Deployment's two replicas share the calls);
- ``accelstack 20 GPRs``: 20 GPRs x 25 nodes x 4 GPUs, N/20 pods each (labelled with their GPR);
- only when named in ``--arms`` (client limit raised), the floors of that path: what a design that narrows pods to
  reserved nodes could reach at best, with no GPR object, queue or decision (``bench/noop_extender.py --floor``):
  ``floor-gprs`` (a webhook that narrows each labelled pod to 25 fixed nodes, the extender binds),
  ``floor-gprs-watch`` (the same with two informers of every pod, as accelstack's extender and controller keep),
  ``floor-auto`` (a webhook that gates each pod, a loop that watches every pod and lifts the gate with a narrowing
  PATCH, the extender binds), ``floor-auto-watch`` (the same with the binder's informer too: two pod watchers, as
  accelstack), ``floor-gprs-filter`` / ``floor-gprs-filter-watch`` (the narrowing webhook, a filter-only extender,
  kube-scheduler binds; with one informer) and ``floor-auto-filter`` (gate and ungating loop, kube-scheduler
  binds), ``floor-gprs-filter-one`` (floor-gprs-filter with each pod narrowed to one of its 25 nodes, in turn: a
  pod of one term where accelstack's carries one a reserved node); ``gprs-bind`` / ``auto-bind``, accelstack
  with the profile's earlier design, its extender the
  binder (``bindVerb: bind``: the bind verb records the pod in the ledger and makes the Binding itself); and
  ``gprs-oneproc``, accelstack's 20 GPRs with the controller inside the extender's process (``--controller=true``,
  not shipped): one pod informer in all; ``gprs-h2``, accelstack's 20 GPRs with HTTP/2 offered on the verbs
  (``--scheduler-http2=true``, as the ``-bind`` arms have it).

Per arm: pods/s (first create to last bind), create -> bound p50/p99, refused creations, never-bound pods,
over-allocated nodes (GPUs requested by the pods bound to a node above its 8), orphan GPRs (auto-GPRs no pod
names), API writes per pod (the API server's own request counter: every POST/PUT/PATCH/DELETE/APPLY but Leases;
its reads, GET and LIST, are printed a pod too),
CPU seconds of each process, the extender's bind p99 (its histogram) and the scheduler's extender timeouts (its
log). Between arms the pods and GPRs are deleted and the nodes left empty.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import ssl
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.realcluster.controlplane import ControlPlane, Process, free_port  # noqa: E402
from tests.realcluster.shipped import WEBHOOK_KINDS, install, pick, render, webhooks_to  # noqa: E402
from tests.realcluster.stack import Stack  # noqa: E402

GPU = "nvidia.com/gpu"
GPUS = 8
RAISED = {"qps": 500, "burst": 1000}
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE"}
READ_VERBS = {"GET", "LIST"}  # a WATCH is counted once when opened: its events are in apiserver_watch_events_total
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    extender: str  # none | noop | noop+bind | accelstack
    raised: bool = False
    mode: str = ""  # accelstack and the floors: auto | gprs


ARMS = [
    Arm("none", "no extender, default client limit", "none"),
    Arm("noop", "do-nothing extender (filter), default limit", "noop"),
    Arm("noop-bind", "do-nothing extender (filter+bind), default limit", "noop+bind"),
    Arm("none-raised", "no extender, client limit 500/1,000", "none", raised=True),
    Arm("noop-raised", "do-nothing extender (filter), 500/1,000", "noop", raised=True),
    Arm("noop-bind-raised", "do-nothing extender (filter+bind), 500/1,000", "noop+bind", raised=True),
    # the profile as shipped: kube-scheduler binds, its client limit 500/1,000
    Arm("auto", "accelstack, one auto-GPR per pod", "accelstack", raised=True, mode="auto"),
    Arm("gprs", "accelstack, 20 GPRs x pods/20", "accelstack", raised=True, mode="gprs"),
    # --auto-gpr-direct: a bare pod admitted at once with no GPR object while nothing waits (its template is one
    # node, whole devices and not preemptible); the same pods and namespace annotation as "auto"
    Arm("auto-direct", "accelstack auto, --auto-gpr-direct", "accelstack", raised=True,
        mode="auto"),
    # the same with every webhook call answered by a second replica that does not bind (the Deployment runs two
    # behind one Service): each pod is held at the gate and handed to the binder, which pins it and lifts the gate
    Arm("auto-direct-other", "accelstack auto, --auto-gpr-direct, via the other replica", "accelstack",
        raised=True, mode="auto"),
    # not run unless asked for (--arms): what a design that narrows pods could reach at best (noop_extender.py)
    Arm("floor-gprs", "floor: webhook narrows, binder, 500/1,000", "noop+bind", raised=True, mode="gprs"),
    Arm("floor-auto", "floor: gate, ungate+narrow, binder, 500/1,000", "noop+bind", raised=True, mode="auto"),
    Arm("floor-gprs-watch", "floor-gprs + 2 pod informers, 500/1,000", "noop+bind", raised=True, mode="gprs"),
    Arm("floor-auto-watch", "floor-auto + 2 pod informers, 500/1,000", "noop+bind", raised=True, mode="auto"),
    Arm("floor-gprs-filter", "floor: webhook narrows, scheduler binds, 500/1,000", "noop", raised=True, mode="gprs"),
    Arm("floor-gprs-filter-watch", "floor-gprs-filter + 1 pod informer, 500/1,000", "noop", raised=True,
        mode="gprs"),
    Arm("floor-auto-filter", "floor: gate, ungate+narrow, scheduler binds, 500/1,000", "noop", raised=True,
        mode="auto"),
    Arm("floor-gprs-filter-one", "floor-gprs-filter, each pod narrowed to 1 node, 500/1,000", "noop", raised=True,
        mode="gprs"),
    # the profile's earlier design, not shipped: accelstack's extender binds (bindVerb), 500/1,000
    Arm("gprs-bind", "accelstack 20 GPRs, extender binds, 500/1,000", "accelstack", raised=True, mode="gprs"),
    Arm("auto-bind", "accelstack auto-GPR, extender binds, 500/1,000", "accelstack", raised=True, mode="auto"),
    # not shipped: the controller inside the extender's process (--controller=true, its passes in a worker thread),
    # so one pod informer in all: what the second informer costs accelstack
    Arm("gprs-oneproc", "accelstack 20 GPRs, one process, 500/1,000", "accelstack", raised=True, mode="gprs"),
    # HTTP/2 offered on the verbs (--scheduler-http2=true), as shipped before 2026-12-05: the shipped profile's
    # filter goes one pod at a time, which one kept-alive HTTP/1.1 connection carries at less CPU
    Arm("gprs-h2", "accelstack 20 GPRs, verbs over HTTP/2, 500/1,000", "accelstack", raised=True, mode="gprs"),
]
FLOORS = {"floor-gprs", "floor-auto", "floor-gprs-watch", "floor-auto-watch", "floor-gprs-filter",
          "floor-gprs-filter-watch", "floor-auto-filter", "floor-gprs-filter-one"}
ON_REQUEST = FLOORS | {"gprs-bind", "auto-bind", "gprs-oneproc", "gprs-h2", "auto-direct-other"}  # arms run only when --arms names them


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its threads (``/proc/PID/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


class Admin:
    """The bench's own client (the admin's certificate): creates, lists, watches, deletes."""

    def __init__(self, cp: ControlPlane, connections: int = 64) -> None:
        import aiohttp

        ctx = ssl.create_default_context(cafile=str(cp.pki.ca_crt))
        crt, key = cp.pki.folder / "admin.crt", cp.pki.folder / "admin.key"
        ctx.load_cert_chain(str(crt), str(key))
        self.url = cp.url
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=connections),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_read=60))

    async def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json"
                   ) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, f"{self.url}/{path.lstrip('/')}", data=data,
                                     headers={"Content-Type": ctype}) as r:
            raw = await r.read()
            return r.status, (json.loads(raw) if raw and raw[:1] == b"{" else {})

    async def text(self, path: str) -> str:
        async with self.http.get(f"{self.url}/{path.lstrip('/')}") as r:
            return await r.text()

    async def close(self) -> None:
        await self.http.close()


async def gather_bounded(n: int, items: list[Any], work: Callable[[Any], Any]) -> list[Any]:
    sem = asyncio.Semaphore(n)

    async def one(item: Any) -> Any:
        async with sem:
            return await work(item)

    return list(await asyncio.gather(*(one(i) for i in items)))


async def make_nodes(api: Admin, count: int) -> list[str]:
    names = [f"node-{i:04d}" for i in range(count)]
    alloc = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU: str(GPUS)}

    async def one(name: str) -> None:
        status, body = await api.call("POST", "api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": "H200",
                                                  "nvidia.com/gpu.count": str(GPUS)}},
            "status": {"capacity": alloc, "allocatable": alloc,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})
        if status not in (201, 409):
            raise RuntimeError(f"node {name}: {status} {body.get('message')}")

    await gather_bounded(32, names, one)
    return names


async def write_counts(api: Admin) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The API server's writes so far by verb and resource (``PATCH nodes``, ``UPDATE pods/status``), Leases left
    out (``apiserver_request_total``), the watch events it sent by kind (``apiserver_watch_events_total``: one
    write fans out to every watcher of its kind), and its reads (GET and LIST) by resource the same way."""
    from prometheus_client.parser import text_string_to_metric_families

    kinds: dict[str, float] = {}
    sent: dict[str, float] = {}
    reads: dict[str, float] = {}
    for fam in text_string_to_metric_families(await api.text("metrics")):
        if fam.name == "apiserver_watch_events":
            for s in fam.samples:
                if s.name == "apiserver_watch_events_total":
                    kind = s.labels.get("kind") or s.labels.get("resource") or "?"
                    sent[kind] = sent.get(kind, 0.0) + s.value
        if fam.name != "apiserver_request":
            continue
        for s in fam.samples:
            verb = s.labels.get("verb")
            if s.name != "apiserver_request_total" or s.labels.get("resource") == "leases" \
                    or verb not in WRITE_VERBS | READ_VERBS:
                continue
            sub = s.labels.get("subresource")
            kind = f"{verb} {s.labels.get('resource')}{'/' + sub if sub else ''}"
            into = kinds if verb in WRITE_VERBS else reads
            into[kind] = into.get(kind, 0.0) + s.value
    return kinds, sent, reads


def histogram_p99(text: str, name: str, match: dict[str, str]) -> tuple[dict[float, float], float]:
    """Cumulative buckets of one histogram (summed over series that carry ``match``) and its count."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in match.items()):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets, buckets.get(float("inf"), 0.0)


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket that holds the q-quantile of what was observed between two scrapes."""
    delta = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = delta.get(float("inf"), 0.0)
    if total <= 0:
        return float("nan")
    for le in sorted(delta):
        if delta[le] >= q * total:
            return le
    return float("inf")


@dataclass
class Result:
    arm: Arm
    pods: int
    bound: int = 0
    refused: int = 0
    pods_per_s: float = 0.0
    lat: list[float] = field(default_factory=list)
    over: int = 0
    orphans: int = 0
    writes_per_pod: float = 0.0
    writes_by_kind: dict[str, float] = field(default_factory=dict)  # per pod
    watch_events: dict[str, float] = field(default_factory=dict)  # sent per pod, by kind
    reads_by_kind: dict[str, float] = field(default_factory=dict)  # GET and LIST per pod, by verb and resource
    cpu: dict[str, float] = field(default_factory=dict)
    bind_p99: float = float("nan")
    connections: dict[str, float] = field(default_factory=dict)  # TLS connections to the verbs, by protocol
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)


class Bench:
    def __init__(self, cp: ControlPlane, nodes: int, pods: int, clients: int, log: Callable[[str], None]) -> None:
        self.cp, self.node_count, self.pods, self.clients, self.log = cp, nodes, pods, clients, log
        self.objects: list[dict[str, Any]] = []
        self.stack: Stack | None = None
        self.noop: Process | None = None
        self.noop_cert: tuple[Path, Path] | None = None
        self.floor = False
        self.watcher: Process | None = None
        self.second: Any = None  # auto-direct-other: the extender replica that does not bind
        self.round = 0

    async def setup(self) -> None:
        self.objects = install(self.cp, render())
        self.api = Admin(self.cp)
        t = time.monotonic()
        self.nodes = await make_nodes(self.api, self.node_count)
        self.log(f"{len(self.nodes):,} nodes x {GPUS} GPUs created in {time.monotonic() - t:.0f} s")
        self.noop_cert = self.cp.pki.issue("noop", "/CN=noop-extender", sans="IP:127.0.0.1")

    async def onboard(self, timeout: float) -> None:
        """Run accelstack's stack once until its accelerator-node controller has made every node's AcceleratorNode
        and written its first status (a one-time cost of installing it on a cluster: 5,000 creates and 5,000
        status writes), so no measured arm shares the API server with that first onboarding. Logged with how long
        it took."""
        t = time.monotonic()
        self._start(Arm("onboard", "accelstack's first start", "accelstack"))
        try:
            made = stated = -1
            while time.monotonic() - t < timeout:
                status, body = await self.api.call("GET", "apis/accelstack.io/v1alpha1/acceleratornodes")
                if status == 200:
                    items = body.get("items") or []
                    made = len(items)
                    stated = sum(1 for o in items if (o.get("status") or {}).get("phase"))
                    if stated >= len(self.nodes):
                        break
                await asyncio.sleep(3)
            self.log(f"accelstack's first start: {made:,} AcceleratorNodes made, {stated:,} with a status, in "
                     f"{time.monotonic() - t:.0f} s (before any measured arm)")
        finally:
            self._stop()

    # ---- the processes of each arm ----------------------------------------------------------------------------
    def _webhooks(self, on: bool, url: str = "") -> None:
        if on:
            base = url or (self.stack.url if self.stack is not None else "")
            assert base, "webhooks need accelstack's extender or a floor's URL"
            hooks = webhooks_to(self.objects, base, self.cp.pki.ca_crt.read_bytes())
            # a floor serves the pods' mutating webhook only (it has no GPRs to validate)
            self.cp.apply([h for h in hooks if not url or h["kind"] == "MutatingWebhookConfiguration"])
        else:
            for obj in self.objects:
                if obj.get("kind") in WEBHOOK_KINDS:
                    plural = obj["kind"].lower() + "s"
                    self.cp.delete(f"apis/admissionregistration.k8s.io/v1/{plural}/{obj['metadata']['name']}")

    def _scheduler_config(self, arm: Arm) -> dict[str, Any]:
        cm = pick(self.objects, "ConfigMap", "accelstack-scheduler-config")
        import yaml

        cfg = yaml.safe_load(cm["data"]["config.yaml"])
        shipped = cfg["extenders"][0]
        if arm.extender == "none":
            cfg.pop("extenders")
        else:
            ext = dict(shipped)
            if arm.extender == "accelstack":
                assert self.stack is not None
                ext["urlPrefix"] = f"{self.stack.verbs_url}/scheduler"  # the verbs' own mTLS listener, as shipped
                if arm.key.endswith("-bind"):
                    ext["bindVerb"] = "bind"
            else:
                ext["urlPrefix"] = f"https://127.0.0.1:{self.noop_port}/scheduler"
                for verb in ("prioritizeVerb", "preemptVerb", "bindVerb"):
                    ext.pop(verb, None)
                if arm.extender == "noop+bind":
                    ext["bindVerb"] = "bind"
            # the shipped client certificate (every arm presents one, so the TLS cost is the same as shipped)
            client_cert, client_key = self.cp.pki.issue("bench-scheduler-client", "/CN=accelstack-scheduler",
                                                        client=True)
            ext["tlsConfig"] = {**shipped.get("tlsConfig", {}), "caFile": str(self.cp.pki.ca_crt),
                                "certFile": str(client_cert), "keyFile": str(client_key),
                                "serverName": "127.0.0.1" if arm.extender != "accelstack" else
                                shipped["tlsConfig"]["serverName"]}
            cfg["extenders"] = [ext]
        if arm.extender == "accelstack":  # the profile's own limit, as shipped (RAISED: the baselines match it)
            assert cfg.get("clientConnection") == RAISED, cfg.get("clientConnection")
        elif arm.raised:
            cfg["clientConnection"] = dict(RAISED)
        else:  # kube-scheduler's default client limit (QPS 50 / burst 100)
            cfg.pop("clientConnection", None)
        return dict(cfg)

    def _start(self, arm: Arm) -> dict[str, int]:
        """Start what the arm runs; the PIDs whose CPU is counted."""
        pids = {"kube-apiserver": self.cp.procs["kube-apiserver"].proc.pid, "etcd": self.cp.procs["etcd"].proc.pid}
        if arm.extender == "accelstack":
            oneproc = arm.key.endswith("-oneproc")  # the controller inside the extender: one pod informer
            # HTTP/2 on the verbs where binds run in parallel (bindVerb, as docs/scheduler.md says), or asked for
            http2 = arm.key.endswith(("-bind", "-h2"))
            self.stack = Stack(self.cp, self.objects,
                               extender_args=("--auto-gpr=true", *(("--controller=true",) if oneproc else ()),
                                              *(("--auto-gpr-direct=true",) if arm.key.startswith("auto-direct") else ()),
                                              *(("--scheduler-http2=true",) if http2 else ())))
            self.stack.start(controller=not oneproc)
            assert self.stack.extender.proc is not None
            pids["extender"] = self.stack.extender.proc.pid
            if not oneproc:
                pids["controller"] = self.stack.controllers[0].proc.pid  # type: ignore[union-attr]
            if arm.key == "auto-direct-other":  # a second replica answers every webhook call
                other, _ = self.stack.second_extender()
                self.second = other
                assert other.proc is not None
                pids["extender-1"] = other.proc.pid
        elif arm.extender.startswith("noop"):
            assert self.noop_cert is not None
            self.noop_port = free_port()
            argv = [sys.executable, str(ROOT / "bench" / "noop_extender.py"), "--port", str(self.noop_port),
                    "--tls-cert-file", str(self.noop_cert[0]), "--tls-key-file", str(self.noop_cert[1])]
            if arm.extender == "noop+bind":
                argv += ["--bind", "--kubeconfig", str(self.cp.sa_kubeconfig("accelstack-system",
                                                                              "accelstack-extender"))]
            if arm.key in FLOORS:
                kubeconfig = str(self.cp.sa_kubeconfig("accelstack-system", "accelstack-extender"))
                argv += ["--floor", arm.mode, *(["--one-node"] if arm.key.endswith("-one") else [])]
                if arm.mode == "auto":  # the ungating loop patches pods
                    argv += ["--ungate-kubeconfig", kubeconfig]
                if arm.extender != "noop+bind":  # a filter-only floor reads pods only for its informer
                    argv += ["--kubeconfig", kubeconfig]
            if arm.key.endswith("-watch"):  # the extender's informer here; the controller's: the ungating loop's
                argv += ["--pod-watch"]  # watch in floor-auto, a process of its own in floor-gprs (no ungating);
                # floor-gprs-filter-watch: one informer in all, as one process holding both would keep
            if arm.key == "floor-gprs-watch":
                kubeconfig = str(self.cp.sa_kubeconfig("accelstack-system", "accelstack-extender"))
                self.watcher = Process("noop-informer", [sys.executable, str(ROOT / "bench" / "noop_extender.py"),
                                                         "--watch-only", "--kubeconfig", kubeconfig],
                                       self.cp.dir / "noop-informer.log")
                pids["noop-informer"] = self.watcher.proc.pid
            self.noop = Process("noop-extender", argv, self.cp.dir / "noop-extender.log")
            deadline = time.monotonic() + 30
            while "serving" not in (self.cp.dir / "noop-extender.log").read_text():
                if time.monotonic() > deadline or not self.noop.alive():
                    raise self.noop.fail("did not start")
                time.sleep(0.1)
            pids["noop-extender"] = self.noop.proc.pid
        # every arm's scheduler as the shipped Deployment runs it: the accelstack-scheduler ServiceAccount (its
        # API priority level is the API server's default for ServiceAccounts, not kube-scheduler's own)
        sched = self.cp.start_scheduler(json.dumps(self._scheduler_config(arm)), name="bench-scheduler",
                                        kubeconfig=self.cp.sa_kubeconfig("accelstack-system", "accelstack-scheduler"))
        pids["kube-scheduler"] = sched.proc.pid
        return pids

    def _stop(self) -> None:
        self.cp.stop_component("bench-scheduler")
        if self.second is not None:
            self.second.stop()
            self.second = None
        if self.stack is not None:
            self._webhooks(False)
            self.stack.stop()
            self.stack = None
        if self.noop is not None:
            if self.floor:
                self._webhooks(False)
                self.floor = False
            self.noop.stop()
            self.noop = None
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None

    # ---- one arm ----------------------------------------------------------------------------------------------
    async def _namespace(self, arm: Arm) -> str:
        ns = f"bench-{arm.key}-{self.round}"
        accelstack = arm.key not in FLOORS  # a floor makes no GPR: no template, no GPRs
        annotations = {"accelstack.io/default-template": "one-gpu"} if arm.mode == "auto" and accelstack else {}
        await self.api.call("POST", "api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": ns, "annotations": annotations}})
        await self.api.call("POST", f"api/v1/namespaces/{ns}/serviceaccounts",
                            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        if arm.mode == "auto" and accelstack:
            await self.api.call("POST", f"apis/accelstack.io/v1alpha1/namespaces/{ns}/gprtemplates", {
                "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate", "metadata": {"name": "one-gpu"},
                "spec": {"resource": GPU, "devicesPerNode": 1, "nodeCount": 1, "priority": 100,
                         "exitDuration": "4h", **({"preemptible": False} if arm.key.startswith("auto-direct") else {})}})
        if arm.mode == "gprs" and accelstack:
            per = -(-self.pods // 20)  # pods a GPR, rounded up; 25 nodes x 4 GPUs for 2,000
            for k in range(20):
                status, body = await self.api.call("POST", f"apis/accelstack.io/v1alpha1/namespaces/{ns}/"
                                                   "gpuprovisioningrequests", {
                    "apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
                    "metadata": {"name": f"team-{k}"},
                    "spec": {"resource": GPU, "devicesPerNode": 4, "nodeCount": -(-per // 4), "priority": 100}})
                if status != 201:
                    raise RuntimeError(f"GPR team-{k}: {status} {body.get('message')}")
        return ns

    def _pod(self, ns: str, i: int, arm: Arm) -> dict[str, Any]:
        labels = {"app": "bench"}
        if arm.mode == "gprs":
            labels["accelstack.io/gpr"] = f"team-{i % 20}"
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p-{i:05d}", "namespace": ns,
                                                                 "labels": labels},
                "spec": {"schedulerName": "accelstack-scheduler", "terminationGracePeriodSeconds": 0,
                         "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {
                             "requests": {"cpu": "10m", GPU: "1"}, "limits": {GPU: "1"}}}]}}

    async def _watch(self, ns: str, bound: dict[str, float], stop: asyncio.Event) -> None:
        """Record when each pod of ``ns`` is first seen with a node (a watch, resumed where it ended)."""
        rv = ""
        while not stop.is_set():
            q = "watch=1&timeoutSeconds=60" + (f"&resourceVersion={rv}" if rv else "")
            try:
                async with self.api.http.get(f"{self.api.url}/api/v1/namespaces/{ns}/pods?{q}") as r:
                    if r.status != 200:
                        await asyncio.sleep(0.5)
                        continue
                    async for line in r.content:
                        ev = json.loads(line)
                        obj = ev.get("object") or {}
                        if ev.get("type") == "ERROR":  # expired: list again from now
                            rv = ""
                            break
                        rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                        name = str((obj.get("metadata") or {}).get("name") or "")
                        if (obj.get("spec") or {}).get("nodeName") and name not in bound:
                            bound[name] = time.monotonic()
                        if stop.is_set():
                            return
            except (TimeoutError, OSError, ValueError):
                pass
            await asyncio.sleep(0.1)

    async def run(self, arm: Arm, timeout: float) -> Result:
        res = Result(arm, self.pods)
        ns = await self._namespace(arm)
        pids = self._start(arm)
        try:
            if arm.extender == "accelstack":
                self._webhooks(True)
                if self.second is not None:  # the pods' webhook answered by the replica that does not bind
                    self._webhooks(True, self.second.health)
            elif arm.key in FLOORS:
                self._webhooks(True, f"https://127.0.0.1:{self.noop_port}")
                self.floor = True
            ext_before, conns_before = await self._extender_metrics()
            bound: dict[str, float] = {}
            stop = asyncio.Event()
            watcher = asyncio.create_task(self._watch(ns, bound, stop))
            await asyncio.sleep(0.5)  # the watch is open before the first create
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            writes0, sent0, reads0 = await write_counts(self.api)
            created: dict[str, float] = {}

            async def create(i: int) -> None:
                t = time.monotonic()
                status, body = await self.api.call("POST", f"api/v1/namespaces/{ns}/pods", self._pod(ns, i, arm))
                if status == 201:
                    created[body["metadata"]["name"]] = t
                else:
                    res.refused += 1
                    if len(res.errors) < 3:
                        res.errors.append(f"{status} {str(body.get('message'))[:200]}")

            started = time.monotonic()
            await gather_bounded(self.clients, list(range(self.pods)), create)
            deadline, last_progress, seen = time.monotonic() + timeout, time.monotonic(), 0
            while len(bound) < len(created) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                if len(bound) != seen:
                    seen, last_progress = len(bound), time.monotonic()
                elif time.monotonic() - last_progress > 60:
                    break  # no bind for a minute: what is left will not be bound
            stop.set()
            writes1, sent1, reads1 = await write_counts(self.api)
            res.cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
            watcher.cancel()
            res.bound = sum(1 for n in created if n in bound)
            last = max((bound[n] for n in created if n in bound), default=started)
            res.pods_per_s = res.bound / max(1e-9, last - started)
            res.lat = [bound[n] - created[n] for n in created if n in bound]
            per_pod = {k: (v - writes0.get(k, 0.0)) / max(1, len(created)) for k, v in writes1.items()}
            res.writes_by_kind = {k: v for k, v in sorted(per_pod.items(), key=lambda kv: -kv[1]) if v > 0}
            res.writes_per_pod = sum(res.writes_by_kind.values())
            sent = {k: (v - sent0.get(k, 0.0)) / max(1, len(created)) for k, v in sent1.items()}
            res.watch_events = {k: v for k, v in sorted(sent.items(), key=lambda kv: -kv[1]) if v >= 0.01}
            read = {k: (v - reads0.get(k, 0.0)) / max(1, len(created)) for k, v in reads1.items()}
            res.reads_by_kind = {k: v for k, v in sorted(read.items(), key=lambda kv: -kv[1]) if v >= 0.01}
            res.over = await self._overallocated()
            if arm.extender == "accelstack":
                res.orphans = await self._orphans(ns)
                after, conns_after = await self._extender_metrics()
                res.bind_p99 = bucket_quantile(ext_before, after, 0.99)
                res.connections = {k: v - conns_before.get(k, 0.0) for k, v in conns_after.items()}
            res.timeouts = self._scheduler_timeouts(f"{arm.key}-{self.round}")
        finally:
            self._stop()
            await self._clean(ns)
        return res

    async def _extender_metrics(self) -> tuple[dict[float, float], dict[str, float]]:
        """The extender's bind-latency buckets, and the TLS connections its verbs listener accepted so far by
        protocol (kube-scheduler's: one HTTP/2 connection, or one per bind in flight beyond two over HTTP/1.1)."""
        if self.stack is None:
            return {}, {}
        import aiohttp
        from prometheus_client.parser import text_string_to_metric_families

        async with aiohttp.ClientSession() as http, http.get(
                f"{self.stack.url}/metrics", ssl=self.cp.ssl_context()) as r:
            text = await r.text()
        connections = {s.labels["protocol"]: s.value for fam in text_string_to_metric_families(text)
                       if fam.name == "accelstack_http_connections" for s in fam.samples
                       if s.name == "accelstack_http_connections_total"}
        return histogram_p99(text, "accelstack_extender_request_seconds", {"verb": "bind"})[0], connections

    def _scheduler_timeouts(self, tag: str) -> int:
        log = self.cp.dir / "bench-scheduler.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if log.exists():
            log.rename(self.cp.dir / f"bench-scheduler-{tag}.log")  # one log per arm
        return len(re.findall(r"(?i)extender.*(deadline exceeded|Client\.Timeout|timeout awaiting)", text))

    async def _overallocated(self) -> int:
        _, body = await self.api.call("GET", "api/v1/pods?fieldSelector=spec.nodeName!=")
        per: dict[str, int] = {}
        for p in body.get("items") or []:
            if p["metadata"].get("deletionTimestamp"):
                continue
            n = p["spec"]["nodeName"]
            per[n] = per.get(n, 0) + sum(int((c.get("resources") or {}).get("requests", {}).get(GPU, 0))
                                         for c in p["spec"]["containers"])
        return sum(1 for v in per.values() if v > GPUS)

    async def _orphans(self, ns: str) -> int:
        _, gprs = await self.api.call("GET", f"apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests")
        _, pods = await self.api.call("GET", f"api/v1/namespaces/{ns}/pods")
        named = {(p["metadata"].get("labels") or {}).get("accelstack.io/gpr") for p in pods.get("items") or []}
        return sum(1 for g in gprs.get("items") or [] if g["metadata"]["name"] not in named)

    async def _clean(self, ns: str) -> None:
        await self.api.call("DELETE", f"apis/accelstack.io/v1alpha1/namespaces/{ns}/gpuprovisioningrequests")
        await self.api.call("DELETE", f"api/v1/namespaces/{ns}/pods", {"gracePeriodSeconds": 0})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            _, body = await self.api.call("GET", f"api/v1/namespaces/{ns}/pods?limit=1")
            if not body.get("items"):
                break
            await asyncio.sleep(0.5)
        await self.api.call("DELETE", f"api/v1/namespaces/{ns}")


def bind_text(seconds: float) -> str:
    """The extender's bind p99 as its histogram can tell it: a bucket's upper bound (``<= 0.25 s``)."""
    if math.isnan(seconds):
        return "-"
    return "> 5 s" if math.isinf(seconds) else f"<= {seconds:g} s"


def table(results: dict[str, list[Result]]) -> list[str]:
    """Medians over rounds (each round's value in brackets where there are several), ratios against the
    do-nothing extender (filter only) at kube-scheduler's default client limit and raised to 500 / 1,000."""
    def med(key: str, get: Callable[[Result], float]) -> float:
        return statistics.median([get(r) for r in results[key]]) if results.get(key) else float("nan")

    base = med("noop", lambda r: r.pods_per_s)
    base_raised = med("noop-raised", lambda r: r.pods_per_s)
    lines = [f"{'configuration':<46} {'pods/s':>7} {'(rounds)':<20} {'x noop':>7} {'x noop 500':>10} "
             f"{'p50 s':>6} {'p99 s':>6} {'refused':>7} {'unbound':>7} {'over':>4} {'orphan':>6} "
             f"{'writes/pod':>10} {'bind p99':>8} {'timeouts':>8}"]
    for arm in ARMS:
        rs = results.get(arm.key)
        if not rs:
            continue
        pps = med(arm.key, lambda r: r.pods_per_s)
        each = ", ".join(f"{r.pods_per_s:.1f}" for r in rs) if len(rs) > 1 else ""
        lines.append(
            f"{arm.label:<46} {pps:7.1f} {('(' + each + ')') if each else '':<20} {pps / base:6.2f}x "
            f"{pps / base_raised:9.2f}x {med(arm.key, lambda r: statistics.median(r.lat or [float('nan')])):6.2f} "
            f"{med(arm.key, lambda r: pct(r.lat, 99)):6.2f} {sum(r.refused for r in rs):>7} "
            f"{sum(r.pods - r.refused - r.bound for r in rs):>7} {sum(r.over for r in rs):>4} "
            f"{sum(r.orphans for r in rs):>6} {med(arm.key, lambda r: r.writes_per_pod):10.1f} "
            f"{bind_text(med(arm.key, lambda r: r.bind_p99)):>8} {sum(r.timeouts for r in rs):>8}")
    lines.append("CPU seconds per arm (median): " + "; ".join(
        f"{arm.key}: " + ", ".join(f"{p} {statistics.median([r.cpu.get(p, 0.0) for r in results[arm.key]]):.1f}"
                                   for p in results[arm.key][0].cpu)
        for arm in ARMS if results.get(arm.key)))
    for arm in ARMS:
        errs = [e for r in results.get(arm.key, []) for e in r.errors]
        if errs:
            lines.append(f"{arm.key}: refused creations, e.g. {errs[0]}")
    return lines


async def part_e2e_real(pods: int, nodes: int, rounds: int, clients: int, arms: list[str], timeout: float
                        ) -> list[str]:
    from tests.realcluster.controlplane import assets_dir, missing_assets

    folder = assets_dir()
    if folder is None or missing_assets(folder, ("kube-apiserver", "kube-scheduler", "etcd", "kubectl")):
        raise SystemExit("bench e2e: KUBEBUILDER_ASSETS must name a folder with kube-apiserver, kube-scheduler, "
                         "etcd and kubectl (scripts/test.sh unpacks ../shared/k8s into .cache/k8s-bin)")
    cp = ControlPlane(folder)
    chosen = [a for a in ARMS if (a.key in arms if arms else a.key not in ON_REQUEST)]
    results: dict[str, list[Result]] = {}
    try:
        cp.start()

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

        bench = Bench(cp, nodes, pods, clients, log)
        await bench.setup()
        if any(a.extender == "accelstack" for a in chosen):
            await bench.onboard(timeout)
        if any(a.extender == "accelstack" and a.key.endswith("-bind") for a in chosen):
            # the extender's bind verb needs pods/binding, which the shipped role leaves out
            import yaml

            cp.apply([d for d in yaml.safe_load_all((ROOT / "manifests/extender/rbac-bind-verb.yaml").read_text())
                      if d])
        for rnd in range(rounds):
            bench.round = rnd
            for arm in chosen:
                r = await bench.run(arm, timeout)
                results.setdefault(arm.key, []).append(r)
                log(f"round {rnd + 1}/{rounds} {arm.key}: {r.bound}/{pods} bound, {r.pods_per_s:.1f} pods/s, "
                    f"p50 {statistics.median(r.lat or [float('nan')]):.2f} s, refused {r.refused}, over {r.over}, "
                    f"writes/pod {r.writes_per_pod:.1f} ({', '.join(f'{k} {v:.2f}' for k, v in r.writes_by_kind.items())}), "
                    f"watch events sent/pod ({', '.join(f'{k} {v:.1f}' for k, v in r.watch_events.items())}), "
                    f"reads/pod ({', '.join(f'{k} {v:.2f}' for k, v in r.reads_by_kind.items()) or 'under 0.01'}), "
                    + (f"verbs connections ({', '.join(f'{k} {v:.0f}' for k, v in r.connections.items()) or 'none'}), "
                       if r.arm.extender == "accelstack" else "") +
                    f"cpu {', '.join(f'{k} {v:.1f}' for k, v in r.cpu.items())}")
        await bench.api.close()
    finally:
        if os.environ.get("ACCELSTACK_KEEP_CONTROL_PLANE"):
            cp.stop()
            print(f"logs kept in {cp.dir}", file=sys.stderr)
        else:
            cp.cleanup()
    head = [f"end to end inside the real kube-scheduler and kube-apiserver v1.36.2 (KUBEBUILDER_ASSETS), "
            f"{pods:,} one-GPU pods by {clients} clients on {nodes:,} nodes x {GPUS} GPUs, "
            f"median of {rounds} interleaved round(s):"]
    return head + table(results)
