"""Regenerate the checked-in Python modules from the upstream .proto files.

Usage: python -m protos.generate [--check]

``--check`` regenerates into a temporary directory and exits 1 when any checked-in module differs,
which is what the test suite runs so that the generated code can never drift from the protos.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("protos/deviceplugin/v1beta1/api.proto", "protos/podresources/v1/api.proto")
OUTPUTS = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency, only needed here

    for proto in PROTOS:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(ROOT / proto),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed for {proto} (exit {rc})")


def differences() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        diffs = []
        for proto in PROTOS:
            pkg = Path(proto).parent
            for name in OUTPUTS:
                fresh, checked_in = Path(tmp) / pkg / name, ROOT / pkg / name
                if not checked_in.exists() or not filecmp.cmp(fresh, checked_in, shallow=False):
                    diffs.append(str(pkg / name))
        return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when checked-in modules differ")
    args = parser.parse_args(argv)
    if args.check:
        diffs = differences()
        for d in diffs:
            print(f"out of date: {d}", file=sys.stderr)
        return 1 if diffs else 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for proto in PROTOS:
            pkg = Path(proto).parent
            for name in OUTPUTS:
                shutil.copyfile(Path(tmp) / pkg / name, ROOT / pkg / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
