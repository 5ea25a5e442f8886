"""Command-line flags of the accelstack processes, checked one way everywhere (as ``observability`` logs and serves
metrics one way): each flag has an environment variable ``<PREFIX><FLAG>`` (upper case, ``-`` → ``_``) and the flag
wins; a bad value raises :class:`UsageError` naming the flag — and its variable, for processes that say so — which
the process's ``main`` turns into one line on stderr and exit code 2 (:func:`run_service` does it for the
long-running API-server clients).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, NoReturn

from service.observability import setup_logging

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "text")


class UsageError(ValueError):
    """A flag (or its environment variable) has a value the process cannot use."""


class Parser(argparse.ArgumentParser):
    """Every process's argument parser: a flag argparse cannot parse (unknown, missing its value) is one line
    ``PROG: error: MESSAGE`` and a pointer to ``--help`` (exit 2), not the whole usage before the error — the
    form ``accelstack simulate`` uses too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the options.\n")


def env_name(prefix: str, flag: str) -> str:
    return prefix + flag.upper().replace("-", "_")


def adder(parser: argparse.ArgumentParser, environ: Mapping[str, str], prefix: str) -> Any:
    """``add(flag, default, help_text, **kw)`` for ``parser``: the default comes from the flag's variable when
    set, and the help names the variable and the built-in default."""

    def add(flag: str, default: str, help_text: str, **kw: Any) -> None:
        name = env_name(prefix, flag)
        parser.add_argument(f"--{flag}", default=environ.get(name, default),
                            help=f"{help_text} [env {name}; default {default!r}]", **kw)

    return add


def add_api_flags(add: Any, environ: Mapping[str, str], lease_name: str = "", identity: bool = True,
                  api_timeout: bool = True) -> None:
    """The flags of a process that talks to the API server: its kubeconfig, the API call timeout and, with
    ``lease_name``, the leader Lease (and ``--identity`` in it)."""
    add("kubeconfig", "", "kubeconfig file; empty: in-cluster service account, then ~/.kube/config")
    if lease_name:
        add("lease-namespace", environ.get("POD_NAMESPACE", "accelstack-system"), "namespace of the leader Lease")
        add("lease-name", lease_name, "name of the leader Lease")
        if identity:
            add("identity", environ.get("POD_NAME", ""), "leader-election identity (default: host-pid)")
        add("lease-seconds", "15", "leader lease duration (renew deadline 2/3 of it, retry period 2/15)")
    if api_timeout:
        add("api-timeout", "10", "seconds before an API server call is abandoned (reads are retried with backoff)")


def add_logging_flags(add: Any) -> None:
    add("log-level", "info", "debug, info, warning or error")
    add("log-format", "json", "json or text")


class Checked:
    """Parsed flags, read with checks whose errors name the flag (``--flag`` or ``--flag (env VAR)``)."""

    def __init__(self, args: argparse.Namespace, prefix: str, name_env: bool = False) -> None:
        self.args = args
        self.prefix = prefix
        self.name_env = name_env

    @classmethod
    def parse(cls, parser: argparse.ArgumentParser, argv: Sequence[str] | None, prefix: str,
              name_env: bool = False) -> Checked:
        return cls(parser.parse_args(argv), prefix, name_env)

    def label(self, flag: str) -> str:
        return f"--{flag} (env {env_name(self.prefix, flag)})" if self.name_env else f"--{flag}"

    def raw(self, flag: str) -> str:
        return str(getattr(self.args, flag.replace("-", "_")))

    def number(self, flag: str, cast: type = float, minimum: float = 0, maximum: float | None = None) -> Any:
        value = self.raw(flag)
        try:
            number = cast(value)
        except ValueError:
            raise UsageError(f"{self.label(flag)}: not a number: {value!r}") from None
        if isinstance(number, float) and not math.isfinite(number):
            raise UsageError(f"{self.label(flag)}: must be a finite number, got {value!r}")
        if number < minimum or (maximum is not None and number > maximum):
            bound = f"between {minimum:g} and {maximum:g}" if maximum is not None else f">= {minimum:g}"
            raise UsageError(f"{self.label(flag)}: must be {bound}, got {value!r}")
        return number

    def boolean(self, flag: str) -> bool:
        value = self.raw(flag).strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"{self.label(flag)}: not a boolean (true/false): {value!r}")

    def listen(self, flag: str = "listen") -> tuple[str, int]:
        """``host:port`` or ``:port`` (every address)."""
        value = self.raw(flag)
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise UsageError(f"{self.label(flag)}: must be host:port or :port, got {value!r}")
        return host or "0.0.0.0", int(port)

    def existing_file(self, flag: str) -> str:
        """A path that must name a file when given ("" when not)."""
        path = self.raw(flag)
        if path and not os.path.isfile(path):
            raise UsageError(f"{self.label(flag)}: no such file: {path}")
        return path

    def one_of(self, flag: str, options: Sequence[str]) -> str:
        value = self.raw(flag)
        if value not in options:
            raise UsageError(f"{self.label(flag)}: one of {', '.join(options)}; got {value!r}")
        return value

    def logging(self) -> tuple[str, str]:
        """(--log-level, --log-format)."""
        return self.one_of("log-level", LOG_LEVELS), self.one_of("log-format", LOG_FORMATS)


def run_loop(coro: Coroutine[Any, Any, None], fast: bool = True) -> None:
    """Run ``coro`` to completion on uvloop where it is installed (Linux, a dependency) and ``fast`` is asked for,
    else on asyncio's own loop. uvloop cuts the cost of each HTTP request a process serves by a third to a half
    (the gateway's proxied requests: bench/bench_gateway.py; the extender's filter, 1.66 -> 1.08 ms p50 over
    HTTP: bench/bench_control_plane.py); processes whose loop drives grpc.aio (the device plugins) keep
    asyncio's loop, the one grpc.aio supports."""
    import asyncio  # here, not at the top: the NPD plugins parse flags with this module and start every few
    # seconds on every node, where asyncio's import (about 20 ms) would be a tenth of a run

    if fast:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(coro)
            return
    asyncio.run(coro)


def run_service(prog: str, argv: Sequence[str] | None, parse: Callable[[Sequence[str] | None], dict[str, Any]],
                serve: Callable[[dict[str, Any]], Coroutine[Any, Any, None]], log: logging.Logger,
                fast_loop: bool = False) -> int:
    """A long-running process's ``main``: a usage error is one line on stderr and exit 2; otherwise logging is
    set up and ``serve(opts)`` runs until it returns (exit 0, as after SIGTERM); failing to serve (a port or
    certificate, an OSError) or to start at all (kubeconfig missing, API server unreachable) is one log line and
    exit 1. ``fast_loop``: on uvloop (:func:`run_loop`)."""
    try:
        opts = parse(argv)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    setup_logging(opts["log_level"], opts["log_format"])
    try:
        run_loop(serve(opts), fast_loop)
    except OSError as exc:
        log.error("cannot serve", extra={"error": str(exc)[:500]})
        return 1
    except Exception as exc:
        log.error("cannot start", extra={"error": f"{type(exc).__name__}: {exc}"[:500]})
        return 1
    return 0
