"""In-process checks of the plugin's parts that need no namespaces: input validation, netlink encoding,
the IPAM version choice, and what the start-up path imports."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cni import errors, netlink
from cni.config import Env, NetConf, retarget, valid_identifier, valid_ifname, valid_pci_address
from cni.errors import CNIError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("0000:3b:00.0", True),
        ("0000:AF:1f.7", True),
        ("0000:3b:00.8", False),
        ("3b:00.0", False),
        ("0000:3b:00", False),
        ("0000:3g:00.0", False),
        ("00000:3b:00.0", False),
        ("", False),
    ],
)
def test_pci_address(text, ok):
    assert valid_pci_address(text) is ok


def test_identifiers_and_ifnames():
    assert valid_identifier("a1_b.c-d") and not valid_identifier("-a") and not valid_identifier("a b")
    assert valid_ifname("net1") and valid_ifname("x" * 15)
    assert not valid_ifname("x" * 16) and not valid_ifname("a/b") and not valid_ifname("..")
    assert not valid_ifname("a b") and not valid_ifname("a:b") and not valid_ifname("")


def test_cni_args_parsing():
    env = Env(
        {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": "c1",
            "CNI_NETNS": "/x",
            "CNI_IFNAME": "net1",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=web-0;;K8S_POD_NAMESPACE=a=b",
        }
    )
    env.validate_command()
    env.validate()
    assert env.args == {"IgnoreUnknown": "1", "K8S_POD_NAME": "web-0", "K8S_POD_NAMESPACE": "a=b"}


def test_del_may_lack_netns_but_add_may_not():
    base = {"CNI_CONTAINERID": "c1", "CNI_IFNAME": "net1", "CNI_PATH": "/opt/cni/bin"}
    Env(dict(base, CNI_COMMAND="DEL")).validate()
    with pytest.raises(CNIError) as exc:
        Env(dict(base, CNI_COMMAND="ADD")).validate()
    assert exc.value.code == errors.INVALID_ENV


def test_config_defaults_and_device_id_forms():
    raw = json.dumps({"cniVersion": "1.1.0", "name": "n", "type": "t", "deviceID": "0000:3B:00.0"}).encode()
    conf = NetConf(raw, "ADD")
    assert conf.device_id == "0000:3b:00.0"  # the sriov-style top-level field, lower-cased like sysfs
    assert conf.resource_name == "neureality.com/nr1"
    assert conf.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert conf.sysfs_root == "/sys" and conf.data_dir == "/var/lib/cni/accelstack-nr1"
    runtime = json.dumps(
        {
            "cniVersion": "1.1.0",
            "name": "n",
            "type": "t",
            "deviceID": "0000:3b:00.0",
            "runtimeConfig": {"deviceID": "0000:5e:00.0"},
        }
    ).encode()
    assert NetConf(runtime, "ADD").device_id == "0000:5e:00.0"  # the runtime's wins


def test_retarget_changes_config_and_prev_result_versions():
    conf: dict = {
        "cniVersion": "1.1.0",
        "prevResult": {"cniVersion": "1.1.0", "ips": []},
        "ipam": {"type": "static"},
    }
    out = retarget(conf, "1.0.0")
    assert out["cniVersion"] == "1.0.0" and out["prevResult"]["cniVersion"] == "1.0.0"
    assert conf["cniVersion"] == "1.1.0" and conf["prevResult"]["cniVersion"] == "1.1.0"  # a copy


def test_error_json_shape():
    err = CNIError(errors.TRY_AGAIN, "busy", "lock held")
    assert err.to_json("1.1.0") == {"cniVersion": "1.1.0", "code": 11, "msg": "busy", "details": "lock held"}
    assert "details" not in CNIError(errors.INTERNAL, "x").to_json("1.0.0")


def test_netlink_attributes_round_trip():
    body = netlink.attr_str(netlink.IFLA_IFNAME, "net1") + netlink.attr(netlink.IFLA_IFALIAS, b"nr1eth0")
    body += netlink.attr_u32(netlink.IFLA_MTU, 9000) + netlink.attr(
        netlink.IFLA_ADDRESS, bytes.fromhex("02aabbccddee")
    )
    assert len(body) % 4 == 0
    attrs = netlink.parse_attrs(body)
    link = netlink.Link(7, netlink.IFF_UP, attrs)
    assert (link.name, link.alias, link.mtu, link.mac, link.up) == (
        "net1",
        "nr1eth0",
        9000,
        "02:aa:bb:cc:dd:ee",
        True,
    )
    # a zero-length alias (how the plugin clears one) is a bare 4-byte header
    assert netlink.attr(netlink.IFLA_IFALIAS, b"") == struct.pack("=HH", 4, netlink.IFLA_IFALIAS)


def test_netlink_reads_this_namespace():
    """A live, read-only check of the client against the kernel: the loopback interface and its address."""
    with netlink.Netlink() as nl:
        lo = nl.get_link("lo")
        assert lo is not None and lo.index == 1
        assert nl.get_link("no-such-if0") is None
        assert any(link.name == "lo" for link in nl.links())


def test_start_up_imports_stay_small():
    """ADD with a deviceID, DEL, CHECK, VERSION: no grpc, no pyroute2, no subprocess, no typing, no pathlib
    beyond what sysfs discovery itself needs. Every module here is start-up latency for each pod."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import cni.main, cni.plugin, cni.netns, cni.ipam, cni.state, cni.config; "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(REPO)], capture_output=True, text=True, check=True
    ).stdout.split()
    for heavy in (
        "grpc",
        "pyroute2",
        "subprocess",
        "typing",
        "pathlib",
        "dataclasses",
        "ctypes",
        "ipaddress",
        "google.protobuf",
        "socket",
        "selectors",
        "device_plugin",
        "json",
        "re",
        "enum",
    ):
        assert heavy not in out, f"{heavy} is imported at start-up"


def test_launcher_runs_without_site_packages():
    proc = subprocess.run(
        [str(REPO / "cni" / "bin" / "accelstack-nr1-cni")],
        env={"CNI_COMMAND": "VERSION", "ACCELSTACK_CNI_PYTHON": sys.executable, "PATH": os.environ["PATH"]},
        input=b"{}",
        capture_output=True,
        check=True,
    )
    assert json.loads(proc.stdout)["supportedVersions"] == ["1.0.0", "1.1.0"]


def launch(*args: str, command: str = "", stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {"ACCELSTACK_CNI_PYTHON": sys.executable, "PATH": os.environ["PATH"]}
    if command:
        env["CNI_COMMAND"] = command
    return subprocess.run([str(REPO / "cni" / "bin" / "accelstack-nr1-cni"), *args], env=env, input=stdin,
                          capture_output=True, check=False, timeout=60)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_on_a_terminal_is_plain_usage_not_cni_json(flag):
    """A person running the binary to see what it is gets what it is, how the runtime runs it and where the
    docs are (exit 0), not ``{"code": 4, "msg": "CNI_COMMAND is not set"}``."""
    proc = launch(flag)
    out = proc.stdout.decode()
    assert proc.returncode == 0 and proc.stderr == b""
    assert out.startswith("usage: accelstack-nr1-cni ") and not out.lstrip().startswith("{")
    for words in ("CNI_COMMAND", "stdin", "docs/cni.md", "NR1"):
        assert words in out
    assert len(out.splitlines()) < 20


def test_version_flag_names_the_plugin_and_the_spec_versions():
    proc = launch("--version")
    assert proc.returncode == 0
    line = proc.stdout.decode()
    assert line.startswith("accelstack-nr1-cni ") and line.endswith("(CNI spec 1.0.0, 1.1.0)\n")


def test_without_cni_command_the_answer_is_still_the_spec_error():
    """No flag asked for help: the spec's answer for a missing CNI_COMMAND, whatever the arguments (a runtime
    passes none); and with CNI_COMMAND set a help flag changes nothing."""
    proc = launch(stdin=b'{"cniVersion": "1.0.0"}')
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == {"cniVersion": "1.0.0", "code": 4, "msg": "CNI_COMMAND is not set"}
    assert b"--help" in proc.stderr  # the one line a person sees says where to look
    proc = launch("--help", command="VERSION", stdin=b"{}")
    assert proc.returncode == 0 and json.loads(proc.stdout)["supportedVersions"] == ["1.0.0", "1.1.0"]


FASTJSON_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
from cni import fastjson
assert "json" not in sys.modules and "re" not in sys.modules
values = [{"a": [1, 2.5, None, True, False, "é\"\\\n"], "b": {"c": -1e300, "d": 12345678901234567890}}, [], "x", 3]
out = [fastjson.dumps(v) for v in values]
assert [fastjson.loads(o) for o in out] == values
assert fastjson.loads(b"\xef\xbb\xbf {\"a\": 1} \n") == {"a": 1}
bad = ["", " ", "{", '{"cniVersion": "1.1.0", ', '{"a":1}x', "NaN", "[1,]", '{"a" 1}', "tru", '"\x01"', "[1] [2]"]
for text in bad:
    try:
        fastjson.loads(text)
    except ValueError:
        continue
    raise AssertionError(f"accepted {text!r}")
for obj in (float("nan"), {"a": object()}):
    try:
        fastjson.dumps(obj)
    except (ValueError, TypeError):
        continue
    raise AssertionError(f"serialized {obj!r}")
import json
assert out == [json.dumps(v) for v in values]
print("ok")
"""


def test_fastjson_matches_json_and_rejects_what_it_rejects():
    """In a fresh interpreter (json not loaded: the case that matters) and compared with the json package."""
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", FASTJSON_CHECK, str(REPO)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize(
    "bad",
    [
        {"ips": [{"address": "10.0.0.5"}]},
        {"ips": [{"address": "10.0.0.5/33"}]},
        {"ips": [{"address": "x/24"}]},
        {"ips": [{"address": "10.0.0.5/24", "gateway": "nope"}]},
        {"ips": "10.0.0.5/24"},
        {"routes": [{"dst": "10.0.0.0/8", "priority": "1"}]},
        {"routes": [{"dst": "10.0.0.0/8", "gw": 5}]},
        {"routes": [{"dst": "10.0.0.0/8", "mtu": True}]},
        {"routes": [{"dst": "10.0.0.0/8", "scope": 300}]},
        {"routes": [{"dst": "10.0.0.0"}]},
    ],
)
def test_ipam_results_the_kernel_cannot_take_are_ipam_errors(bad):
    from cni.plugin import _check_ipam_result

    with pytest.raises(CNIError) as exc:
        _check_ipam_result(bad)
    assert exc.value.code == errors.IPAM


def test_ipam_result_accepted():
    from cni.plugin import _check_ipam_result

    good = {
        "ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0.1"}, {"address": "fd00::5/64"}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 10}, {"dst": "fd01::/64"}],
        "dns": {},
    }
    assert _check_ipam_result(good) == (good["ips"], good["routes"])


def test_launcher_answers_in_json_when_the_package_is_broken(tmp_path):
    root = tmp_path / "install"
    (root / "cni" / "bin").mkdir(parents=True)
    launcher = root / "cni" / "bin" / "accelstack-nr1-cni"
    launcher.write_bytes((REPO / "cni" / "bin" / "accelstack-nr1-cni").read_bytes())
    launcher.chmod(0o755)
    (root / "cni" / "__init__.py").write_text("")
    (root / "cni" / "main.py").write_text("import no_such_module_acn\n")
    proc = subprocess.run(
        [str(launcher)],
        env={"CNI_COMMAND": "ADD", "ACCELSTACK_CNI_PYTHON": sys.executable, "PATH": os.environ["PATH"]},
        input=b"{}",
        capture_output=True,
    )
    assert proc.returncode == 1
    err = json.loads(proc.stdout)
    assert err["code"] == errors.INTERNAL and "no_such_module_acn" in err["msg"]
