"""The plugin's inputs: CNI_* environment and the network configuration on stdin, checked before any work."""

from __future__ import annotations

from cni import fastjson as json
from cni.errors import DECODE_FAILURE, INCOMPATIBLE_VERSION, INVALID_CONFIG, INVALID_ENV, CNIError

SUPPORTED_VERSIONS = ("1.0.0", "1.1.0")
LATEST = "1.1.0"
COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC")

DEFAULT_RESOURCE = "neureality.com/nr1"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_SYSFS = "/sys"
DEFAULT_DATA_DIR = "/var/lib/cni/accelstack-nr1"
FAIL_AT_ENV = "ACCELSTACK_NR1_CNI_FAIL_AT"

_ID_FIRST = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_ID_REST = _ID_FIRST + "_.-"
_HEX = "0123456789abcdefABCDEF"


def valid_identifier(text: str) -> bool:
    """The spec's rule for network names and container IDs: ``^[a-zA-Z0-9][a-zA-Z0-9_.\\-]*$``."""
    return bool(text) and text[0] in _ID_FIRST and all(c in _ID_REST for c in text)


def valid_ifname(text: str) -> bool:
    """What the kernel accepts as an interface name (dev_valid_name)."""
    return 0 < len(text) < 16 and text not in (".", "..") and not any(c in "/:" or c.isspace() for c in text)


def valid_pci_address(text: str) -> bool:
    """``DDDD:BB:DD.F`` (domain, bus, device, function in hex), the form sysfs and Multus use."""
    parts = text.split(":")
    if len(parts) != 3 or len(parts[0]) != 4 or len(parts[1]) != 2:
        return False
    dev, _, fn = parts[2].partition(".")
    return (
        len(dev) == 2
        and len(fn) == 1
        and all(c in _HEX for c in parts[0] + parts[1] + dev)
        and fn in "01234567"
    )


class Env:
    """The CNI_* variables of one invocation."""

    def __init__(self, environ: dict[str, str] | None = None):
        import os

        env = os.environ if environ is None else environ
        self.command = env.get("CNI_COMMAND", "")
        self.container_id = env.get("CNI_CONTAINERID", "")
        self.netns = env.get("CNI_NETNS", "")
        self.ifname = env.get("CNI_IFNAME", "")
        self.path = env.get("CNI_PATH", "")
        self.raw_args = env.get("CNI_ARGS", "")
        self.fail_at = env.get(FAIL_AT_ENV, "")
        self.args: dict[str, str] = {}

    def validate_command(self) -> None:
        if not self.command:
            raise CNIError(INVALID_ENV, "CNI_COMMAND is not set")
        if self.command not in COMMANDS:
            raise CNIError(
                INVALID_ENV, f"unknown CNI_COMMAND {self.command!r}", f"expected one of {COMMANDS}"
            )

    def validate(self) -> None:
        """Everything but CNI_COMMAND (checked first, by ``validate_command``)."""
        if self.raw_args:
            for pair in self.raw_args.split(";"):
                if not pair:
                    continue
                key, sep, value = pair.partition("=")
                if not sep or not key:
                    raise CNIError(INVALID_ENV, f"CNI_ARGS: {pair!r} is not KEY=VALUE", self.raw_args)
                self.args[key] = value
        if self.command in ("ADD", "DEL", "CHECK"):
            if not self.container_id:
                raise CNIError(INVALID_ENV, "CNI_CONTAINERID is not set")
            if not valid_identifier(self.container_id):
                raise CNIError(
                    INVALID_ENV, f"CNI_CONTAINERID {self.container_id!r} is not a valid container ID"
                )
            if not self.ifname:
                raise CNIError(INVALID_ENV, "CNI_IFNAME is not set")
            if not valid_ifname(self.ifname):
                raise CNIError(INVALID_ENV, f"CNI_IFNAME {self.ifname!r} is not a valid interface name")
            if self.command != "DEL" and not self.netns:
                raise CNIError(INVALID_ENV, "CNI_NETNS is not set")
            if not self.path:
                raise CNIError(INVALID_ENV, "CNI_PATH is not set")


def _field(conf: dict, key: str, kind: type, default: object = None) -> object:
    value = conf.get(key, default)
    if value is default:
        return value
    if kind is int and isinstance(value, bool):
        raise CNIError(INVALID_CONFIG, f"{key!r} must be a number, not {value!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind):
        raise CNIError(INVALID_CONFIG, f"{key!r} must be a {kind.__name__}, not {type(value).__name__}")
    return value


class NetConf:
    """The plugin's network configuration (one entry of a conflist, with what the runtime injected)."""

    def __init__(self, raw: bytes, command: str):
        self.raw = raw
        try:
            conf = json.loads(raw) if raw.strip() else ({} if command == "VERSION" else None)
        except (ValueError, UnicodeDecodeError) as err:
            raise CNIError(DECODE_FAILURE, "network configuration is not valid JSON", str(err)) from None
        if not isinstance(conf, dict):
            raise CNIError(DECODE_FAILURE, "network configuration must be a JSON object")
        self.conf = conf
        version = conf.get("cniVersion", LATEST if command == "VERSION" else None)
        if not isinstance(version, str) or not version:
            raise CNIError(INVALID_CONFIG, "cniVersion is missing")
        self.cni_version = version
        if command == "VERSION":
            return
        if version not in SUPPORTED_VERSIONS:
            raise CNIError(
                INCOMPATIBLE_VERSION,
                f"incompatible CNI version {version}",
                f"supported: {', '.join(SUPPORTED_VERSIONS)}",
            )
        if command in ("STATUS", "GC") and version != "1.1.0":
            raise CNIError(INCOMPATIBLE_VERSION, f"{command} needs cniVersion 1.1.0, got {version}")
        name = conf.get("name")
        if not isinstance(name, str) or not valid_identifier(name):
            raise CNIError(INVALID_CONFIG, f"network name {name!r} is missing or invalid")
        self.name = name
        if not isinstance(conf.get("type"), str) or not conf["type"]:
            raise CNIError(INVALID_CONFIG, "plugin type is missing")

        ipam = conf.get("ipam")
        if ipam is not None and not isinstance(ipam, dict):
            raise CNIError(INVALID_CONFIG, "'ipam' must be an object")
        if ipam and (not isinstance(ipam.get("type"), str) or not ipam["type"] or "/" in ipam["type"]):
            raise CNIError(INVALID_CONFIG, "ipam.type is missing or invalid")
        self.ipam_type: str = ipam["type"] if ipam else ""

        dns = conf.get("dns")
        if dns is not None and not isinstance(dns, dict):
            raise CNIError(INVALID_CONFIG, "'dns' must be an object")
        self.dns: dict = dns or {}

        self.resource_name = str(_field(conf, "resourceName", str, DEFAULT_RESOURCE))
        self.pod_resources_socket = str(_field(conf, "podResourcesSocket", str, DEFAULT_POD_RESOURCES_SOCKET))
        self.pod_resources_timeout = float(_field(conf, "podResourcesTimeout", float, 5.0))  # type: ignore[arg-type]
        self.sysfs_root = str(_field(conf, "sysfsRoot", str, DEFAULT_SYSFS))
        self.data_dir = str(_field(conf, "dataDir", str, DEFAULT_DATA_DIR))
        self.lock_timeout = float(_field(conf, "lockTimeout", float, 10.0))  # type: ignore[arg-type]
        if self.pod_resources_timeout <= 0 or self.lock_timeout <= 0:
            raise CNIError(INVALID_CONFIG, "podResourcesTimeout and lockTimeout must be positive")
        if not self.data_dir.startswith("/") or not self.sysfs_root.startswith("/"):
            raise CNIError(INVALID_CONFIG, "dataDir and sysfsRoot must be absolute paths")

        runtime = conf.get("runtimeConfig")
        if runtime is not None and not isinstance(runtime, dict):
            raise CNIError(INVALID_CONFIG, "'runtimeConfig' must be an object")
        device = (runtime or {}).get("deviceID") or conf.get("deviceID") or ""
        if device and (not isinstance(device, str) or not valid_pci_address(device)):
            raise CNIError(INVALID_CONFIG, f"deviceID {device!r} is not a PCI address (DDDD:BB:DD.F)")
        self.device_id: str = device.lower() if device else ""

        prev = conf.get("prevResult")
        if prev is not None and not isinstance(prev, dict):
            raise CNIError(INVALID_CONFIG, "'prevResult' must be an object")
        self.prev_result: dict | None = prev

        valid = conf.get("cni.dev/valid-attachments")
        self.valid_attachments: set[tuple[str, str]] | None = None
        if command == "GC":
            if not isinstance(valid, list):
                raise CNIError(INVALID_CONFIG, "GC needs 'cni.dev/valid-attachments' (a list)")
            pairs = set()
            for item in valid:
                if not isinstance(item, dict) or not isinstance(item.get("containerID"), str):
                    raise CNIError(INVALID_CONFIG, f"invalid entry in cni.dev/valid-attachments: {item!r}")
                pairs.add((item["containerID"], str(item.get("ifname", ""))))
            self.valid_attachments = pairs

    def with_version(self, version: str) -> bytes:
        """The configuration as bytes with another cniVersion (for a delegate that speaks an older one)."""
        if version == self.cni_version:
            return self.raw
        return json.dumps(retarget(self.conf, version)).encode()


def retarget(conf: dict, version: str) -> dict:
    """A copy of ``conf`` for a delegate that speaks ``version``: the config's and prevResult's cniVersion
    changed (1.0.0 and 1.1.0 IPAM configs and results have the same shape)."""
    out = dict(conf)
    out["cniVersion"] = version
    prev = out.get("prevResult")
    if isinstance(prev, dict) and "cniVersion" in prev:
        out["prevResult"] = dict(prev, cniVersion=version)
    return out
