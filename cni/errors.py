"""CNI error codes (spec 1.1.0, "Error") and the plugin's own (100 and up)."""

from __future__ import annotations

# the spec's well-known codes (0-99 are reserved for it)
INCOMPATIBLE_VERSION = 1
UNSUPPORTED_FIELD = 2
CONTAINER_UNKNOWN = 3
INVALID_ENV = 4
IO_FAILURE = 5
DECODE_FAILURE = 6
INVALID_CONFIG = 7
TRY_AGAIN = 11
NOT_READY = 50  # STATUS: the plugin cannot serve ADD now
NOT_READY_DEGRADED = 51

# the plugin's own
INTERNAL = 100  # an unexpected failure inside the plugin (a bug): the message says where
NO_DEVICE = 101  # no NR1 module allocated to the pod, or the module is not on this host
NO_INTERFACE = 102  # the module has no network interface left on the host
NETLINK = 103  # the kernel refused a link, address or route change
IFNAME_EXISTS = 104  # CNI_IFNAME already exists in the container's namespace
IPAM = 105  # the IPAM delegate failed or returned something unusable
POD_RESOURCES = 106  # the kubelet's pod-resources API answered with an error
INJECTED = 107  # a failure asked for through ACCELSTACK_NR1_CNI_FAIL_AT (tests, drills)
CHECK_FAILED = 108  # CHECK found the attachment different from the ADD result
LOCK_TIMEOUT = 109  # another ADD/DEL held the module's lock too long


class CNIError(Exception):
    """A failure reported to the runtime as the spec's error JSON."""

    def __init__(self, code: int, msg: str, details: str = ""):
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details

    def to_json(self, cni_version: str) -> dict[str, object]:
        out: dict[str, object] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out
