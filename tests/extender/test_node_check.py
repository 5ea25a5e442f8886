"""The node preflight (``kubectl accelstack node check NODE``, issue 39.5): every item ok on a ready NR1 node, and
each one missing or unknown in turn with the evidence or the fix; a GPU-only node gets the items that apply; the
plugin prints one line an item and exits 1 unless all are ok; the CNI installer's readiness probe really fails
without the conflist or the plugin. Fails on the code before: there was no preflight."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler_extender.cli import kubectl_plugin
from scheduler_extender.objects import node_check as nc
from scheduler_extender.objects.gpr_codec import rfc3339

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0
NR1 = "neureality.com/nr1"


def managed(*labels: str) -> dict[str, Any]:
    return {"manager": "accelstack-device-plugin", "operation": "Apply",
            "fieldsV1": {"f:metadata": {"f:labels": {f"f:{k}": {} for k in labels}}}}


def ready_node(modules: int = 4) -> dict[str, Any]:
    res = {"cpu": "32", NR1: str(modules)}
    return {"metadata": {"name": "nr1-01", "labels": {"accelstack.io/nr1-node": "true",
                                                      "accelstack.io/nr1.count": str(modules)},
                         "managedFields": [managed("accelstack.io/nr1.count", "accelstack.io/nr1.product")]},
            "spec": {},
            "status": {"capacity": dict(res), "allocatable": dict(res), "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                {"type": "NR1Unhealthy", "status": "False", "reason": "NoNR1Problem",
                 "lastHeartbeatTime": rfc3339(NOW - 120)}]}}


def ds_pod(app: str, component: str = "", ready: bool = True, phase: str = "Running",
           **status: Any) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": app, "app.kubernetes.io/part-of": "accelstack",
              **({"app.kubernetes.io/component": component} if component else {})}
    return {"metadata": {"name": f"{app}-{component or 'x'}-abcde", "namespace": "accelstack-node", "labels": labels},
            "spec": {"nodeName": "nr1-01"},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       **status}}


def ready_pods() -> list[dict[str, Any]]:
    return [ds_pod("accelstack-device-plugin-nr1"), ds_pod("accelstack-nr1-cni"), ds_pod("accelstack-npd-nr1"),
            ds_pod("accelstack-device-exporter", "nr1")]


def items(node: dict[str, Any], pods: list[dict[str, Any]] | None = None,
          an: dict[str, Any] | None = None) -> dict[str, tuple[str, str]]:
    out = nc.check(node, ready_pods() if pods is None else pods, an, NOW)
    assert out["ok"] == all(i["status"] == "ok" for i in out["items"])
    return {i["name"]: (i["status"], i["detail"]) for i in out["items"]}


def only(got: dict[str, tuple[str, str]], name: str, status: str) -> str:
    """The one item not ok is ``name``, with ``status``; its detail."""
    bad = {k: v[0] for k, v in got.items() if v[0] != "ok"}
    assert bad == {name: status}, got
    return got[name][1]


def test_a_ready_nr1_node_is_all_ok_with_the_evidence() -> None:
    got = items(ready_node())
    assert list(got) == ["node", "labels", "modules", "device plugin", "cni", "npd", "exporter"]
    assert all(s == "ok" for s, _ in got.values()), got
    assert got["modules"][1] == ("4 NR1 modules in sysfs (label accelstack.io/nr1.count=4, written by "
                                 "accelstack-device-plugin)")
    assert "capacity 4 == accelstack.io/nr1.count" in got["device plugin"][1]
    assert got["npd"][1] == "NR1Unhealthy=False (NoNR1Problem), heartbeat 2m ago"
    assert "accelstack-node/accelstack-nr1-cni-x-abcde Running and Ready" in got["cni"][1]


def test_labels_missing() -> None:
    node = ready_node()
    del node["metadata"]["labels"]["accelstack.io/nr1-node"]
    detail = only(items(node), "labels", "missing")
    assert "kubectl label node nr1-01 accelstack.io/nr1-node=true" in detail


def test_modules_missing_zero_hand_written_and_garbled() -> None:
    node = ready_node()
    del node["metadata"]["labels"]["accelstack.io/nr1.count"]
    got = items(node)
    assert got["modules"][0] == "missing" and "has not labelled the node" in got["modules"][1]
    assert got["device plugin"][0] == "unknown"  # advertised, but nothing to compare with
    node = ready_node(0)
    node["status"]["capacity"][NR1] = "0"
    got = items(node)
    assert got["modules"][0] == "missing" and "0 NR1 modules in sysfs" in got["modules"][1] \
        and "nr1.vendorIDs" in got["modules"][1]
    node = ready_node()
    node["metadata"]["managedFields"] = [{"manager": "kubectl-label", "fieldsV1": managed("accelstack.io/nr1.count")[
        "fieldsV1"]}]
    assert "not written by accelstack-device-plugin" in only(items(node), "modules", "unknown")
    node = ready_node()
    node["metadata"]["labels"]["accelstack.io/nr1.count"] = "four"
    assert items(node)["modules"][0] == "unknown"


def test_device_plugin_not_registered_or_a_different_count() -> None:
    node = ready_node()
    del node["status"]["capacity"][NR1], node["status"]["allocatable"][NR1]
    detail = only(items(node), "device plugin", "missing")
    assert detail == ("neureality.com/nr1 not advertised (capacity 0): the plugin is not registered; "
                      "kubectl -n accelstack-node logs ds/accelstack-device-plugin-nr1")
    pods = [p for p in ready_pods() if p["metadata"]["labels"]["app.kubernetes.io/name"] != "accelstack-device-plugin-nr1"]
    assert "(no accelstack-device-plugin-nr1 pod on the node)" in items(node, pods)["device plugin"][1]
    node = ready_node()
    node["status"]["capacity"][NR1] = "3"
    assert "capacity 3 but 4 NR1 modules counted" in only(items(node), "device plugin", "missing")
    node = ready_node()
    node["status"]["allocatable"][NR1] = "3"  # one unhealthy module is still a registered plugin
    assert "(allocatable 3, 1 unhealthy)" in items(node)["device plugin"][1]


@pytest.mark.parametrize("item,app,component", [("cni", "accelstack-nr1-cni", ""),
                                                ("exporter", "accelstack-device-exporter", "nr1")])
def test_a_daemonset_pod_absent_not_ready_crashing_or_unknown(item: str, app: str, component: str) -> None:
    others = [p for p in ready_pods() if p["metadata"]["labels"]["app.kubernetes.io/name"] != app]
    ds = f"{app}-{component}" if component else app
    assert f"no {ds} pod on the node" in only(items(ready_node(), others), item, "missing")
    not_ready = ds_pod(app, component, ready=False)
    assert "Running, not Ready" in only(items(ready_node(), [*others, not_ready]), item, "missing")
    crashing = ds_pod(app, component, ready=False, containerStatuses=[
        {"name": "c", "restartCount": 7, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
    assert "c: CrashLoopBackOff, 7 restarts" in only(items(ready_node(), [*others, crashing]), item, "missing")
    lost = ds_pod(app, component, ready=True, phase="Unknown")
    assert "phase Unknown" in only(items(ready_node(), [*others, lost]), item, "unknown")
    # a Ready pod wins over a terminating one of an old rollout
    old = ds_pod(app, component, ready=False)
    old["metadata"]["deletionTimestamp"] = rfc3339(NOW)
    old["metadata"]["name"] = "aaa-old"
    assert items(ready_node(), [*others, old, ds_pod(app, component)])[item][0] == "ok"


def test_npd_absent_stale_unhealthy_or_unknown() -> None:
    def with_condition(**cond: Any) -> dict[str, Any]:
        node = ready_node()
        node["status"]["conditions"] = [c for c in node["status"]["conditions"] if c["type"] != "NR1Unhealthy"]
        if cond:
            node["status"]["conditions"].append({"type": "NR1Unhealthy", **cond})
        return node

    assert "no NR1Unhealthy condition" in only(items(with_condition()), "npd", "missing")
    stale = with_condition(status="False", reason="NoNR1Problem", lastHeartbeatTime=rfc3339(NOW - 40 * 60))
    assert "heartbeat 40m ago: NPD stopped reporting" in only(items(stale), "npd", "missing")
    late = with_condition(status="False", reason="NoNR1Problem", lastHeartbeatTime=rfc3339(NOW - 9 * 60))
    assert items(late)["npd"][0] == "ok"  # one heartbeat late is not news
    sick = with_condition(status="True", reason="NR1Unhealthy", message="module 2 missing from sysfs",
                          lastHeartbeatTime=rfc3339(NOW - 10))
    assert "module 2 missing from sysfs" in only(items(sick), "npd", "missing")
    unsure = with_condition(status="Unknown", reason="NoNR1Problem", lastHeartbeatTime=rfc3339(NOW - 10))
    assert "could not look" in only(items(unsure), "npd", "unknown")


def test_node_not_ready_cordoned_deboarding_or_silent() -> None:
    node = ready_node()
    node["status"]["conditions"][0] = {"type": "Ready", "status": "False", "reason": "KubeletNotReady",
                                       "message": "container runtime down"}
    assert "NotReady (KubeletNotReady): container runtime down" in only(items(node), "node", "missing")
    node = ready_node()
    node["status"]["conditions"][0] = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
    only(items(node), "node", "unknown")
    node = ready_node()
    node["spec"]["unschedulable"] = True
    assert "kubectl uncordon nr1-01" in only(items(node), "node", "missing")
    node = ready_node()
    node["spec"]["taints"] = [{"key": "accelstack.io/deboarding", "value": "1", "effect": "NoSchedule"}]
    an = {"spec": {"deboard": {"grace": "10m"}}, "status": {"phase": "Deboarded"}}
    assert "kubectl accelstack node deboard nr1-01 --abort" in only(items(node, an=an), "node", "missing")
    assert only(items(ready_node(), an={"spec": {"deboard": {"grace": "1m"}}}), "node", "missing").startswith(
        "Deboarding")


def test_a_bare_node_is_checked_as_an_nr1_node_about_to_join() -> None:
    bare = {"metadata": {"name": "new-01", "labels": {"kubernetes.io/hostname": "new-01"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    got = items(bare, [])
    assert got["node"][0] == "ok" and all(s == "missing" for k, (s, _) in got.items() if k != "node"), got
    assert list(got) == ["node", "labels", "modules", "device plugin", "cni", "npd", "exporter"]


def test_a_gpu_only_node_gets_the_items_that_apply() -> None:
    res = {"nvidia.com/gpu": "8"}
    gpu: dict[str, Any] = {"metadata": {"name": "gpu-01", "labels": {"accelstack.io/gpu-node": "true", "nvidia.com/gpu.present": "true",
                                                     "nvidia.com/gpu.count": "8"},
                        "managedFields": [managed("nvidia.com/gpu.count")]},
           "status": {"capacity": res, "allocatable": res, "conditions": [
               {"type": "Ready", "status": "True"},
               {"type": "GPUUnhealthy", "status": "False", "reason": "NoGPUProblem",
                "lastHeartbeatTime": rfc3339(NOW)}]}}
    pods = [ds_pod("accelstack-device-plugin-nvidia"), ds_pod("accelstack-npd-gpu"),
            ds_pod("accelstack-device-exporter", "gpu")]
    got = items(gpu, pods)
    assert list(got) == ["node", "labels", "devices", "device plugin", "npd", "exporter"]  # no CNI
    assert all(s == "ok" for s, _ in got.values()), got
    assert got["devices"][1].startswith("8 GPUs through NVML")
    # GPU feature discovery's label is evidence of a GPU node, not where the DaemonSets land
    gfd_only = copy.deepcopy(gpu)
    del gfd_only["metadata"]["labels"]["accelstack.io/gpu-node"]
    assert "kubectl label node gpu-01 accelstack.io/gpu-node=true" in only(items(gfd_only, pods), "labels", "missing")
    # an NR1 pod on it never stands in for the GPU exporter
    got = items(gpu, [*pods[:2], ds_pod("accelstack-device-exporter", "nr1")])
    assert got["exporter"][0] == "missing"
    both = copy.deepcopy(ready_node())
    both["metadata"]["labels"]["nvidia.com/gpu.present"] = "true"
    assert "nr1 modules" in items(both) and "gpu devices" in items(both)


def test_the_plugin_prints_a_line_an_item_and_exits_1_unless_all_ok(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    answers = {"ok": nc.check(ready_node(), ready_pods(), None, NOW),
               "bad": nc.check(ready_node(), [p for i, p in enumerate(ready_pods()) if i != 1], None, NOW)}
    answers["bad"]["node"] = "nr1-01"
    asked: list[str] = []

    def get(self: kubectl_plugin.Client, path: str, **query: Any) -> Any:
        asked.append(path)
        return answers["bad" if "bad" in path else "ok"]

    monkeypatch.setattr(kubectl_plugin.Client, "get", get)
    base = ["--server", "http://127.0.0.1:1", "node", "check"]
    assert kubectl_plugin.main([*base, "nr1-01"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["ITEM", "STATUS", "EVIDENCE"]
    assert "node nr1-01: all 7 checks ok" in out
    assert kubectl_plugin.main([*base, "bad/node"]) == 1
    out, err = capsys.readouterr()
    assert asked[-1] == "/api/v1/acceleratornodes/bad%2Fnode/check"
    assert next(ln for ln in out.splitlines() if ln.startswith("cni")).split()[:2] == ["cni", "missing"]
    assert "node nr1-01: 1 of 7 checks not ok" in out and err == ""  # the lines said why: no error line
    assert kubectl_plugin.main([*base, "nr1-01", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def _probe() -> list[str]:
    ds = yaml.safe_load((ROOT / "manifests/cni/daemonset-installer.yaml").read_text())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return list(container["readinessProbe"]["exec"]["command"])


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
def test_the_cni_installers_readiness_probe_needs_the_conflist_and_a_plugin_that_answers(tmp_path: Path) -> None:
    """The probe the node check relies on, run as the kubelet would, against a host layout: ok with the plugin
    (this checkout's launcher) and the conflist; not ok without either."""
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    bin_dir.mkdir()
    conf_dir.mkdir()
    launcher = bin_dir / "accelstack-nr1-cni"
    launcher.write_text((ROOT / "cni/bin/accelstack-nr1-cni").read_text())
    launcher.chmod(0o755)
    home = bin_dir / "accelstack-nr1-cni.d"  # the installed layout: an interpreter and the package beside it
    (home / "bin").mkdir(parents=True)
    (home / "app").mkdir()
    (home / "bin" / "python3").symlink_to(sys.executable)
    for pkg in ("cni", "device_plugin", "protos"):
        (home / "app" / pkg).symlink_to(ROOT / pkg)
    (conf_dir / "zz-accelstack-nr1.conflist").write_text('{"name": "accelstack-nr1"}')
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELSTACK_CNI_PYTHON", "PYTHONPATH")}
    env |= {"CNI_BIN_DIR": str(bin_dir), "CNI_CONF_DIR": str(conf_dir)}

    def probe() -> int:
        return subprocess.run(_probe(), env=env, capture_output=True, timeout=60).returncode

    assert probe() == 0
    (conf_dir / "zz-accelstack-nr1.conflist").unlink()
    assert probe() != 0
    (conf_dir / "zz-accelstack-nr1.conflist").write_text('{"name": "accelstack-nr1"}')
    launcher.unlink()
    assert probe() != 0
