"""The code map of docs/architecture.md holds: every import points down to the pure core, the objects layer and
the shared layers (``kubeapi``, ``service``), never sideways or up. A new import that breaks the rule fails here
with the file, the line and the rule it breaks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SE = "scheduler_extender"
SHARED = {"kubeapi", "service"}
# package -> what it may import besides itself and the shared layers (docs/architecture.md, "The code")
ALLOWED: dict[str, set[str]] = {
    f"{SE}.cmd": {f"{SE}.api", f"{SE}.admission", f"{SE}.extender", f"{SE}.controller", f"{SE}.multicluster",
                  f"{SE}.objects", f"{SE}.core"},
    f"{SE}.cli": {f"{SE}.multicluster", f"{SE}.objects", f"{SE}.core"},
    f"{SE}.api": {f"{SE}.objects", f"{SE}.core"},
    f"{SE}.admission": {f"{SE}.objects", f"{SE}.core"},
    f"{SE}.extender": {f"{SE}.objects", f"{SE}.core"},
    f"{SE}.controller": {f"{SE}.objects", f"{SE}.core"},
    f"{SE}.multicluster": {f"{SE}.objects", f"{SE}.core"},
    f"{SE}.simulator": {f"{SE}.core"},
    f"{SE}.objects": {f"{SE}.core"},
    f"{SE}.core": set(),
    "inference": set(),
    "device_plugin": {"protos"},
    "npd": {"device_plugin", "protos"},
    "cni": {"device_plugin", "protos"},
    "kubeapi": set(),
    "service": set(),
    "protos": set(),
}
NO_SHARED = {f"{SE}.core", f"{SE}.simulator", "service", "kubeapi", "protos"}  # the bottom: nothing of accelstack
OURS = {"scheduler_extender", "inference", "device_plugin", "npd", "cni", "kubeapi", "service", "protos"}


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == SE and len(parts) > 1 else parts[0]


def imports(root: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, importing package, imported module) for every accelstack import in the product code."""
    found = []
    for top in sorted(OURS):
        for path in sorted((root / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            rel = path.relative_to(root)
            here = package_of(".".join(rel.with_suffix("").parts))
            for node in ast.walk(ast.parse(path.read_text(), str(rel))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] if node.module != SE else [f"{SE}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                found += [(str(rel), node.lineno, here, n) for n in names if n.split(".")[0] in OURS]
    return found


def violations(root: Path) -> list[str]:
    broken = []
    for file, line, here, module in imports(root):
        there = package_of(module)
        if there == here or (there in SHARED and here not in NO_SHARED):
            continue
        if there not in ALLOWED.get(here, set()):
            broken.append(f"{file}:{line}: {here} imports {module} (allowed: "
                          f"{', '.join(sorted(ALLOWED.get(here, set()) | (SHARED - NO_SHARED if here not in NO_SHARED else set()))) or 'nothing of accelstack'})")
    return broken


def test_every_import_points_down_the_code_map() -> None:
    broken = violations(ROOT)
    assert not broken, "\n".join(broken)


def test_the_map_names_every_package() -> None:
    """A new package gets a row in the map (and here) before it gets code."""
    packages = {package_of(".".join(p.relative_to(ROOT).parent.parts)) for top in OURS
                for p in (ROOT / top).rglob("__init__.py")} - {SE}  # the top folder holds only packages
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))
    doc = (ROOT / "docs/architecture.md").read_text()
    for package in ALLOWED:
        folder = package.replace(".", "/") + "/"
        short = folder.removeprefix(f"{SE}/")
        assert f"`{folder}`" in doc or f"`{short}`" in doc, f"docs/architecture.md has no row for {folder}"


def test_the_check_sees_sideways_and_upward_imports(tmp_path: Path) -> None:
    """Function-level imports and the ``from scheduler_extender import x`` form are found too."""
    (tmp_path / SE / "objects").mkdir(parents=True)
    (tmp_path / SE / "core").mkdir()
    (tmp_path / SE / "objects" / "view.py").write_text(
        "from scheduler_extender.core import gpr\n\ndef f():\n    from scheduler_extender.api import app\n")
    (tmp_path / SE / "core" / "queue.py").write_text("from scheduler_extender import controller\nimport service\n")
    broken = violations(tmp_path)
    assert [b.split(" (")[0] for b in broken] == [
        f"{SE}/core/queue.py:1: {SE}.core imports {SE}.controller",
        f"{SE}/core/queue.py:2: {SE}.core imports service",
        f"{SE}/objects/view.py:4: {SE}.objects imports {SE}.api"]
