"""Finding the pod's module through the kubelet's pod-resources API (a real gRPC peer on a unix socket)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from cni import errors
from tests.cni.conftest import RESOURCE, assert_error
from tests.podresources_peer import PodResourcesPeer

pytestmark = pytest.mark.root

PCI_A, PCI_B = "0000:3b:00.0", "0000:5e:00.0"
POD_ARGS = "IgnoreUnknown=1;K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=infer-0;K8S_POD_INFRA_CONTAINER_ID=c0ffee"


@pytest.fixture
def kubelet_socket():
    short = Path(tempfile.mkdtemp(prefix="acn-pr-"))  # unix socket paths must stay under 108 bytes
    try:
        yield str(short / "kubelet.sock")
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("get_mode", ["ok", "unimplemented", "disabled"])
def test_module_found_through_pod_resources(node, kubelet_socket, get_mode):
    (nic_a,) = node.add_module(PCI_A)
    (nic_b,) = node.add_module(PCI_B)
    netns = node.container()
    conf = node.conf(podResourcesSocket=kubelet_socket, ipam=node.static_ipam())
    with PodResourcesPeer(kubelet_socket, get_mode=get_mode) as peer:
        peer.set_pod("team-a", "infer-0", {RESOURCE: [PCI_B], "nvidia.com/gpu": ["GPU-1"]})
        peer.set_pod("team-b", "other-0", {RESOURCE: [PCI_A]})
        res = node.run("ADD", conf, netns=netns, args=POD_ARGS)
        assert res.rc == 0, res
        assert peer.calls == (["Get"] if get_mode == "ok" else ["Get", "List"])
    assert res.json["interfaces"][0]["pciID"] == PCI_B
    assert node.links(netns)["net1"]["ifalias"] == nic_b
    assert nic_a in node.links()
    assert node.run("DEL", conf, netns=netns, args=POD_ARGS).rc == 0  # DEL works from its record
    node.assert_on_host(nic_b)


def test_two_modules_two_attachments(node, kubelet_socket):
    nics = node.add_module(PCI_A) + node.add_module(PCI_B)
    netns = node.container()
    conf = node.conf(podResourcesSocket=kubelet_socket)
    with PodResourcesPeer(kubelet_socket) as peer:
        peer.set_pod("team-a", "infer-0", {RESOURCE: [PCI_B, PCI_A]}, container="main")
        first = node.run("ADD", conf, netns=netns, args=POD_ARGS, ifname="net1")
        second = node.run("ADD", conf, netns=netns, args=POD_ARGS, ifname="net2")
    assert first.rc == 0 and second.rc == 0, (first, second)
    assert first.json["interfaces"][0]["pciID"] == PCI_A  # in PCI order
    assert second.json["interfaces"][0]["pciID"] == PCI_B
    inside = node.links(netns)
    assert [inside["net1"]["ifalias"], inside["net2"]["ifalias"]] == nics
    for ifname in ("net1", "net2"):
        assert node.run("DEL", conf, netns=netns, ifname=ifname).rc == 0
    for nic in nics:
        node.assert_on_host(nic)


def test_pod_without_a_module(node, kubelet_socket):
    (nic,) = node.add_module(PCI_A)
    with PodResourcesPeer(kubelet_socket) as peer:
        peer.set_pod("team-a", "infer-0", {"nvidia.com/gpu": ["GPU-1"]})
        res = node.run(
            "ADD", node.conf(podResourcesSocket=kubelet_socket), netns=node.container(), args=POD_ARGS
        )
    err = assert_error(res, errors.NO_DEVICE)
    assert RESOURCE in err["msg"]
    assert nic in node.links()


def test_pod_unknown_to_the_kubelet(node, kubelet_socket):
    node.add_module(PCI_A)
    with PodResourcesPeer(kubelet_socket) as peer:
        res = node.run(
            "ADD", node.conf(podResourcesSocket=kubelet_socket), netns=node.container(), args=POD_ARGS
        )
        assert peer.calls == ["Get", "List"]
    assert_error(res, errors.NO_DEVICE)


def test_custom_resource_name(node, kubelet_socket):
    node.add_module(PCI_A)
    netns = node.container()
    conf = node.conf(podResourcesSocket=kubelet_socket, resourceName="example.com/nr1-lab")
    with PodResourcesPeer(kubelet_socket) as peer:
        peer.set_pod("team-a", "infer-0", {"example.com/nr1-lab": [PCI_A]})
        res = node.run("ADD", conf, netns=netns, args=POD_ARGS)
    assert res.rc == 0, res
    assert node.run("DEL", conf, netns=netns).rc == 0


def test_kubelet_not_listening_is_try_again(node, kubelet_socket):
    (nic,) = node.add_module(PCI_A)
    conf = node.conf(podResourcesSocket=kubelet_socket, podResourcesTimeout=2)
    res = node.run("ADD", conf, netns=node.container(), args=POD_ARGS)
    assert_error(res, errors.TRY_AGAIN)
    assert nic in node.links()


def test_kubelet_too_slow_is_try_again(node, kubelet_socket):
    node.add_module(PCI_A)
    conf = node.conf(podResourcesSocket=kubelet_socket, podResourcesTimeout=0.3)
    with PodResourcesPeer(kubelet_socket, delay=1.0) as peer:
        peer.set_pod("team-a", "infer-0", {RESOURCE: [PCI_A]})
        res = node.run("ADD", conf, netns=node.container(), args=POD_ARGS)
    assert_error(res, errors.TRY_AGAIN)


def test_device_id_wins_over_pod_resources(node, kubelet_socket):
    """With Multus' runtimeConfig.deviceID the kubelet is not asked at all."""
    node.add_module(PCI_A)
    netns = node.container()
    conf = node.conf(podResourcesSocket=kubelet_socket, runtimeConfig={"deviceID": PCI_A.upper()})
    with PodResourcesPeer(kubelet_socket) as peer:
        res = node.run("ADD", conf, netns=netns, args=POD_ARGS)
        assert peer.calls == []
    assert res.rc == 0, res
    assert res.json["interfaces"][0]["pciID"] == PCI_A
    assert node.run("DEL", conf, netns=netns).rc == 0
