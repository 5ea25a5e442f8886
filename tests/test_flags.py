"""The flag checks every accelstack process shares (service/flags.py): errors name the flag, and its
environment variable where the process says so; the variable sets a default the flag overrides."""

from __future__ import annotations

import argparse

import pytest

from service.flags import Checked, UsageError, adder


def parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add = adder(p, environ, "X_")
    add("listen", ":80", "where")
    add("count", "3", "how many")
    add("on", "true", "switch")
    add("file", "", "a file")
    add("log-level", "info", "level")
    add("log-format", "json", "format")
    return p


def test_values_from_flags_and_variables() -> None:
    flags = Checked.parse(parser({"X_COUNT": "7"}), ["--listen", "127.0.0.1:9"], "X_")
    assert flags.listen() == ("127.0.0.1", 9) and flags.number("count", int, 1) == 7
    assert flags.boolean("on") is True and flags.existing_file("file") == "" and flags.logging() == ("info", "json")
    assert Checked.parse(parser({"X_COUNT": "7"}), ["--count", "2"], "X_").number("count", int) == 2
    assert Checked.parse(parser({}), ["--listen", ":5"], "X_").listen() == ("0.0.0.0", 5)
    assert "[env X_COUNT; default '3']" in parser({}).format_help()


@pytest.mark.parametrize(("argv", "call", "message"), [
    (["--listen", "nowhere"], lambda f: f.listen(), "--listen: must be host:port or :port, got 'nowhere'"),
    (["--listen", ":99999"], lambda f: f.listen(), "--listen: must be host:port or :port, got ':99999'"),
    (["--count", "many"], lambda f: f.number("count", int), "--count: not a number: 'many'"),
    (["--count", "0"], lambda f: f.number("count", int, 1), "--count: must be >= 1, got '0'"),
    (["--count", "9"], lambda f: f.number("count", int, 0, 5), "--count: must be between 0 and 5, got '9'"),
    (["--on", "perhaps"], lambda f: f.boolean("on"), "--on: not a boolean (true/false): 'perhaps'"),
    (["--file", "/no/such"], lambda f: f.existing_file("file"), "--file: no such file: /no/such"),
    (["--log-level", "loud"], lambda f: f.logging(), "--log-level: one of debug, info, warning, error; got 'loud'"),
])
def test_bad_values_name_the_flag(argv: list[str], call: object, message: str) -> None:
    with pytest.raises(UsageError) as err:
        call(Checked.parse(parser({}), argv, "X_"))  # type: ignore[operator]
    assert str(err.value) == message


def test_processes_that_name_the_variable_too() -> None:
    with pytest.raises(UsageError, match=r"^--count \(env X_COUNT\): not a number: 'x'$"):
        Checked.parse(parser({"X_COUNT": "x"}), [], "X_", name_env=True).number("count")


def test_a_service_runs_on_uvloop_when_it_asks_and_on_asyncio_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extender and the controller serve on uvloop (half the cost of each request they answer); the device
    plugins keep asyncio's loop, which grpc.aio supports. A failing service still exits 1 with one log line."""
    import asyncio
    import logging

    import uvloop

    from service import flags
    from service.flags import run_loop, run_service

    monkeypatch.setattr(flags, "setup_logging", lambda level, fmt: None)  # leave the test run's logging alone
    seen: list[type] = []

    async def probe() -> None:
        seen.append(type(asyncio.get_running_loop()))

    run_loop(probe())
    run_loop(probe(), fast=False)
    assert seen[0] is uvloop.Loop and not issubclass(seen[1], uvloop.Loop)

    def parse(argv: object) -> dict[str, str]:
        return {"log_level": "error", "log_format": "json"}

    async def serve(opts: dict[str, str]) -> None:
        seen.append(type(asyncio.get_running_loop()))
        raise OSError("port taken")

    assert run_service("x", [], parse, serve, logging.getLogger("x"), fast_loop=True) == 1
    assert seen[2] is uvloop.Loop


def console_scripts() -> dict[str, str]:
    """Every process pyproject.toml installs: name -> module (its ``main``)."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


# runs its plugin in a thread and leaves with os._exit (NPD must not wait for a check stuck in a C call):
# started as NPD starts it
NPD_PLUGINS = {"accelstack-npd-gpu", "accelstack-npd-nr1"}
# no flags at all: the runtime passes everything as CNI_* variables (tests/cni/test_units.py has its --help)
NO_FLAGS = {"accelstack-nr1-cni"}
ELSEWHERE: set[str] = set()


@pytest.mark.parametrize("prog", sorted(set(console_scripts()) - NO_FLAGS - ELSEWHERE))
def test_a_flag_argparse_cannot_parse_is_one_line_and_a_help_pointer(
        prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``PROG: error: MESSAGE`` and ``Run 'PROG --help' for the options.``, exit 2 — not the whole usage (for
    the NPD plugin, 296 lines) before the error."""
    import importlib
    import subprocess
    import sys
    from pathlib import Path

    module = console_scripts()[prog]
    code: object
    if prog in NPD_PLUGINS:
        run = subprocess.run([sys.executable, "-m", module, "--no-such-flag"], capture_output=True, text=True,
                             timeout=60, cwd=Path(__file__).resolve().parents[1], check=False)
        code, err = run.returncode, run.stderr
        assert run.stdout == "bad arguments (see stderr)\n"  # what NPD shows in the condition
    else:
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(module).main(["--no-such-flag"])
        code, err = exit_.value.code, capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert lines[1] == f"Run '{prog} --help' for the options."


def test_the_shared_parser_keeps_a_missing_value_to_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from service.flags import Parser

    p = Parser(prog="x")
    adder(p, {}, "X_")("count", "3", "how many")
    with pytest.raises(SystemExit) as exit_:
        p.parse_args(["--count"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "x: error: argument --count: expected one argument\nRun 'x --help' for the options.\n"
