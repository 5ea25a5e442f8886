"""The commands the documentation tells people to run, and the output it shows, match the product.

- Every command in a shell block (```bash, ```console lines starting with ``$``, ```sh, unlabelled) of
  README.md and docs/*.md, and every inline `code span` that starts with one of this repository's commands,
  that names something of this repository names something that exists: a script or
  file, a ``python -m`` module, a console script of pyproject.toml, a manifest path given to kubectl, a test path
  given to pytest.
- Every ``--flag`` such a command passes is one its entry point accepts (its ``--help`` lists it).
- What docs say ``scripts/demo.sh`` runs is what it runs.
- The tour's sample output: the device-plugin demo is run and compared line by line (numbers masked); the
  simulator demo's table is compared, column by column, with a short replay (the demo itself takes minutes).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
CONSOLE_SCRIPTS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
REPO_PACKAGES = ("device_plugin", "scheduler_extender", "npd", "cni", "protos", "bench", "tests", "scripts")
PYTHONS = ("python", "python3", ".venv/bin/python")
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    words: tuple[str, ...]

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.words)}"


def blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced block."""
    found = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if match:
            start, language = i + 1, match.group(1)
            i += 1
            body = []
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            found.append((language, start + 1, body))
        i += 1
    return found


def commands_of(path: Path) -> list[Command]:
    found = []
    for language, first, body in blocks(path.read_text()):
        if language not in SHELL_LANGUAGES:
            continue
        pending, start = "", 0
        for offset, raw in enumerate(body):
            line = raw.strip()
            if language == "console" and not pending:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            if not pending:
                start = first + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = pending + line, ""
            if not line or line.startswith("#"):
                continue
            try:
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.commenters = "#"
                lexer.whitespace_split = True
                tokens = list(lexer)
            except ValueError:  # an unbalanced quote across lines of a sample (a JSON body): not a command
                continue
            current: list[str] = []
            for token in [*tokens, ";"]:
                if token in SEPARATORS:
                    if current:
                        found.append(Command(path.name, start, tuple(current)))
                    current = []
                else:
                    current.append(token)
    return found


def inline_commands(path: Path) -> list[Command]:
    """`accelstack simulate replay --load 4 --audit` in running text (outside fenced blocks)."""
    found = []
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if re.match(r"^\s*```", line):
            inside = not inside
            continue
        if inside:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            words = span.split()
            if len(words) < 2 or "<" in span or "…" in span:
                continue
            starts = words[0] in CONSOLE_SCRIPTS or words[0] in PYTHONS or words[0].startswith(("scripts/", "bench/"))
            if starts:
                found.append(Command(path.name, number, tuple(words)))
    return found


def all_commands() -> list[Command]:
    return [c for path in DOCS for c in [*commands_of(path), *inline_commands(path)]]


def entry_point(command: Command) -> tuple[list[str], list[str]] | None:
    """(the argv that names the entry point, the rest) when the command runs something of this repository."""
    words = list(command.words)
    while words and re.match(r"^\w+=", words[0]):  # VAR=value prefixes
        words.pop(0)
    if words[:1] == ["sudo"]:
        words.pop(0)
    if not words:
        return None
    head = words[0]
    if head in ("bash", "sh") and len(words) > 1:
        return words[:2], words[2:]
    if head in PYTHONS and len(words) > 2 and words[1] == "-m":
        subcommands = _subcommands(words[3:])
        return words[:3 + len(subcommands)], words[3 + len(subcommands):]
    if head in PYTHONS and len(words) > 1 and words[1].endswith(".py"):
        return words[:2], words[2:]
    if head.startswith(("scripts/", "bench/", "./scripts/")):
        return words[:1], words[1:]
    if head in CONSOLE_SCRIPTS or head.startswith(".venv/bin/accelstack"):
        subcommands = _subcommands(words[1:])
        return words[:1 + len(subcommands)], words[1 + len(subcommands):]
    return None


def _subcommands(words: list[str]) -> list[str]:
    taken = []
    for word in words[:2]:
        if not re.fullmatch(r"[a-z][a-z-]*", word):
            break
        taken.append(word)
    return taken


def repository_paths(command: Command) -> list[str]:
    """Paths of this repository a command reads: kubectl -f/-k arguments, pytest targets."""
    words = list(command.words)
    paths = []
    if words[:1] == ["kubectl"]:
        for flag, value in itertools.pairwise(words):
            if flag in ("-f", "-k", "--filename", "--kustomize") and not value.startswith(("http", "-", "<")):
                paths.append(value)
    if "pytest" in words[:3]:
        paths += [w.split("::")[0] for w in words if w.startswith("tests")]
    return [p for p in paths if not p.startswith(("/", "$", "~")) and "*" not in p and "<" not in p]


COMMANDS = all_commands()


def test_the_docs_have_commands_to_check() -> None:
    """The extraction finds the commands (a parser that finds nothing would pass every test below)."""
    names = {" ".join(c.words[:2]) for c in COMMANDS}
    assert {"scripts/demo.sh", "scripts/test.sh"} <= {c.words[0] for c in COMMANDS}
    assert "kubectl apply" in names
    assert sum(1 for c in COMMANDS if entry_point(c)) >= 20


@pytest.mark.parametrize("command", [c for c in COMMANDS if entry_point(c)], ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_entry_points_exist(command: Command) -> None:
    found = entry_point(command)
    assert found is not None
    argv, _rest = found
    head = argv[0]
    if head in ("bash", "sh"):
        assert (ROOT / argv[1]).is_file(), command.where()
    elif head in PYTHONS and argv[1] == "-m":
        module = argv[2]
        if module.split(".")[0] in REPO_PACKAGES:
            assert importlib.util.find_spec(module) is not None, command.where()
    elif head in PYTHONS:
        assert (ROOT / argv[1]).is_file(), command.where()
    elif head.startswith(("scripts/", "bench/", "./scripts/")):
        assert (ROOT / head).is_file(), command.where()
        assert os.access(ROOT / head, os.X_OK) or head.endswith(".py"), f"not executable: {command.where()}"
    else:
        assert Path(head).name in CONSOLE_SCRIPTS, command.where()


@pytest.mark.parametrize("command", [c for c in COMMANDS if repository_paths(c)], ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_repository_paths_exist(command: Command) -> None:
    for path in repository_paths(command):
        assert (ROOT / path).exists(), f"{path} does not exist: {command.where()}"


@cache
def help_text(argv: tuple[str, ...]) -> str:
    """``--help`` of a Python entry point (never a shell script: those set things up)."""
    head = argv[0]
    if head in PYTHONS:
        run = [sys.executable, *argv[1:]]
    else:
        run = [str(Path(sys.executable).parent / Path(head).name), *argv[1:]]
    result = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, f"{' '.join(argv)} --help: {result.stderr[-500:]}"
    return result.stdout


def flagged() -> list[Command]:
    out = []
    for command in COMMANDS:
        found = entry_point(command)
        if found is None or found[0][0] in ("bash", "sh") or found[0][0].endswith(".sh"):
            continue
        if any(w.startswith("--") for w in found[1]):
            out.append(command)
    return out


@pytest.mark.parametrize("command", flagged(), ids=lambda c: f"{c.doc}:{c.line}")
def test_documented_flags_are_accepted(command: Command) -> None:
    found = entry_point(command)
    assert found is not None
    argv, rest = found
    text = help_text(tuple(argv))
    for word in rest:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
                f"{flag} is not an option of {' '.join(argv)}: {command.where()}"


def test_what_docs_say_demo_sh_runs_is_what_it_runs() -> None:
    script = (ROOT / "scripts/demo.sh").read_text()
    (runs,) = re.findall(r"^exec \.venv/bin/(accelstack [\w ]+?) \"\$@\"$", script, re.MULTILINE)
    assert runs == "accelstack simulate demo"
    for path in DOCS:
        text = path.read_text()
        if "scripts/demo.sh" not in text:
            continue
        assert runs in text, f"{path.name} mentions scripts/demo.sh but not what it runs ({runs})"
        for line in text.splitlines():
            if "scripts/demo.sh" in line:
                assert "kubelet" not in line and "device plugin" not in line, f"{path.name}: {line.strip()}"


def sample(doc: str, first_line: str) -> list[str]:
    """The lines of the console block of ``doc`` that starts with ``first_line``."""
    for language, _start, body in blocks((ROOT / "docs" / doc).read_text()):
        if language == "console" and body and body[0].startswith(first_line):
            return body
    raise AssertionError(f"docs/{doc}: no console block starting with {first_line!r}")


def masked(line: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", line.rstrip())


def test_tour_device_plugin_demo_output_is_what_the_demo_prints() -> None:
    documented = sample("tour.md", "NVML:")
    result = subprocess.run([sys.executable, "scripts/device_plugin_demo.py"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.splitlines()
    if printed[0].startswith("NVML: found"):  # a machine with a GPU prints its GPUs first
        pytest.skip("this machine has NVML; the sample shows a machine without")
    assert [masked(line) for line in printed] == [masked(line) for line in documented]


def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_tour_simulator_table_has_the_columns_and_rows_the_simulator_prints() -> None:
    documented = sample("tour.md", "Queueing (seconds)")
    result = subprocess.run([str(Path(sys.executable).parent / "accelstack"), "simulate", "replay", "--max-jobs",
                             "50", "--days", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.splitlines()
    start = printed.index(documented[0])
    assert columns(printed[start + 1]) == columns(documented[1])
    assert [columns(r)[:2] for r in printed[start + 3:start + 6]] == [columns(r)[:2] for r in documented[3:6]]
    assert all(len(columns(r)) == len(columns(documented[1])) for r in documented[3:6])
