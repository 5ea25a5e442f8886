"""Malformed configuration and environment: each its own case, each answered with the spec's error JSON and
the right code, never a traceback, and nothing on the node changed."""

from __future__ import annotations

import json

import pytest

from cni import errors
from tests.cni.conftest import assert_error

pytestmark = pytest.mark.root

PCI = "0000:3b:00.0"


def _good(node) -> dict:
    return node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.static_ipam())


CONFIG_CASES: dict[str, tuple[bytes | dict[str, object], int]] = {
    "not-json": (b'{"cniVersion": "1.1.0", ', errors.DECODE_FAILURE),
    "not-utf8": (b'{"cniVersion": "\xff"}', errors.DECODE_FAILURE),
    "json-array": (b"[1, 2]", errors.DECODE_FAILURE),
    "empty-stdin": (b"", errors.DECODE_FAILURE),
    "no-version": ({"cniVersion": None}, errors.INVALID_CONFIG),
    "old-version": ({"cniVersion": "0.3.1"}, errors.INCOMPATIBLE_VERSION),
    "future-version": ({"cniVersion": "9.0.0"}, errors.INCOMPATIBLE_VERSION),
    "no-name": ({"name": None}, errors.INVALID_CONFIG),
    "bad-name": ({"name": "bad name/../x"}, errors.INVALID_CONFIG),
    "no-type": ({"type": None}, errors.INVALID_CONFIG),
    "ipam-not-object": ({"ipam": "static"}, errors.INVALID_CONFIG),
    "ipam-without-type": ({"ipam": {"addresses": []}}, errors.INVALID_CONFIG),
    "ipam-type-path": ({"ipam": {"type": "../../bin/sh"}}, errors.INVALID_CONFIG),
    "dns-not-object": ({"dns": ["10.0.0.1"]}, errors.INVALID_CONFIG),
    "device-not-pci": ({"runtimeConfig": {"deviceID": "eth0"}}, errors.INVALID_CONFIG),
    "device-not-string": ({"runtimeConfig": {"deviceID": 7}}, errors.INVALID_CONFIG),
    "runtime-config-list": ({"runtimeConfig": ["deviceID"]}, errors.INVALID_CONFIG),
    "sysfs-relative": ({"sysfsRoot": "sys"}, errors.INVALID_CONFIG),
    "lock-timeout-negative": ({"lockTimeout": -1}, errors.INVALID_CONFIG),
    "lock-timeout-bool": ({"lockTimeout": True}, errors.INVALID_CONFIG),
    "resource-name-number": ({"resourceName": 5}, errors.INVALID_CONFIG),
    "prev-result-list": ({"prevResult": []}, errors.INVALID_CONFIG),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_malformed_config(node, case):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    change, code = CONFIG_CASES[case]
    if isinstance(change, bytes):
        stdin = change
    else:
        conf = _good(node)
        for key, value in change.items():
            if value is None:
                conf.pop(key)
            else:
                conf[key] = value
        stdin = json.dumps(conf).encode()
    res = node.run_raw(node.env("ADD", netns=netns), stdin)
    err = assert_error(res, code)
    assert err["cniVersion"] in ("1.1.0", "0.3.1", "9.0.0")
    assert nic in node.links() and "net1" not in node.links(netns)


def _drop(name: str) -> dict[str, str | None]:
    return {name: None}


ENV_CASES: dict[str, tuple[dict[str, str | None], int]] = {
    "no-command": (_drop("CNI_COMMAND"), errors.INVALID_ENV),
    "unknown-command": ({"CNI_COMMAND": "ATTACH"}, errors.INVALID_ENV),
    "no-container-id": (_drop("CNI_CONTAINERID"), errors.INVALID_ENV),
    "bad-container-id": ({"CNI_CONTAINERID": "-c0ffee;rm"}, errors.INVALID_ENV),
    "no-ifname": (_drop("CNI_IFNAME"), errors.INVALID_ENV),
    "ifname-too-long": ({"CNI_IFNAME": "averyveryverylongname"}, errors.INVALID_ENV),
    "ifname-with-slash": ({"CNI_IFNAME": "net/1"}, errors.INVALID_ENV),
    "no-netns": (_drop("CNI_NETNS"), errors.INVALID_ENV),
    "missing-netns": ({"CNI_NETNS": "/run/netns/does-not-exist-acn"}, errors.INVALID_ENV),
    "no-path": (_drop("CNI_PATH"), errors.INVALID_ENV),
    "bad-args": ({"CNI_ARGS": "K8S_POD_NAME"}, errors.INVALID_ENV),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_malformed_environment(node, case):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    change, code = ENV_CASES[case]
    env = node.env("ADD", netns=netns)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    res = node.run_raw(env, json.dumps(_good(node)).encode())
    assert_error(res, code)
    assert nic in node.links() and "net1" not in node.links(netns)


def test_no_device_and_no_pod_in_args(node):
    node.add_module(PCI)
    res = node.run("ADD", node.conf(ipam=node.static_ipam()), netns=node.container())
    err = assert_error(res, errors.INVALID_ENV)
    assert "K8S_POD_NAME" in err["msg"]


def test_device_not_on_this_host(node):
    node.add_module(PCI)
    res = node.run("ADD", node.conf(runtimeConfig={"deviceID": "0000:af:00.0"}), netns=node.container())
    assert_error(res, errors.NO_DEVICE)


def test_module_without_interface(node):
    node.add_module(PCI, nics=1, create=False)  # sysfs names an interface the host does not have
    res = node.run("ADD", node.conf(runtimeConfig={"deviceID": PCI}), netns=node.container())
    assert_error(res, errors.NO_INTERFACE)


def test_ifname_already_in_container(node):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    name = node.ns_name(netns)
    import subprocess

    subprocess.run(
        ["ip", "-n", name, "link", "add", "net1", "type", "veth", "peer", "name", "x1"], check=True
    )
    res = node.run("ADD", node.conf(runtimeConfig={"deviceID": PCI}), netns=netns)
    assert_error(res, errors.IFNAME_EXISTS)
    assert nic in node.links()


def test_gc_needs_valid_attachments(node):
    assert_error(node.run("GC", node.conf()), errors.INVALID_CONFIG)


def test_status_and_gc_need_1_1_0(node):
    assert_error(node.run("STATUS", node.conf(cniVersion="1.0.0")), errors.INCOMPATIBLE_VERSION)
    gc = node.conf(cniVersion="1.0.0", **{"cni.dev/valid-attachments": []})
    assert_error(node.run("GC", gc), errors.INCOMPATIBLE_VERSION)


def test_version_ignores_missing_env_and_config(node):
    res = node.run_raw({"CNI_COMMAND": "VERSION"}, b"")
    assert res.rc == 0, res
    assert "1.1.0" in res.json["supportedVersions"]
