"""Entry point of the ``accelstack-nr1-cni`` plugin: CNI_* environment + config on stdin -> result on stdout.

Whatever happens, stdout carries either the command's result or the spec's error JSON, and the exit code is
0 only on success. Tracebacks (a bug) go to stderr, which runtimes log.

Start-up time is most of this plugin's latency, so only what every command needs is imported here; grpc,
the IPAM delegate, sysfs discovery and ``ipaddress`` are imported by the commands that use them.
"""

from __future__ import annotations

import sys

from cni import fastjson as json
from cni.config import LATEST, SUPPORTED_VERSIONS, Env, NetConf
from cni.errors import INTERNAL, IO_FAILURE, NETLINK, CNIError


def _write(obj: object) -> None:
    sys.stdout.write(json.dumps(obj))
    sys.stdout.write("\n")
    sys.stdout.flush()


def run(env: Env, stdin: bytes) -> object:
    """One invocation; returns what goes to stdout (None: nothing) or raises CNIError."""
    env.validate_command()
    conf = NetConf(stdin, env.command)
    if env.command == "VERSION":
        return {"cniVersion": conf.cni_version, "supportedVersions": list(SUPPORTED_VERSIONS)}
    env.validate()
    from cni import plugin

    if env.command == "ADD":
        return plugin.cmd_add(env, conf)
    if env.command == "DEL":
        plugin.cmd_del(env, conf)
    elif env.command == "CHECK":
        plugin.cmd_check(env, conf)
    elif env.command == "STATUS":
        plugin.cmd_status(env, conf)
    elif env.command == "GC":
        plugin.cmd_gc(env, conf)
    return None


def _version_of(stdin: bytes) -> str:
    """The cniVersion to put in an error, read as leniently as possible."""
    try:
        version = json.loads(stdin).get("cniVersion")
    except Exception:
        return LATEST
    return version if isinstance(version, str) and version else LATEST


def main(argv: list[str] | None = None) -> int:
    env = Env()
    stdin = b""
    try:
        stdin = sys.stdin.buffer.read()
        out = run(env, stdin)
    except CNIError as err:
        _write(err.to_json(_version_of(stdin)))
        sys.stderr.write(f"accelstack-nr1-cni {env.command}: error {err.code}: {err.msg} {err.details}\n")
        return 1
    except Exception as err:  # a bug or an unexpected system failure: still the spec's JSON on stdout
        from cni.netlink import NetlinkError

        if isinstance(err, NetlinkError):
            code, msg = NETLINK, f"netlink: {err.strerror}"
        elif isinstance(err, OSError):
            code, msg = IO_FAILURE, f"I/O failure: {err}"
        else:
            code, msg = INTERNAL, f"internal error: {type(err).__name__}: {err}"
        import traceback

        traceback.print_exc(file=sys.stderr)
        _write(CNIError(code, msg).to_json(_version_of(stdin)))
        return 1
    if out is not None:
        _write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
