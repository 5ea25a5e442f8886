"""``accelstack-npd-install``: the relocated runtime runs the plugins with nothing from outside its tree, from a
clean environment, the way the NPD container (another image, no Python) runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.npd.test_plugin_process import MAX_OUTPUT
from tests.sysfs_fixture import NR1_VENDOR, nr1_node

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("opt-accelstack")
    result = subprocess.run([sys.executable, "-m", "npd.install", str(target), f"--mount-path={target}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "ready for" in result.stdout
    return target


def clean_run(argv: list[str], timeout: float = 15) -> subprocess.CompletedProcess[str]:
    """No PYTHONPATH, no venv, not the repository as working directory."""
    return subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", *argv], cwd="/", capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_installed_gpu_plugin_answers_by_the_protocol(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text("4,1,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n")
    result = clean_run([str(installed / "bin/accelstack-npd-gpu"), "--plugin-state-dir", str(tmp_path / "s"),
                        "--gpu-kmsg-path", str(tmp_path / "kmsg"), "--node-sysfs-root", str(tmp_path)])
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("GPU 0000:3b:00 XID 79")
    assert len(result.stdout.strip().encode()) <= MAX_OUTPUT


def test_installed_nr1_plugin(installed: Path, tmp_path: Path) -> None:
    nr1_node(tmp_path / "sys", 2)
    result = clean_run([str(installed / "bin/accelstack-npd-nr1"), "--node-sysfs-root", str(tmp_path / "sys"),
                        "--plugin-state-dir", str(tmp_path / "s"), "--nr1-vendor-ids", NR1_VENDOR])
    assert (result.returncode, result.stdout.strip()) == (0, "2 NR1 modules healthy"), result.stderr


def test_nothing_is_loaded_from_outside_the_tree(installed: Path) -> None:
    probe = ("import sys, npd.gpu_check, npd.nr1_check, npd.nodeinfo, device_plugin.nvml_backend, "
             "device_plugin.nr1_backend, service.observability, npd.config, pynvml, yaml\n"
             "outside = sorted(m.__file__ for m in list(sys.modules.values())\n"
             f"                 if getattr(m, '__file__', None) and not m.__file__.startswith({str(installed)!r}))\n"
             "print(outside)\n")
    result = clean_run(["env", f"PYTHONHOME={installed}", f"LD_LIBRARY_PATH={installed}/lib",
                        str(installed / "bin/python3"), "-c", probe])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    maps = clean_run(["env", f"PYTHONHOME={installed}", f"LD_LIBRARY_PATH={installed}/lib",
                      str(installed / "bin/python3"), "-c",
                      "import ctypes, ssl; print(open('/proc/self/maps').read())"])
    libraries = {line.split()[-1] for line in maps.stdout.splitlines() if ".so" in line}
    glibc = ("libc.so", "libm.so", "ld-linux", "libpthread", "libdl.so", "librt.so")
    assert not [lib for lib in libraries if not lib.startswith(str(installed)) and not any(g in lib for g in glibc)]
