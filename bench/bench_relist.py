"""An informer relist into the extender's view, with objects the size a real cluster's are, beside the way
relists were taken before, in the same run: how long the event loop that answers filter, bind and the webhooks
is held in one piece, and how long the relist takes in all.

Objects: 5,000 nodes of 18 KB (60 feature labels as GPU feature discovery sets them, six managedFields entries,
50 images, the ledger annotation) and 20,000 pods of 5 KB (managedFields, env, volumes, status), encoded as the
API server sends list pages. A task on the same loop wakes whenever it can and records the longest gap: what a
filter request arriving during the relist waits at most (the machine's own scheduling included).

- ``before``: each page decoded whole (500 a page, ``orjson.loads``, as the client did), the loop given back
  between pages (the next page's request), then the view replaced in one call (``ClusterView.sync_*``); the
  cyclic collector running, as it did.
- ``now``: each page scanned with its items left raw (100 a page, ``KubeClient.list_raw``), handed to the view as
  a ``Listed`` that decodes each item as the view reads it in slices (``ClusterView.resync_*`` through the
  informer's relist, the collector held off), the replaced view let go of a slice at a time.

Reported per kind: the longest hold and the total time, median of the rounds, and the ratio now / before.

Usage: python bench/bench_relist.py [--nodes 5000] [--pods 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kubeapi import metrics as kube_metrics  # noqa: E402
from kubeapi.client import _decode_page  # noqa: E402
from kubeapi.informer import Informer  # noqa: E402
from kubeapi.resources import NODES, PODS, Resource  # noqa: E402
from scheduler_extender.objects import ledger  # noqa: E402
from scheduler_extender.objects.cluster import GPU, ClusterView  # noqa: E402
from tests.extender.harness import loop_hold  # noqa: E402

STAMP = "2026-11-30T00:00:00Z"


def managed_fields(count: int, fields: int) -> list[dict[str, Any]]:
    return [{"manager": f"manager-{i}", "operation": "Update", "apiVersion": "v1", "time": STAMP,
             "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {f"f:l{j}": {} for j in range(fields)}}}}
            for i in range(count)]


def real_node(i: int) -> dict[str, Any]:
    name = f"gpu-node-{i:05}"
    entries = {f"uid-{i}-{j}": ledger.Entry(f"uid-{i}-{j}", f"team/pod-{i}-{j}", {GPU: 2}, "team/gpr", 1.0)
               for j in range(2)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"node-uid-{i}", "resourceVersion": str(1000 + i), "creationTimestamp": STAMP,
                     "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                **{f"nvidia.com/gpu.feature-{k}": f"value-{k}-abcdefgh" for k in range(60)}},
                     "annotations": {ledger.LEDGER_ANNOTATION: ledger.render(entries),
                                     "node.alpha.kubernetes.io/ttl": "0"},
                     "managedFields": managed_fields(6, 40)},
        "spec": {"podCIDR": "10.0.0.0/24", "providerID": f"aws:///us-east-1a/i-{i:017x}"},
        "status": {
            "capacity": {"cpu": "192", "memory": "2Ti", "pods": "110", GPU: "8"},
            "allocatable": {"cpu": "191", "memory": "2000Gi", "pods": "110", GPU: "8"},
            "conditions": [{"type": t, "status": "True" if t == "Ready" else "False", "lastHeartbeatTime": STAMP,
                            "lastTransitionTime": STAMP, "reason": f"Kubelet{t}", "message": f"kubelet reports {t}"}
                           for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")],
            "addresses": [{"type": "InternalIP", "address": f"10.1.{i // 250}.{i % 250}"},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.36.2", "containerRuntimeVersion": "containerd://2.1.0",
                         "kernelVersion": "6.8.0", "osImage": "Ubuntu 24.04", "architecture": "amd64"},
            "images": [{"names": [f"registry.example.com/team/image-{k}@sha256:{'a' * 64}",
                                  f"registry.example.com/team/image-{k}:v1.2.{k}"], "sizeBytes": 123456789}
                       for k in range(50)]}}


def real_pod(i: int, nodes: int) -> dict[str, Any]:
    name = f"trainer-{i:06}"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": f"team-{i % 40}", "uid": f"pod-uid-{i}",
                     "resourceVersion": str(100_000 + i), "creationTimestamp": STAMP,
                     "labels": {"app": "trainer", "accelstack.io/gpr": f"gpr-{i // 4}", "batch.kubernetes.io/job-name":
                                f"job-{i // 4}"},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": f"job-{i // 4}",
                                          "uid": f"job-uid-{i // 4}", "controller": True}],
                     "managedFields": managed_fields(3, 20)},
        "spec": {"nodeName": f"gpu-node-{i % nodes:05}", "schedulerName": "default-scheduler",
                 "containers": [{"name": "main", "image": "registry.example.com/team/trainer:v3",
                                 "env": [{"name": f"ENV_{k}", "value": f"value-{k}"} for k in range(12)],
                                 "resources": {"limits": {GPU: "2"}, "requests": {GPU: "2", "cpu": "8"}},
                                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                 "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": f"data-{i}"}}]},
        "status": {"phase": "Running", "podIP": "10.2.0.1", "startTime": STAMP,
                   "conditions": [{"type": t, "status": "True", "lastTransitionTime": STAMP}
                                  for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                   "containerStatuses": [{"name": "main", "ready": True, "restartCount": 0,
                                          "image": "registry.example.com/team/trainer:v3",
                                          "imageID": f"registry.example.com/team/trainer@sha256:{'b' * 64}",
                                          "containerID": f"containerd://{'c' * 64}",
                                          "state": {"running": {"startedAt": STAMP}}}]}}


def pages(objects: list[dict[str, Any]], size: int) -> list[bytes]:
    out = []
    for start in range(0, len(objects), size):
        more = start + size < len(objects)
        out.append(orjson.dumps({"apiVersion": "v1", "kind": "List",
                                 "metadata": {"resourceVersion": "5000000", **({"continue": f"t{start}"} if more else {})},
                                 "items": objects[start:start + size]}))
    return out


class Pages:
    """The list pages as a client receives them (each scanned by the client's own page decoder), the loop given
    back between pages as the next page's request would."""

    def __init__(self, encoded: list[bytes]) -> None:
        self.encoded = encoded
        self.metrics = kube_metrics.api_metrics(None)

    async def list_raw(self, *args: Any, **kwargs: Any) -> tuple[list[Any], str]:
        items: list[Any] = []
        rv = ""
        for body in self.encoded:
            await asyncio.sleep(0)
            page = _decode_page(body)
            items += page.items or []
            rv = str(page.metadata.get("resourceVersion") or "")
        return items, rv


async def before(view: ClusterView, kind: Resource, encoded: list[bytes]) -> None:
    items: list[dict[str, Any]] = []
    for body in encoded:
        await asyncio.sleep(0)
        items += orjson.loads(body).get("items") or []
    (view.sync_nodes if kind is NODES else view.sync_pods)(items)


async def now(view: ClusterView, kind: Resource, encoded: list[bytes]) -> None:
    sync = view.resync_nodes if kind is NODES else view.resync_pods
    informer = Informer(Pages(encoded), kind, lambda k, o: None, sync, lazy=True)  # type: ignore[arg-type]
    await informer._list()


async def measure(kind: Resource, objects: list[dict[str, Any]], rounds: int) -> list[str]:
    old_pages, new_pages = pages(objects, 500), pages(objects, 100)
    mb = sum(len(p) for p in new_pages) / 1e6
    figures: dict[str, list[tuple[float, float]]] = {"before": [], "now": []}
    view = ClusterView()
    for _ in range(rounds):
        for name, how, encoded in (("before", before, old_pages), ("now", now, new_pages)):
            gc.collect()
            longest, took, _ = await loop_hold(lambda: how(view, kind, encoded))  # noqa: B023
            figures[name].append((longest, took))
    assert len(view.nodes if kind is NODES else view.pods) == len(objects)
    med = {name: (statistics.median(f[0] for f in runs), statistics.median(f[1] for f in runs))
           for name, runs in figures.items()}
    label = f"{len(objects):,} {kind.plural} ({mb:.0f} MB of JSON)"
    return [f"relist of {label}: longest hold / total, median of {rounds}",
            f"  before (pages of 500 decoded whole, view replaced at once, collector running): "
            f"{med['before'][0] * 1e3:8.1f} ms / {med['before'][1] * 1e3:7.0f} ms",
            f"  now    (pages of 100 scanned, items decoded in slices of 8, collector held off):  "
            f"{med['now'][0] * 1e3:8.1f} ms / {med['now'][1] * 1e3:7.0f} ms",
            f"  ratio now / before: longest hold {med['now'][0] / med['before'][0]:.3f}x, "
            f"total {med['now'][1] / med['before'][1]:.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000, help="real-sized nodes to relist (default 5000)")
    parser.add_argument("--pods", type=int, default=20_000, help="real-sized pods to relist (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per way, the median reported (default 3)")
    args = parser.parse_args()
    if args.nodes < 1 or args.pods < 0 or args.rounds < 1:
        parser.error("--nodes and --rounds must be at least 1, --pods at least 0")

    async def run() -> None:
        lines = await measure(NODES, [real_node(i) for i in range(args.nodes)], args.rounds)
        if args.pods:
            lines += await measure(PODS, [real_pod(i, args.nodes) for i in range(args.pods)], args.rounds)
        print("\n".join(lines))

    asyncio.run(run())


if __name__ == "__main__":
    main()
