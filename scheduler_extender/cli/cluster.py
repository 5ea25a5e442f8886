"""``kubectl accelstack cluster join|leave``: register a member cluster with the hub, or take it out
(docs/multicluster.md). It talks to both API servers directly (the REST API serves one cluster; joining needs
two), with the admin's two kubeconfigs, and prints one line per object as it creates, updates or deletes it.
Bad arguments exit 2, an unreachable or refusing API server exits 1, each with one line saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from typing import Any

DEFAULT_TOKEN_EXPIRY = "24h"


def add_parser(sub: Any, parser_class: type[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """The ``cluster`` subcommand of the plugin's parser."""
    cl = sub.add_parser("cluster", help="member clusters of a hub (docs/multicluster.md)").add_subparsers(
        dest="cluster_command", metavar="COMMAND", parser_class=parser_class)
    cl.required = True
    for verb, text in (("join", "register a member with the hub: prints each object it creates on both sides"),
                       ("leave", "take a member out: deletes what join made, on both sides, and prints it")):
        c = cl.add_parser(verb, help=text)
        c.add_argument("name", help="the member's name on the hub (a DNS label, at most 45 characters)")
        c.add_argument("--hub-kubeconfig", required=True, help="kubeconfig of the hub, as an admin")
        c.add_argument("--kubeconfig", dest="member_kubeconfig", default=None,
                       help="kubeconfig of the member, as an admin (default $KUBECONFIG, ~/.kube/config)")
        if verb == "join":
            c.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                           help="a label of the member on the hub (region=eu-west, provider=aws; repeatable)")
            c.add_argument("--hub-server", default="", help="the hub's API server as the member reaches it "
                                                           "(default: the server in --hub-kubeconfig)")
            c.add_argument("--member-server", default="", help="the member's API server as its workspace "
                           "kubeconfigs reach it, recorded with its CA in the hub's Cluster (default: the server "
                           "in --kubeconfig)")
            c.add_argument("--token-expiry", default=DEFAULT_TOKEN_EXPIRY,
                           help="life of the agent's hub token (the agent renews it past two thirds; default 24h)")
            c.add_argument("--dry-run", action="store_true", help="print what join would create, create nothing")
        c.set_defaults(cluster_run=run_join if verb == "join" else run_leave)


class Usage(ValueError):
    """A bad argument (exit 2)."""


def _kubeconfig(path: str | None, flag: str) -> str:
    path = path or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser("~/.kube/config")
    if not os.path.isfile(path):
        raise Usage(f"{flag}: no such file: {path}")
    return path


def _seconds(value: str) -> int:
    from scheduler_extender.multicluster.join import TOKEN_MIN_S
    from scheduler_extender.objects.gpr_codec import parse_duration

    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise Usage(f"--token-expiry: {exc}") from None
    if seconds < TOKEN_MIN_S:
        raise Usage(f"--token-expiry: at least 10m (the API server's floor), got {value!r}")
    return int(seconds)


def run_join(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    from scheduler_extender.multicluster.clusters import check_name, parse_label

    name = check_name(args.name)
    labels = dict(parse_label(text) for text in args.label)
    seconds = _seconds(args.token_expiry)
    if args.dry_run:
        from scheduler_extender.multicluster.join import plan_lines

        for line in plan_lines(name, labels):
            say(f"{line}: would be created")
        return
    hub_path = _kubeconfig(args.hub_kubeconfig, "--hub-kubeconfig")
    member_path = _kubeconfig(args.member_kubeconfig, "--kubeconfig")
    asyncio.run(_join(hub_path, member_path, name, labels, args.hub_server, seconds, say,
                      getattr(args, "member_server", "")))


def run_leave(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    from scheduler_extender.multicluster.clusters import check_name

    name = check_name(args.name)
    hub_path = _kubeconfig(args.hub_kubeconfig, "--hub-kubeconfig")
    member_path = _kubeconfig(args.member_kubeconfig, "--kubeconfig")
    asyncio.run(_leave(hub_path, member_path, name, say))


async def _clients(hub_path: str, member_path: str) -> tuple[Any, Any]:
    from kubeapi.client import from_config

    hub = await from_config(hub_path, field_manager="accelstack-cluster-join", timeout=15, max_retries=1)
    member = await from_config(member_path, field_manager="accelstack-cluster-join", timeout=15, max_retries=1)
    return hub, member


def _ca(client: Any) -> bytes | None:
    path = getattr(client.configuration, "ssl_ca_cert", None)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


async def _join(hub_path: str, member_path: str, name: str, labels: dict[str, str], hub_server: str,
                seconds: int, say: Callable[[str], None], member_server: str = "") -> None:
    from scheduler_extender.multicluster.join import join

    hub, member = await _clients(hub_path, member_path)
    try:
        await join(hub, member, name, labels, hub_server=hub_server or hub.host, ca_pem=_ca(hub),
                   insecure=not hub.configuration.verify_ssl, token_seconds=seconds, say=say,
                   member_server=member_server or member.host, member_ca=_ca(member))
    finally:
        await hub.close()
        await member.close()


async def _leave(hub_path: str, member_path: str, name: str, say: Callable[[str], None]) -> None:
    from scheduler_extender.multicluster.join import leave

    hub, member = await _clients(hub_path, member_path)
    try:
        await leave(hub, member, name, say=say)
    finally:
        await hub.close()
        await member.close()


def run(args: argparse.Namespace, prog: str) -> int:
    """Run ``cluster join|leave``: 0 when done; 2 and one line for a bad argument; 1 and one line when an API
    server cannot be reached, refuses, or holds an object of the same name that join did not make."""
    import sys

    from kubeapi import ApiError
    from kubeapi.client import ConfigMissing
    from scheduler_extender.multicluster.join import JoinError

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        args.cluster_run(args, say)
    except ValueError as exc:  # Usage, a bad name or label
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (JoinError, ConfigMissing) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"{prog}: error: {_api_error(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _api_error(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status == 0:
        return f"cannot reach an API server: {exc}"
    if status == 403:
        return f"refused (join and leave need an admin's kubeconfig on both sides): {exc}"
    return str(exc)
