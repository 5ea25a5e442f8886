"""Alert rules with promtool (check + unit tests), the ServiceMonitor's and PrometheusRule's structure (external
CRDs, skipped by tests/test_manifests.py), the NPD monitor configs against the custom-plugin-monitor rules
(UPSTREAM.md §F), and every rule's command run the way NPD runs it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from npd.config import load
from tests.npd.helpers import kmsg_line
from tests.npd.promtools import MANIFESTS, need, write_rules
from tests.npd.test_plugin_process import npd_exec, nvml_loadable
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

HERE = Path(__file__).resolve().parent


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    promtool = need("promtool")
    rules = write_rules(tmp_path / "rules.yml")
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 20 rules found" in result.stdout


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    promtool = need("promtool")
    write_rules(tmp_path / "rules.yml")
    shutil.copy(HERE / "alert_rules_test.yaml", tmp_path / "alert_rules_test.yaml")
    result = subprocess.run([promtool, "test", "rules", "alert_rules_test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """A rule that no longer fires makes the unit tests fail (the tests are not vacuous)."""
    promtool = need("promtool")
    rules = write_rules(tmp_path / "rules.yml")
    rules.write_text(rules.read_text().replace("accelstack_gpu_healthy == 0", "accelstack_gpu_healthy == 2"))
    shutil.copy(HERE / "alert_rules_test.yaml", tmp_path / "alert_rules_test.yaml")
    result = subprocess.run([promtool, "test", "rules", "alert_rules_test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, check=False)
    assert result.returncode != 0 and "AccelstackGPUUnhealthy" in result.stdout + result.stderr


def test_prometheus_rule_structure() -> None:
    (rule,) = docs(MANIFESTS / "monitoring/prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for name in ("AccelstackGPUTemperatureHigh", "AccelstackGPUPowerHigh", "AccelstackGPUXidErrors",
                 "AccelstackGPUUnhealthy", "AccelstackNR1Unhealthy", "AccelstackGPUIdleWhileAllocated",
                 "AccelstackGPUBusyWhileUnallocated", "AccelstackNR1IdleWhileAllocated",
                 "AccelstackNR1BusyWhileUnallocated", "AccelstackAcceleratorNodesNotManaged",
                 "AccelstackAcceleratorNodeStuck", "AccelstackAcceleratorNodeFailed"):
        assert name in alerts
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), name
        assert {"summary", "description"} <= set(alert["annotations"]), name
    documented = (MANIFESTS.parent / "docs/metrics.md").read_text()
    for alert in alerts.values():  # every metric an alert uses is documented
        for metric in re.findall(r"accelstack_[a-z0-9_]+", alert["expr"]):
            assert f"`{metric}`" in documented, metric
    # every alert has a row in the alert table (its severity as shipped) and a runbook entry
    table, runbook = documented.split("## Alerts", 1)[1].split("### Runbook", 1)
    for name, alert in alerts.items():
        assert f"| `{name}` | {alert['labels']['severity']} |" in table, name
        assert f"**`{name}`**" in runbook, f"{name}: no runbook entry in docs/metrics.md"
    # the detected-not-managed alert tells the platform engineer what to run
    description = alerts["AccelstackAcceleratorNodesNotManaged"]["annotations"]["description"]
    assert "`kubectl get an`" in description and "`kubectl accelstack node onboard NODE`" in description


def test_service_monitor_selects_the_exporter_service() -> None:
    (monitor,) = docs(MANIFESTS / "monitoring/servicemonitor.yaml")
    (service,) = docs(MANIFESTS / "monitoring/service.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    daemonsets = docs(MANIFESTS / "monitoring/daemonset-exporter.yaml")
    for ds in daemonsets:
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        container = ds["spec"]["template"]["spec"]["containers"][0]
        assert any(p["name"] == "metrics" and p["containerPort"] == 9402 for p in container["ports"])
    # the job label Prometheus gives the targets is what the rules expect
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "accelstack-device-exporter"


def _duration(text: str) -> float:
    return float(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def monitors() -> dict[str, dict]:
    (cm,) = docs(MANIFESTS / "npd/configmap.yaml")
    return {name: json.loads(text) for name, text in cm["data"].items() if name.endswith(".json")}


def test_npd_monitor_configs_follow_the_custom_plugin_rules(tmp_path: Path) -> None:
    (cm,) = docs(MANIFESTS / "npd/configmap.yaml")
    (tmp_path / "npd.yaml").write_text(cm["data"]["npd.yaml"])
    plugin_config, _ = load(["--config-file", str(tmp_path / "npd.yaml")], environ={})
    found = monitors()
    assert set(found) == {"gpu-monitor.json", "nr1-monitor.json"}
    permanent = set()
    for name, monitor in found.items():
        assert monitor["plugin"] == "custom"
        global_timeout = _duration(monitor["pluginConfig"]["timeout"])
        defaults = {c["type"] for c in monitor["conditions"]}
        for rule in monitor["rules"]:
            assert rule["type"] in ("temporary", "permanent"), name
            assert _duration(rule["timeout"]) <= global_timeout, (name, rule["reason"])
            assert _duration(rule.get("invoke_interval", monitor["pluginConfig"]["invoke_interval"])) > 0
            # the plugin answers by its own deadline, well inside NPD's timeout
            assert plugin_config["plugin.deadline"] <= _duration(rule["timeout"]) - 3
            assert rule["path"].startswith("/opt/accelstack/bin/accelstack-npd-")
            if rule["type"] == "permanent":
                assert rule["condition"] in defaults
                assert not any(a.startswith("--report") for a in rule["args"])  # all: NonOK and Unknown
                permanent.add(rule["condition"])
            else:  # NPD makes an event of Unknown too: only the Unknown rule may report it
                report = [a for a in rule["args"] if a.startswith("--report=")]
                expected = "--report=unknown" if rule["reason"].endswith("CheckUnknown") else "--report=problems"
                assert report == [expected], (name, rule["reason"])
        # NPD gives an Unknown condition the default reason: it must not claim health
        for condition in monitor["conditions"]:
            assert "Healthy" not in condition["reason"] and "healthy" not in condition["message"], condition
        # the permanent rule's Unknown is reported under its own reason, running the same checks
        unknown_rules = [r for r in monitor["rules"] if r["reason"].endswith("CheckUnknown")]
        (permanent_rule,) = [r for r in monitor["rules"] if r["type"] == "permanent"]
        assert [r["args"][:-1] for r in unknown_rules] == [permanent_rule["args"]], name
        assert monitor["pluginConfig"]["max_output_length"] == plugin_config["plugin.maxOutputLength"]
    assert permanent == {"GPUUnhealthy", "NR1Unhealthy"}


def test_every_npd_rule_runs_as_npd_would(tmp_path: Path) -> None:
    """Each rule's args, with the ConfigMap's npd.yaml pointed at fixtures, give a protocol-conformant answer."""
    (cm,) = docs(MANIFESTS / "npd/configmap.yaml")
    config = yaml.safe_load(cm["data"]["npd.yaml"])
    config["node"]["sysfsRoot"] = str(tmp_path / "sys")
    config["plugin"]["stateDir"] = str(tmp_path / "state")
    config["gpu"]["kmsgPath"] = str(tmp_path / "kmsg")
    config["nr1"]["vendorIDs"] = [NR1_VENDOR]
    (tmp_path / "npd.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot"))
    nr1_node(tmp_path / "sys", 2)
    modules = {"accelstack-npd-gpu": "npd.gpu_check", "accelstack-npd-nr1": "npd.nr1_check"}
    answers: dict[str, str] = {}
    for name, monitor in monitors().items():
        limit = monitor["pluginConfig"]["max_output_length"]
        for rule in monitor["rules"]:
            args = [a if not a.startswith("--config-file=") else f"--config-file={tmp_path / 'npd.yaml'}"
                    for a in rule.get("args", [])]
            run = npd_exec(modules[Path(rule["path"]).name], *args, timeout=_duration(rule["timeout"]),
                           max_output=limit)
            assert run.code in (0, 1, 2), (name, rule["reason"], run)
            assert run.message, (name, rule["reason"])
            answers[rule["reason"]] = run.status
    assert answers["NR1Unhealthy"] == answers["NR1Problem"] == answers["NR1CheckUnknown"] == "OK"
    assert answers["GPUXidError"] == "OK"  # the kernel log alone; no NVML needed
    if not nvml_loadable():  # NVML is absent here: the condition and the Unknown rule say so, no threshold event
        assert answers["GPUUnhealthy"] == answers["GPUCheckUnknown"] == "Unknown"
        assert answers["GPUTemperatureHigh"] == answers["GPUPowerHigh"] == "OK"


def test_npd_daemonsets_mount_what_the_monitors_reference() -> None:
    found = monitors()
    for short in ("gpu", "nr1"):
        (ds,) = docs(MANIFESTS / f"npd/daemonset-npd-{short}.yaml")
        pod = ds["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        (npd,) = pod["containers"]
        install_mount = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        npd_mounts = {m["mountPath"]: m["name"] for m in npd["volumeMounts"]}
        assert init["command"][0] == "accelstack-npd-install"
        target = init["command"][1]
        mount_path = next(a.split("=", 1)[1] for a in init["command"] if a.startswith("--mount-path="))
        # the init container fills the volume the NPD container mounts at --mount-path
        assert install_mount[npd_mounts[mount_path]] == target
        monitor_arg = next(a for a in npd["args"] if a.startswith("--config.custom-plugin-monitor="))
        monitor_path = Path(monitor_arg.split("=", 1)[1])
        assert npd_mounts[str(monitor_path.parent)] == "config"
        for rule in found[monitor_path.name]["rules"]:
            assert rule["path"].startswith(mount_path + "/bin/")
            config_file = next(a.split("=", 1)[1] for a in rule["args"] if a.startswith("--config-file="))
            assert npd_mounts[str(Path(config_file).parent)] == "config"
        volumes = {v["name"]: v for v in pod["volumes"]}
        # the state directory survives the pod (the NR1 check's memory of the modules seen) and is created
        assert volumes["state"]["hostPath"] == {"path": "/var/lib/accelstack-npd", "type": "DirectoryOrCreate"}
        assert npd_mounts["/var/lib/accelstack-npd"] == "state"
        (cm,) = docs(MANIFESTS / "npd/configmap.yaml")
        assert yaml.safe_load(cm["data"]["npd.yaml"])["plugin"]["stateDir"] == "/var/lib/accelstack-npd"
        if short == "gpu":  # the kernel log: privileged, as upstream NPD's own DaemonSet
            assert volumes["kmsg"]["hostPath"]["path"] == "/dev/kmsg"
        else:  # sysfs and the state directory only: no privilege, no capability
            assert "kmsg" not in volumes and not npd["securityContext"].get("privileged")
            assert npd["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert npd["securityContext"]["allowPrivilegeEscalation"] is False
        assert any(t["key"] == "accelstack.io/unhealthy" for t in pod["tolerations"])
        assert npd["image"].startswith("registry.k8s.io/node-problem-detector/node-problem-detector:")
