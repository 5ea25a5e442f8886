"""Readers for the trace and node files (plain comma-separated, header line first, no quoting).

Every problem is reported as :class:`TraceError` naming file, line and column (1-based, the column is the
character where the offending field starts) so a user can jump straight to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..core.inventory import GPU, NodeSpec

MAX_INT = 2**53  # any integer field: beyond this, floats (the virtual clock) lose whole units
MAX_DEVICES_PER_NODE = 256
MAX_TIMESTAMP_S = 4_102_444_800  # 2100-01-01 in Unix seconds: larger values are milli-/micro-/nanoseconds
MAX_DURATION_S = 10 * 366 * 86400  # ten years
# No trace line comes near this (the longest bundled one is under 200 characters); a longer one is not a CSV
# line (a binary file, a file without newlines) and is refused before it is read whole into memory.
MAX_LINE_CHARS = 1 << 20
MAX_MESSAGE_CHARS = 200  # an error never echoes more of the input than this


def clip(text: str, limit: int = 40) -> str:
    """``repr(text)``, cut to about ``limit`` characters: an error quotes enough to find the value, never a
    whole hostile line."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[: limit - 1]}…"


class TraceError(ValueError):
    def __init__(self, path: Path | str, line: int, column: int, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        super().__init__(f"{path}:{line}:{column}: {message}")
        self.path, self.line, self.column, self.message = str(path), line, column, message


def _int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise ValueError("must not be negative")
    if v > MAX_INT:
        raise ValueError(f"more than {MAX_INT}")
    return v


def _int_upto(limit: int, why: str) -> Callable[[str], int]:
    """An integer from 0 to ``limit``; above it the error says ``why`` the limit exists."""

    def conv(text: str) -> int:
        v = int(text)
        if v < 0:
            raise ValueError("must not be negative")
        if v > limit:
            raise ValueError(f"more than {limit:,}: {why}")
        return v

    return conv


def _str(text: str) -> str:
    return text


Field = tuple[str, Callable[[str], object], bool]  # name, converter, required


def _readline(fh: TextIO, path: Path, lineno: int) -> str:
    """One line of at most MAX_LINE_CHARS characters (a longer one is an error, read no further)."""
    try:
        raw = fh.readline(MAX_LINE_CHARS + 1)
    except UnicodeDecodeError as exc:
        raise TraceError(path, lineno, 1, "not UTF-8 text") from exc
    if len(raw) > MAX_LINE_CHARS:
        raise TraceError(path, lineno, 1, f"line longer than {MAX_LINE_CHARS:,} characters: not a CSV file "
                                          "with one record per line")
    return raw


def _rows(path: Path, fields: list[Field]) -> Iterator[tuple[int, dict[str, object], dict[str, int]]]:
    """Yield ``(line number, converted fields, 1-based column of each field)`` for each data line; raise
    TraceError on any problem."""
    try:
        fh = path.open(encoding="utf-8-sig")  # a leading byte-order mark is not part of the first column's name
    except OSError as exc:
        raise TraceError(path, 0, 0, f"cannot read: {exc.strerror or exc}") from exc
    with fh:
        header_line = _readline(fh, path, 1)
        header = [h.strip() for h in header_line.rstrip("\r\n").split(",")]
        if not header_line.strip():
            raise TraceError(path, 1, 1, "empty file: expected a header line")
        pos: dict[str, int] = {}
        for name, _, required in fields:
            if name in header:
                pos[name] = header.index(name)
            elif required:
                has = ", ".join(header)
                raise TraceError(path, 1, 1, f"header lacks column {name!r} (has: {has[:80]}"
                                             f"{'…' if len(has) > 80 else ''})")
        lineno = 1
        while True:
            raw = _readline(fh, path, lineno + 1)
            if not raw:
                break
            lineno += 1
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            if '"' in line:
                raise TraceError(path, lineno, line.index('"') + 1, "quoted fields are not supported")
            cells = line.split(",")
            if len(cells) != len(header):
                col = len(line) + 1 if len(cells) < len(header) else sum(len(c) + 1 for c in cells[: len(header)]) + 1
                raise TraceError(path, lineno, col, f"expected {len(header)} fields, found {len(cells)}")
            starts = [0]
            for c in cells[:-1]:
                starts.append(starts[-1] + len(c) + 1)
            out: dict[str, object] = {}
            cols: dict[str, int] = {}
            for name, conv, _ in fields:
                if name not in pos:
                    continue
                i = pos[name]
                text = cells[i].strip()
                cols[name] = starts[i] + 1
                try:
                    out[name] = conv(text)
                except ValueError as exc:
                    why = str(exc).replace(repr(text), clip(text))  # int() quotes the whole text
                    raise TraceError(path, lineno, starts[i] + 1,
                                     f"column {name!r}: bad value {clip(text)} ({why})") from exc
            yield lineno, out, cols


def _unique(path: Path, what: str, value: str, lineno: int, column: int, seen: dict[str, int]) -> None:
    """Refuse a name seen on an earlier line (``seen``: name -> its line)."""
    if value in seen:
        raise TraceError(path, lineno, column, f"{what} {clip(value)} repeated (first on line {seen[value]}): "
                                               "each must be unique")
    seen[value] = lineno


# ------------------------------------------------------------------------------------------ openb
@dataclass(frozen=True)
class Pod:
    """One openb pod: host CPU/memory, ``num_gpu`` devices of ``gpu_milli`` each, allowed models."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str]

    def gpu_request(self) -> int:
        return self.num_gpu * self.gpu_milli if self.num_gpu else 0


def read_openb_nodes(path: Path) -> list[NodeSpec]:
    """``sn, cpu_milli, memory_mib, gpu, model``: GPU nodes only (rows with 0 GPUs are skipped)."""
    fields: list[Field] = [
        ("sn", _str, True),
        ("cpu_milli", _int, True),
        ("memory_mib", _int, True),
        ("gpu", _int_upto(MAX_DEVICES_PER_NODE, "no node has that many devices"), True),
        ("model", _str, True),
    ]
    nodes: list[NodeSpec] = []
    seen: dict[str, int] = {}
    for lineno, r, col in _rows(path, fields):
        name = str(r["sn"])
        if not name:
            raise TraceError(path, lineno, col["sn"], "node name is empty")
        _unique(path, "node name", name, lineno, col["sn"], seen)
        if int(r["gpu"]) == 0:  # type: ignore[call-overload]
            continue
        nodes.append(
            NodeSpec(
                name=name,
                devices=int(r["gpu"]),  # type: ignore[call-overload]
                model=str(r["model"]),
                resource=GPU,
                cpu_milli=int(r["cpu_milli"]),  # type: ignore[call-overload]
                memory_mib=int(r["memory_mib"]),  # type: ignore[call-overload]
            )
        )
    if not nodes:
        raise TraceError(path, 1, 1, "no GPU nodes in file")
    return nodes


def _milli(text: str) -> int:
    v = _int(text)
    if v > 1000:
        raise ValueError("gpu_milli is at most 1000")
    return v


def _spec(text: str) -> frozenset[str]:
    return frozenset(s for s in text.split("|") if s)


def read_openb_pods(path: Path, max_gpus: int = MAX_DEVICES_PER_NODE) -> list[Pod]:
    """``name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec, …]`` (extra columns ignored).
    ``max_gpus``: the most GPUs any node has (a pod asking for more is refused: it could never run)."""
    fields: list[Field] = [
        ("name", _str, True),
        ("cpu_milli", _int, True),
        ("memory_mib", _int, True),
        ("num_gpu", _int_upto(max_gpus, "no node has that many GPUs"), True),
        ("gpu_milli", _milli, True),
        ("gpu_spec", _spec, False),
    ]
    pods = []
    seen: dict[str, int] = {}
    for lineno, r, col in _rows(path, fields):
        # the protocol sorts pods by name: a repeated name would make the order depend on the file's order
        _unique(path, "pod name", str(r["name"]), lineno, col["name"], seen)
        num, milli = int(r["num_gpu"]), int(r["gpu_milli"])  # type: ignore[call-overload]
        if num > 0 and milli == 0:
            raise TraceError(path, lineno, 1, f"pod {clip(str(r['name']))}: num_gpu {num} with gpu_milli 0")
        pods.append(
            Pod(
                name=str(r["name"]),
                cpu_milli=int(r["cpu_milli"]),  # type: ignore[call-overload]
                memory_mib=int(r["memory_mib"]),  # type: ignore[call-overload]
                num_gpu=num,
                gpu_milli=milli if num else 0,
                gpu_spec=r.get("gpu_spec", frozenset()),  # type: ignore[arg-type]
            )
        )
    if not pods:
        raise TraceError(path, 1, 1, "no pods in file")
    return pods


def read_published(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    """The FGD artifact's summary: ``{(workload, policy): {metric: value}}``; policy names lower-cased
    without the numeric prefix (``01-Random`` → ``random``)."""
    fields: list[Field] = [
        ("workload", _str, True),
        ("policy", _str, True),
        ("alloc_ratio_pct@arrived100", float, True),
        ("alloc_ratio_pct@arrived130", float, True),
        ("frag_amount_pct@arrived80", float, True),
        ("frag_ratio_pct@arrived80", float, True),
    ]
    out: dict[tuple[str, str], dict[str, float]] = {}
    for _, r, _ in _rows(path, fields):
        policy = str(r["policy"]).split("-", 1)[-1].lower()
        out[(str(r["workload"]), policy)] = {k: float(v) for k, v in r.items() if isinstance(v, float)}  # type: ignore[arg-type]
    return out


# ----------------------------------------------------------------------------------------- philly
@dataclass(frozen=True)
class Job:
    """One Philly job: when it arrived, how long it ran, how many GPUs, which VC (workspace); optionally the GPU
    model it must run on (``""``: any) and its exitDuration (``None``: drawn; ``math.inf``: none at all, a
    holder whose end nobody can bound)."""

    job_id: str
    submit_s: int
    duration_s: int
    num_gpu: int
    vc: str
    model: str = ""
    exit_s: float | None = None


def _exit(text: str) -> float | None:
    """``exit_duration_s``: empty = drawn, ``none`` = no exitDuration, else whole seconds up to ten years."""
    if not text:
        return None
    if text.lower() == "none":
        return math.inf
    v = _int_upto(MAX_DURATION_S, "ten years")(text)
    if v < 1:
        raise ValueError("must be at least 1 (or none, or empty to draw one)")
    return float(v)


def read_philly_jobs(path: Path, max_gpus: int = MAX_INT) -> list[Job]:
    """``job_id, submit_time_s, duration_s, num_gpu, vc[, gpu_model, exit_duration_s]`` (other columns ignored),
    sorted by submit time. ``gpu_model``: the only model the job may use (empty: any); ``exit_duration_s``: its
    exitDuration (empty: drawn, ``none``: none).
    ``max_gpus``: the cluster's GPUs (a job asking for more is refused: it could never run). Times are whole
    seconds: a submit time past 2100 in Unix seconds (a milli- or nanosecond timestamp) or a duration over
    ten years is refused."""
    fields: list[Field] = [
        ("job_id", _str, True),
        ("submit_time_s", _int_upto(MAX_TIMESTAMP_S, "seconds up to the year 2100 (is it in ms or ns?)"), True),
        ("duration_s", _int_upto(MAX_DURATION_S, "ten years"), True),
        ("num_gpu", _int_upto(max_gpus, "the cluster has fewer GPUs"), True),
        ("vc", _str, True),
        ("gpu_model", _str, False),
        ("exit_duration_s", _exit, False),
    ]
    jobs = []
    seen: dict[str, int] = {}
    for lineno, r, col in _rows(path, fields):
        # the job id is the GPR's name: a second job under it would replace or crash into the first
        _unique(path, "job_id", str(r["job_id"]), lineno, col["job_id"], seen)
        if int(r["num_gpu"]) < 1:  # type: ignore[call-overload]
            raise TraceError(path, lineno, 1, f"job {clip(str(r['job_id']))}: num_gpu must be at least 1")
        jobs.append(
            Job(
                str(r["job_id"]),
                int(r["submit_time_s"]),  # type: ignore[call-overload]
                int(r["duration_s"]),  # type: ignore[call-overload]
                int(r["num_gpu"]),  # type: ignore[call-overload]
                str(r["vc"]),
                str(r.get("gpu_model") or ""),
                r.get("exit_duration_s"),  # type: ignore[arg-type]
            )
        )
    if not jobs:
        raise TraceError(path, 1, 1, "no jobs in file")
    jobs.sort(key=lambda j: (j.submit_s, j.job_id))
    return jobs


def _gib(text: str) -> int:
    t = text.upper().removesuffix("GB").removesuffix("G")
    v = float(t)
    if not math.isfinite(v) or v <= 0 or v > 1 << 20:
        raise ValueError("expected a size such as 12GB")
    return int(v * 1024)


def read_philly_nodes(path: Path) -> list[NodeSpec]:
    """``node_id, gpu_count, gpu_mem[, model]`` (e.g. ``12GB``); the model is ``model`` where given, else named
    after the memory size."""
    fields: list[Field] = [
        ("node_id", _str, True),
        ("gpu_count", _int_upto(MAX_DEVICES_PER_NODE, "no node has that many devices"), True),
        ("gpu_mem", _gib, True),
        ("model", _str, False),
    ]
    nodes = []
    seen: dict[str, int] = {}
    for lineno, r, col in _rows(path, fields):
        _unique(path, "node_id", str(r["node_id"]), lineno, col["node_id"], seen)
        mem = int(r["gpu_mem"])  # type: ignore[call-overload]
        if int(r["gpu_count"]) == 0:  # type: ignore[call-overload]
            continue
        nodes.append(
            NodeSpec(
                name=str(r["node_id"]),
                devices=int(r["gpu_count"]),  # type: ignore[call-overload]
                model=str(r.get("model") or f"{mem // 1024}GB"),
                device_memory_mib=mem,
            )
        )
    if not nodes:
        raise TraceError(path, 1, 1, "no GPU nodes in file")
    return nodes


def read_quotas(path: Path) -> dict[str, int]:
    """``vc, gpus`` → device quota per workspace."""
    fields: list[Field] = [("vc", _str, True), ("gpus", _int, True)]
    out: dict[str, int] = {}
    seen: dict[str, int] = {}
    for lineno, r, col in _rows(path, fields):
        _unique(path, "vc", str(r["vc"]), lineno, col["vc"], seen)  # which of two quotas would hold is a guess
        out[str(r["vc"])] = int(r["gpus"])  # type: ignore[call-overload]
    return out
