"""The device plugin's versioned configuration: a YAML (or JSON) file, environment variables and flags.

Precedence is flag > environment > file > default, as in the upstream NVIDIA plugin. Every value is validated
and an error names the offending key (``nvidia.sharing.replicas: must be an integer >= 1, got 0``). Unknown
keys are errors too: a key in the wrong place (upstream issue #1433, ``renameByDefault`` under ``flags``) must
not be silently ignored.

The single table ``OPTIONS`` declares each setting once: its dotted key in the file, its flag, its environment
variable, its type and its default. Parsing, ``--help`` and validation all read it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from service.flags import Parser

CONFIG_VERSION = "v1"
ENV_PREFIX = "ACCELSTACK_DP_"

# Upstream's ignored XIDs: application errors after which the GPU itself is fine
# (13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
#  45 preemptive cleanup, 68 video processor exception, 109 context switch timeout).
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range; the message names the key."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_COMPOUND = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|h|m|s))+")  # Go's form: 1m30s, 1h5m, 2s500ms
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _seconds(number: str, unit: str | None) -> float:
    # milliseconds divided, not multiplied by 0.001: '3ms' is the float nearest 0.003, which format_duration
    # then writes back as '3ms'
    return float(number) / 1000 if unit == "ms" else float(number) * _UNITS[unit]


def parse_duration(value: Any) -> float:
    """'30s', '5m', '1h', '250ms', Go's compound form ('1m30s', '1h5m') or a bare number of seconds -> seconds
    (float, >= 0)."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value)
        match = _DURATION.match(text)
        if match:
            seconds = _seconds(match.group(1), match.group(2))
        elif _COMPOUND.fullmatch(text.strip()):
            seconds = sum(_seconds(n, u) for n, u in _PART.findall(text))
        else:
            raise ValueError(f"not a duration (use e.g. 250ms, 30s, 5m, 1h, 1m30s): {value!r}")
    if seconds < 0:
        raise ValueError(f"must not be negative: {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """A duration as the docs write it and :func:`parse_duration` reads it back to the very same float: '5s',
    '500ms', '1m30s', '1h', '0s'; '<seconds>s' in plain decimals where no such form reads back exactly."""
    plain = f"{Decimal(repr(float(seconds))):f}".rstrip("0").rstrip(".") + "s" if seconds else "0s"
    millis = round(seconds * 1000)
    if not seconds or not math.isfinite(seconds) or seconds < 0 or abs(seconds * 1000 - millis) > 1e-6:
        return plain
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, ms = divmod(rest, 1000)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    if ms and not (hours or minutes or whole):
        parts.append(f"{ms}ms")
    elif ms:
        parts.append(f"{whole}.{ms:03d}".rstrip("0") + "s")
    elif whole:
        parts.append(f"{whole}s")
    text = "".join(parts)  # "" for under half a microsecond
    return text if text and parse_duration(text) == seconds else plain


def shown(option: Option, value: Any) -> Any:
    """A setting's value as ``--print-config`` and ``--help`` show it: durations as written in the docs."""
    return format_duration(value) if option.parse is parse_duration else value


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean (true/false): {value!r}")


def parse_int(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}") from None
        if number < minimum or (maximum is not None and number > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise ValueError(f"must be an integer {bound}, got {number}")
        return number

    return parse


def parse_list(item: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    """A YAML list, or a comma-separated string (flags and env)."""

    def parse(value: Any) -> list[Any]:
        if isinstance(value, str):
            parts: Sequence[Any] = [p for p in (s.strip() for s in value.split(",")) if p]
        elif isinstance(value, list | tuple):
            parts = value
        else:
            raise ValueError(f"must be a list or a comma-separated string, got {value!r}")
        out = []
        for part in parts:
            try:
                out.append(item(part))
            except ValueError as exc:
                raise ValueError(f"item {part!r}: {exc}") from None
        return out

    return parse


def parse_choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value)
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return text

    return parse


def parse_resource_name(value: Any) -> str:
    text = str(value)
    if not _RESOURCE_NAME.match(text) or len(text) > 253:
        raise ValueError(f"not an extended resource name like vendor.com/device: {value!r}")
    return text


def parse_hex_id(value: Any) -> str:
    from device_plugin.nr1_sysfs import normalize_hex_id

    return normalize_hex_id(str(value))


def parse_str(value: Any) -> str:
    if isinstance(value, dict | list):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    return str(value)


def parse_address(value: Any) -> str:
    """'host:port' or ':port' for a listener; empty string disables it."""
    text = str(value).strip()
    if not text:
        return ""
    _host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"must be host:port or :port, got {value!r}")
    return text


def parse_argv(value: Any) -> list[str]:
    """A probe command: a YAML list of arguments, or one string split on whitespace."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"must be a list of strings or a command line, got {value!r}")


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


@dataclass(frozen=True)
class Option:
    key: str  # dotted path in the file, e.g. "nvidia.sharing.replicas"
    parse: Callable[[Any], Any]
    default: Any
    help: str
    flag: str = ""  # derived from the key when empty
    env: str = ""  # derived from the key when empty
    env_prefix: str = ENV_PREFIX

    def _words(self) -> list[str]:
        """'nr1.vendorIDs' -> ['nr1', 'vendor', 'IDs']; the 'flags.' section adds no word."""
        key = self.key.removeprefix("flags.").replace("IDs", "Ids")
        return [w for part in key.split(".") for w in _CAMEL.sub(" ", part).split()]

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + "-".join(self._words()).lower()

    @property
    def env_name(self) -> str:
        return self.env or self.env_prefix + "_".join(self._words()).upper()


OPTIONS: tuple[Option, ...] = (
    # process-wide
    Option("flags.devicePluginPath", parse_str, "/var/lib/kubelet/device-plugins/",
           "kubelet device-plugin directory (holds kubelet.sock and the plugins' sockets)"),
    Option("flags.sysfsRoot", parse_str, "/sys",
           "root of sysfs (NUMA nodes, NR1 PCI functions); must exist, and hold bus/pci/devices when nr1.enabled"),
    Option("flags.devRoot", parse_str, "/dev", "root of the host's device nodes as the plugin sees them"),
    Option("flags.failOnInitError", parse_bool, True,
           "exit when a backend cannot start (no NVML, no driver); false: advertise zero devices with a warning"),
    Option("flags.metricsAddress", parse_address, ":9401",
           "listen address of /metrics, /healthz and /readyz; empty disables"),
    Option("flags.logLevel", parse_choice("debug", "info", "warning", "error"), "info", "log level"),
    Option("flags.logFormat", parse_choice("json", "text"), "json", "log format"),
    Option("flags.registerRetry", parse_duration, 5.0,
           "wait between registration attempts at a kubelet.sock that does not answer (a new kubelet.sock is tried "
           "at once)"),
    # NVIDIA backend
    Option("nvidia.enabled", parse_bool, True, "advertise NVIDIA GPUs (NVML through pynvml)"),
    Option("nvidia.resourceName", parse_resource_name, "nvidia.com/gpu", "extended resource for GPUs"),
    Option("nvidia.deviceListStrategy", parse_list(parse_choice("envvar", "cdi-cri")), ["envvar"],
           "how Allocate hands GPUs over: envvar (NVIDIA_VISIBLE_DEVICES) and/or cdi-cri (CDI device names)"),
    Option("nvidia.deviceIDStrategy", parse_choice("uuid", "index"), "uuid",
           "identify GPUs in NVIDIA_VISIBLE_DEVICES by uuid or by index"),
    Option("nvidia.passDeviceSpecs", parse_bool, False,
           "also return /dev/nvidia* device specs from Allocate (CPU-manager compatibility)"),
    Option("nvidia.cdiKind", parse_str, "nvidia.com/gpu", "CDI kind used for cdi-cri device names (<kind>=<uuid>)"),
    Option("nvidia.health.enabled", parse_bool, True, "watch NVML events (XID, double-bit ECC) for device health"),
    Option("nvidia.health.ignoredXids", parse_list(parse_int(0)), list(DEFAULT_IGNORED_XIDS),
           "XIDs that are application errors and leave the GPU healthy"),
    Option("nvidia.health.recoveryPeriod", parse_duration, 300.0,
           "quiet time after the last critical event before an unhealthy GPU is re-checked and may return; 0 never"),
    Option("nvidia.health.recheckInterval", parse_duration, 30.0, "how often unhealthy GPUs are re-checked"),
    Option("nvidia.sharing.replicas", parse_int(1, 64), 1,
           "time-slicing: advertise each GPU this many times as <uuid>::<k> (1 = no sharing)"),
    Option("nvidia.sharing.allocationPolicy", parse_choice("distributed", "packed"), "distributed",
           "which replicas the preferred allocation picks: spread over GPUs or pack onto few"),
    Option("nvidia.sharing.failRequestsGreaterThanOne", parse_bool, False,
           "refuse Allocate of more than one replica per container when sharing"),
    # NR1 backend
    Option("nr1.enabled", parse_bool, False, "advertise NeuReality NR1 modules (PCI functions in sysfs)"),
    Option("nr1.resourceName", parse_resource_name, "neureality.com/nr1", "extended resource for NR1 modules"),
    Option("nr1.vendorIDs", parse_list(parse_hex_id), [],
           "PCI vendor IDs of NR1 modules (as `lspci -nn` shows them); required when nr1.enabled"),
    Option("nr1.deviceIDs", parse_list(parse_hex_id), [], "PCI device IDs of NR1 modules; empty = any"),
    Option("nr1.devPattern", parse_str, "/dev/nr1_{index}*",
           "device nodes of a module; {index} and {pci} are substituted, then globbed"),
    Option("nr1.healthAttribute", parse_str, "",
           "sysfs attribute of the PCI function read for health (empty = presence only)"),
    Option("nr1.healthyValues", parse_list(parse_str), ["1", "ok", "healthy", "up"],
           "values of the health attribute that mean healthy (case-insensitive)"),
    Option("nr1.probeCommand", parse_argv, [],
           "command run per module for health ({pci} substituted); exit 0 = healthy"),
    Option("nr1.probeTimeout", parse_duration, 5.0, "probe command timeout"),
    Option("nr1.healthInterval", parse_duration, 10.0, "how often NR1 health is polled"),
    # the kubelet's view of assigned devices (handover.py)
    Option("podResources.socket", parse_str, "/var/lib/kubelet/pod-resources/kubelet.sock",
           "kubelet pod-resources API socket: which device IDs pods hold, published as the Node annotation "
           "accelstack.io/pod-resources; empty disables (no annotation, no handover guard)"),
    Option("podResources.interval", parse_duration, 30.0,
           "how often the pod-resources API is read (also at each registration and after each Allocate)"),
    # feature discovery
    Option("labeller.enabled", parse_bool, True, "publish node labels for what the node has"),
    Option("labeller.nodeName", parse_str, "", "this node's name (default: env NODE_NAME)"),
    Option("labeller.interval", parse_duration, 60.0, "how often labels are recomputed and reconciled"),
)

@dataclass(frozen=True)
class Config:
    values: Mapping[str, Any]
    sources: Mapping[str, str]  # key -> "flag" | "env" | "file" | "default"

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def section(self, prefix: str) -> dict[str, Any]:
        """Settings under a prefix with the prefix removed: section('nvidia.health') -> {'enabled': ...}."""
        dot = prefix + "."
        return {k[len(dot):]: v for k, v in self.values.items() if k.startswith(dot)}


class Schema:
    """One process's versioned configuration: its options table and environment prefix. Reads the file, adds
    the flags to a parser and resolves flag > env > file > default into a validated :class:`Config`. The device
    plugin and the node-health processes each declare an ``OPTIONS`` table and use this one machinery."""

    def __init__(self, options: Sequence[Option], env_prefix: str) -> None:
        self.options = tuple(options)
        self.env_prefix = env_prefix
        self.by_key = {o.key: o for o in self.options}
        self.sections = sorted({o.key.split(".", 1)[0] for o in self.options})

    def _flatten(self, tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            if not isinstance(key, str):
                raise ConfigError(f"{prefix}{key!r}: keys must be strings")
            path = f"{prefix}{key}"
            if isinstance(value, Mapping) and path not in self.by_key and value:
                flat.update(self._flatten(value, path + "."))
            elif isinstance(value, Mapping) and not value and any(k.startswith(path + ".") for k in self.by_key):
                continue  # an empty known section, e.g. "nr1: {}"
            else:
                flat[path] = value
        return flat

    def load_file(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and structurally check a config file; returns dotted key -> raw value."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
        try:
            tree = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ConfigError(f"config file {path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
        if tree is None:
            tree = {}
        if not isinstance(tree, Mapping):
            raise ConfigError(f"config file {path}: the top level must be a mapping, got {type(tree).__name__}")
        version = tree.get("version")
        if version != CONFIG_VERSION:
            raise ConfigError(f"version: must be {CONFIG_VERSION!r}, got {version!r} (in {path})")
        flat = self._flatten({k: v for k, v in tree.items() if k != "version"})
        for key in flat:
            if key not in self.by_key:
                section = key.split(".", 1)[0]
                hint = "" if section in self.sections else f" (top-level sections: {', '.join(self.sections)})"
                raise ConfigError(f"{key}: unknown key{hint} (in {path})")
        return flat

    def add_arguments(self, parser: argparse.ArgumentParser, options: Sequence[Option] | None = None) -> None:
        """``--config-file``, ``--print-config`` and a flag per option (``options``: the ones this process reads;
        default all). A setting without a flag here still comes from its variable or the file, which may hold
        every process's sections."""
        parser.add_argument("--config-file", default=None, help=f"versioned YAML/JSON config file (version: "
                            f"{CONFIG_VERSION}); env {self.env_prefix}CONFIG_FILE")
        parser.add_argument("--print-config", action="store_true",
                            help="print the effective configuration (after flags, env and file) and exit")
        for option in self.options if options is None else options:
            parser.add_argument(option.flag_name, dest=option.key, default=None, metavar="VALUE",
                                help=f"{option.help} [env {option.env_name}; file {option.key}; "
                                     f"default {shown(option, option.default)!r}]")

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
        """Each setting from its flag, else its variable, else the file, else the default; parsed and checked."""
        config_file = args.config_file or environ.get(self.env_prefix + "CONFIG_FILE") or None
        file_values = self.load_file(config_file) if config_file else {}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for option in self.options:
            raw, source = option.default, "default"
            if option.key in file_values:
                raw, source = file_values[option.key], "file"
            if option.env_name in environ:
                raw, source = environ[option.env_name], "env"
            flag_value = getattr(args, option.key, None)  # None too where the process has no such flag
            if flag_value is not None:
                raw, source = flag_value, "flag"
            where = {"flag": f" (flag {option.flag_name})", "env": f" (env {option.env_name})",
                     "file": f" (in {config_file})", "default": ""}[source]
            try:
                values[option.key] = option.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{option.key}: {exc}{where}") from None
            sources[option.key] = source
        return Config(values, sources)

    def print_tree(self, config: Config, keys: Collection[str] | None = None) -> str:
        """The effective configuration as a versioned YAML file (``keys``: only these settings)."""
        tree: dict[str, Any] = {"version": CONFIG_VERSION}
        for key, value in config.values.items():
            if keys is not None and key not in keys:
                continue
            node = tree
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = shown(self.by_key[key], value)
        return yaml.safe_dump(tree, sort_keys=False)


SCHEMA = Schema(OPTIONS, ENV_PREFIX)


def build_parser(prog: str = "accelstack-device-plugin") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description=(
            "Advertise NVIDIA GPUs and NeuReality NR1 modules to the kubelet (device-plugin API v1beta1), with "
            "live health, NUMA topology, preferred allocation and re-registration when the kubelet restarts. "
            "Every setting is a flag, an environment variable and a key of the versioned config file; "
            "precedence: flag > environment > file > default."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    SCHEMA.add_arguments(parser)
    return parser


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[Config, argparse.Namespace]:
    """Parse flags, environment and file into a validated Config. Raises ConfigError (SystemExit for --help)."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    config = SCHEMA.resolve(args, environ)
    values = dict(config.values)
    if values["nr1.enabled"] and not values["nr1.vendorIDs"]:
        raise ConfigError("nr1.vendorIDs: required when nr1.enabled is true (PCI vendor IDs, see `lspci -nn`)")
    if not values["nvidia.enabled"] and not values["nr1.enabled"]:
        raise ConfigError("nvidia.enabled, nr1.enabled: at least one backend must be enabled")
    if not values["nvidia.deviceListStrategy"]:
        raise ConfigError("nvidia.deviceListStrategy: must name at least one strategy")
    if values["nvidia.resourceName"] == values["nr1.resourceName"]:
        raise ConfigError("nr1.resourceName: must differ from nvidia.resourceName")
    if values["podResources.interval"] <= 0:
        raise ConfigError(f"podResources.interval: must be more than 0s, got {values['podResources.interval']}s")
    if not values["labeller.nodeName"]:
        values["labeller.nodeName"] = environ.get("NODE_NAME", "")
    return Config(values, config.sources), args
