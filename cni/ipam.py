"""Delegation to an IPAM plugin, as the spec describes it: find ``ipam.type`` in CNI_PATH, exec it with the
same CNI_* environment (only CNI_COMMAND may differ) and the same network configuration on stdin.

The delegate is started with ``os.posix_spawn`` rather than ``subprocess`` (which alone costs ~10 ms to
import). A delegate that does not speak the configuration's cniVersion (Debian's plugins stop at 1.0.0) gets
the newest version both speak; for ADD/DEL/CHECK the 1.0.0 and 1.1.0 IPAM formats are the same. What a
delegate speaks is remembered next to the plugin's state, keyed by the binary's size and mtime, so the
VERSION exec happens once per delegate binary, not once per pod.
"""

from __future__ import annotations

import os

from cni import fastjson as json
from cni.config import NetConf, retarget
from cni.errors import IPAM, CNIError


def find_plugin(kind: str, cni_path: str) -> str:
    for directory in cni_path.split(":"):
        if not directory:
            continue
        candidate = os.path.join(directory, kind)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise CNIError(IPAM, f"IPAM plugin {kind!r} not found in CNI_PATH", cni_path)


def run(path: str, env: dict[str, str], data: bytes) -> tuple[int, bytes]:
    """Exec ``path`` with ``env`` and ``data`` on stdin; its stderr is ours. Returns (exit code, stdout)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        pid = os.posix_spawn(
            path,
            [path],
            env,
            file_actions=[(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)],
        )
    except OSError:
        for fd in (in_r, in_w, out_r, out_w):
            os.close(fd)
        raise
    os.close(in_r)
    os.close(out_w)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(in_w, view) :]
    except BrokenPipeError:
        pass
    finally:
        os.close(in_w)
    chunks = []
    try:
        while chunk := os.read(out_r, 65536):
            chunks.append(chunk)
    finally:
        os.close(out_r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks)


class Delegate:
    """The IPAM plugin of one network configuration."""

    def __init__(self, conf: NetConf, cni_path: str, base_env: dict[str, str] | None = None):
        self.conf = conf
        self.kind = conf.ipam_type
        self.path = find_plugin(self.kind, cni_path)
        self.env = dict(os.environ if base_env is None else base_env)
        self.env["CNI_PATH"] = cni_path

    def _memo_path(self) -> str:
        return os.path.join(self.conf.data_dir, "ipam-versions", self.kind)

    def supported_versions(self) -> list[str]:
        """The cniVersions the delegate speaks (VERSION), remembered per binary."""
        st = os.stat(self.path)
        key = f"{self.path} {st.st_size} {st.st_mtime_ns}"
        memo = self._memo_path()
        try:
            with open(memo) as fh:
                first, _, rest = fh.read().partition("\n")
            if first == key:
                return rest.split()
        except OSError:
            pass
        env = dict(self.env, CNI_COMMAND="VERSION")
        code, out = run(self.path, env, json.dumps({"cniVersion": self.conf.cni_version}).encode())
        versions: list[str] = []
        if code == 0:
            try:
                versions = [str(v) for v in json.loads(out).get("supportedVersions", [])]
            except (ValueError, AttributeError):
                versions = []
        if versions:
            try:
                os.makedirs(os.path.dirname(memo), exist_ok=True)
                tmp = f"{memo}.{os.getpid()}"
                with open(tmp, "w") as fh:
                    fh.write(key + "\n" + " ".join(versions))
                os.replace(tmp, memo)
            except OSError:
                pass
        return versions

    def version_for(self, command: str) -> str | None:
        """The cniVersion to send the delegate for ``command``; None when it cannot take the command."""
        wanted = self.conf.cni_version
        versions = self.supported_versions()
        if not versions or wanted in versions:  # a delegate that does not say: let it judge the config
            return wanted
        if command in ("STATUS", "GC"):
            return None  # both are 1.1.0 commands
        if wanted == "1.1.0" and "1.0.0" in versions:
            return "1.0.0"
        return None

    def call(self, command: str, env: dict[str, str], config: bytes | None = None) -> dict:
        """Run one command; the parsed stdout (``{}`` when empty). A failure raises the delegate's error."""
        version = self.version_for(command)
        if version is None:
            raise CNIError(
                IPAM,
                f"IPAM plugin {self.kind!r} does not speak cniVersion {self.conf.cni_version} for {command}",
            )
        data = config if config is not None else self.conf.with_version(version)
        if config is not None and version != self.conf.cni_version:
            data = json.dumps(retarget(json.loads(config), version)).encode()
        full_env = dict(self.env)
        full_env.update(env)
        full_env["CNI_COMMAND"] = command
        try:
            code, out = run(self.path, full_env, data)
        except OSError as err:
            raise CNIError(IPAM, f"cannot run IPAM plugin {self.kind!r}: {err}") from None
        parsed: object = {}
        if out.strip():
            try:
                parsed = json.loads(out)
            except ValueError:
                parsed = None
        if code != 0:
            if isinstance(parsed, dict) and isinstance(parsed.get("code"), int):
                # keep the delegate's code when it is one of the spec's (11 "try again" must reach the
                # runtime as 11); a delegate's own code (100+) means nothing to the runtime as ours
                err_code = parsed["code"] if 0 < parsed["code"] < 100 else IPAM
                raise CNIError(
                    err_code,
                    f"IPAM plugin {self.kind!r} {command} failed: {parsed.get('msg', '')}",
                    str(parsed.get("details", "")),
                )
            raise CNIError(
                IPAM, f"IPAM plugin {self.kind!r} {command} exited {code}", out.decode(errors="replace")
            )
        if not isinstance(parsed, dict):
            raise CNIError(IPAM, f"IPAM plugin {self.kind!r} {command} printed no JSON object")
        return parsed
