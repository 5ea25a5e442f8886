"""The kube-scheduler extender wire format (k8s.io/kube-scheduler/extender/v1), decoded with msgspec.

The Go types carry no JSON tags, so the keys are the Go field names (``Pod``, ``NodeNames``, ``FailedNodes``,
``Host``, ``Score``, ``PodUID``, ``NodeNameToMetaVictims``, ...); unused fields arrive as ``null``. Pods and
nodes are decoded into lean structs holding only what the extender reads; unknown fields are ignored. With
``nodeCacheCapable: false`` the scheduler sends whole ``Nodes`` and expects the passing node objects back, so
node items are kept raw and echoed unchanged.

The decoders answer JSON nested deeper than msgspec can follow (it skips unknown fields recursively) with a
``msgspec.DecodeError``, like any other malformed body, instead of a ``RecursionError``.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


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
    restartPolicy: str | None = None  # "Always" on an init container: a native sidecar, counted with the app


class PodSpec(msgspec.Struct, omit_defaults=True):
    containers: list[Container] = []
    initContainers: list[Container] | None = None
    priority: int | None = None
    nodeName: str = ""
    # kept raw (any JSON value), read only for a pod of a GPR: is it pinned to one node?
    affinity: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))


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


class Decoder(Generic[T]):
    """A typed msgspec JSON decoder whose only errors are ``msgspec.DecodeError`` and ``ValidationError``."""

    def __init__(self, type_: type[T]) -> None:
        self._decoder: Any = msgspec.json.Decoder(type_)

    def decode(self, body: bytes | str | msgspec.Raw) -> T:
        try:
            return self._decoder.decode(body)  # type: ignore[no-any-return]
        except RecursionError:
            raise msgspec.DecodeError("JSON nested too deeply to decode") from None


encoder = msgspec.json.Encoder()
filter_args = Decoder(ExtenderArgs)
binding_args = Decoder(ExtenderBindingArgs)
preemption_args = Decoder(ExtenderPreemptionArgs)
node_item = Decoder(NodeItem)
