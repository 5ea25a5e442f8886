"""A node's life cycle on the real control plane (issue 39): how long onboarding takes with the real node agents,
and how long deboarding a node under 8 running GPR pods takes against ``kubectl drain``.

Measured on the real kube-apiserver and kube-scheduler (``KUBEBUILDER_ASSETS``, which must hold
node-problem-detector too), the shipped manifests, the extender and controller as the suite's ``Stack`` runs them:

- ``onboarding``: an NR1 node another plugin serves (capacity 4, a pod of another scheduler holding 2 modules);
  ``spec.onboard`` set (what ``kubectl accelstack node onboard`` writes); when the controller's landing label
  ``accelstack.io/nr1-node=true`` appears, the real ``accelstack-device-plugin`` and the real node-problem-detector
  with accelstack's NR1 plugin start, as in ``tests/realcluster/test_node_onboard_real.py``
  (``tests/realcluster/nr1_agents.py``: the kubelet gRPC and pod-resources peers, NR1 sysfs fixture). Reported:
  request -> landing label, label -> plugin registered (its first ListAndWatch answer at the kubelet peer),
  label -> ``Managed``. The processes' start-up (Python imports, NPD's first plugin run) is inside the figure, as it
  is when a DaemonSet lands; image pulls and pod start-up are not.
- ``deboard``: a node with 8 running one-GPU GPR pods (bound through the real kube-scheduler with the shipped
  profile, marked Running as the kubelet would); ``spec.deboard`` with grace ``0s``: request -> all 8 pods evicted,
  -> ``Deboarded``. Baseline in the same round: ``kubectl drain NODE --ignore-daemonsets --grace-period=0 --force``
  of the same 8 pods on a twin node (``--force`` because the pods have no controller; the upstream way to empty a
  node), from the command's start to its exit. Fake nodes have no kubelet: pods with a 0 s termination grace go at
  once, so both figures are the control plane's part only.

Medians of ``--rounds`` rounds, each round's value in brackets. Run it on a quiet machine.

Usage: KUBEBUILDER_ASSETS=/tmp/k8s-bin python bench/bench_node_lifecycle.py [--rounds 3] [--timeout 120]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.realcluster.conftest import Nodes  # noqa: E402
from tests.realcluster.controlplane import ApiCallError, ControlPlane, assets_dir, missing_assets  # noqa: E402
from tests.realcluster.nr1_agents import NR1, DevicePlugin, Kubelet, landing_label_seen, nr1_npd, nr1_pod  # noqa: E402
from tests.realcluster.objects import GPRS, gpr, pod  # noqa: E402
from tests.realcluster.shipped import install, render  # noqa: E402
from tests.realcluster.stack import Stack  # noqa: E402
from tests.realcluster.test_accelerator_nodes import (  # noqa: E402
    AN,
    GFD,
    OUTSIDE,
    label_as_device_plugin,
    npd_reports,
    plugin_reports,
    status_of,
)
from tests.realcluster.test_gpr_control_plane import set_running  # noqa: E402
from tests.sysfs_fixture import nr1_node  # noqa: E402

NEEDED = ("kube-apiserver", "kube-scheduler", "etcd", "kubectl", "node-problem-detector")
PODS = 8


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def until(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"bench node lifecycle: {what} not reached within {timeout:.0f} s")


def phase(cp: ControlPlane, node: str) -> str:
    return str((status_of(cp, node) or {}).get("phase") or "")


def namespace(cp: ControlPlane, name: str) -> str:
    cp.create("api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    with contextlib.suppress(ApiCallError):
        cp.create(f"api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}})
    return name


def clean(cp: ControlPlane, ns: str) -> None:
    cp.delete(GPRS.format(ns=ns))
    cp.api("DELETE", f"api/v1/namespaces/{ns}/pods", {"gracePeriodSeconds": 0})
    cp.delete(f"api/v1/namespaces/{ns}")


def pods_on(cp: ControlPlane, node: str) -> int:
    items = cp.api("GET", f"api/v1/pods?fieldSelector=spec.nodeName={node}").get("items") or []
    return len(items)


def onboarding(cp: ControlPlane, shipped: list[dict[str, Any]], rnd: int, timeout: float) -> dict[str, float]:
    """One onboarding with the real plugin and NPD: seconds from the request and from the landing label."""
    # another scheduler's pod, outside the namespaces accelstack's pod webhook gates (as test_node_onboard.py)
    ns, held = OUTSIDE, f"life-held-{rnd}"
    with contextlib.suppress(ApiCallError):
        cp.create(f"api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "default"}})
    nodes = Nodes(cp, f"life-{rnd}")
    work = Path(tempfile.mkdtemp(prefix="life-"))
    node = nodes.add("nr1", gpus=0, nr1=4)
    modules = nr1_node(work / "sys", 4)
    cp.create(f"api/v1/namespaces/{ns}/pods", nr1_pod(held, 2, node))
    kubelet = Kubelet(cp, node)
    kubelet.pods.set_pod(ns, held, {NR1: modules[:2]})
    kubelet.start()
    plugin = DevicePlugin(cp, shipped, node, work / "sys", kubelet, work / "plugin")
    npd = nr1_npd(cp, shipped, node, work / "sys", work / "npd")
    try:
        until(f"{node} Detected", lambda: phase(cp, node) == "Detected", timeout)
        asked = time.monotonic()
        cp.patch(f"{AN}/{node}", {"spec": {"onboard": {"requestedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime())}}})
        labelled = landing_label_seen(cp, node, timeout)
        plugin.start()
        npd.start()
        until(f"{node} Managed", lambda: phase(cp, node) == "Managed", timeout)
        managed = time.monotonic()
        registered = kubelet.registered_at or float("nan")
        return {"label": labelled - asked, "registered": registered - labelled, "managed": managed - labelled}
    except SystemExit:
        progress(f"device plugin log:\n{plugin.tail()}\nNPD log:\n{npd.tail()}")
        raise
    finally:
        plugin.stop()
        npd.stop()
        kubelet.stop()
        cp.api("DELETE", f"api/v1/namespaces/{ns}/pods/{held}", {"gracePeriodSeconds": 0}, ok=(200, 202, 404))
        nodes.cleanup()
        shutil.rmtree(work, ignore_errors=True)


def managed_gpu_node(cp: ControlPlane, nodes: Nodes, suffix: str, timeout: float) -> str:
    """A GPU node accelstack's plugin serves, Managed (its agents' writes played as test_node_deboard.py does)."""
    node = nodes.add(suffix, gpus=PODS)
    label_as_device_plugin(cp, node, GFD)
    npd_reports(cp, node)
    plugin_reports(cp, node, "nvidia.com/gpu", PODS, 0)
    until(f"{node} Managed", lambda: phase(cp, node) == "Managed", timeout)
    return node


def fill(cp: ControlPlane, ns: str, node: str, prefix: str, timeout: float) -> None:
    """8 one-GPU GPRs, each with its pod, bound to ``node`` by the real kube-scheduler and marked Running."""
    names = [f"{prefix}-{i}" for i in range(PODS)]
    for name in names:
        cp.create(f"api/v1/namespaces/{ns}/pods", pod(name, gpr_name=name))
        cp.create(GPRS.format(ns=ns), gpr(name))

    def bound() -> bool:
        got = [((cp.get(f"api/v1/namespaces/{ns}/pods/{n}") or {}).get("spec") or {}).get("nodeName") for n in names]
        if any(g and g != node for g in got):
            raise SystemExit(f"bench node lifecycle: a pod of {prefix} bound elsewhere than {node}: {got}")
        return all(got)
    until(f"{PODS} pods bound to {node}", bound, timeout, every=0.2)
    for name in names:
        set_running(cp, ns, name)
    until(f"{PODS} GPRs Running", lambda: all(((cp.get(f"{GPRS.format(ns=ns)}/{n}") or {}).get("status") or {})
                                              .get("phase") == "Running" for n in names), timeout, every=0.2)


def deboarding(cp: ControlPlane, rnd: int, timeout: float) -> dict[str, float]:
    """Deboard (grace 0s) a node under 8 GPR pods; ``kubectl drain`` a twin under 8 more. Seconds."""
    ns = namespace(cp, f"life-deboard-{rnd}")
    nodes = Nodes(cp, f"life-d{rnd}")
    try:
        first = managed_gpu_node(cp, nodes, "a", timeout)
        fill(cp, ns, first, "a", timeout)
        twin = managed_gpu_node(cp, nodes, "b", timeout)  # the first is full: the next 8 land on the twin
        fill(cp, ns, twin, "b", timeout)
        asked = time.monotonic()
        cp.patch(f"{AN}/{first}", {"spec": {"deboard": {"grace": "0s", "requestedAt": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}})
        until(f"{PODS} pods evicted from {first}", lambda: pods_on(cp, first) == 0, timeout)
        evicted = time.monotonic()
        until(f"{first} Deboarded", lambda: phase(cp, first) == "Deboarded", timeout)
        deboarded = time.monotonic()
        start = time.monotonic()
        cp.kubectl("drain", twin, "--ignore-daemonsets", "--grace-period=0", "--force", f"--timeout={timeout:.0f}s",
                   timeout=timeout + 10)
        drained = time.monotonic()
        if pods_on(cp, twin):
            raise SystemExit(f"bench node lifecycle: kubectl drain left pods on {twin}")
        return {"evicted": evicted - asked, "deboarded": deboarded - asked, "drain": drained - start}
    finally:
        clean(cp, ns)
        nodes.cleanup()


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_node_lifecycle.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds (median)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one step")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    folder = assets_dir()
    if folder is None or missing_assets(folder, NEEDED):
        raise SystemExit(f"bench node lifecycle: KUBEBUILDER_ASSETS must name a folder with {', '.join(NEEDED)} "
                         "(scripts/test.sh unpacks ../shared/k8s into .cache/k8s-bin)")
    cp = ControlPlane(folder)
    onboards: list[dict[str, float]] = []
    deboards: list[dict[str, float]] = []
    try:
        cp.start()
        shipped = install(cp, render())
        stack = Stack(cp, shipped).start()
        try:
            stack.start_scheduler()
            for rnd in range(args.rounds):
                o = onboarding(cp, shipped, rnd, args.timeout)
                onboards.append(o)
                progress(f"round {rnd + 1}/{args.rounds} onboarding: request -> label {o['label']:.2f} s, label -> "
                         f"registered {o['registered']:.2f} s, -> Managed {o['managed']:.2f} s")
                d = deboarding(cp, rnd, args.timeout)
                deboards.append(d)
                progress(f"round {rnd + 1}/{args.rounds} deboard: {PODS} pods evicted {d['evicted']:.2f} s, "
                         f"Deboarded {d['deboarded']:.2f} s; kubectl drain {d['drain']:.2f} s")
        finally:
            stack.stop()
    finally:
        if os.environ.get("ACCELSTACK_KEEP_CONTROL_PLANE"):
            cp.stop()
        else:
            cp.cleanup()
    ratio = statistics.median(d["evicted"] for d in deboards) / statistics.median(d["drain"] for d in deboards)
    lines = [f"node life cycle on the real kube-apiserver and kube-scheduler v1.36.2, median of {args.rounds} "
             "round(s) (each round's value in brackets):", "",
             "| what | measured | median |", "|---|---|---|",
             f"| onboarding (NR1, real plugin + NPD) | request -> landing label | "
             f"{med([o['label'] for o in onboards])} |",
             f"| | landing label -> plugin registered | {med([o['registered'] for o in onboards])} |",
             f"| | landing label -> Managed | {med([o['managed'] for o in onboards])} |",
             f"| deboard, {PODS} GPR pods, grace 0s | request -> all {PODS} evicted | "
             f"{med([d['evicted'] for d in deboards])} |",
             f"| | request -> Deboarded | {med([d['deboarded'] for d in deboards])} |",
             f"| baseline: kubectl drain --ignore-daemonsets --grace-period=0 --force, {PODS} pods | command start "
             f"-> exit | {med([d['drain'] for d in deboards])} |",
             f"| ratio | deboard (all evicted) / kubectl drain | {ratio:.2f}x |"]
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
