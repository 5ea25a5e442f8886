"""The plugins run the way node-problem-detector runs them: a subprocess with a timeout, judged by its exit
code (0 OK, 1 NonOK, anything else Unknown) with stdout cut to max_output_length as the message.

NVML is really absent on this machine (no NVIDIA driver), which is the real Unknown path of the GPU check;
the NR1 check and the GPU check's kernel-log part read real files in sysfs and kmsg fixtures. A sysfs
attribute or kernel log that blocks (a FIFO nobody writes) stands for a wedged device."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.npd.helpers import kmsg_line, xid_line
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

REPO = Path(__file__).resolve().parents[2]
NPD_TIMEOUT = 5.0  # the rule timeout NPD would apply
MAX_OUTPUT = 80


@dataclass
class Run:
    status: str
    message: str
    seconds: float
    code: int


def npd_exec(module: str, *args: str, timeout: float = NPD_TIMEOUT, max_output: int = MAX_OUTPUT) -> Run:
    """What NPD's plugin.go does: run, kill at the timeout, map the exit code, cut stdout."""
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, timeout=timeout,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    except subprocess.TimeoutExpired:
        return Run("Unknown", "Timeout when running plugin", time.monotonic() - started, -9)
    status = {0: "OK", 1: "NonOK"}.get(proc.returncode, "Unknown")
    message = proc.stdout[:max_output].decode(errors="replace").strip()
    return Run(status, message, time.monotonic() - started, proc.returncode)


def nvml_loadable() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def common(tmp: Path, gpu: bool = True) -> list[str]:
    """The flags of every run; ``gpu``: with the GPU plugin's own kernel-log path (the NR1 plugin has no such flag)."""
    return ["--node-sysfs-root", str(tmp / "sys"), "--plugin-state-dir", str(tmp / "state"),
            *(["--gpu-kmsg-path", str(tmp / "kmsg")] if gpu else []), "--log-level", "warning"]


@pytest.mark.skipif(nvml_loadable(), reason="a real NVML is present; this tests its absence")
def test_gpu_plugin_without_nvml_is_unknown_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot"))
    run = npd_exec("npd.gpu_check", *common(tmp_path))
    assert run.code == 2 and run.status == "Unknown"
    assert run.message.startswith("NVML unavailable: NVML Shared Library Not Found")
    assert len(run.message.encode()) <= MAX_OUTPUT


def test_gpu_plugin_reports_xids_from_the_kernel_log(tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot") + xid_line(2, "0000:3b:00", 79, "pid=0, GPU has fallen "
                                                                      "off the bus.") + xid_line(3, "0000:3b:00", 31))
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "xid")
    assert (run.status, run.message) == ("NonOK", "GPU 0000:3b:00 XID 79: pid=0, GPU has fallen off the bus.")
    # the next run: nothing new, but the critical XID is held (gpu.xidHoldTime); with no hold it is over
    assert npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "xid").status == "NonOK"
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "xid", "--gpu-xid-hold-time", "0")
    assert run.status == "OK" and run.message.startswith("no critical XIDs")


def test_stdout_is_cut_to_max_output_length(tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text("".join(xid_line(i, f"0000:{0x10 + i:02x}:00", 79) for i in range(1, 9)))
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "xid", "--plugin-max-output-length", "60")
    assert run.status == "NonOK"
    # whole items and how many were left out, within NPD's cut (the same 60 bytes here)
    assert run.message == "8 GPU problems: GPU 0000:11:00 XID 79; +7 more"


def test_several_nr1_failures_are_summarised_within_the_limit_never_mid_word(tmp_path: Path) -> None:
    """Today's NPD limit (80 bytes) with three failing modules: counted, whole items, the rest counted."""
    sysfs = tmp_path / "sys"
    addresses = nr1_node(sysfs, 4)
    base = sysfs / "bus/pci/devices"
    (base / addresses[0] / "net/nr1p0/operstate").write_text("down\n")
    (base / addresses[1] / "health").write_text("fault\n")
    (base / addresses[3] / "net/nr1p3/operstate").write_text("lowerlayerdown\n")
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path))
    assert run.status == "NonOK"
    assert run.message == "3 NR1 problems: 3b:00.0 nr1p0 link down; +2 more"
    wide = npd_exec("npd.nr1_check", *nr1_args(tmp_path, "--plugin-max-output-length", "200"), max_output=200)
    assert wide.message == ("3 NR1 problems: 3b:00.0 nr1p0 link down; 3c:00.0 health attribute health='fault'; "
                            "3e:00.0 nr1p3 link lowerlayerdown")
    # one long finding is cut at a word, marked
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path, "--nr1-expected-count", "5",
                                              "--plugin-max-output-length", "40"), max_output=40)
    assert run.message == "4 NR1 problems: 4/5 NR1…; +3 more"


def test_hung_sysfs_read_still_answers_unknown_in_time(tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot"))
    base = tmp_path / "sys/bus/pci/devices/0000:3b:00.0"
    base.mkdir(parents=True)
    (base / "vendor").write_text("0x10de\n")
    os.mkfifo(base / "class")  # opening it blocks: nobody writes (a wedged device's attribute)
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--plugin-deadline", "1s")
    assert run.status == "Unknown" and run.code == 2
    assert run.message.startswith("no answer within 1s (stuck in count")
    assert run.seconds < NPD_TIMEOUT - 2


def test_kernel_log_without_writer_does_not_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "kmsg")  # read non-blocking, like /dev/kmsg at its end
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "xid", "--plugin-deadline", "1s")
    assert run.status == "OK", run.message


def test_bad_configuration_is_unknown_naming_the_key(tmp_path: Path) -> None:
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--gpu-max-power-ratio", "lots")
    assert run.status == "Unknown" and run.message.startswith("config: gpu.maxPowerRatio: must be a number")
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "fans")
    assert run.status == "Unknown" and "unknown ['fans']" in run.message
    run = npd_exec("npd.nr1_check", *common(tmp_path, gpu=False), "--log-level", "verbose")
    assert run.code == 2  # within NPD's default 80 bytes, cut at a word: the key and the value are there
    assert run.message == "config: log.level: must be one of debug, info, warning, error; got 'verbose'…"
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--no-such-flag")
    assert (run.code, run.message) == (2, "bad arguments (see stderr)")


def test_failure_outside_the_check_is_unknown_not_nonok(tmp_path: Path) -> None:
    """Python exits 1 on an uncaught exception, which NPD would read as NonOK; the plugins answer Unknown."""
    (tmp_path / "state").write_text("a file where the state directory should be")
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot"))
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks", "xid")
    assert run.code in (0, 2), run  # the state is only a cache: losing it is a warning, never NonOK


def nr1_args(tmp: Path, *extra: str) -> list[str]:
    return [*common(tmp, gpu=False), "--nr1-vendor-ids", NR1_VENDOR, "--nr1-health-attribute", "health", *extra]


def test_nr1_plugin_healthy_then_each_failure(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    addresses = nr1_node(sysfs, 4)
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path, "--nr1-expected-count", "4"))
    assert (run.status, run.message) == ("OK", "4 NR1 modules healthy")
    base = sysfs / "bus/pci/devices"
    (base / addresses[1] / "health").write_text("fault\n")
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path))
    assert (run.status, run.message) == ("NonOK", "NR1 3c:00.0: health attribute health='fault'")
    (base / addresses[1] / "health").write_text("ok\n")
    (base / addresses[2] / "net/nr1p2/operstate").write_text("down\n")
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path))
    assert (run.status, run.message) == ("NonOK", "NR1 3d:00.0: nr1p2 link down")
    assert npd_exec("npd.nr1_check", *nr1_args(tmp_path, "--nr1-require-link-up", "false")).status == "OK"
    (base / addresses[2] / "net/nr1p2/operstate").write_text("up\n")
    import shutil

    shutil.rmtree(base / addresses[3])  # a module vanished from the bus
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path, "--nr1-expected-count", "4"))
    assert (run.status, run.message) == ("NonOK", "3/4 NR1 modules present (config; missing 3e:00.0)")


def test_nr1_plugin_without_modules_or_vendor(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    assert npd_exec("npd.nr1_check", *nr1_args(tmp_path)).message == "no NR1 modules found"
    run = npd_exec("npd.nr1_check", *common(tmp_path, gpu=False))
    assert (run.status, run.message) == ("Unknown", "nr1.vendorIDs not configured")


def test_nr1_plugin_hung_sysfs_read_is_unknown_in_time(tmp_path: Path) -> None:
    """The plugin answers by its own deadline while the read is still blocked (nothing ever writes the FIFO), well
    before NPD would kill it. Times are scaled to a healthy run of the same plugin measured here, not absolute: a
    loaded machine stretches the interpreter's start and the check's way to the read."""
    nr1_node(tmp_path / "healthy/sys", 2)  # the same node, healthy, with its own state directory
    healthy = npd_exec("npd.nr1_check", *nr1_args(tmp_path / "healthy"), timeout=60)
    assert (healthy.status, healthy.message) == ("OK", "2 NR1 modules healthy"), healthy
    addresses = nr1_node(tmp_path / "sys", 2)
    # the deadline leaves the check a whole healthy run to reach the read (the run is mostly the interpreter's
    # start, which happens before the deadline counts), so it is stuck in the read when the deadline passes
    deadline_ms = max(800, math.ceil(1000 * healthy.seconds))
    deadline = deadline_ms / 1000
    limit = 2 * (healthy.seconds + deadline)  # a run that honours the deadline: its start, then the deadline
    attribute = tmp_path / "sys/bus/pci/devices" / addresses[0] / "health"
    attribute.unlink()
    os.mkfifo(attribute)
    # NPD's timeout here is past the limit, so a plugin that waits for the read (or long past its deadline) is
    # killed: "Timeout when running plugin", not the plugin's own answer
    run = npd_exec("npd.nr1_check", *nr1_args(tmp_path, "--plugin-deadline", f"{deadline_ms}ms"),
                   timeout=max(NPD_TIMEOUT, 2 * limit))
    assert run.status == "Unknown" and run.code == 2, run
    assert run.message.startswith(f"no answer within {deadline:g}s (stuck in health NR1 3b:00.0"), run
    assert run.seconds < limit, (run, healthy)


def test_nr1_plugin_remembers_the_most_modules_seen_and_reports_a_drop(tmp_path: Path) -> None:
    """No nr1.expectedCount, no label: four modules becoming three is NonOK, across runs (NPD starts the plugin
    afresh every interval) in a state directory the plugin creates."""
    import shutil

    sysfs = tmp_path / "sys"
    addresses = nr1_node(sysfs, 4)
    state = tmp_path / "var/lib/accelstack-npd"  # does not exist yet
    args = [*nr1_args(tmp_path), "--plugin-state-dir", str(state)]
    run = npd_exec("npd.nr1_check", *args)
    assert (run.status, run.message) == ("OK", "4 NR1 modules healthy")
    assert (state / "nr1-modules.json").is_file()
    shutil.rmtree(sysfs / "bus/pci/devices" / addresses[2])
    for _ in range(2):  # and stays so: the memory is not lowered by the drop it reports
        run = npd_exec("npd.nr1_check", *args)
        assert (run.status, run.message) == ("NonOK", "3/4 NR1 modules present (most seen; missing 3d:00.0)")
    # every NR1 rule shares the memory: the temporary rule that names problems sees the drop too
    assert npd_exec("npd.nr1_check", *args, "--report=problems").status == "NonOK"
    # an explicit count wins over the memory (modules removed on purpose)
    assert npd_exec("npd.nr1_check", *args, "--nr1-expected-count", "3").status == "OK"
    # a memory that makes no sense is forgotten, never a failure
    (state / "nr1-modules.json").write_text('{"max": "lots", "modules": 3}')
    run = npd_exec("npd.nr1_check", *args)
    assert (run.status, run.message) == ("OK", "3 NR1 modules healthy")


def test_nr1_plugin_with_an_unreadable_label_is_unknown_not_ok(tmp_path: Path) -> None:
    nr1_node(tmp_path / "sys", 2)
    args = nr1_args(tmp_path, "--node-name", "nr1-a", "--node-api-server", "http://127.0.0.1:9")
    run = npd_exec("npd.nr1_check", *args)
    assert run.status == "Unknown" and run.code == 2
    assert run.message.startswith("label accelstack.io/nr1.expected-count unreadable: ")
    assert len(run.message.encode()) <= MAX_OUTPUT and not run.message.endswith("(fl")
    # the temporary rule naming problems stays quiet (no event); the Unknown rule reports it
    assert npd_exec("npd.nr1_check", *args, "--report=problems").status == "OK"
    assert npd_exec("npd.nr1_check", *args, "--report=unknown").status == "Unknown"


@pytest.mark.skipif(nvml_loadable(), reason="a real NVML is present; this tests its absence")
def test_threshold_rules_without_nvml_exit_ok_so_npd_emits_no_event(tmp_path: Path) -> None:
    """NPD emits a temporary rule's event for Unknown as well as NonOK: with nothing to measure, the temperature
    and power rules exit 0. The Unknown has its own rule (--report=unknown) and reason."""
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot"))
    for check in ("temperature", "power"):
        run = npd_exec("npd.gpu_check", *common(tmp_path), f"--checks={check}", "--report=problems")
        assert (run.status, run.code) == ("OK", 0), run
        assert run.message.startswith("nothing to judge: NVML unavailable")
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks=count,xid,ecc,pages", "--report=unknown")
    assert (run.status, run.code) == ("Unknown", 2) and run.message.startswith("NVML unavailable")
    # the Unknown rule keeps its own kernel-log position: it does not take XIDs from the permanent rule
    (tmp_path / "kmsg").write_text(kmsg_line(1, "boot") + xid_line(2, "0000:3b:00", 79))
    npd_exec("npd.gpu_check", *common(tmp_path), "--checks=count,xid,ecc,pages", "--report=unknown")
    run = npd_exec("npd.gpu_check", *common(tmp_path), "--checks=count,xid,ecc,pages")
    assert run.status == "NonOK" and run.message.startswith("GPU 0000:3b:00 XID 79")
