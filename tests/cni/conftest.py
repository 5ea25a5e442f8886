"""Fixtures for the NR1 CNI plugin tests: a fake node made of real network namespaces.

Every test gets its own "host" namespace (the plugin runs inside it, as it would on a node's host namespace),
veth pairs in it standing in for NR1 modules' NICs, a sysfs tree in a tmp dir mapping PCI addresses to those
NICs, and a state dir. Container namespaces are made with ``ip netns add``. Everything is deleted when the
test ends, pass or fail; the machine's own interfaces are never touched.

The plugin is run the way a runtime runs it: its executable (the launcher ``cni/bin/accelstack-nr1-cni``),
CNI_* variables in the environment, the config on stdin, entered into the host namespace with ``nsenter``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import STRICT

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "cni" / "bin" / "accelstack-nr1-cni"
CNI_BIN = "/usr/lib/cni"  # Debian's containernetworking-plugins
RESOURCE = "neureality.com/nr1"


def need_tools() -> None:
    missing = [t for t in ("ip", "nsenter") if shutil.which(t) is None]
    missing += [
        p for p in ("static", "host-local", "host-device") if not os.access(f"{CNI_BIN}/{p}", os.X_OK)
    ]
    if missing:
        why = f"missing {missing}: install iproute2, util-linux, containernetworking-plugins (scripts/cni-deps.sh)"
        if STRICT:
            pytest.fail(why)
        pytest.skip(why)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        return json.loads(self.stdout)


def assert_error(res: Result, code: int) -> dict:
    """The plugin failed the spec's way: non-zero exit, stdout exactly one error object with ``code``."""
    assert res.rc != 0, res
    assert "Traceback" not in res.stdout
    err = json.loads(res.stdout)  # one JSON document, nothing else
    assert isinstance(err, dict), err
    assert set(err) <= {"cniVersion", "code", "msg", "details"}, err
    assert isinstance(err["msg"], str) and err["msg"], err
    assert isinstance(err["cniVersion"], str), err
    assert err["code"] == code, (err, res.stderr)
    return err


class Node:
    """One fake node: host namespace, NR1 modules (veth ends), sysfs tree, containers."""

    def __init__(self, tmp: Path):
        self.id = secrets.token_hex(3)
        self.host = f"acnh{self.id}"
        self.tmp = tmp
        self.sysfs = tmp / "sys"
        self.data = tmp / "state"
        self.ipam_data = tmp / "ipam"
        self.containers: list[str] = []
        self.peers: dict[str, str] = {}
        self.counter = 0
        (self.sysfs / "bus" / "pci" / "devices").mkdir(parents=True)
        sh("ip", "netns", "add", self.host)

    # -- building the node --------------------------------------------------------------------------------
    def add_module(self, pci: str, nics: int = 1, create: bool = True) -> list[str]:
        """An NR1 module at ``pci`` with ``nics`` interfaces (veth ends in the host namespace)."""
        base = self.sysfs / "bus" / "pci" / "devices" / pci
        base.mkdir(parents=True)
        (base / "vendor").write_text("0x1f2e\n")
        (base / "device").write_text("0x0001\n")
        (base / "numa_node").write_text("0\n")
        names = []
        for _ in range(nics):
            self.counter += 1
            name, peer = f"nr{self.id}{self.counter}", f"np{self.id}{self.counter}"
            if create:
                sh("ip", "-n", self.host, "link", "add", name, "type", "veth", "peer", "name", peer)
            self.peers[name] = peer
            (base / "net" / name).mkdir(parents=True)
            names.append(name)
        return names

    def container(self) -> str:
        """A new container namespace; returns its path (what CNI_NETNS carries)."""
        name = f"acnc{self.id}{len(self.containers)}"
        sh("ip", "netns", "add", name)
        self.containers.append(name)
        return f"/run/netns/{name}"

    def cleanup(self) -> None:
        for name in [*self.containers, self.host]:
            sh("ip", "netns", "del", name, check=False)

    # -- looking ----------------------------------------------------------------------------------------
    @staticmethod
    def ns_name(path_or_name: str) -> str:
        return path_or_name.rsplit("/", 1)[-1]

    def links(self, ns: str | None = None) -> dict[str, dict]:
        """Links of a namespace (the host one by default) as iproute2 reports them, by name."""
        name = self.ns_name(ns) if ns else self.host
        out = sh("ip", "-n", name, "-j", "-d", "link", "show").stdout
        return {link["ifname"]: link for link in json.loads(out or "[]")}

    def addresses(self, ns: str, ifname: str) -> list[str]:
        out = sh("ip", "-n", self.ns_name(ns), "-j", "addr", "show", "dev", ifname).stdout
        return [
            f"{a['local']}/{a['prefixlen']}" for entry in json.loads(out) for a in entry.get("addr_info", [])
        ]

    def routes(self, ns: str, family: str = "-4") -> list[dict]:
        return json.loads(sh("ip", "-n", self.ns_name(ns), family, "-j", "route", "show").stdout or "[]")

    def assert_on_host(self, name: str) -> None:
        """``name`` is back on the host under its own name, down, without alias."""
        links = self.links()
        assert name in links, f"{name} not on the host: {sorted(links)}"
        link = links[name]
        assert "UP" not in link["flags"], link
        assert not link.get("ifalias"), link

    # -- running the plugin -----------------------------------------------------------------------------
    def conf(self, **fields: object) -> dict:
        conf: dict = {
            "cniVersion": "1.1.0",
            "name": "nr1net",
            "type": "accelstack-nr1-cni",
            "sysfsRoot": str(self.sysfs),
            "dataDir": str(self.data),
            "lockTimeout": 20,
        }
        conf.update(fields)
        return conf

    def static_ipam(self, address: str = "10.77.0.5/24", **more: object) -> dict:
        ipam: dict = {"type": "static", "addresses": [{"address": address, "gateway": "10.77.0.1"}]}
        ipam.update(more)
        return ipam

    def host_local_ipam(self, subnet: str = "10.88.0.0/24") -> dict:
        return {
            "type": "host-local",
            "ranges": [[{"subnet": subnet}]],
            "routes": [{"dst": "10.99.0.0/16"}],
            "dataDir": str(self.ipam_data),
        }

    def env(
        self,
        command: str,
        *,
        netns: str = "",
        ifname: str = "net1",
        cid: str = "c0ffee",
        args: str = "",
        **extra: str,
    ) -> dict[str, str]:
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": netns,
            "CNI_IFNAME": ifname,
            "CNI_PATH": CNI_BIN,
            "CNI_ARGS": args,
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "ACCELSTACK_CNI_PYTHON": sys.executable,
        }
        env.update(extra)
        return {k: v for k, v in env.items() if v is not None}

    def run_raw(self, env: dict[str, str], stdin: bytes, timeout: float = 60) -> Result:
        proc = subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.host}", "--", str(PLUGIN)],
            env=env,
            input=stdin,
            capture_output=True,
            timeout=timeout,
        )
        return Result(proc.returncode, proc.stdout.decode(), proc.stderr.decode())

    def run(self, command: str, conf: dict, **env: str) -> Result:
        return self.run_raw(self.env(command, **env), json.dumps(conf).encode())

    def popen(self, command: str, conf: dict, **env: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.host}", "--", str(PLUGIN)],
            env=self.env(command, **env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(conf).encode())
        proc.stdin.close()
        proc.stdin = None  # communicate() then only reads
        return proc


@pytest.fixture
def node(tmp_path: Path):
    need_tools()
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.cleanup()
