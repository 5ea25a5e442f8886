"""ADD -> CHECK -> DEL through the real executable, real namespaces and the reference IPAM plugins."""

from __future__ import annotations

import json
import os

import pytest

from cni import errors

pytestmark = pytest.mark.root

PCI = "0000:3b:00.0"


def test_version_lists_supported_versions(node):
    res = node.run_raw({"CNI_COMMAND": "VERSION", "PATH": "/usr/bin:/bin"}, b'{"cniVersion":"1.1.0"}')
    assert res.rc == 0, res
    assert res.json == {"cniVersion": "1.1.0", "supportedVersions": ["1.0.0", "1.1.0"]}


def test_add_check_del_with_static_ipam(node):
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(
        runtimeConfig={"deviceID": PCI},
        ipam=node.static_ipam(routes=[{"dst": "10.70.0.0/16", "gw": "10.77.0.1"}]),
        dns={"nameservers": ["10.77.0.2"], "search": ["nr1.local"]},
    )
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    result = res.json

    inside = node.links(netns)
    assert "net1" in inside and nic not in node.links()
    link = inside["net1"]
    assert "UP" in link["flags"]
    assert link["ifalias"] == nic  # the host name is kept as the alias
    assert result["cniVersion"] == "1.1.0"
    assert result["interfaces"] == [
        {"name": "net1", "mac": link["address"], "sandbox": netns, "mtu": link["mtu"], "pciID": PCI}
    ]
    assert result["ips"] == [{"address": "10.77.0.5/24", "gateway": "10.77.0.1", "interface": 0}]
    assert result["routes"] == [{"dst": "10.70.0.0/16", "gw": "10.77.0.1"}]
    assert result["dns"] == {"nameservers": ["10.77.0.2"], "search": ["nr1.local"]}
    assert node.addresses(netns, "net1") == ["10.77.0.5/24"]
    assert {"dst": "10.70.0.0/16", "gateway": "10.77.0.1"}.items() <= next(
        r for r in node.routes(netns) if r["dst"] == "10.70.0.0/16"
    ).items()

    check = node.run("CHECK", dict(conf, prevResult=result), netns=netns)
    assert check.rc == 0, check
    assert check.stdout == ""

    gone = node.run("DEL", dict(conf, prevResult=result), netns=netns)
    assert gone.rc == 0, gone
    node.assert_on_host(nic)
    assert "net1" not in node.links(netns)
    assert os.listdir(node.data / "attachments" / "nr1net") == []

    again = node.run("DEL", dict(conf, prevResult=result), netns=netns)  # idempotent
    assert again.rc == 0, again
    node.assert_on_host(nic)


def test_host_local_lease_is_released_and_reused(node):
    (nic,) = node.add_module(PCI)
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.host_local_ipam())
    first = node.container()
    res = node.run("ADD", conf, netns=first, cid="pod1")
    assert res.rc == 0, res
    address = res.json["ips"][0]["address"]
    assert address.startswith("10.88.0.") and res.json["routes"] == [{"dst": "10.99.0.0/16"}]
    leases = node.ipam_data / "nr1net"
    assert address.split("/")[0] in os.listdir(leases)
    assert node.run("CHECK", dict(conf, prevResult=res.json), netns=first, cid="pod1").rc == 0

    assert node.run("DEL", conf, netns=first, cid="pod1").rc == 0
    assert address.split("/")[0] not in os.listdir(leases)
    node.assert_on_host(nic)

    second = node.container()
    res2 = node.run("ADD", conf, netns=second, cid="pod2", ifname="eth1")
    assert res2.rc == 0, res2
    assert "eth1" in node.links(second)
    assert node.run("DEL", conf, netns=second, cid="pod2", ifname="eth1").rc == 0
    node.assert_on_host(nic)


def test_cni_1_0_0_result_has_no_1_1_fields(node):
    node.add_module(PCI)
    netns = node.container()
    conf = node.conf(cniVersion="1.0.0", runtimeConfig={"deviceID": PCI}, ipam=node.static_ipam())
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    assert res.json["cniVersion"] == "1.0.0"
    assert set(res.json["interfaces"][0]) == {"name", "mac", "sandbox"}
    assert node.run("CHECK", dict(conf, prevResult=res.json), netns=netns).rc == 0
    assert node.run("DEL", conf, netns=netns).rc == 0


def test_add_without_ipam_and_chained_prev_result(node):
    """As the second plugin of a conflist: prevResult's interfaces and ips pass through, ours is appended."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    prev = {
        "cniVersion": "1.1.0",
        "interfaces": [{"name": "eth0", "mac": "02:00:00:00:00:01", "sandbox": netns}],
        "ips": [{"address": "10.1.0.9/24", "interface": 0}],
    }
    conf = node.conf(runtimeConfig={"deviceID": PCI}, prevResult=prev)
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    assert res.json["interfaces"][0] == prev["interfaces"][0]
    assert res.json["interfaces"][1]["name"] == "net1"
    assert res.json["ips"] == prev["ips"]
    assert node.addresses(netns, "net1") == []
    assert node.run("DEL", conf, netns=netns).rc == 0
    node.assert_on_host(nic)


def test_check_notices_a_missing_address(node):
    node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.static_ipam())
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    os.system(f"ip -n {node.ns_name(netns)} addr flush dev net1")
    err = node.run("CHECK", dict(conf, prevResult=res.json), netns=netns)
    assert_msg = json.loads(err.stdout)
    assert err.rc != 0 and assert_msg["code"] == errors.CHECK_FAILED, err
    assert "10.77.0.5/24" in assert_msg["msg"]
    assert node.run("DEL", conf, netns=netns).rc == 0


def test_del_after_namespace_is_gone(node):
    node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.host_local_ipam())
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    ip = res.json["ips"][0]["address"].split("/")[0]
    assert ip in os.listdir(node.ipam_data / "nr1net")
    os.system(f"ip netns del {node.ns_name(netns)}")  # a veth dies with its namespace
    gone = node.run("DEL", conf, netns=netns)
    assert gone.rc == 0, gone
    assert node.run("DEL", conf, netns="").rc == 0  # CNI_NETNS may be empty on DEL
    assert os.listdir(node.data / "attachments" / "nr1net") == []
    assert ip not in os.listdir(node.ipam_data / "nr1net")  # the lease was released


def test_del_restores_a_nic_the_kernel_handed_back(node):
    """A physical NIC returns to the initial namespace under its in-pod name when the pod's namespace dies;
    DEL finds it by the alias and gives it its name back."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI})
    assert node.run("ADD", conf, netns=netns).rc == 0
    # do what the kernel does for a physical device: back to the host namespace, name and alias kept
    os.system(f"ip -n {node.ns_name(netns)} link set net1 netns {node.host}")
    os.system(f"ip netns del {node.ns_name(netns)}")
    assert "net1" in node.links() and node.links()["net1"]["ifalias"] == nic
    res = node.run("DEL", conf, netns=netns)
    assert res.rc == 0, res
    node.assert_on_host(nic)
    assert "net1" not in node.links()


def test_del_without_state_uses_the_alias(node):
    """The state dir was lost (node rebuilt): DEL still moves the NIC back, named by its alias."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI})
    assert node.run("ADD", conf, netns=netns).rc == 0
    for path in (node.data / "attachments" / "nr1net").iterdir():
        path.unlink()
    assert node.run("DEL", conf, netns=netns).rc == 0
    node.assert_on_host(nic)


def test_module_with_two_nics_serves_two_attachments(node):
    nics = node.add_module(PCI, nics=2)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI})
    a = node.run("ADD", conf, netns=netns, ifname="net1")
    b = node.run("ADD", conf, netns=netns, ifname="net2")
    assert a.rc == 0 and b.rc == 0, (a, b)
    inside = node.links(netns)
    assert {inside["net1"]["ifalias"], inside["net2"]["ifalias"]} == set(nics)
    c = node.run("ADD", conf, netns=netns, ifname="net3")
    assert_error = json.loads(c.stdout)
    assert c.rc != 0 and assert_error["code"] == errors.NO_INTERFACE
    assert node.run("DEL", conf, netns=netns, ifname="net1").rc == 0
    assert node.run("DEL", conf, netns=netns, ifname="net2").rc == 0
    for nic in nics:
        node.assert_on_host(nic)


def test_status_and_gc(node):
    nics = node.add_module(PCI, nics=2)
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.host_local_ipam())
    status = node.run("STATUS", conf)
    assert status.rc == 0, status
    keep, stale = node.container(), node.container()
    assert node.run("ADD", conf, netns=keep, cid="keep").rc == 0
    added = node.run("ADD", conf, netns=stale, cid="stale")
    assert added.rc == 0, added
    stale_ip = added.json["ips"][0]["address"].split("/")[0]

    gc = node.run(
        "GC", dict(conf, **{"cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "net1"}]})
    )
    assert gc.rc == 0, gc
    records = os.listdir(node.data / "attachments" / "nr1net")
    assert records == ["keep_net1.json"]
    assert "net1" not in node.links(stale) and "net1" in node.links(keep)
    assert stale_ip not in os.listdir(node.ipam_data / "nr1net")
    on_host = [n for n in nics if n in node.links()]
    assert len(on_host) == 1
    node.assert_on_host(on_host[0])
    assert node.run("DEL", conf, netns=keep, cid="keep").rc == 0


def test_status_not_ready_without_the_ipam_plugin(node):
    conf = node.conf(ipam={"type": "no-such-ipam"})
    res = node.run("STATUS", conf)
    from tests.cni.conftest import assert_error

    assert_error(res, errors.NOT_READY)


def test_del_when_the_container_has_an_interface_with_the_host_name(node):
    """The NIC's host name is taken inside the container: DEL renames it in a temporary namespace instead
    (the direct rename would collide) and leaves the container's own interface alone."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI})
    assert node.run("ADD", conf, netns=netns).rc == 0
    os.system(f"ip -n {node.ns_name(netns)} link add {nic} type veth peer name other0")
    res = node.run("DEL", conf, netns=netns)
    assert res.rc == 0, res
    node.assert_on_host(nic)
    inside = node.links(netns)
    assert nic in inside and "net1" not in inside  # the container's namesake is untouched


def test_del_fails_cleanly_when_the_host_took_the_name_and_succeeds_later(node):
    """Something on the host took the NIC's name while the pod ran: DEL reports the clash and leaves the NIC
    in the pod as it was (name, alias), so the runtime's retry succeeds once the name is free."""
    (nic,) = node.add_module(PCI)
    netns = node.container()
    conf = node.conf(runtimeConfig={"deviceID": PCI})
    assert node.run("ADD", conf, netns=netns).rc == 0
    os.system(f"ip -n {node.host} link add {nic} type veth peer name squat0")
    first = node.run("DEL", conf, netns=netns)
    assert first.rc != 0 and json.loads(first.stdout)["code"] == errors.NETLINK, first
    inside = node.links(netns)
    assert inside["net1"]["ifalias"] == nic
    os.system(f"ip -n {node.host} link del {nic}")
    retry = node.run("DEL", conf, netns=netns)
    assert retry.rc == 0, retry
    node.assert_on_host(nic)


def test_dual_stack_static_addresses_and_routes(node):
    node.add_module(PCI)
    netns = node.container()
    ipam = {
        "type": "static",
        "addresses": [{"address": "10.77.0.5/24", "gateway": "10.77.0.1"}, {"address": "fd00:77::5/64"}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.77.0.1"}, {"dst": "fd00:78::/64", "gw": "fd00:77::1"}],
    }
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=ipam)
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    assert sorted(node.addresses(netns, "net1")) == sorted(
        ["10.77.0.5/24", "fd00:77::5/64"] + [a for a in node.addresses(netns, "net1") if a.startswith("fe80")]
    )
    assert any(r["dst"] == "default" and r.get("gateway") == "10.77.0.1" for r in node.routes(netns))
    assert any(
        r["dst"] == "fd00:78::/64" and r.get("gateway") == "fd00:77::1" for r in node.routes(netns, "-6")
    )
    assert node.run("CHECK", dict(conf, prevResult=res.json), netns=netns).rc == 0
    assert node.run("DEL", conf, netns=netns).rc == 0


@pytest.mark.parametrize("damage", ["down", "gone", "mac", "route"])
def test_check_notices_drift(node, damage):
    node.add_module(PCI)
    netns = node.container()
    ns = node.ns_name(netns)
    conf = node.conf(runtimeConfig={"deviceID": PCI}, ipam=node.static_ipam(routes=[{"dst": "10.60.0.0/16"}]))
    res = node.run("ADD", conf, netns=netns)
    assert res.rc == 0, res
    prev = res.json
    if damage == "down":
        os.system(f"ip -n {ns} link set net1 down")
    elif damage == "gone":
        os.system(f"ip -n {ns} link set net1 name other1")
    elif damage == "mac":
        prev["interfaces"][0]["mac"] = "02:00:00:00:00:99"
    else:
        os.system(f"ip -n {ns} route del 10.60.0.0/16")
    err = node.run("CHECK", dict(conf, prevResult=prev), netns=netns)
    assert err.rc != 0 and json.loads(err.stdout)["code"] == errors.CHECK_FAILED, err
    if damage == "gone":
        os.system(f"ip -n {ns} link set other1 name net1")
    assert node.run("DEL", conf, netns=netns).rc == 0
