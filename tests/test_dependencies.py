"""The runtime dependencies pyproject.toml declares are the ones the product imports (issue 38.3): each declared
distribution is imported by some product module, each third-party module a product module imports is declared,
and matplotlib, which only ``accelstack simulate ... --plot`` uses, is the ``plots`` extra, not a dependency
of every install and image."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("device_plugin", "service", "scheduler_extender", "npd", "cni", "protos", "kubeapi", "inference")
# distribution -> the module it is imported as, where the two names differ
MODULE_OF = {"nvidia-ml-py": "pynvml", "PyYAML": "yaml", "kubernetes-asyncio": "kubernetes_asyncio",
             "protobuf": "google.protobuf", "prometheus-client": "prometheus_client", "grpcio": "grpc"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def distribution(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return match.group(0)


def imported_modules() -> dict[str, str]:
    """Every dotted module a product file imports (absolute imports, function-level ones too, the generated
    protobuf modules included: they are what imports protobuf) -> one file that does."""
    found: dict[str, str] = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_declared_runtime_dependency_is_imported_by_the_product() -> None:
    imported = imported_modules()
    unused = []
    for requirement in project()["dependencies"]:
        dist = distribution(requirement)
        module = MODULE_OF.get(dist, dist.replace("-", "_").lower())
        if not any(name == module or name.startswith(module + ".") for name in imported):
            unused.append(f"{dist} (module {module})")
    assert not unused, f"declared in pyproject.toml, imported by no product module: {', '.join(unused)}"


def test_every_third_party_module_the_product_imports_is_declared() -> None:
    declared = {MODULE_OF.get(d, d.replace("-", "_").lower()).split(".")[0]
                for d in map(distribution, project()["dependencies"])}
    extras = {"matplotlib"}  # the plots extra: imported only when --plot draws
    developer = {("grpc_tools", "protos/generate.py")}  # regenerating the protos is a dev-extra task
    undeclared = sorted(f"{name} ({where})" for name, where in imported_modules().items()
                        if (top := name.split(".")[0]) not in sys.stdlib_module_names
                        and top not in PRODUCT and top not in declared | extras and (top, where) not in developer)
    assert not undeclared, f"imported but not a declared dependency: {', '.join(undeclared)}"


def test_matplotlib_is_an_extra_and_pyroute2_is_gone() -> None:
    meta = project()
    runtime = {distribution(r) for r in meta["dependencies"]}
    extras = {name: {distribution(r) for r in reqs} for name, reqs in meta["optional-dependencies"].items()}
    assert "matplotlib" not in runtime and "matplotlib" in extras["plots"]
    assert "matplotlib" in extras["dev"]  # the tests that draw a plot keep running
    assert "pyroute2" not in runtime | set().union(*extras.values())


def test_plot_without_matplotlib_fails_before_the_run_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An install without the plots extra: ``--plot`` is refused up front (exit 2, one line naming the extra),
    not after a replay that may run for an hour."""
    from scheduler_extender.simulator import cli

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started although --plot cannot draw")

    monkeypatch.setattr(cli, "run_fill", no_run)
    monkeypatch.setattr(cli, "run_replay", no_run)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without it does: ImportError
    assert cli.main(["simulate", "replay", "--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("accelstack simulate replay: error: --plot needs matplotlib")
    assert "pip install 'accelstack[plots]'" in err[0]
    assert not (tmp_path / "r.png").exists()
