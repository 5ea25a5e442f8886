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


PROG = "accelstack-nr1-cni"
HELP_FLAGS = ("-h", "--help", "--version")
USAGE = f"""usage: {PROG}   (executed by the container runtime, or Multus, not by hand)

The accelstack NR1 CNI plugin: moves the network interface of the NR1 module a pod was allocated into the
pod's network namespace and gives it addresses from the configured IPAM plugin (CNI spec 1.0.0 and 1.1.0).

The runtime execs it with CNI_COMMAND (ADD, DEL, CHECK, STATUS, GC or VERSION), CNI_CONTAINERID, CNI_NETNS,
CNI_IFNAME, CNI_PATH and CNI_ARGS in the environment and the network configuration (JSON) on stdin; the result,
or the spec's error JSON, goes to stdout. Its settings are keys of the network configuration, not flags.

options (only without CNI_COMMAND, as a person runs it):
  -h, --help   this text
  --version    the plugin's version and the CNI spec versions it speaks

To see it answer:  echo '{{"cniVersion": "1.1.0"}}' | CNI_COMMAND=VERSION {PROG}
Docs: docs/cni.md (the configuration keys: docs/configuration.md)
"""


def _version() -> str:
    """The installed package's version, where the interpreter can see its metadata (the relocated host copy,
    started with -S, may not)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:
        return ""
    try:
        return version("accelstack")
    except PackageNotFoundError:
        return ""


def help_asked(env: Env, argv: list[str]) -> str | None:
    """'help' or 'version' when a person ran the plugin with -h/--help/--version (no CNI_COMMAND: a runtime
    always sets it, and passes no arguments); None otherwise, when the spec's answer is due."""
    if env.command or not any(a in HELP_FLAGS for a in argv):
        return None
    return "version" if "--version" in argv and not ({"-h", "--help"} & set(argv)) else "help"


def main(argv: list[str] | None = None) -> int:
    env = Env()
    asked = help_asked(env, sys.argv[1:] if argv is None else list(argv))
    if asked == "help":
        sys.stdout.write(USAGE)
        return 0
    if asked == "version":
        number = _version()
        sys.stdout.write(f"{PROG} {number + ' ' if number else ''}(CNI spec {', '.join(SUPPORTED_VERSIONS)})\n")
        return 0
    stdin = b""
    try:
        if env.command or not sys.stdin.isatty():  # a person at a terminal without CNI_COMMAND: do not wait
            stdin = sys.stdin.buffer.read()
        out = run(env, stdin)
    except CNIError as err:
        _write(err.to_json(_version_of(stdin)))
        hint = "" if env.command else f" ('{PROG} --help' says how the runtime runs it)"
        sys.stderr.write(f"{PROG} {env.command}: error {err.code}: {err.msg} {err.details}{hint}\n")
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
