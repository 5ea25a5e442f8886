"""Concurrent ADDs (and DELs): separate processes, as a runtime starting several pods at once."""

from __future__ import annotations

import json
import os

import pytest

from cni import errors

pytestmark = pytest.mark.root


def _finish(procs):
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        out.append((proc.returncode, stdout.decode(), stderr.decode()))
    return out


def test_concurrent_adds_on_different_modules(node):
    pcis = [f"0000:{bus:02x}:00.0" for bus in (0x1A, 0x3B, 0x5E, 0x86, 0xAF, 0xD8)]
    nics = {pci: node.add_module(pci)[0] for pci in pcis}
    conf = node.conf(ipam=node.host_local_ipam())
    pods = [(pci, node.container(), f"pod{i}") for i, pci in enumerate(pcis)]
    procs = [
        node.popen("ADD", dict(conf, runtimeConfig={"deviceID": pci}), netns=netns, cid=cid)
        for pci, netns, cid in pods
    ]
    results = _finish(procs)
    assert all(rc == 0 for rc, _, _ in results), results
    addresses = {json.loads(out)["ips"][0]["address"] for _, out, _ in results}
    assert len(addresses) == len(pcis)  # host-local under concurrency: all distinct
    for pci, netns, _ in pods:
        assert node.links(netns)["net1"]["ifalias"] == nics[pci]

    procs = [node.popen("DEL", conf, netns=netns, cid=cid) for _, netns, cid in pods]
    assert all(rc == 0 for rc, _, _ in _finish(procs))
    for nic in nics.values():
        node.assert_on_host(nic)
    assert os.listdir(node.data / "attachments" / "nr1net") == []


def test_concurrent_adds_racing_for_one_module(node):
    """Two pods wrongly given the same module: the lock lets exactly one have its NIC; the others get a clean
    NO_INTERFACE error and the NIC is never half-moved."""
    pci = "0000:3b:00.0"
    (nic,) = node.add_module(pci)
    conf = node.conf(runtimeConfig={"deviceID": pci}, ipam=node.static_ipam())
    pods = [(node.container(), f"pod{i}") for i in range(4)]
    results = _finish([node.popen("ADD", conf, netns=netns, cid=cid) for netns, cid in pods])
    winners = [i for i, (rc, _, _) in enumerate(results) if rc == 0]
    assert len(winners) == 1, results
    for i, (rc, out, _) in enumerate(results):
        if i not in winners:
            assert rc != 0 and json.loads(out)["code"] == errors.NO_INTERFACE, out
    netns, cid = pods[winners[0]]
    assert node.links(netns)["net1"]["ifalias"] == nic
    for other, _ in pods:
        if other != netns:
            assert "net1" not in node.links(other)
    # DELs for the losers are harmless (the runtime sends DEL after a failed ADD)
    losers = [node.popen("DEL", conf, netns=n, cid=c) for n, c in pods if c != cid]
    assert all(rc == 0 for rc, _, _ in _finish(losers))
    assert node.links(netns)["net1"]["ifalias"] == nic
    assert node.run("DEL", conf, netns=netns, cid=cid).rc == 0
    node.assert_on_host(nic)


def test_add_waits_for_a_del_of_the_same_module(node):
    """A DEL and the next pod's ADD for the same module at once: the ADD either gets the NIC (after the DEL)
    or a clean NO_INTERFACE (before it); never a half-moved NIC."""
    pci = "0000:3b:00.0"
    (nic,) = node.add_module(pci)
    conf = node.conf(runtimeConfig={"deviceID": pci})
    old, new = node.container(), node.container()
    assert node.run("ADD", conf, netns=old, cid="old").rc == 0
    dele, add = _finish(
        [node.popen("DEL", conf, netns=old, cid="old"), node.popen("ADD", conf, netns=new, cid="new")]
    )
    assert dele[0] == 0, dele
    if add[0] == 0:
        assert node.links(new)["net1"]["ifalias"] == nic
        assert node.run("DEL", conf, netns=new, cid="new").rc == 0
    else:
        assert json.loads(add[1])["code"] == errors.NO_INTERFACE, add
    node.assert_on_host(nic)
