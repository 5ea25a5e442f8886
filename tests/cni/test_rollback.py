"""ADD failing at each step leaves the node as it was: NIC on the host under its name, down, no alias; no
IPAM lease; no state record; nothing in the container. Failures are injected with
ACCELSTACK_NR1_CNI_FAIL_AT (honoured by the production code path) or caused for real (bad IPAM, bad route).
"""

from __future__ import annotations

import os

import pytest

from cni import errors
from cni.plugin import ADD_STEPS
from tests.cni.conftest import assert_error

pytestmark = pytest.mark.root

PCI = "0000:3b:00.0"


def _assert_untouched(node, nic: str, netns: str) -> None:
    node.assert_on_host(nic)
    assert "net1" not in node.links(netns)
    records = node.data / "attachments" / "nr1net"
    assert not records.exists() or os.listdir(records) == []
    leases = node.ipam_data / "nr1net"
    if leases.exists():
        assert [n for n in os.listdir(leases) if n.startswith("10.")] == []


@pytest.mark.parametrize("step", ADD_STEPS)
def test_add_fails_at_step_and_rolls_back(node, step):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.host_local_ipam())
    res = node.run("ADD", conf, netns=netns, ACCELSTACK_NR1_CNI_FAIL_AT=step)
    err = assert_error(res, errors.INJECTED)
    assert step in err["msg"]
    if step != "resolve":
        assert err["details"] == "rolled back"
    _assert_untouched(node, nic, netns)
    # and the module works afterwards
    ok = node.run("ADD", conf, netns=netns)
    assert ok.rc == 0, ok
    assert node.run("DEL", conf, netns=netns).rc == 0
    node.assert_on_host(nic)


def test_ipam_plugin_missing(node):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    res = node.run(
        "ADD", node.conf(runtimeConfig={"deviceID": PCI}, ipam={"type": "no-such-ipam"}), netns=netns
    )
    assert_error(res, errors.IPAM)
    _assert_untouched(node, nic, netns)


def test_ipam_plugin_rejects_its_config(node):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(
        runtimeConfig={"deviceID": PCI}, ipam={"type": "static", "addresses": [{"address": "bogus"}]}
    )
    res = node.run("ADD", conf, netns=netns)
    err = assert_error(res, errors.IPAM)  # static answers 999 (its own code): reported as ours, 105
    assert "static" in err["msg"] and "CIDR" in err["msg"]
    _assert_untouched(node, nic, netns)


def test_unreachable_gateway_fails_at_routes(node):
    """The kernel refuses a route via a gateway outside every connected subnet: a real netlink failure after
    IPAM succeeded, so the lease must be released too."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    ipam = node.host_local_ipam()
    ipam["routes"] = [{"dst": "10.50.0.0/16", "gw": "192.168.250.1"}]
    res = node.run("ADD", node.conf(runtimeConfig={"deviceID": PCI}, ipam=ipam), netns=netns)
    err = assert_error(res, errors.NETLINK)
    assert "routes" in err["msg"] and err["details"] == "rolled back"
    _assert_untouched(node, nic, netns)


def test_address_conflict_fails_at_addresses(node):
    """Two IPAM answers with the same address: the second add is refused by the kernel (EEXIST)."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    ipam = node.static_ipam()
    ipam["addresses"] = [{"address": "10.77.0.5/24"}, {"address": "10.77.0.5/24"}]
    res = node.run("ADD", node.conf(runtimeConfig={"deviceID": PCI}, ipam=ipam), netns=netns)
    err = assert_error(res, errors.NETLINK)
    assert "addresses" in err["msg"]
    _assert_untouched(node, nic, netns)


@pytest.mark.parametrize("step", ["link-up", "addresses", "cache"])
def test_del_cleans_up_after_an_add_that_was_killed(node, step):
    """The runtime killed ADD half-way (nothing undone): the DEL that follows every ADD puts the NIC back
    under its name and releases the lease, from the record ADD wrote before it moved anything."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.host_local_ipam())
    res = node.run("ADD", conf, netns=netns, ACCELSTACK_NR1_CNI_FAIL_AT=f"crash:{step}")
    assert res.rc == 137 and res.stdout == ""
    assert "net1" in node.links(netns)  # left half-done
    gone = node.run("DEL", conf, netns=netns)
    assert gone.rc == 0, gone
    _assert_untouched(node, nic, netns)


FAKE_IPAM = """#!/bin/sh
cat >/dev/null
case "$CNI_COMMAND" in
  VERSION) echo '{"cniVersion":"1.0.0","supportedVersions":["1.0.0","1.1.0"]}' ;;
  ADD) %s ;;
  *) exit 0 ;;
esac
"""

FAKE_ANSWERS = {
    "try-again": ('echo \'{"cniVersion":"1.1.0","code":11,"msg":"pool busy"}\'; exit 1', errors.TRY_AGAIN),
    "own-code": ('echo \'{"cniVersion":"1.1.0","code":999,"msg":"exhausted"}\'; exit 1', errors.IPAM),
    "garbage": ("echo 'panic: runtime error'; exit 2", errors.IPAM),
    "bad-address": ('echo \'{"cniVersion":"1.1.0","ips":[{"address":"10.1.2.3"}]}\'', errors.IPAM),
    "not-json-ok": ("echo 'ok'", errors.IPAM),
}


@pytest.mark.parametrize("answer", sorted(FAKE_ANSWERS))
def test_ipam_delegate_failures_roll_back(node, tmp_path, answer):
    """A delegate that fails in its own ways (its code 11 reaches the runtime as 11, its own codes as 105)."""
    script, code = FAKE_ANSWERS[answer]
    bindir = tmp_path / "cni-bin"
    bindir.mkdir()
    fake = bindir / "fake-ipam"
    fake.write_text(FAKE_IPAM % script)
    fake.chmod(0o755)
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam={"type": "fake-ipam"})
    res = node.run("ADD", conf, netns=netns, CNI_PATH=f"{bindir}:/usr/lib/cni")
    err = assert_error(res, code)
    assert "fake-ipam" in err["msg"] and err["details"].endswith("rolled back")
    _assert_untouched(node, nic, netns)
