"""Node health on the real control plane: the real node-problem-detector runs the shipped monitors (custom plugins
``accelstack-npd-nr1`` on an NR1 sysfs fixture, ``accelstack-npd-gpu`` on a kernel-log fixture) and writes the
``NR1Unhealthy`` / ``GPUUnhealthy`` condition of a fake node as the shipped ``accelstack-npd`` ServiceAccount; the
remediation controller (``npd.remediation``, the shipped ConfigMap and arguments, the shipped
``accelstack-remediation`` ServiceAccount) taints the node, records Events, and lifts the taint after the hold once
NPD has cleared the condition (and not while the GPU check is Unknown). Both accounts' shipped RBAC is checked for
what they must and must not do.

NPD runs as the shipped DaemonSets run it: the container's own arguments and environment (``NODE_NAME``),
in-cluster credentials (``KUBERNETES_SERVICE_HOST``/``PORT``, a real token and the CA at
``/var/run/secrets/kubernetes.io/serviceaccount``). That path is provided in a private mount namespace (a tmpfs on
``/run`` that only NPD and its plugins see), so the plugins' own in-cluster read of the node's expected-count label
(``npd.nodeinfo``) goes through the API server under NPD's account too. The namespace needs root (or unprivileged
user namespaces); elsewhere the tests skip (fail under ``ACCELSTACK_STRICT=1``).

What differs from the shipped objects, and only this: the monitors' paths (each plugin is a ``/bin/sh`` wrapper
like those ``accelstack-npd-install`` writes, and the ConfigMap's ``npd.yaml`` sits in a temp dir), their intervals
divided by ``SPEEDUP``, NPD's listen addresses (free loopback ports instead of ``0.0.0.0:20257``), the settings a
site sets for its NR1 nodes (``nr1.vendorIDs``, ``nr1.healthAttribute``), the host paths (sysfs root, state
directory, kernel log) and the GPU check's ``gpu.xidHoldTime`` as ``ACCELSTACK_NPD_*`` variables in NPD's
environment, which the plugins inherit; and the remediation's ``holdTime`` (flag) and metrics address.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_root
from tests.npd.helpers import kmsg_line, xid_line
from tests.npd.test_plugin_process import nvml_loadable
from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane, Process, free_port
from tests.realcluster.objects import events_for, wait_for
from tests.realcluster.shipped import ROOT, pick
from tests.realcluster.stack import Product
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

NODE_NS = "accelstack-node"
NPD_SA, REMEDIATION_SA = "accelstack-npd", "accelstack-remediation"
SA_DIR = "/run/secrets/kubernetes.io/serviceaccount"  # /var/run is a link to /run
SPEEDUP = 15  # the monitor's intervals divided by this: 30 s -> 2 s, 5 m -> 20 s
HOLD = 4.0  # remediation.holdTime for the test (shipped: 10m)
XID_HOLD = 8.0  # gpu.xidHoldTime for the test (shipped: 5m): how long a critical XID keeps the GPU check NonOK
EVENTS_NS = "default"  # NPD (no --event-namespace) and the controller record their Events there


# ---- a private mount namespace for NPD's in-cluster credentials ----------------------------------------------
@functools.cache
def unshare_prefix() -> tuple[str, ...] | None:
    """``unshare`` arguments that give a mount namespace where a tmpfs can go on /run, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ((unshare, "--mount"), (unshare, "--mount", "--map-root-user")):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs accelstack-probe /run"],
                               capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return prefix
    return None


def in_cluster_argv(argv: list[str]) -> list[str]:
    """``argv`` started in its own mount namespace holding a ServiceAccount directory copied from
    ``$ACCELSTACK_TEST_SA_DIR`` at ``SA_DIR`` (where client-go's and ``npd.nodeinfo``'s in-cluster config look)."""
    prefix = unshare_prefix()
    if prefix is None:
        require_root("node-problem-detector's in-cluster credentials need a private mount namespace (unshare)")
        pytest.fail("unshare cannot make a mount namespace here even as root")
    script = (f'set -e; mount -t tmpfs -o mode=0755 accelstack-test /run; mkdir -p {SA_DIR}; '
              f'cp "$ACCELSTACK_TEST_SA_DIR"/token "$ACCELSTACK_TEST_SA_DIR"/ca.crt '
              f'"$ACCELSTACK_TEST_SA_DIR"/namespace {SA_DIR}/; exec "$@"')
    return [*prefix, "sh", "-c", script, "in-cluster", *argv]


# ---- the shipped objects, fitted to a test node --------------------------------------------------------------
def scaled(interval: str) -> str:
    """A Go duration (``30s``, ``5m``) divided by SPEEDUP, at least one second."""
    seconds = int(interval[:-1]) * {"s": 1, "m": 60, "h": 3600}[interval[-1]]
    return f"{max(1, seconds // SPEEDUP)}s"


def plugin_wrapper(folder: Path, script: str, module: str) -> Path:
    """A ``/bin/sh`` wrapper of the shape ``accelstack-npd-install`` writes, running this checkout's module."""
    path = folder / script
    path.write_text(f"#!/bin/sh\nexport PYTHONPATH={ROOT} PYTHONDONTWRITEBYTECODE=1\n"
                    f'exec {sys.executable} -m {module} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def monitor_config(shipped: list[dict[str, Any]], key: str, bin_dir: Path, config_file: Path) -> dict[str, Any]:
    """The shipped monitor ``key`` of ConfigMap ``accelstack-npd`` with its paths and intervals changed only."""
    monitor = json.loads(pick(shipped, "ConfigMap", "accelstack-npd")["data"][key])
    monitor["pluginConfig"]["invoke_interval"] = scaled(monitor["pluginConfig"]["invoke_interval"])
    for rule in monitor["rules"]:
        rule["path"] = str(bin_dir / Path(rule["path"]).name)
        rule["args"] = [f"--config-file={config_file}" if a.startswith("--config-file=") else a
                        for a in rule["args"]]
        if "invoke_interval" in rule:
            rule["invoke_interval"] = scaled(rule["invoke_interval"])
    return dict(monitor)


class NPD:
    """node-problem-detector as the shipped DaemonSet ``daemonset`` runs it, for one fake node."""

    def __init__(self, cp: ControlPlane, shipped: list[dict[str, Any]], daemonset: str, node: str,
                 workdir: Path, env: dict[str, str]) -> None:
        self.cp, self.node, self.dir = cp, node, workdir
        bin_dir, sa_dir = workdir / "bin", workdir / "serviceaccount"
        bin_dir.mkdir(parents=True)
        sa_dir.mkdir()
        plugin_wrapper(bin_dir, "accelstack-npd-gpu", "npd.gpu_check")
        plugin_wrapper(bin_dir, "accelstack-npd-nr1", "npd.nr1_check")
        config = workdir / "npd.yaml"
        config.write_text(pick(shipped, "ConfigMap", "accelstack-npd")["data"]["npd.yaml"])
        ds = pick(shipped, "DaemonSet", daemonset)
        pod = ds["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == NPD_SA
        container = next(c for c in pod["containers"] if c["name"] == "node-problem-detector")
        (sa_dir / "token").write_text(cp.token(NODE_NS, NPD_SA))
        shutil.copy(cp.pki.ca_crt, sa_dir / "ca.crt")
        (sa_dir / "namespace").write_text(NODE_NS)
        self.port, self.metrics_port = free_port(), free_port()
        args: list[str] = []
        for arg in container["args"]:
            flag, _, value = arg.partition("=")
            if flag == "--config.custom-plugin-monitor":
                monitor = workdir / Path(value).name
                monitor.write_text(json.dumps(monitor_config(shipped, Path(value).name, bin_dir, config)))
                arg = f"{flag}={monitor}"
            elif flag == "--prometheus-address":
                arg = f"{flag}=127.0.0.1"
            elif flag == "--prometheus-port":
                arg = f"{flag}={self.metrics_port}"
            args.append(arg)
        args += ["--address=127.0.0.1", f"--port={self.port}"]
        ds_env = {e["name"]: e.get("value", "") for e in container.get("env") or []}
        assert "fieldRef" in next(e for e in container["env"] if e["name"] == "NODE_NAME")["valueFrom"]
        host, port = cp.url.removeprefix("https://").rsplit(":", 1)
        self.env = {**os.environ, **ds_env, "NODE_NAME": node, "KUBERNETES_SERVICE_HOST": host,
                    "KUBERNETES_SERVICE_PORT": port, "ACCELSTACK_TEST_SA_DIR": str(sa_dir), **env}
        self.argv = in_cluster_argv([cp.binary("node-problem-detector"), *args])
        self.proc: Process | None = None

    def start(self) -> NPD:
        self.proc = Process(f"npd-{self.node}", self.argv, self.dir / "npd.log", env=self.env)
        wait_for("node-problem-detector serving /healthz", self.healthy, timeout=60)
        return self

    def healthy(self) -> bool:
        assert self.proc is not None
        if not self.proc.alive():
            raise self.proc.fail("exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        return "(not started)" if self.proc is None else Path(self.proc.log).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def remediation(cp: ControlPlane, shipped: list[dict[str, Any]], workdir: Path) -> Product:
    """``accelstack-remediation`` with the shipped ConfigMap and the shipped Deployment's arguments, as its
    ServiceAccount (a real token in a kubeconfig); the hold shortened to HOLD by flag."""
    deployment = pick(shipped, "Deployment", "accelstack-remediation")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == REMEDIATION_SA
    container = pod["containers"][0]
    assert container["command"] == ["accelstack-remediation"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")["mountPath"]
    config_dir = workdir / "remediation-config"
    config_dir.mkdir()
    cm = pick(shipped, "ConfigMap", "accelstack-remediation")
    for name, text in cm["data"].items():
        (config_dir / name).write_text(text)
    args = [a.replace(mount, str(config_dir)) for a in container["args"]]
    port = free_port()
    kubeconfig = cp.sa_kubeconfig(NODE_NS, REMEDIATION_SA)
    return Product(cp, "remediation", "npd.remediation", [
        *args, "--remediation-hold-time", f"{HOLD:g}s", "--remediation-metrics-address", f"127.0.0.1:{port}"],
        env={"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": ""},
        health=f"http://127.0.0.1:{port}")


# ---- reading the node ----------------------------------------------------------------------------------------
def node_obj(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.get(f"api/v1/nodes/{name}") or {}


def condition(cp: ControlPlane, name: str, ctype: str) -> dict[str, Any]:
    for cond in (node_obj(cp, name).get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return {}


def taints(cp: ControlPlane, name: str, key: str) -> list[dict[str, Any]]:
    return [t for t in (node_obj(cp, name).get("spec") or {}).get("taints") or [] if t.get("key") == key]


def plugin_state(path: Path) -> dict[str, Any]:
    """A check's state file (written after each run), {} before the first."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def epoch(stamp: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@contextlib.contextmanager
def logs_on_failure(*procs: NPD | Product) -> Iterator[None]:
    """An assertion that fails says what NPD and the controller logged."""
    try:
        yield
    except AssertionError as exc:
        tails = "\n".join(f"---- {getattr(p, 'name', None) or 'npd'}:\n{p.tail()}" for p in procs)
        raise AssertionError(f"{exc}\n{tails}") from None


# ---- the tests -----------------------------------------------------------------------------------------------
def test_npd_condition_taints_and_recovery_untaints_after_the_hold(
        cp: ControlPlane, shipped: list[dict[str, Any]], nodes: Nodes, tmp_path: Path) -> None:
    remediation_cm = yaml.safe_load(pick(shipped, "ConfigMap", "accelstack-remediation")["data"]["remediation.yaml"])
    key = remediation_cm["remediation"]["taintKey"]
    # an NR1 node as the NR1 DaemonSet selects it, with two modules and the expected count on its label
    node = nodes.add("nr1", gpus=0, nr1=2, labels={"accelstack.io/nr1-node": "true",
                                                   "accelstack.io/nr1.expected-count": "2"})
    sysfs, state = tmp_path / "sys", tmp_path / "state"
    modules = nr1_node(sysfs, 2)
    npd = NPD(cp, shipped, "accelstack-npd-nr1", node, tmp_path / "npd", {
        "ACCELSTACK_NPD_NODE_SYSFS_ROOT": str(sysfs), "ACCELSTACK_NPD_PLUGIN_STATE_DIR": str(state),
        "ACCELSTACK_NPD_NR1_VENDOR_IDS": NR1_VENDOR, "ACCELSTACK_NPD_NR1_HEALTH_ATTRIBUTE": "health"})
    ctl = remediation(cp, shipped, tmp_path)
    try:
        npd.start()
        ctl.start()
        with logs_on_failure(npd, ctl):
            # NPD starts with the condition False (its initial status); the plugin's first runs read the node's
            # label through the API server with NPD's token (a label it could not read would make the verdict
            # Unknown, and the NR1CheckUnknown rule say so in an Event, asserted absent at the end)
            healthy = wait_for("NR1Unhealthy False", lambda: condition(cp, node, "NR1Unhealthy").get("status")
                               == "False" and condition(cp, node, "NR1Unhealthy"), timeout=60)
            assert healthy["reason"] == "NoNR1Problem", healthy
            for rule_state in ("nr1-health.json", "nr1-health.unknown.json"):  # NR1Unhealthy, NR1CheckUnknown
                label = wait_for(f"the plugin's run recorded in {rule_state}",
                                 lambda: plugin_state(state / rule_state).get("labels"), timeout=60)  # noqa: B023
                assert label["accelstack.io/nr1.expected-count"]["value"] == "2", label
            assert not taints(cp, node, key)

            # a module fails its health attribute: NPD sets the condition True, the controller taints
            (sysfs / "bus/pci/devices" / modules[1] / "health").write_text("fault\n")
            sick = wait_for("NR1Unhealthy True", lambda: condition(cp, node, "NR1Unhealthy").get("status") == "True"
                            and condition(cp, node, "NR1Unhealthy"), timeout=60)
            assert sick["reason"] == "NR1Unhealthy", sick
            assert sick["message"] == "NR1 3c:00.0: health attribute health='fault'", sick
            taint = wait_for("the unhealthy taint", lambda: taints(cp, node, key), timeout=60)
            assert taint == [{"key": key, "value": "NR1Unhealthy", "effect": "NoSchedule"}], taint
            tainted = wait_for("the controller's AccelstackTainted Event", lambda: [
                e for e in events_for(cp, EVENTS_NS, node) if e.get("reason") == "AccelstackTainted"], timeout=30)
            assert tainted[0]["type"] == "Warning" and tainted[0]["source"]["component"] == "accelstack-remediation"
            assert tainted[0]["involvedObject"]["kind"] == "Node"
            # NPD's temporary rule (NR1Problem) recorded the problem as a Warning Event under the NPD account
            npd_event = wait_for("NPD's NR1Problem Event", lambda: [
                e for e in events_for(cp, EVENTS_NS, node) if e.get("reason") == "NR1Problem"], timeout=30)
            assert npd_event[0]["type"] == "Warning", npd_event
            assert npd_event[0]["source"]["component"] == "accelstack-nr1-monitor", npd_event
            assert "health attribute health='fault'" in npd_event[0]["message"], npd_event

            # the module recovers: NPD clears the condition; the taint stays through the hold, then goes
            (sysfs / "bus/pci/devices" / modules[1] / "health").write_text("ok\n")
            cleared = wait_for("NR1Unhealthy False again",
                               lambda: condition(cp, node, "NR1Unhealthy").get("status") == "False"
                               and condition(cp, node, "NR1Unhealthy"), timeout=60)
            assert cleared["reason"] == "NoNR1Problem", cleared
            wait_for("the taint lifted", lambda: not taints(cp, node, key), timeout=60)
            untainted = wait_for("the controller's AccelstackUntainted Event", lambda: [
                e for e in events_for(cp, EVENTS_NS, node) if e.get("reason") == "AccelstackUntainted"], timeout=30)
            assert untainted[0]["type"] == "Normal", untainted
            # not before the hold: the lift is at least HOLD after NPD's transition to False (second-resolution
            # stamps on both sides, hence the one-second allowance)
            lifted_after = epoch(untainted[0]["lastTimestamp"]) - epoch(cleared["lastTransitionTime"])
            assert lifted_after >= HOLD - 1, (lifted_after, untainted[0], cleared)
            annotations = node_obj(cp, node)["metadata"].get("annotations") or {}
            assert not {a for a in annotations if a.startswith("accelstack.io/")}, annotations
            reasons = [e["reason"] for e in sorted(events_for(cp, EVENTS_NS, node),
                                                   key=lambda e: e.get("lastTimestamp") or "")
                       if e["reason"].startswith("Accelstack")]
            assert reasons == ["AccelstackTainted", "AccelstackUntainted"], reasons
            assert not [e for e in events_for(cp, EVENTS_NS, node) if e["reason"] == "NR1CheckUnknown"]
    finally:
        npd.stop()
        ctl.stop()


@pytest.mark.skipif(nvml_loadable(), reason="a real NVML is present; this runs the GPU check without one")
def test_gpu_xid_taints_and_unknown_keeps_the_taint(cp: ControlPlane, shipped: list[dict[str, Any]], nodes: Nodes,
                                                   tmp_path: Path) -> None:
    """The GPU monitor on a GPU node without NVML (this machine's real case): its condition is Unknown, which never
    taints; a critical XID in the kernel log is NonOK even so (True: tainted); when the XID's hold ends the
    condition is Unknown again, and Unknown about a resource the node has keeps the taint (recovery unproven)."""
    remediation_cm = yaml.safe_load(pick(shipped, "ConfigMap", "accelstack-remediation")["data"]["remediation.yaml"])
    key = remediation_cm["remediation"]["taintKey"]
    node = nodes.add("gpu", gpus=8, labels={"nvidia.com/gpu.present": "true",
                                            "accelstack.io/gpu.expected-count": "8"})
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_line(1, "Linux version 6.1.0"))
    npd = NPD(cp, shipped, "accelstack-npd-gpu", node, tmp_path / "npd", {
        "ACCELSTACK_NPD_NODE_SYSFS_ROOT": str(tmp_path / "sys"),
        "ACCELSTACK_NPD_PLUGIN_STATE_DIR": str(tmp_path / "state"), "ACCELSTACK_NPD_GPU_KMSG_PATH": str(kmsg),
        "ACCELSTACK_NPD_GPU_XID_HOLD_TIME": f"{XID_HOLD:g}s"})
    ctl = remediation(cp, shipped, tmp_path)
    try:
        npd.start()
        ctl.start()
        with logs_on_failure(npd, ctl):
            unknown = wait_for("GPUUnhealthy Unknown (no NVML)", lambda: condition(cp, node, "GPUUnhealthy").get(
                "status") == "Unknown" and condition(cp, node, "GPUUnhealthy"), timeout=60)
            # NPD has no reason of its own for Unknown: the default one, and the plugin's message
            assert unknown["reason"] == "NoGPUProblem", unknown
            assert unknown["message"].startswith("NVML unavailable"), unknown
            why = wait_for("NPD's GPUCheckUnknown Event", lambda: [
                e for e in events_for(cp, EVENTS_NS, node) if e.get("reason") == "GPUCheckUnknown"], timeout=60)
            assert why[0]["message"].startswith("NVML unavailable"), why

            with kmsg.open("a") as log:  # the driver logs that GPU 3b:00 fell off the bus
                log.write(xid_line(2, "0000:3b:00", 79, "pid=0, GPU has fallen off the bus."))
            sick = wait_for("GPUUnhealthy True", lambda: condition(cp, node, "GPUUnhealthy").get("status") == "True"
                            and condition(cp, node, "GPUUnhealthy"), timeout=60)
            assert sick["reason"] == "GPUUnhealthy" and "XID 79" in sick["message"], sick
            taint = wait_for("the unhealthy taint", lambda: taints(cp, node, key), timeout=60)
            assert taint == [{"key": key, "value": "GPUUnhealthy", "effect": "NoSchedule"}], taint
            xid_event = wait_for("NPD's GPUXidError Event", lambda: [
                e for e in events_for(cp, EVENTS_NS, node) if e.get("reason") == "GPUXidError"], timeout=60)
            assert "XID 79" in xid_event[0]["message"] and xid_event[0]["type"] == "Warning", xid_event

            # the XID's hold ends: NVML still absent, so Unknown again; the taint must stay past the remediation hold
            again = wait_for("GPUUnhealthy Unknown after the XID hold", lambda: condition(cp, node, "GPUUnhealthy")
                             .get("status") == "Unknown" and condition(cp, node, "GPUUnhealthy"), timeout=60)
            time.sleep(HOLD + 2)  # what must not happen has had the time to: a lift after HOLD
            assert taints(cp, node, key) == taint
            assert condition(cp, node, "GPUUnhealthy")["lastTransitionTime"] == again["lastTransitionTime"]
            annotations = node_obj(cp, node)["metadata"].get("annotations") or {}
            assert "accelstack.io/healthy-since" not in annotations, annotations
            tainted = [e for e in events_for(cp, EVENTS_NS, node) if e["reason"].startswith("Accelstack")]
            # one taint, for the True condition only: neither Unknown (before the XID, after its hold) tainted
            assert [(e["reason"], e["message"].rsplit(": ", 1)[-1]) for e in tainted] == [
                ("AccelstackTainted", "GPUUnhealthy True")], tainted
    finally:
        npd.stop()
        ctl.stop()


def test_shipped_rbac_of_the_node_health_accounts(cp: ControlPlane, shipped: list[dict[str, Any]]) -> None:
    """What each account may do, from its real token under the shipped roles."""
    npd = cp.sa_kubeconfig(NODE_NS, NPD_SA)
    ctl = cp.sa_kubeconfig(NODE_NS, REMEDIATION_SA)
    # NPD: read its node (the plugins' expected-count label), set conditions, record events; nothing else
    assert cp.can_i(npd, "patch", "nodes", subresource="status")
    assert cp.can_i(npd, "get", "nodes")
    assert cp.can_i(npd, "create", "events", namespace=EVENTS_NS)
    for verb, resource, sub in [("patch", "nodes", ""), ("update", "nodes", ""), ("delete", "nodes", ""),
                                ("list", "nodes", ""), ("update", "nodes", "status"), ("get", "secrets", ""),
                                ("list", "pods", ""), ("create", "pods", "eviction"), ("delete", "events", "")]:
        assert not cp.can_i(npd, verb, resource, subresource=sub), (NPD_SA, verb, resource, sub)
    # remediation: watch and patch nodes (taints), list pods and evict (drain), record events
    for verb in ("get", "list", "watch", "patch"):
        assert cp.can_i(ctl, verb, "nodes"), (REMEDIATION_SA, verb)
    assert cp.can_i(ctl, "create", "events", namespace=EVENTS_NS)
    assert cp.can_i(ctl, "list", "pods")
    assert cp.can_i(ctl, "create", "pods", subresource="eviction", namespace=EVENTS_NS)
    for verb, resource, sub in [("delete", "nodes", ""), ("update", "nodes", ""), ("patch", "nodes", "status"),
                                ("get", "secrets", ""), ("list", "secrets", ""), ("delete", "pods", ""),
                                ("create", "pods", ""), ("get", "configmaps", ""), ("update", "events", "")]:
        assert not cp.can_i(ctl, verb, resource, subresource=sub), (REMEDIATION_SA, verb, resource, sub)
