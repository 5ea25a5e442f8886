"""``accelstack-npd-install TARGET``: put a self-contained copy of the NPD plugins into TARGET, for the upstream
node-problem-detector image to run.

NPD executes a custom plugin inside its own container, whose image has no Python. The NPD DaemonSets therefore
run this command in an init container from the accelstack image: it copies the interpreter, the standard library
(without tests and GUI modules), the few packages the plugins import, and the shared libraries those need that
are not glibc itself, into TARGET (an ``emptyDir``), and writes one ``/bin/sh`` wrapper per plugin that points
Python at that tree (``PYTHONHOME``, ``LD_LIBRARY_PATH``). The NPD container mounts the same ``emptyDir`` at
``--mount-path`` (``/opt/accelstack``) and runs ``/opt/accelstack/bin/accelstack-npd-gpu``. Both images must
share the glibc generation (the accelstack image and NPD's are Debian bookworm based).

Everything is byte-compiled in TARGET (the official Python images ship without ``.pyc`` files), so a plugin run
does not compile its imports every time.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from service.flags import Parser

SCRIPTS = {"accelstack-npd-gpu": "npd.gpu_check", "accelstack-npd-nr1": "npd.nr1_check"}
# top-level packages the plugins import (checked by running the installed plugins in the tests)
PACKAGES = ("npd", "device_plugin", "service", "protos", "pynvml", "yaml", "prometheus_client", "google")
OPTIONAL = ("_yaml",)
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
               "lib2to3", "__phello__", "pydoc_data"}
DYNLOAD_SKIP = ("_tkinter", "_curses", "_dbm", "_gdbm")  # GUI and terminal modules: X11, Tcl/Tk, ncurses
# provided by every glibc system; never copied (the loader and libc must be the host image's own)
GLIBC = {"linux-vdso.so.1", "linux-gate.so.1", "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2",
         "librt.so.1", "libutil.so.1", "libresolv.so.2", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__", "tests", "*.pyc"))
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def _package_paths(name: str) -> list[Path]:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin)] if spec.origin else []


def _needed_libraries(files: list[Path]) -> dict[str, Path]:
    """Shared libraries (name -> path) the files link against, outside glibc."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise RuntimeError("ldd not found: cannot tell which shared libraries the runtime needs")
    needed: dict[str, Path] = {}
    for chunk in range(0, len(files), 200):
        result = subprocess.run([ldd, *map(str, files[chunk:chunk + 200])], capture_output=True, text=True,
                                check=False)
        for line in result.stdout.splitlines():
            name, arrow, rest = line.strip().partition(" => ")
            if not arrow or name in GLIBC:
                continue
            path = rest.split(" (", 1)[0].strip()
            if path == "not found":
                raise RuntimeError(f"{name}: not found by ldd")
            if path:
                needed.setdefault(name, Path(path))
    return needed


def install(target: Path, mount_path: str = "/opt/accelstack") -> dict[str, int]:
    """Copy the runtime into ``target`` for use at ``mount_path``; returns counts for the log."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    executable = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    bin_dir, lib_dir = target / "bin", target / "lib"
    stdlib = Path(os.path.dirname(os.__file__))
    bin_dir.mkdir(parents=True, exist_ok=True)
    lib_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executable, bin_dir / "python3")
    shutil.copytree(stdlib, lib_dir / version, dirs_exist_ok=True, symlinks=False,
                    ignore=lambda directory, names: [n for n in names if n in STDLIB_SKIP or n == "__pycache__"
                                                     or n.startswith("config-")] if directory == str(stdlib)
                    else [n for n in names if n == "__pycache__" or n.startswith(DYNLOAD_SKIP)])
    site = lib_dir / version / "site-packages"
    site.mkdir(exist_ok=True)
    copied = 0
    for name in PACKAGES + OPTIONAL:
        paths = _package_paths(name)
        if not paths and name not in OPTIONAL:
            raise RuntimeError(f"package {name} not importable here; the plugins need it")
        for path in paths:
            _copy(path, site / (name if path.is_dir() else path.name))
            copied += 1
    binaries = [bin_dir / "python3", *target.rglob("*.so"), *target.rglob("*.so.*")]
    libraries = _needed_libraries([b for b in binaries if b.is_file()])
    for name, path in libraries.items():
        if not (lib_dir / name).exists():
            shutil.copy2(path, lib_dir / name)
    for script, module in SCRIPTS.items():
        wrapper = bin_dir / script
        wrapper.write_text(
            "#!/bin/sh\n"
            f"# written by accelstack-npd-install: the accelstack NPD plugin {module}, runtime at {mount_path}\n"
            "unset PYTHONPATH PYTHONSTARTUP\n"
            f"export PYTHONHOME={mount_path} PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1\n"
            f"export LD_LIBRARY_PATH={mount_path}/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n"
            f'exec {mount_path}/bin/python3 -m {module} "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    # a few workers, not one per CPU: the init container has a small memory limit and nodes have many CPUs
    compileall.compile_dir(str(lib_dir / version), quiet=2, workers=min(4, os.cpu_count() or 1))
    return {"packages": copied, "libraries": len(libraries)}


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="accelstack-npd-install", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="directory to fill (the emptyDir the NPD container mounts)")
    parser.add_argument("--mount-path", default="/opt/accelstack",
                        help="where the NPD container mounts TARGET (default /opt/accelstack)")
    args = parser.parse_args(argv)
    try:
        counts = install(Path(args.target), args.mount_path)
    except (OSError, RuntimeError) as exc:
        print(f"accelstack-npd-install: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"accelstack-npd-install: {args.target} ready for {args.mount_path} "
          f"({counts['packages']} packages, {counts['libraries']} shared libraries)")


if __name__ == "__main__":
    main(sys.argv[1:])
