"""The NR1 check NPD runs (``accelstack-npd-nr1``): one verdict for the node's NeuReality NR1 modules.

- present: the modules found in sysfs (``nr1_sysfs.discover``, the device plugin's discovery) against the
  expected count (``nr1.expectedCount``, else the node label ``nr1.expectedCountLabel``, else at least one);
- health: the device plugin's per-module check (``NR1Backend.check``: PCI function present, the configured
  health attribute reads a healthy value, the optional probe command passes);
- links: every network interface of a module is operationally up (``operstate``), when ``nr1.requireLinkUp``.

Only sysfs is read, but a sysfs read can block on a wedged device, so the run has the same deadline as the GPU
check.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from npd import state as state_store
from npd.gpu_check import expected_count, state_path
from npd.plugin import UNKNOWN, Findings, Progress, Result, emit, finish, run_plugin, run_with_deadline


def backend_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The NR1 backend's settings from this process's configuration."""
    return {"resourceName": "neureality.com/nr1", "vendorIDs": values["nr1.vendorIDs"],
            "deviceIDs": values["nr1.deviceIDs"], "devPattern": "", "healthAttribute": values["nr1.healthAttribute"],
            "healthyValues": values["nr1.healthyValues"], "probeCommand": values["nr1.probeCommand"],
            "probeTimeout": values["nr1.probeTimeout"]}


def check_nr1(values: Mapping[str, Any], state: dict[str, Any], progress: Progress) -> Result:
    from device_plugin import nr1_sysfs
    from device_plugin.nr1_backend import NR1Backend

    if not values["nr1.vendorIDs"]:
        return Result(UNKNOWN, "nr1.vendorIDs not configured")
    sysfs_root = values["node.sysfsRoot"]
    found = Findings()
    backend = NR1Backend(backend_settings(values), sysfs_root=sysfs_root)
    progress("discovery")
    modules = backend.discover()
    progress("expected count")
    expected, source, doubt = expected_count(values, state, "nr1", None, "")
    if doubt:
        found.notes.append(doubt)
    if expected is None and not modules:
        found.problems.append("no NR1 modules found")
    elif expected is not None and len(modules) < expected:
        found.problems.append(f"{len(modules)}/{expected} NR1 modules present ({source})")
    for module in modules:
        name = f"NR1 {module.id[5:] if module.id.startswith('0000:') else module.id}"
        progress(f"health {name}")
        healthy, reason = backend.check(module)
        if not healthy:
            found.problems.append(f"{name}: {reason}")
            continue
        if values["nr1.requireLinkUp"]:
            interfaces = module.attrs["net_interfaces"]
            if not interfaces:
                found.problems.append(f"{name}: no network interface")
            for ifname in interfaces:
                progress(f"link {name} {ifname}")
                state_now = nr1_sysfs.interface_operstate(sysfs_root, module.id, ifname)
                if state_now != "up":
                    found.problems.append(f"{name}: {ifname} link {state_now or 'gone'}")
    return found.result(f"{len(modules)} NR1 modules healthy")


def main(argv: list[str] | None = None) -> None:
    run_plugin(_main, argv)


def _main(argv: list[str] | None) -> None:
    from device_plugin.config import ConfigError
    from device_plugin.observability import setup_logging
    from npd.config import SCHEMA, load

    try:
        config, args = load(argv, prog="accelstack-npd-nr1",
                            description="NPD custom plugin: health of this node's NR1 modules (exit 0 OK, "
                                        "1 NonOK, 2 Unknown; stdout is the message).")
    except ConfigError as exc:
        finish(emit(Result(UNKNOWN, f"config: {exc}"), 200))
        return
    if args.print_config:
        print(SCHEMA.print_tree(config), end="")
        return
    setup_logging(config["log.level"], config["log.format"])
    values = config.values
    path = state_path(values, "nr1", ["health"])

    def run(progress: Progress) -> Result:
        progress("state")
        state = state_store.load(path)
        result = check_nr1(values, state, progress)
        state_store.save(path, state)
        return result

    result = run_with_deadline(run, values["plugin.deadline"])
    finish(emit(result, values["plugin.maxOutputLength"]))


if __name__ == "__main__":
    main(sys.argv[1:])
