"""``kubectl-accelstack``: the queue, the inventory, wait-time estimates, why a GPR waits and workspace usage, from
the accelstack REST API (kubectl finds it on PATH as ``kubectl accelstack``).

The server is ``--server`` or ``$ACCELSTACK_SERVER``; the bearer token is ``--token``, ``$ACCELSTACK_TOKEN`` or
the current kubeconfig user's token (``token`` or ``tokenFile``). The REST API checks the token with the API
server and the action with your RBAC, as kubectl would. Tables by default; ``-o json`` or ``-o yaml`` print what
the API answered. Bad arguments exit 2; an error from the API exits 1 with one line saying why. ``node check``
exits 1 too when an item is not ok (its lines say which).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import yaml

from scheduler_extender.cli import cluster as cluster_cli

PROG = "kubectl-accelstack"
ENV_SERVER, ENV_TOKEN = "ACCELSTACK_SERVER", "ACCELSTACK_TOKEN"
OUTPUTS = ("table", "json", "yaml")
TIMEOUT = 30.0


class Failure(Exception):
    """An error to print as one line (exit code ``code``)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# ---- talking to the REST API -------------------------------------------------------------------------------
def kubeconfig_token(path: str | None = None) -> str:
    """The current context's user token from the kubeconfig (``$KUBECONFIG``'s first file or ~/.kube/config);
    "" when there is none (a client-certificate user, say)."""
    first = (path or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]) or str(Path.home() / ".kube" / "config")
    try:
        config = yaml.safe_load(Path(first).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    if not isinstance(config, dict):
        return ""
    context = next((c.get("context") or {} for c in config.get("contexts") or []
                    if isinstance(c, dict) and c.get("name") == config.get("current-context")), {})
    user = next((u.get("user") or {} for u in config.get("users") or []
                 if isinstance(u, dict) and u.get("name") == context.get("user")), {})
    if user.get("token"):
        return str(user["token"])
    if user.get("tokenFile"):
        try:
            return Path(user["tokenFile"]).read_text().strip()
        except OSError:
            return ""
    return ""


class Client:
    def __init__(self, server: str, token: str, context: ssl.SSLContext | None = None) -> None:
        self.server, self.token, self.context = server.rstrip("/"), token, context

    def call(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None) -> Any:
        url = self.server + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v not in (None, "")})
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Accept": "application/json", **({"Authorization": f"Bearer {self.token}"} if self.token else {}),
            **({"Content-Type": "application/json"} if data is not None else {})})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT, context=self.context) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error") or exc.reason
            except (ValueError, AttributeError):
                message = exc.reason
            hint = " (give --token, set ACCELSTACK_TOKEN, or use a kubeconfig user with a token)" \
                if exc.code == 401 and not self.token else ""
            raise Failure(f"{method} {path}: {exc.code} {message}{hint}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Failure(f"cannot reach the accelstack REST API at {self.server}: {reason}") from None

    def get(self, path: str, **query: Any) -> Any:
        return self.call("GET", path, query=query)


# ---- output ------------------------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def relative(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    a = abs(seconds)
    text = f"{a:.0f}s" if a < 60 else f"{a / 60:.0f}m" if a < 3600 else f"{a / 3600:.1f}h" if a < 86400 \
        else f"{a / 86400:.1f}d"
    return "now" if a < 5 else f"in {text}" if seconds > 0 else f"{text} ago"


def until(ts: str | None) -> str:
    if not ts:
        return "-"
    try:
        return relative(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() - time.time())
    except ValueError:
        return ts


def age(seconds: float | None) -> str:
    return "-" if seconds is None else relative(-seconds).removesuffix(" ago")


def emit(args: argparse.Namespace, data: Any, render: Callable[[Any], str]) -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    elif args.output == "yaml":
        print(yaml.safe_dump(data, sort_keys=True), end="")
    else:
        print(render(data))


# ---- commands ----------------------------------------------------------------------------------------------
def cmd_queue(client: Client, args: argparse.Namespace) -> None:
    data = client.get("/api/v1/queue", namespace=args.namespace, workspace=args.workspace, phase=args.phase,
                      resource=args.resource, limit=args.limit, cluster=args.cluster)
    if on_hub(data, args):
        emit(args, data, render_hub_queue)
        return

    def render(d: dict[str, Any]) -> str:
        rows = [[r["position"] if r["position"] is not None else "-", r["namespace"], r["name"], r["workspace"],
                 r["phase"], f"{r['priority']} ({r['level']})" if r.get("level") else r["priority"],
                 f"{r['devicesPerNode']}x{r['nodeCount']} {r['resource']}",
                 until(r["estimatedStart"]) if r["phase"] == "Queued" else "-", age(r["ageSeconds"]),
                 r["reason"]] for r in d["items"]]
        more = f"\n({len(d['items'])} of {d['total']}; --limit to see more)" if d.get("continue") else ""
        if not rows:
            return "No GPRs match."
        order = f"\n\n{textwrap.fill(d['order'], 110)}" if d.get("order") else ""
        return table(["POS", "NAMESPACE", "NAME", "WORKSPACE", "PHASE", "PRIORITY", "DEVICES", "START", "AGE",
                      "REASON"], rows) + more + order

    emit(args, data, render)


def cmd_node_deboard(client: Client, args: argparse.Namespace) -> None:
    path = f"/api/v1/acceleratornodes/{_seg(args.node)}/deboard"
    data = client.call("DELETE", path) if args.abort else client.call("POST", path, {"grace": args.grace})

    def render(d: dict[str, Any]) -> str:
        if args.abort:
            return (f"node {d['node']}: deboard request removed; the controller lifts the taint"
                    if d.get("changed") else f"node {d['node']}: no deboard request to remove")
        request = d.get("deboard") or {}
        return (f"node {d['node']}: deboard requested at {request.get('requestedAt')} with a grace of "
                f"{request.get('grace')}; follow it with: kubectl get acceleratornode {d['node']} -o wide")

    emit(args, data, render)


def cmd_node_onboard(client: Client, args: argparse.Namespace) -> None:
    data = client.call("POST", f"/api/v1/acceleratornodes/{_seg(args.node)}/onboard",
                       {"adoptPods": True} if args.adopt_pods else {})

    def render(d: dict[str, Any]) -> str:
        when = (d.get("onboard") or {}).get("requestedAt")
        said = f"onboarding requested at {when}" if d.get("changed") else f"onboarding already requested at {when}"
        return f"node {d['node']}: {said}; follow it with: kubectl get acceleratornode {d['node']} -o wide"

    emit(args, data, render)


def render_check(d: dict[str, Any]) -> str:
    """One line an item, ``NAME  STATUS  EVIDENCE-OR-FIX``, then the verdict."""
    rows = [[i["name"], i["status"], i["detail"]] for i in d["items"]]
    bad = sum(i["status"] != "ok" for i in d["items"])
    verdict = f"node {d['node']}: all {len(rows)} checks ok" if d.get("ok") else \
        f"node {d['node']}: {bad} of {len(rows)} checks not ok"
    return table(["ITEM", "STATUS", "EVIDENCE"], rows) + "\n\n" + verdict


def cmd_node_check(client: Client, args: argparse.Namespace) -> None:
    data = client.get(f"/api/v1/acceleratornodes/{_seg(args.node)}/check")
    emit(args, data, render_check)
    if not data.get("ok"):
        raise Failure("", 1)  # the items said why: no second line


def cmd_inventory(client: Client, args: argparse.Namespace) -> None:
    if args.node:
        emit(args, client.get(f"/api/v1/inventory/nodes/{_seg(args.node)}"), _render_node)
        return
    if args.group:
        data = client.get(f"/api/v1/inventory/groups/{_seg(args.group)}", resource=args.resource, model=args.model)
        emit(args, data, lambda d: table(
            ["NODE", "RESOURCE", "MODEL", "CAPACITY", "ALLOCATED", "RESERVED", "FREE", "HEALTH"],
            [[n["node"], n["resource"], n["model"], n["capacity"], n["allocated"], n["reserved"], n["free"],
              "ok" if n["healthy"] else n["reason"]] for n in d["nodes"]]))
        return
    data = client.get("/api/v1/inventory", summary="1", cluster=args.cluster)
    if on_hub(data, args):
        emit(args, data, lambda d: render_hub_inventory(d, args.resource, args.model))
        return

    def render(d: dict[str, Any]) -> str:
        cells = [c for c in d["cells"] if (not args.resource or c["resource"] == args.resource)
                 and (not args.model or c["model"] == args.model)]
        t = d["totals"]
        return table(["RESOURCE", "MODEL", d["groupLabel"].upper(), "NODES", "DEVICES", "ALLOCATED", "RESERVED",
                      "FREE", "UNHEALTHY-NODES"],
                     [[c["resource"], c["model"], c["group"], c["nodes"], c["capacity"], c["allocated"],
                       c["reserved"], c["free"], c["unhealthyNodes"]] for c in cells]) + \
            f"\n\n{t['nodes']} nodes, {t['capacity']} devices: {t['allocated']} allocated, {t['reserved']} " \
            f"reserved, {t['free']} free; {t['unhealthyNodes']} unhealthy nodes"

    emit(args, data, render)


def _render_node(n: dict[str, Any]) -> str:
    out = [f"Node:   {n['node']}", f"Group:  {n['group']}", "", table(
        ["RESOURCE", "MODEL", "CAPACITY", "ALLOCATABLE", "ALLOCATED", "RESERVED", "FREE", "HEALTH"],
        [[r["resource"], r["model"], r["capacity"], r["allocatable"], r["allocated"], r["reserved"], r["free"],
          "ok" if r["healthy"] else r["reason"]] for r in n["resources"]])]
    if n["holders"]:
        out += ["", "Pods holding devices:", table(["POD", "GPR", "RESOURCE", "DEVICES", "PHASE"], [
            [h["pod"], h["gpr"] or "-", h["resource"], h["devices"], h["phase"]] for h in n["holders"]])]
    if n["reservations"]:
        out += ["", "Reservations:", table(["GPR", "PHASE", "DEVICES", "IN-USE"], [
            [r["gpr"], r["phase"], r["devices"], r["inUse"]] for r in n["reservations"]])]
    return "\n".join(out)


def cmd_wait_time(client: Client, args: argparse.Namespace) -> None:
    spec: dict[str, Any] = {}
    if args.template:
        template = client.get(f"/api/v1/templates/{_seg(args.namespace)}/{_seg(args.template)}")
        spec = {k: v for k, v in (template.get("spec") or {}).items() if k != "description"}
    for key, value in (("resource", args.resource), ("devicesPerNode", args.devices), ("nodeCount", args.nodes),
                       ("priority", args.priority), ("exitDuration", args.exit_duration)):
        if value is not None:
            spec[key] = value
    if args.model:
        spec["models"] = args.model
    data = client.call("POST", "/api/v1/waittime", {"namespace": args.namespace, "spec": spec})

    def render(d: dict[str, Any]) -> str:
        start = "now" if d["estimable"] and (d["waitSeconds"] or 0) <= 1 else until(d["estimatedStart"]) \
            if d["estimable"] else "unknown"
        span = d.get("estimatedStartRange")
        likely = f" (likely {until(span['earliest'])} to {until(span['latest'])})" if span else ""
        return (f"Queue position:  {d['queuePosition']}\nEstimated start: {start}{likely}\n"
                f"Basis:           {d['basis']}")

    emit(args, data, render)


def cmd_gpr_describe(client: Client, args: argparse.Namespace) -> None:
    namespace, _, name = args.ref.partition("/")
    if not namespace or not name or "/" in name:
        raise Failure(f"gpr describe: want NAMESPACE/NAME, got {args.ref!r}", 2)
    obj = client.get(f"/api/v1/gprs/{_seg(namespace)}/{_seg(name)}")
    try:
        events: Any = client.get(f"/api/v1/gprs/{_seg(namespace)}/{_seg(name)}/events")["items"]
    except Failure as exc:
        events = {"error": str(exc)}
    emit(args, {"gpr": obj, "events": events}, _render_gpr)


def why(status: dict[str, Any]) -> str:
    """Why a queued GPR waits, from what the controller wrote: the reason and message, and any condition that
    is not a plain phase marker."""
    parts = [f"{status.get('reason') or 'Queued'}: {status.get('message') or 'no message'}"]
    for c in status.get("conditions") or []:
        if c.get("type") not in ("Queued", "Admitted", "Running", "Finished") and c.get("status") == "True":
            parts.append(f"{c['type']}: {c.get('message') or c.get('reason') or ''}".rstrip(": "))
    if status.get("nextRetryTime"):
        parts.append(f"retries {until(status['nextRetryTime'])} (after a failure)")
    return "; ".join(parts)


def _render_gpr(d: dict[str, Any]) -> str:
    obj, events = d["gpr"], d["events"]
    meta, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    phase = st.get("phase") or "Queued"
    lines = [f"Name:         {meta.get('namespace')}/{meta.get('name')}",
             f"Phase:        {phase}" + (f" ({st['reason']})" if st.get("reason") else ""),
             f"Request:      {spec.get('devicesPerNode', 1)} x {spec.get('resource', 'nvidia.com/gpu')} on "
             f"{spec.get('nodeCount', 1)} node(s), priority {spec.get('priority', 100)}"
             + (f", exitDuration {spec['exitDuration']}" if spec.get("exitDuration") else "")
             + (f", models {', '.join(spec['models'])}" if spec.get("models") else "")]
    if phase == "Queued":
        span = st.get("estimatedStartRange")
        lines += [f"Position:     {st.get('queuePosition', '-')}",
                  f"Estimate:     {until(st.get('estimatedStart'))}"
                  + (f" ({st['estimatedStart']}; likely {until(span['earliest'])} to {until(span['latest'])})"
                     if st.get("estimatedStart") and span else ""),
                  f"Why it waits: {why(st)}"]
    elif st.get("message"):
        lines.append(f"Message:      {st['message']}")
    reservation = st.get("reservation") or []
    lines.append("Reservation:  " + (", ".join(f"{r['node']} ({r['devices']})" for r in reservation) or "none"))
    for key in ("admittedAt", "startedAt", "finishedAt"):
        if st.get(key):
            lines.append(f"{key + ':':<13} {st[key]} ({until(st[key])})")
    lines += ["", "Conditions:", table(["TYPE", "STATUS", "REASON", "SINCE", "MESSAGE"], [
        [c.get("type"), c.get("status"), c.get("reason", ""), until(c.get("lastTransitionTime")), c.get("message", "")]
        for c in st.get("conditions") or []]), "", "Events:"]
    if isinstance(events, dict):
        lines.append(f"  (not shown: {events['error']})")
    elif not events:
        lines.append("  none")
    else:
        lines.append(table(["LAST SEEN", "TYPE", "REASON", "COUNT", "MESSAGE"], [
            [until(e.get("lastTimestamp")), e.get("type"), e.get("reason"), e.get("count"), e.get("message")]
            for e in events]))
    return "\n".join(lines)


def cmd_workspace_kubeconfig(client: Client, args: argparse.Namespace) -> None:
    """POST /api/v1/workspaces/WS/kubeconfig on a hub: the member's kubeconfig, printed or written 0600."""
    data = client.call("POST", f"/api/v1/workspaces/{_seg(args.name)}/kubeconfig",
                       query={"cluster": args.cluster, "expiry": args.expiry})
    text = str((data or {}).get("kubeconfig") or "")
    if not text:
        raise Failure("the server answered no kubeconfig (is --server the hub's API?)")
    if not args.file:
        print(text, end="")
        return
    try:
        fd = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file that was there keeps no wider mode
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as exc:
        raise Failure(f"--output-file: cannot write {args.file!r}: {exc.strerror}") from None
    print(f"kubeconfig for workspace {data.get('workspace')} on {data.get('cluster')} written to {args.file} "
          f"(role {data.get('role')}, namespace {data.get('namespace')}, token for "
          f"{relative(float(data.get('expirySeconds') or 0)).removeprefix('in ')})", file=sys.stderr)


def cmd_workspace_usage(client: Client, args: argparse.Namespace) -> None:
    if args.cluster:
        data = client.get("/api/v1/usage", cluster=args.cluster, workspace=args.name)
        on_hub(data, args)
        emit(args, data, render_hub_usage)
        return
    try:
        items = [client.get(f"/api/v1/workspaces/{_seg(args.name)}")] if args.name \
            else client.get("/api/v1/workspaces")["items"]
    except Failure as exc:  # a hub has no /api/v1/workspaces: its usage is per member, at /api/v1/usage
        if ": 404 " not in str(exc):
            raise
        try:
            data = client.get("/api/v1/usage", workspace=args.name)
        except Failure:
            raise exc from None
        if not on_hub(data, args):
            raise exc from None
        emit(args, data, render_hub_usage)
        return

    def render(ws: list[dict[str, Any]]) -> str:
        rows = []
        for w in ws:
            st = w.get("status") or {}
            gprs = st.get("gprs") or {}
            counts = f"{gprs.get('queued', 0)}/{gprs.get('admitted', 0)}/{gprs.get('running', 0)}"
            for u in st.get("usage") or [{}]:
                quota = u.get("max")
                held = (u.get("inUse") or 0) + (u.get("reserved") or 0)
                rows.append([w["metadata"]["name"], u.get("resource", "-"), u.get("model") or "any",
                             u.get("inUse", "-"), u.get("reserved", "-"), u.get("queued", "-"),
                             quota if quota is not None else "-",
                             f"{int(100 * held / quota + 0.5)}%" if quota else "-", counts])
        if not rows:
            return "No workspaces."
        return table(["WORKSPACE", "RESOURCE", "MODEL", "IN-USE", "RESERVED", "QUEUED", "QUOTA", "HELD%",
                      "GPRS Q/A/R"], rows)

    emit(args, items, render)


# ---- a hub (docs/multicluster.md "One view"): the same commands, every row naming its cluster -------------------
def on_hub(data: Any, args: argparse.Namespace) -> bool:
    """Whether the answer is a hub's (it says ``hub: true``); --cluster to a member's own API is an error, not a
    filter it would silently ignore."""
    hub = isinstance(data, dict) and data.get("hub") is True
    if args.cluster and not hub:
        raise Failure(f"--cluster {args.cluster}: the server is not a hub (only accelstack-hub's API has clusters)")
    return hub


def render_hub_inventory(d: dict[str, Any], resource: str = "", model: str = "") -> str:
    cells = [c for c in d["cells"] if (not resource or c["resource"] == resource) and (not model or c["model"] == model)]
    rows = [[c["cluster"], "Ready" if c["ready"] else "Lost" if c["lost"] else "NotReady", c["resource"], c["model"],
             c["nodes"], c["capacity"], c["allocated"], c["reserved"], c["free"], c["unhealthy"], c["queued"]]
            for c in cells]
    t = d["totals"]
    return table(["CLUSTER", "STATE", "RESOURCE", "MODEL", "NODES", "DEVICES", "ALLOCATED", "RESERVED", "FREE",
                  "UNHEALTHY", "QUEUED"], rows) + \
        f"\n\n{len(d['clusters'])} clusters, {t['capacity']} devices: {t['allocated']} allocated, {t['reserved']} " \
        f"reserved, {t['free']} free; {d['groupLabel']}"


def render_hub_queue(d: dict[str, Any]) -> str:
    if not d["items"]:
        return "No GPRs match."
    rows = [[r["cluster"] or "(unplaced)", r["position"] if r["position"] is not None else "-", r["namespace"],
             r["name"], r["phase"], f"{r['devicesPerNode']}x{r['nodeCount']} {r['resource']}",
             until(r["estimatedStart"]) if r["phase"] == "Queued" else "-", age(r["ageSeconds"]), r["reason"]]
            for r in d["items"]]
    return table(["CLUSTER", "POS", "NAMESPACE", "NAME", "PHASE", "DEVICES", "START", "AGE", "REASON"], rows) + \
        f"\n\n{textwrap.fill(d['order'], 110)}"


def render_hub_usage(d: dict[str, Any]) -> str:
    if not d["items"]:
        return "No workspaces."
    return table(["WORKSPACE", "CLUSTER", "READY", "RESOURCE", "MODEL", "IN-USE", "RESERVED", "QUEUED", "QUOTA"],
                 [[u["workspace"], u["cluster"], "yes" if u["ready"] else "no", u["resource"] or "-",
                   u["model"] or "any", *("-" if u[k] is None else u[k] for k in ("inUse", "reserved", "queued", "max"))]
                  for u in d["items"]])


def _seg(value: str) -> str:
    return urllib.parse.quote(value, safe="")


# ---- arguments ---------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """One line for an argument argparse cannot parse and a pointer to ``--help`` (exit 2), as every accelstack
    command answers, not the whole usage before the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the options.\n")


def positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"want a number of at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("-o", "--output", choices=OUTPUTS, default=argparse.SUPPRESS,
                        help="table (default), json or yaml")
    p = Parser(prog=PROG, parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
               description="accelstack from kubectl: the GPR queue, the accelerator inventory, wait-time "
                           "estimates, why a GPR waits, and workspace usage.",
               epilog="examples:\n"
                      "  kubectl accelstack queue -w team-a\n"
                      "  kubectl accelstack inventory --group p5.48xlarge\n"
                      "  kubectl accelstack wait-time -n team-a --template small-gpu\n"
                      "  kubectl accelstack gpr describe team-a/finetune\n"
                      "  kubectl accelstack workspace usage team-a -o yaml\n"
                      "  kubectl accelstack workspace kubeconfig team-a --cluster member-a -o team-a.kubeconfig\n"
                      "  kubectl accelstack node check nr1-01\n\n"
                      f"The server is --server or ${ENV_SERVER}; the token --token, ${ENV_TOKEN} or the current "
                      "kubeconfig user's token.")
    p.add_argument("--server", default=os.environ.get(ENV_SERVER, ""),
                   help=f"the accelstack REST API, e.g. https://accelstack-extender.accelstack-system:8443 "
                        f"(default ${ENV_SERVER})")
    p.add_argument("--token", default=os.environ.get(ENV_TOKEN, ""),
                   help=f"bearer token (default ${ENV_TOKEN}, then the kubeconfig user's token)")
    p.add_argument("--kubeconfig", default="", help="kubeconfig to take the token from (default $KUBECONFIG, "
                                                    "~/.kube/config)")
    p.add_argument("--certificate-authority", default="", help="CA bundle (PEM) to verify the server with")
    p.add_argument("--insecure-skip-tls-verify", action="store_true", help="do not verify the server's certificate")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    q = sub.add_parser("queue", parents=[common], help="GPRs in queue order, with position and estimated start")
    q.add_argument("-n", "--namespace", default="", help="only this namespace")
    q.add_argument("-w", "--workspace", default="", help="only this workspace's namespaces")
    q.add_argument("--phase", default="", help="phases, comma-separated, or all (default: unfinished)")
    q.add_argument("--resource", default="", help="nvidia.com/gpu or neureality.com/nr1")
    q.add_argument("--limit", type=positive, default=100, help="at most this many rows (default 100)")
    q.add_argument("--cluster", default="", help="on a hub: only the GPRs placed on this member cluster")
    q.set_defaults(run=cmd_queue)

    i = sub.add_parser("inventory", parents=[common],
                       help="devices by model and node group; --group for its nodes, --node for one node")
    i.add_argument("--group", default="", help="the nodes of this node group")
    i.add_argument("--node", default="", help="one node: devices, health, holders, reservations")
    i.add_argument("--resource", default="", help="only this resource")
    i.add_argument("--model", default="", help="only this model")
    i.add_argument("--cluster", default="", help="on a hub: only this member cluster's devices")
    i.set_defaults(run=cmd_inventory)

    w = sub.add_parser("wait-time", parents=[common], help="when a GPR submitted now would start")
    w.add_argument("-n", "--namespace", default="default", help="namespace it would be created in")
    w.add_argument("--template", default="", help="start from this GPRTemplate of the namespace")
    w.add_argument("--resource", default=None, help="nvidia.com/gpu (default) or neureality.com/nr1")
    w.add_argument("--devices", type=positive, default=None, help="devices per node")
    w.add_argument("--nodes", type=positive, default=None, help="number of nodes")
    w.add_argument("--priority", type=int, default=None, help="priority (higher first)")
    w.add_argument("--model", action="append", default=[], help="acceptable device model (repeatable)")
    w.add_argument("--exit-duration", default=None, help="how long it may hold the devices, e.g. 2h")
    w.set_defaults(run=cmd_wait_time)

    g = sub.add_parser("gpr", help="one GPR").add_subparsers(dest="gpr_command", metavar="COMMAND",
                                                              parser_class=Parser)
    g.required = True
    d = g.add_parser("describe", parents=[common],
                     help="reservation, position, estimate, why it waits, conditions and Events")
    d.add_argument("ref", metavar="NAMESPACE/NAME")
    d.set_defaults(run=cmd_gpr_describe)

    ws = sub.add_parser("workspace", help="workspaces").add_subparsers(dest="ws_command", metavar="COMMAND",
                                                                        parser_class=Parser)
    ws.required = True
    u = ws.add_parser("usage", parents=[common], help="devices in use, reserved and queued against the quota")
    u.add_argument("name", nargs="?", default="", help="one workspace (default: all you may list)")
    u.add_argument("--cluster", default="", help="on a hub: only this member cluster's usage")
    u.set_defaults(run=cmd_workspace_usage)
    k = ws.add_parser("kubeconfig", help="a kubeconfig for one member cluster of a hub workspace, with a short-lived "
                      "token of your role there (--server: the hub's API; docs/multicluster.md)")
    k.add_argument("name", help="the workspace (on the hub)")
    k.add_argument("--cluster", required=True, help="the member cluster the kubeconfig is for")
    k.add_argument("--expiry", default="1h", help="the token's life: 10m to 24h (default 1h)")
    k.add_argument("-o", "--output-file", dest="file", default="",
                   help="write it to this file (mode 0600) instead of printing it")
    k.set_defaults(run=cmd_workspace_kubeconfig)
    nd = sub.add_parser("node", help="accelerator nodes (docs/nodes.md)").add_subparsers(
        dest="node_command", metavar="COMMAND", parser_class=Parser)
    nd.required = True
    o = nd.add_parser("onboard", parents=[common], help="hand a detected node to accelstack: labelled so the "
                      "DaemonSets land, Managed once its device plugin, NPD and the kubelet's view agree; running "
                      "pods are not touched (docs/nodes.md#onboarding)")
    o.add_argument("node", help="the node (its AcceleratorNode has the same name)")
    o.add_argument("--adopt-pods", action="store_true", help="once Managed, give each pod already holding devices "
                   "there an automatic GPR (placed where it runs) so the queue and quotas see it")
    o.set_defaults(run=cmd_node_onboard)
    d = nd.add_parser("deboard", parents=[common], help="take a node out: no new placement, reservations moved, "
                                                       "running GPR pods evicted after the grace, labels removed")
    d.add_argument("node", help="the node (its AcceleratorNode has the same name)")
    d.add_argument("--grace", default="10m", help="how long running GPR pods may finish first: 90s, 10m, 1h30m "
                                                  "(default 10m, at most 7 days)")
    d.add_argument("--abort", action="store_true", help="take the request back: the taint goes, nothing is put back")
    d.set_defaults(run=cmd_node_deboard)
    c = nd.add_parser("check", parents=[common], help="preflight: what the node needs to serve accelerator pods, "
                                                      "item by item (exit 0 when all ok, 1 otherwise)")
    c.add_argument("node", help="the node")
    c.set_defaults(run=cmd_node_check)
    cluster_cli.add_parser(sub, Parser, common)
    return p


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.server.startswith("https://"):
        return None
    if args.insecure_skip_tls_verify:
        return ssl._create_unverified_context()
    try:
        return ssl.create_default_context(cafile=args.certificate_authority or None)
    except (OSError, ssl.SSLError) as exc:
        raise Failure(f"--certificate-authority: cannot load {args.certificate_authority!r}: {exc}", 2) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not hasattr(args, "output"):
        args.output = "table"
    if args.command == "cluster":  # talks to two API servers, not to the REST API
        return cluster_cli.run(args, PROG)
    try:
        if not args.server:
            raise Failure(f"no server: give --server or set {ENV_SERVER}", 2)
        if not args.server.startswith(("http://", "https://")):
            raise Failure(f"--server: want an http:// or https:// URL, got {args.server!r}", 2)
        token = args.token or kubeconfig_token(args.kubeconfig or None)
        args.run(Client(args.server, token, tls_context(args)), args)
    except Failure as exc:
        if str(exc):
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:  # `| head`
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
