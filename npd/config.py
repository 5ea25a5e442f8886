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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from device_plugin.config import (
    DEFAULT_IGNORED_XIDS,
    Config,
    ConfigError,
    Schema,
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
from device_plugin.config import Option as BaseOption
from npd.plugin import DEFAULT_MAX_OUTPUT
from service.flags import Parser

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


def parse_condition_resource(value: Any) -> str:
    """``Condition=vendor.com/resource``: a node condition and the extended resource it is about (normalised)."""
    from device_plugin.config import parse_resource_name

    text = str(value).strip()
    condition, sep, resource = text.partition("=")
    if not sep or not condition.strip():
        raise ValueError(f"must be Condition=vendor.com/resource, got {value!r}")
    return f"{condition.strip()}={parse_resource_name(resource.strip())}"


def parse_kubeconfig(value: Any) -> str:
    """A kubeconfig file that exists, or "" (in-cluster service account, then KUBECONFIG / ~/.kube/config)."""
    path = parse_str(value)
    if path and not os.path.isfile(path):
        raise ValueError(f"no such file: {path!r}")
    return path


def Option(key: str, parse: Callable[[Any], Any], default: Any, help: str) -> BaseOption:
    """An option of the node-health processes: the device plugin's Option with their environment prefix."""
    return BaseOption(key, parse, default, help, env_prefix=ENV_PREFIX)


OPTIONS: tuple[BaseOption, ...] = (
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
    Option("plugin.maxOutputLength", parse_int(1), DEFAULT_MAX_OUTPUT,
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
    Option("remediation.conditionResources", parse_list(parse_condition_resource),
           ["GPUUnhealthy=nvidia.com/gpu", "NR1Unhealthy=neureality.com/nr1"],
           "the resource each condition is about: Unknown on a node without that resource (not in its capacity) "
           "neither taints nor keeps the taint; conditions not listed count on every node"),
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
    Option("remediation.apiTimeout", parse_duration, 10.0,
           "an API server call not answered by then is abandoned (reads and node patches are retried with backoff)"),
    BaseOption("remediation.kubeconfig", parse_kubeconfig, "",
               "kubeconfig file; empty: in-cluster service account, then KUBECONFIG or ~/.kube/config",
               flag="--kubeconfig", env_prefix=ENV_PREFIX),
)

SCHEMA = Schema(OPTIONS, ENV_PREFIX)
SECTIONS = SCHEMA.sections

_NR1_HEALTH = ("nr1.vendorIDs", "nr1.deviceIDs", "nr1.healthAttribute", "nr1.healthyValues", "nr1.probeCommand",
               "nr1.probeTimeout")
# The settings each process reads: its flags, its --help and its --print-config. A key ending in "." is a whole
# section. Every process still accepts every key from the file and the environment, so one ConfigMap serves
# them all; a process not named here (tests) has every flag.
USES: dict[str, tuple[str, ...]] = {
    "accelstack-npd-gpu": ("node.", "log.", "plugin.", "gpu."),
    "accelstack-npd-nr1": ("node.", "log.", "plugin.", *_NR1_HEALTH, "nr1.expectedCount", "nr1.expectedCountLabel",
                           "nr1.requireLinkUp"),
    "accelstack-device-exporter": ("node.name", "node.sysfsRoot", "log.", "exporter.", "gpu.criticalXids",
                                   "gpu.xidHoldTime", "gpu.maxUncorrectedEcc", *_NR1_HEALTH,
                                   "nr1.temperatureAttribute", "nr1.powerAttribute", "nr1.utilizationAttribute",
                                   "nr1.memoryUsedAttribute", "nr1.memoryTotalAttribute"),
    "accelstack-remediation": ("log.", "remediation."),
}


def options_of(prog: str) -> tuple[BaseOption, ...]:
    """The options ``prog`` reads (all of them for a process not in ``USES``)."""
    uses = USES.get(prog)
    if uses is None:
        return OPTIONS
    return tuple(o for o in OPTIONS if any(o.key == u or (u.endswith(".") and o.key.startswith(u)) for u in uses))


def print_config(config: Config, prog: str) -> str:
    """``--print-config``: the settings ``prog`` reads, as a versioned file it accepts back."""
    return SCHEMA.print_tree(config, {o.key for o in options_of(prog)})


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=description + " Precedence: flag > environment > file > default; "
                    "the file and the environment may also hold the other node-health processes' settings.")
    SCHEMA.add_arguments(parser, options_of(prog))
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
    config = SCHEMA.resolve(args, environ)
    values = dict(config.values)
    if not values["node.name"]:
        values["node.name"] = environ.get("NODE_NAME", "")
    return Config(values, config.sources), args


__all__ = ["OPTIONS", "USES", "Config", "ConfigError", "load", "options_of", "parse_argv", "print_config"]
