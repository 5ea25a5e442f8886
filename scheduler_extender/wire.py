"""The kube-scheduler extender wire format (k8s.io/kube-scheduler/extender/v1), decoded with msgspec.

The Go types carry no JSON tags, so the keys are the Go field names (``Pod``, ``NodeNames``, ``FailedNodes``,
``Host``, ``Score``, ``PodUID``, ``NodeNameToMetaVictims``, ...); unused fields arrive as ``null``. Pods and
nodes are decoded into lean structs holding only what the extender reads; unknown fields are ignored. With
``nodeCacheCapable: false`` the scheduler sends whole ``Nodes`` and expects the passing node objects back, so
node items are kept raw and echoed unchanged.
"""

from __future__ import annotations

import msgspec


class ObjectMeta(msgspec.Struct, omit_defaults=True):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class ResourceRequirements(msgspec.Struct, omit_defaults=True):
    requests: dict[str, str | int | float] | None = None
    limits: dict[str, str | int | float] | None = None


class Container(msgspec.Struct, omit_defaults=True):
    name: str = ""
    resources: ResourceRequirements | None = None


class PodSpec(msgspec.Struct, omit_defaults=True):
    containers: list[Container] = []
    initContainers: list[Container] | None = None
    priority: int | None = None
    nodeName: str = ""


class Pod(msgspec.Struct, omit_defaults=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)


class NodeItem(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)


class NodeList(msgspec.Struct):
    items: list[msgspec.Raw] | None = None
    metadata: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))


class ExtenderArgs(msgspec.Struct):
    Pod: Pod | None = None
    Nodes: NodeList | None = None
    NodeNames: list[str] | None = None


class ExtenderFilterResult(msgspec.Struct):
    NodeNames: list[str] | None = None
    Nodes: NodeList | None = None
    FailedNodes: dict[str, str] = {}
    FailedAndUnresolvableNodes: dict[str, str] = {}
    Error: str = ""


class HostPriority(msgspec.Struct):
    Host: str
    Score: int


class ExtenderBindingArgs(msgspec.Struct):
    PodName: str
    PodNamespace: str
    PodUID: str
    Node: str


class ExtenderBindingResult(msgspec.Struct):
    Error: str = ""


class MetaPod(msgspec.Struct):
    UID: str


class MetaVictims(msgspec.Struct):
    Pods: list[MetaPod] = []
    NumPDBViolations: int = 0


class Victims(msgspec.Struct):
    Pods: list[Pod] = []
    NumPDBViolations: int = 0


class ExtenderPreemptionArgs(msgspec.Struct):
    Pod: Pod | None = None
    NodeNameToVictims: dict[str, Victims] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims] | None = None


class ExtenderPreemptionResult(msgspec.Struct):
    NodeNameToMetaVictims: dict[str, MetaVictims] = {}


encoder = msgspec.json.Encoder()
filter_args = msgspec.json.Decoder(ExtenderArgs)
binding_args = msgspec.json.Decoder(ExtenderBindingArgs)
preemption_args = msgspec.json.Decoder(ExtenderPreemptionArgs)
node_item = msgspec.json.Decoder(NodeItem)
