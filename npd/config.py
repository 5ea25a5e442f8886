"""Configuration of the node-health processes (NPD checks, exporter, remediation controller).

The same style as the device plugin's (``device_plugin/config.py``, whose value parsers are reused): one
table ``OPTIONS`` declares each setting once (dotted key in the versioned file, flag, environment variable,
parser, default); precedence is flag > environment > file > default; every error names the key, and unknown
keys in the file are errors. Each process reads the whole table and uses its own sections, so one ConfigMap
can serve them all.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_plugin.config import (
    DEFAULT_IGNORED_XIDS,
    ConfigError,
    parse_address,
    parse_argv,
    parse_bool,
    parse_choice,
    parse_duration,
    parse_hex_id,
    parse_int,
    parse_list,
    parse_str,
)

CONFIG_VERSION = "v1"
ENV_PREFIX = "ACCELSTACK_NPD_"

# XIDs that mean the GPU itself needs attention (reset, drain or RMA), as NVIDIA's XID catalogue describes
# them: 48 double-bit ECC, 62/64 internal micro-controller and ECC page-retirement failures, 74 NVLink error,
# 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors.
DEFAULT_CRITICAL_XIDS = (48, 62, 64, 74, 79, 92, 94, 95, 119, 120)


def parse_float(minimum: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError(f"must be a number >= {minimum}, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number >= {minimum}, got {value!r}") from None
        if number < minimum:
            raise ValueError(f"must be a number >= {minimum}, got {number}")
        return number

    return parse


def parse_signed_int(value: Any) -> int:
    """An integer where -1 means 'not set'."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer (-1 = not set), got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be an integer (-1 = not set), got {value!r}") from None
    if number < -1:
        raise ValueError(f"must be an integer >= -1 (-1 = not set), got {number}")
    return number


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


@dataclass(frozen=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    default: Any
    help: str

    def _words(self) -> list[str]:
        key = self.key.replace("IDs", "Ids")
        return [w for part in key.split(".") for w in _CAMEL.sub(" ", part).split()]

    @property
    def flag_name(self) -> str:
        return "--" + "-".join(self._words()).lower()

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + "_".join(self._words()).upper()


OPTIONS: tuple[Option, ...] = (
    # common to every node-health process
    Option("node.name", parse_str, "", "this node's name (default: env NODE_NAME)"),
    Option("node.sysfsRoot", parse_str, "/sys", "root of sysfs (PCI functions, NUMA, network interfaces)"),
    Option("node.apiServer", parse_str, "",
           "API server URL for reading this node's labels; empty = in-cluster (KUBERNETES_SERVICE_HOST), or none"),
    Option("log.level", parse_choice("debug", "info", "warning", "error"), "info", "log level"),
    Option("log.format", parse_choice("json", "text"), "json", "log format"),
    # the NPD plugin runner
    Option("plugin.deadline", parse_duration, 4.0,
           "a check that has not finished by then reports Unknown; keep it under the NPD rule's timeout"),
    Option("plugin.maxOutputLength", parse_int(1), 80,
           "the message is cut to this many bytes (NPD's max_output_length)"),
    Option("plugin.stateDir", parse_str, "/var/lib/accelstack-npd",
           "where checks keep what they saw last run (kernel-log position, recent XIDs); must survive restarts"),
    Option("plugin.labelCacheTime", parse_duration, 300.0, "how long a node label read from the API is reused"),
    # GPU checks
    Option("gpu.expectedCount", parse_signed_int, -1,
           "GPUs this node must show; -1 = from the node label, else the NVIDIA GPUs on the PCI bus"),
    Option("gpu.expectedCountLabel", parse_str, "accelstack.io/gpu.expected-count",
           "node label holding the expected GPU count (empty: do not read labels)"),
    Option("gpu.kmsgPath", parse_str, "/dev/kmsg", "kernel log read for XIDs (NVRM: Xid lines)"),
    Option("gpu.ignoredXids", parse_list(parse_int(0)), list(DEFAULT_IGNORED_XIDS),
           "XIDs that are application errors: never reported"),
    Option("gpu.criticalXids", parse_list(parse_int(0)), list(DEFAULT_CRITICAL_XIDS),
           "XIDs that make the GPU check NonOK (others only in the xid check); empty = every non-ignored XID"),
    Option("gpu.xidHoldTime", parse_duration, 300.0,
           "a critical XID keeps the check NonOK this long after it was logged"),
    Option("gpu.maxTemperature", parse_float(0), 0.0,
           "°C over which a GPU is too hot; 0 = the GPU's own slowdown threshold minus gpu.temperatureMargin"),
    Option("gpu.temperatureMargin", parse_float(0), 5.0, "°C below the slowdown threshold (maxTemperature 0)"),
    Option("gpu.maxPowerRatio", parse_float(0), 1.05,
           "power draw over this fraction of the enforced power limit is reported"),
    Option("gpu.maxUncorrectedEcc", parse_int(0), 0,
           "volatile uncorrected ECC errors tolerated since the driver loaded"),
    # NR1 checks
    Option("nr1.vendorIDs", parse_list(parse_hex_id), [], "PCI vendor IDs of NR1 modules (required for NR1)"),
    Option("nr1.deviceIDs", parse_list(parse_hex_id), [], "PCI device IDs of NR1 modules; empty = any"),
    Option("nr1.expectedCount", parse_signed_int, -1,
           "NR1 modules this node must show; -1 = from the node label (none: at least one)"),
    Option("nr1.expectedCountLabel", parse_str, "accelstack.io/nr1.expected-count",
           "node label holding the expected NR1 count (empty: do not read labels)"),
    Option("nr1.healthAttribute", parse_str, "", "sysfs attribute of the PCI function read for health"),
    Option("nr1.healthyValues", parse_list(parse_str), ["1", "ok", "healthy", "up"],
           "values of the health attribute that mean healthy (case-insensitive)"),
    Option("nr1.probeCommand", parse_argv, [], "command run per module ({pci} substituted); exit 0 = healthy"),
    Option("nr1.probeTimeout", parse_duration, 2.0, "probe command timeout"),
    Option("nr1.requireLinkUp", parse_bool, True, "every network interface of a module must be operationally up"),
    Option("nr1.temperatureAttribute", parse_str, "hwmon/hwmon*/temp1_input",
           "sysfs attribute (glob, under the PCI function) with the temperature in m°C; exporter"),
    Option("nr1.powerAttribute", parse_str, "hwmon/hwmon*/power1_average",
           "sysfs attribute with the power draw in µW; exporter"),
    Option("nr1.utilizationAttribute", parse_str, "", "sysfs attribute with utilisation in percent; exporter"),
    Option("nr1.memoryUsedAttribute", parse_str, "", "sysfs attribute with device memory used in bytes; exporter"),
    Option("nr1.memoryTotalAttribute", parse_str, "", "sysfs attribute with device memory size in bytes; exporter"),
    # exporter
    Option("exporter.address", parse_address, ":9402", "listen address of /metrics, /healthz, /readyz"),
    Option("exporter.gpu", parse_bool, True, "export NVIDIA GPUs (NVML)"),
    Option("exporter.nr1", parse_bool, False, "export NR1 modules (sysfs; needs nr1.vendorIDs)"),
    Option("exporter.podResourcesSocket", parse_str, "/var/lib/kubelet/pod-resources/kubelet.sock",
           "kubelet pod-resources API socket for the allocation metrics; empty disables"),
    Option("exporter.resources", parse_list(parse_str), ["nvidia.com/gpu", "neureality.com/nr1"],
           "extended resources whose allocation is exported"),
    Option("exporter.nvmlRetry", parse_duration, 30.0, "while NVML cannot be initialised, try again this often"),
    Option("exporter.collectTimeout", parse_duration, 3.0,
           "a scrape that cannot read the devices by then answers without device metrics"),
    # remediation controller
    Option("remediation.conditions", parse_list(parse_str), ["GPUUnhealthy", "NR1Unhealthy"],
           "node condition types that taint the node while True"),
    Option("remediation.taintKey", parse_str, "accelstack.io/unhealthy", "taint key (effect NoSchedule)"),
    Option("remediation.holdTime", parse_duration, 600.0,
           "a condition must have been False this long before the taint is lifted (hysteresis)"),
    Option("remediation.resync", parse_duration, 30.0, "how often every node is re-evaluated (hold timers)"),
    Option("remediation.cordon", parse_bool, False, "also cordon tainted nodes (and uncordon what it cordoned)"),
    Option("remediation.drain", parse_bool, False,
           "also evict the pods of tainted nodes that use the managed resources (Eviction API; PDBs apply)"),
    Option("remediation.resources", parse_list(parse_str), ["nvidia.com/gpu", "neureality.com/nr1"],
           "resources whose pods a drain evicts"),
    Option("remediation.metricsAddress", parse_address, ":9403", "listen address of /metrics and health"),
)

_BY_KEY = {o.key: o for o in OPTIONS}
SECTIONS = sorted({o.key.split(".", 1)[0] for o in OPTIONS})


@dataclass(frozen=True)
class Config:
    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def section(self, prefix: str) -> dict[str, Any]:
        dot = prefix + "."
        return {k[len(dot):]: v for k, v in self.values.items() if k.startswith(dot)}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path not in _BY_KEY:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    try:
        tree = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    tree = tree or {}
    if not isinstance(tree, Mapping):
        raise ConfigError(f"config file {path}: the top level must be a mapping")
    if tree.get("version") != CONFIG_VERSION:
        raise ConfigError(f"version: must be {CONFIG_VERSION!r}, got {tree.get('version')!r} (in {path})")
    flat = _flatten({k: v for k, v in tree.items() if k != "version"})
    for key in flat:
        if key not in _BY_KEY:
            raise ConfigError(f"{key}: unknown key (sections: {', '.join(SECTIONS)}) (in {path})")
    return flat


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description + " Precedence: flag > environment > "
                                     "file > default.")
    parser.add_argument("--config-file", default=None,
                        help=f"versioned YAML/JSON file (version: {CONFIG_VERSION}); env {ENV_PREFIX}CONFIG_FILE")
    parser.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    for option in OPTIONS:
        parser.add_argument(option.flag_name, dest=option.key, default=None, metavar="VALUE",
                            help=f"{option.help} [env {option.env_name}; default {option.default!r}]")
    return parser


def load(argv: Sequence[str] | None, environ: Mapping[str, str] | None = None, prog: str = "accelstack-npd",
         description: str = "", extra: Callable[[argparse.ArgumentParser], None] | None = None,
         ) -> tuple[Config, argparse.Namespace]:
    """Flags, environment and file -> validated Config. Raises ConfigError naming the key."""
    environ = os.environ if environ is None else environ
    parser = build_parser(prog, description)
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    config_file = args.config_file or environ.get(ENV_PREFIX + "CONFIG_FILE") or None
    file_values = load_file(config_file) if config_file else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        raw, source = option.default, "default"
        if option.key in file_values:
            raw, source = file_values[option.key], "file"
        if option.env_name in environ:
            raw, source = environ[option.env_name], "env"
        if getattr(args, option.key) is not None:
            raw, source = getattr(args, option.key), "flag"
        where = {"flag": f" (flag {option.flag_name})", "env": f" (env {option.env_name})",
                 "file": f" (in {config_file})", "default": ""}[source]
        try:
            values[option.key] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{option.key}: {exc}{where}") from None
        sources[option.key] = source
    if not values["node.name"]:
        values["node.name"] = environ.get("NODE_NAME", "")
    return Config(values, sources), args


__all__ = ["OPTIONS", "Config", "ConfigError", "load", "parse_argv"]
