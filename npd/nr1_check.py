"""The NR1 check NPD runs (``accelstack-npd-nr1``): one verdict for the node's NeuReality NR1 modules.

- present: the modules found in sysfs (``nr1_sysfs.discover``, the device plugin's discovery) against the
  expected count: ``nr1.expectedCount``, else the node label ``nr1.expectedCountLabel``, else the most modules
  this node has shown (remembered in ``plugin.stateDir``/``nr1-modules.json`` across runs and restarts, with
  their PCI addresses, so a lost module is named), else at least one. A label that cannot be read (or is not
  a number) makes the verdict Unknown unless a problem is found anyway;
- health: the device plugin's per-module check (``NR1Backend.check``: PCI function present, the configured
  health attribute reads a healthy value, the optional probe command passes);
- links: every network interface of a module is operationally up (``operstate``), when ``nr1.requireLinkUp``.

Only sysfs is read, but a sysfs read can block on a wedged device, so the run has the same deadline as the GPU
check. Modules removed on purpose: set ``nr1.expectedCount`` or the label, or delete ``nr1-modules.json``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from npd import state as state_store
from npd.gpu_check import expected_count, state_path
from npd.plugin import (
    DEFAULT_MAX_OUTPUT,
    UNKNOWN,
    Findings,
    Progress,
    Result,
    add_report_argument,
    apply_report,
    emit,
    finish,
    run_plugin,
    run_with_deadline,
)

MEMORY_FILE = "nr1-modules.json"  # the most modules this node has shown; shared by every NR1 rule


def _short(address: str) -> str:
    return address[5:] if address.startswith("0000:") else address


def most_seen(memory: dict[str, Any]) -> int:
    """The count in ``memory``; a memory that does not make sense (edited, another version) is forgotten, as a
    corrupt state file is: a first run, never a failure."""
    count, modules = memory.get("max", 0), memory.get("modules", [])
    if not (isinstance(count, int) and count >= 0 and isinstance(modules, list)
            and all(isinstance(m, str) for m in modules)):
        memory.clear()
        return 0
    return count


def remember(memory: dict[str, Any], addresses: list[str], now: float) -> None:
    """Keep the largest set of modules seen (count and addresses) in ``memory``, in place."""
    if len(addresses) > most_seen(memory):
        memory.update(max=len(addresses), modules=sorted(addresses), at=now)


def backend_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The NR1 backend's settings from this process's configuration."""
    return {"resourceName": "neureality.com/nr1", "vendorIDs": values["nr1.vendorIDs"],
            "deviceIDs": values["nr1.deviceIDs"], "devPattern": "", "healthAttribute": values["nr1.healthAttribute"],
            "healthyValues": values["nr1.healthyValues"], "probeCommand": values["nr1.probeCommand"],
            "probeTimeout": values["nr1.probeTimeout"]}


def check_nr1(values: Mapping[str, Any], state: dict[str, Any], progress: Progress,
              memory: dict[str, Any] | None = None, now: float | None = None) -> Result:
    """The verdict; ``state`` (this rule's) and ``memory`` (the node's, ``MEMORY_FILE``) are updated in place."""
    from device_plugin import nr1_sysfs
    from device_plugin.nr1_backend import NR1Backend

    memory = {} if memory is None else memory
    if not values["nr1.vendorIDs"]:
        return Result(UNKNOWN, "nr1.vendorIDs not configured")
    sysfs_root = values["node.sysfsRoot"]
    found = Findings(noun="NR1 problems")
    backend = NR1Backend(backend_settings(values), sysfs_root=sysfs_root)
    progress("discovery")
    modules = backend.discover()
    present = [m.id for m in modules]
    progress("expected count")
    expected, source, doubt = expected_count(values, state, "nr1", None, "")
    if doubt:
        found.doubts.append(doubt)
    if expected is None and most_seen(memory) > 0:
        expected, source = most_seen(memory), "most seen"
    if expected is None and not modules:
        found.problem("no NR1 modules found")
    elif expected is not None and len(modules) < expected:
        missing = [_short(a) for a in memory.get("modules", []) if a not in present]
        where = f"; missing {','.join(missing)}" if missing else ""
        found.problem(f"{len(modules)}/{expected} NR1 modules present ({source}{where})")
    remember(memory, present, time.time() if now is None else now)
    for module in modules:
        name = _short(module.id)
        progress(f"health NR1 {name}")
        healthy, reason = backend.check(module)
        if not healthy:
            found.problem(f"NR1 {name}: {reason}", f"{name} {reason}")
            continue
        if values["nr1.requireLinkUp"]:
            interfaces = module.attrs["net_interfaces"]
            down = []
            if not interfaces:
                down.append("no network interface")
            for ifname in interfaces:
                progress(f"link NR1 {name} {ifname}")
                state_now = nr1_sysfs.interface_operstate(sysfs_root, module.id, ifname)
                if state_now != "up":
                    down.append(f"{ifname} link {state_now or 'gone'}")
            if down:
                found.problem(f"NR1 {name}: {', '.join(down)}", f"{name} {', '.join(down)}")
    return found.result(f"{len(modules)} NR1 modules healthy")


def main(argv: list[str] | None = None) -> None:
    run_plugin(_main, argv)


def _main(argv: list[str] | None) -> None:
    from device_plugin.config import ConfigError
    from npd.config import load, print_config
    from service.observability import setup_logging

    try:
        config, args = load(argv, prog="accelstack-npd-nr1", extra=add_report_argument,
                            description="NPD custom plugin: health of this node's NR1 modules (exit 0 OK, "
                                        "1 NonOK, 2 Unknown; stdout is the message).")
    except ConfigError as exc:
        finish(emit(Result(UNKNOWN, f"config: {exc}"), DEFAULT_MAX_OUTPUT))
        return
    if args.print_config:
        print(print_config(config, "accelstack-npd-nr1"), end="")
        return
    setup_logging(config["log.level"], config["log.format"])
    values = config.values
    path = state_path(values, "nr1", ["health"], args.report)
    memory_path = Path(values["plugin.stateDir"]) / MEMORY_FILE

    def run(progress: Progress) -> Result:
        progress("state")
        state = state_store.load(path)
        memory = state_store.load(memory_path)
        before = dict(memory)
        result = check_nr1(values, state, progress, memory)
        state_store.save(path, state)
        if memory != before:
            state_store.save(memory_path, memory)
        return result

    result = apply_report(run_with_deadline(run, values["plugin.deadline"]), args.report)
    finish(emit(result, values["plugin.maxOutputLength"]))


if __name__ == "__main__":
    main(sys.argv[1:])
