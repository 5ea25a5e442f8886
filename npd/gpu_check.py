"""The GPU check NPD runs (``accelstack-npd-gpu``): one verdict for the node's NVIDIA GPUs.

Checks, chosen with ``--checks`` (default ``count,xid,ecc,pages``; NPD rules pick subsets):

- ``count``: GPUs NVML shows vs the expected count (``gpu.expectedCount``, else the node label
  ``gpu.expectedCountLabel``, else the NVIDIA display functions on the PCI bus) — a GPU that fell off the bus
  or that the driver lost shows here;
- ``xid``: XIDs in the kernel log since the last run (see ``npd.kmsg``); critical ones keep the check NonOK
  for ``gpu.xidHoldTime``; ignored ones (application errors) never count;
- ``ecc``: volatile uncorrected ECC errors over ``gpu.maxUncorrectedEcc``;
- ``pages``: retired pages pending, or row remapping pending or failed (the GPU needs a reset);
- ``temperature``: over ``gpu.maxTemperature`` or the GPU's slowdown threshold minus a margin;
- ``power``: draw over ``gpu.maxPowerRatio`` of the enforced power limit.

NVML failing (no driver, library missing, an error other than "GPU lost") makes the verdict Unknown with the
reason, unless something else already proves a problem; so does an expected-count label that cannot be read
or is not a number. ``--report`` (``npd.plugin``) fits the verdict to the NPD rule: the temperature and power
rules run with ``--report=problems``, so with nothing to measure they exit 0 and NPD emits no threshold event. Discovery is the device plugin's (``NvmlBackend``).
The check logic takes the ``nvml`` module as a parameter: production passes ``pynvml``, tests a stand-in at
the same function boundary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from npd import kmsg
from npd import state as state_store
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

CHECKS = ("count", "xid", "ecc", "pages", "temperature", "power")
DEFAULT_CHECKS = ("count", "xid", "ecc", "pages")
MAX_RECENT_XIDS = 50


def _short(bus_id: str) -> str:
    return bus_id[5:] if bus_id.startswith("0000:") else bus_id


def _is_lost(nvml: Any, exc: BaseException) -> bool:
    return getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15)


def _not_supported(nvml: Any, exc: BaseException) -> bool:
    return getattr(exc, "value", None) in (getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
                                          getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13))


def expected_count(values: Mapping[str, Any], state: dict[str, Any], prefix: str,
                   fallback: int | None, fallback_source: str) -> tuple[int | None, str, str]:
    """(expected, where it came from, doubt): config, then the node label, then ``fallback``."""
    configured = int(values[f"{prefix}.expectedCount"])
    if configured >= 0:
        return configured, "config", ""
    label_key = values[f"{prefix}.expectedCountLabel"]
    doubt = ""
    if label_key and values["node.name"]:
        from npd.nodeinfo import cached_label  # urllib and ssl: imported only when a label is read

        value, error = cached_label(state, values["node.apiServer"], values["node.name"], label_key,
                                    timeout=1.0, max_age=values["plugin.labelCacheTime"])
        if value is not None:
            try:
                return int(value), f"label {label_key}", ""
            except ValueError:
                doubt = f"label {label_key}={value!r} is not a number"
        elif error:
            doubt = error
    return fallback, fallback_source, doubt


def check_gpus(nvml: Any, values: Mapping[str, Any], checks: Collection[str], state: dict[str, Any],
               progress: Progress, now: float | None = None) -> Result:
    """The verdict for ``checks``; ``state`` (what the last run saw) is updated in place."""
    from device_plugin.nvml_backend import BackendInitError, NvmlBackend, pci_gpu_functions

    now = time.time() if now is None else now
    found = Findings(noun="GPU problems")
    sysfs_root = values["node.sysfsRoot"]
    backend = NvmlBackend({"resourceName": "nvidia.com/gpu"}, sysfs_root=sysfs_root, nvml=nvml)
    devices: list[Any] = []
    nvml_ok = False
    needs_nvml = bool(set(checks) - {"xid"})
    progress("nvml discovery")
    try:
        devices = backend.discover()
        nvml_ok = True
    except BackendInitError as exc:
        # the kernel log alone (checks=xid) does not need NVML: there, NVML only names the GPUs
        (found.doubts if needs_nvml else found.notes).append(f"NVML unavailable: {exc.__cause__ or exc}")
    except Exception as exc:
        if _is_lost(nvml, exc):
            found.problems.append(f"a GPU is lost to NVML ({exc})")
        else:
            (found.doubts if needs_nvml else found.notes).append(f"NVML discovery failed: {exc}")
    try:
        if "count" in checks:
            progress("count")
            on_bus = pci_gpu_functions(sysfs_root)
            expected, source, doubt = expected_count(values, state, "gpu", len(on_bus) if on_bus else None,
                                                     "PCI bus")
            if doubt:
                found.doubts.append(doubt)
            if nvml_ok and expected is not None and len(devices) < expected:
                seen = {d.attrs["bus_id"] for d in devices}
                missing = [_short(a) for a in on_bus if a not in seen]
                where = f" (missing {','.join(missing)})" if missing else ""
                found.problems.append(f"{len(devices)}/{expected} GPUs visible{where}")
            elif nvml_ok and expected is not None and len(devices) > expected:
                found.notes.append(f"{len(devices)} GPUs, more than the {expected} expected ({source})")
        if "xid" in checks:
            _check_xids(values, state, devices, found, progress, now)
        for device in devices if nvml_ok else ():
            name = f"GPU{device.index} {_short(device.attrs['bus_id'])}"
            progress(f"nvml {name}")
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(device.id)
            except Exception as exc:
                (found.problems if _is_lost(nvml, exc) else found.doubts).append(f"{name}: {exc}")
                continue
            for check in ("ecc", "pages", "temperature", "power"):
                if check not in checks:
                    continue
                progress(f"{check} {name}")
                try:
                    _DEVICE_CHECKS[check](nvml, handle, name, values, found)
                except Exception as exc:
                    if _not_supported(nvml, exc):
                        continue
                    (found.problems if _is_lost(nvml, exc) else found.doubts).append(f"{name} {check}: {exc}")
    finally:
        progress("nvml shutdown")
        backend.close()
    if needs_nvml:
        return found.result(f"{len(devices)} GPUs healthy ({','.join(c for c in CHECKS if c in checks)})")
    return found.result("no critical XIDs")


def _check_xids(values: Mapping[str, Any], state: dict[str, Any], devices: list[Any], found: Findings,
                progress: Progress, now: float) -> None:
    progress("kernel log")
    cursor = state.get("kmsg") or {}
    boot = state_store.boot_id()
    after = int(cursor.get("seq", -1)) if cursor.get("boot") == boot else -1
    try:
        events, last = kmsg.read_xids(values["gpu.kmsgPath"], after)
    except OSError as exc:
        found.doubts.append(f"kernel log {values['gpu.kmsgPath']} unreadable: {exc.strerror or exc}")
        return
    state["kmsg"] = {"boot": boot, "seq": last}
    ignored = set(values["gpu.ignoredXids"])
    critical = set(values["gpu.criticalXids"])
    hold = float(values["gpu.xidHoldTime"])
    recent = [e for e in state.get("recent_xids", []) if now - float(e["at"]) < hold]
    for event in events:
        if event.xid in ignored:
            continue
        index = next((d.index for d in devices if kmsg.same_device(event.pci, d.attrs["bus_id"])), None)
        gpu = f"GPU{index}" if index is not None else f"GPU {event.pci}"
        entry = {"at": now, "xid": event.xid, "gpu": gpu, "text": event.text[:60]}
        if not critical or event.xid in critical:
            recent.append(entry)
        else:
            found.notes.append(f"{gpu} XID {event.xid} (not critical)")
    # a hold of 0 reports an XID in the run that saw it only
    recent = recent[-MAX_RECENT_XIDS:]  # an XID storm must not grow the state file without bound
    state["recent_xids"] = recent if hold > 0 else []
    # newest first: the message has room for little
    for entry in sorted(recent, key=lambda e: -float(e["at"])):
        found.problem(_xid_text(entry), f"{entry['gpu']} XID {entry['xid']}")


def _xid_text(entry: Mapping[str, Any]) -> str:
    detail = f": {entry['text']}" if entry.get("text") else ""
    return f"{entry['gpu']} XID {entry['xid']}{detail}"


def _problem(found: Findings, name: str, what: str) -> None:
    """A GPU's problem; in a list of several the GPU is named by index only ("GPU3 ...", not "GPU3 3b:00.0")."""
    found.problem(f"{name} {what}", f"{name.split()[0]} {what}")


def _ecc(nvml: Any, handle: Any, name: str, values: Mapping[str, Any], found: Findings) -> None:
    count = int(nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                  nvml.NVML_VOLATILE_ECC))
    if count > int(values["gpu.maxUncorrectedEcc"]):
        _problem(found, name, f"{count} uncorrected ECC errors")


def _pages(nvml: Any, handle: Any, name: str, values: Mapping[str, Any], found: Findings) -> None:
    try:
        if int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == nvml.NVML_FEATURE_ENABLED:
            _problem(found, name, "retired pages pending (reset the GPU)")
    except Exception as exc:
        if not _not_supported(nvml, exc):
            raise
    try:  # Ampere and later remap rows instead of retiring pages
        _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
    except Exception as exc:
        if not _not_supported(nvml, exc):
            raise
        return
    if failed:
        _problem(found, name, "row remapping failed")
    elif pending:
        _problem(found, name, "row remapping pending (reset the GPU)")


def _temperature(nvml: Any, handle: Any, name: str, values: Mapping[str, Any], found: Findings) -> None:
    temperature = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
    limit = float(values["gpu.maxTemperature"])
    if limit <= 0:
        slowdown = float(nvml.nvmlDeviceGetTemperatureThreshold(handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        limit = slowdown - float(values["gpu.temperatureMargin"])
    if temperature > limit:
        _problem(found, name, f"{temperature:.0f}C over {limit:.0f}C")


def _power(nvml: Any, handle: Any, name: str, values: Mapping[str, Any], found: Findings) -> None:
    draw = int(nvml.nvmlDeviceGetPowerUsage(handle)) / 1000.0
    limit = int(nvml.nvmlDeviceGetEnforcedPowerLimit(handle)) / 1000.0
    allowed = limit * float(values["gpu.maxPowerRatio"])
    if limit > 0 and draw > allowed:
        _problem(found, name, f"{draw:.0f}W over {allowed:.0f}W")


_DEVICE_CHECKS = {"ecc": _ecc, "pages": _pages, "temperature": _temperature, "power": _power}


def parse_checks(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHECKS]
    if unknown or not names:
        raise ValueError(f"--checks: unknown {unknown or 'empty'}; choose from {', '.join(CHECKS)}")
    return names


def state_path(values: Mapping[str, Any], kind: str, checks: Collection[str], report: str = "all") -> Path:
    """One state file per check set, and one more for the ``--report=unknown`` rule, which runs the permanent
    rule's checks: two rules reading the kernel log must not move each other's position."""
    suffix = ".unknown" if report == "unknown" else ""
    return Path(values["plugin.stateDir"]) / f"{kind}-{'-'.join(sorted(checks))}{suffix}.json"


def main(argv: list[str] | None = None) -> None:
    run_plugin(_main, argv)


def _main(argv: list[str] | None) -> None:
    from device_plugin.config import ConfigError
    from npd.config import load, print_config
    from service.observability import setup_logging

    def extra(parser: Any) -> None:
        parser.add_argument("--checks", default=",".join(DEFAULT_CHECKS),
                            help=f"comma-separated subset of {', '.join(CHECKS)}")
        add_report_argument(parser)

    try:
        config, args = load(argv, prog="accelstack-npd-gpu", extra=extra,
                            description="NPD custom plugin: health of this node's NVIDIA GPUs (exit 0 OK, "
                                        "1 NonOK, 2 Unknown; stdout is the message).")
        checks = parse_checks(args.checks)
    except (ConfigError, ValueError) as exc:
        finish(emit(Result(UNKNOWN, f"config: {exc}"), DEFAULT_MAX_OUTPUT))
        return
    if args.print_config:
        print(print_config(config, "accelstack-npd-gpu"), end="")
        return
    setup_logging(config["log.level"], config["log.format"])
    values = config.values
    path = state_path(values, "gpu", checks, args.report)

    def run(progress: Progress) -> Result:
        progress("import pynvml")
        import pynvml

        progress("state")
        state = state_store.load(path)
        result = check_gpus(pynvml, values, checks, state, progress)
        state_store.save(path, state)
        return result

    result = apply_report(run_with_deadline(run, values["plugin.deadline"]), args.report)
    finish(emit(result, values["plugin.maxOutputLength"]))


if __name__ == "__main__":
    main(sys.argv[1:])
