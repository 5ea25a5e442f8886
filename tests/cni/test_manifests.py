"""The CNI manifests: configs the plugin accepts, and an installer script that really installs a working
plugin (run here against a tmp dir standing in for the host's /opt/cni/bin and /etc/cni/net.d)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from cni.config import NetConf

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests" / "cni"


def _configmap() -> dict:
    return yaml.safe_load((MANIFESTS / "configmap.yaml").read_text())


def _plugin_configs(conflist: dict) -> list[bytes]:
    """Each plugin entry as the runtime hands it over: cniVersion and name injected."""
    out = []
    for plugin in conflist["plugins"]:
        conf = dict(plugin, cniVersion=conflist["cniVersion"], name=conflist["name"])
        conf["runtimeConfig"] = {"deviceID": "0000:3b:00.0"}  # what Multus adds for the deviceID capability
        out.append(json.dumps(conf).encode())
    return out


def test_installed_conflist_is_accepted_by_the_plugin():
    conflist = json.loads(_configmap()["data"]["accelstack-nr1.conflist"])
    assert conflist["cniVersion"] in conflist["cniVersions"]
    (raw,) = _plugin_configs(conflist)
    conf = NetConf(raw, "ADD")
    assert conf.ipam_type == "host-local" and conf.device_id == "0000:3b:00.0"
    assert json.loads(raw)["type"] == "accelstack-nr1-cni"
    assert json.loads(raw)["capabilities"] == {"deviceID": True}


def test_network_attachment_example_is_accepted_by_the_plugin():
    docs = list(yaml.safe_load_all((MANIFESTS / "networkattachmentdefinition-example.yaml").read_text()))
    nad = next(d for d in docs if d["kind"] == "NetworkAttachmentDefinition")
    assert nad["metadata"]["annotations"]["k8s.v1.cni.cncf.io/resourceName"] == "neureality.com/nr1"
    conflist = json.loads(nad["spec"]["config"])
    assert conflist["name"] == nad["metadata"]["name"]
    for raw in _plugin_configs(conflist):
        NetConf(raw, "ADD")
    pod = next(d for d in docs if d["kind"] == "Pod")
    assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"].startswith(nad["metadata"]["name"])
    assert pod["spec"]["containers"][0]["resources"]["limits"]["neureality.com/nr1"] == 1


def test_installer_daemonset_mounts_what_the_script_writes():
    ds = yaml.safe_load((MANIFESTS / "daemonset-installer.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cni-bin"]["hostPath"]["path"] == "/opt/cni/bin"
    assert volumes["cni-conf"]["hostPath"]["path"] == "/etc/cni/net.d"
    assert volumes["config"]["configMap"]["name"] == _configmap()["metadata"]["name"]
    init = pod["initContainers"][0]
    env = {e["name"]: e["value"] for e in init["env"]}
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert env["CNI_BIN_DIR"] == mounts["cni-bin"] and env["CNI_CONF_DIR"] == mounts["cni-conf"]
    assert init["command"] == ["/bin/sh", f"{mounts['config']}/install.sh"]


def test_install_script_installs_a_working_plugin_twice(tmp_path):
    """The script as the init container runs it, against a fake image layout (the repo's package and this
    interpreter) and a fake host; the second run is an upgrade and leaves exactly one version."""
    cm = _configmap()
    config = tmp_path / "config"
    config.mkdir()
    for key, text in cm["data"].items():
        (config / key).write_text(text)
    image = tmp_path / "opt-accelstack"
    (image / "bin").mkdir(parents=True)
    # the image's relocatable Python, played by this interpreter (a wrapper keeps its venv and so the package)
    (image / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (image / "bin" / "python3").chmod(0o755)
    host_bin, host_conf = (
        tmp_path / "host" / "opt" / "cni" / "bin",
        tmp_path / "host" / "etc" / "cni" / "net.d",
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "ACCELSTACK_HOME": str(image),
        "CNI_BIN_DIR": str(host_bin),
        "CNI_CONF_DIR": str(host_conf),
        "CONFIG_DIR": str(config),
    }
    for _ in range(2):
        proc = subprocess.run(
            ["/bin/sh", str(config / "install.sh")], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        assert '"supportedVersions"' in proc.stdout
    versions = sorted(p.name for p in host_bin.glob("accelstack-nr1-cni.d-*"))
    assert len(versions) == 1
    assert os.readlink(host_bin / "accelstack-nr1-cni.d") == versions[0]
    assert (host_bin / "accelstack-nr1-cni.d" / "app" / "cni" / "main.py").is_file()
    assert json.loads((host_conf / "zz-accelstack-nr1.conflist").read_text())["name"] == "accelstack-nr1"
    assert not [p for p in host_bin.iterdir() if p.name.startswith(".")]
    # the installed plugin runs from its own copy of the package, not from this checkout
    run = subprocess.run(
        [str(host_bin / "accelstack-nr1-cni")],
        env={"CNI_COMMAND": "VERSION", "PATH": "/usr/bin:/bin"},
        input=b'{"cniVersion": "1.0.0"}',
        capture_output=True,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["cniVersion"] == "1.0.0"
    marker = subprocess.run(
        [
            str(host_bin / "accelstack-nr1-cni.d" / "bin" / "python3"),
            "-I",
            "-S",
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import cni; print(cni.__file__)",
            str(host_bin / "accelstack-nr1-cni.d" / "app"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert marker.stdout.strip().startswith(str(host_bin))
