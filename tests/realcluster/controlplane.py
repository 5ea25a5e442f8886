"""A real Kubernetes control plane on loopback for the suite, in the style of controller-runtime's envtest.

``KUBEBUILDER_ASSETS`` (envtest's own variable, so existing set-ups work) names a folder holding
``kube-apiserver``, ``etcd`` and ``kubectl``, and optionally ``kube-controller-manager``, ``kube-scheduler`` and
``node-problem-detector``. :class:`ControlPlane` starts etcd and the API server on free loopback ports with a
throwaway CA, service-account signing keys (so ``TokenRequest`` issues real ServiceAccount tokens), Node + RBAC
authorisation and NodeRestriction, and the flags fake nodes need (``../shared/k8s/README.md``: no
``TaintNodesByCondition``, no node-lifecycle controller). The controller manager and the scheduler start on
demand. Every process of the product then runs with a kubeconfig holding a real token of its shipped
ServiceAccount (:meth:`ControlPlane.sa_kubeconfig`), never the admin's certificate.

Where a user gets the binaries: the upstream release archives of the same version (``kubernetes-server-linux-
amd64.tar.gz`` of v1.36.2 holds kube-apiserver, kube-controller-manager and kube-scheduler; node-problem-detector's
release tarball; etcd from Debian's ``etcd-server`` or etcd's release). ``scripts/test.sh`` unpacks the copies
in ``../shared/k8s`` when that folder exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REQUIRED = ("kube-apiserver", "etcd", "kubectl")
OPTIONAL = ("kube-controller-manager", "kube-scheduler", "node-problem-detector")
ISSUER = "https://kubernetes.default.svc.cluster.local"


class ControlPlaneError(RuntimeError):
    """A component would not start or answer; the message names it and ends with its log's tail."""


class ApiCallError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{status} {body.get('reason', '')}: {body.get('message', '')}")
        self.status, self.body = status, body


def assets_dir() -> Path | None:
    """The folder ``KUBEBUILDER_ASSETS`` names, or None when it is unset."""
    value = os.environ.get("KUBEBUILDER_ASSETS", "").strip()
    return Path(value) if value else None


def missing_assets(folder: Path, names: tuple[str, ...] = REQUIRED) -> list[str]:
    return [n for n in names if not os.access(folder / n, os.X_OK)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


class PKI:
    """A throwaway CA (EC P-256) that signs the API server's certificate and client certificates."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca_crt, self.ca_key = folder / "ca.crt", folder / "ca.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", str(self.ca_key), "-out", str(self.ca_crt), "-days", "3", "-subj", "/CN=accelstack-test-ca")

    def issue(self, name: str, subject: str, *, sans: str = "", client: bool = False) -> tuple[Path, Path]:
        """A key and certificate signed by the CA; ``sans`` like ``IP:127.0.0.1,DNS:localhost``."""
        key, csr, crt = (self.folder / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", str(key), "-out", str(csr), "-subj", subject)
        ext = self.folder / f"{name}.ext"
        lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment",
                 f"extendedKeyUsage={'clientAuth' if client else 'serverAuth,clientAuth'}"]
        if sans:
            lines.append(f"subjectAltName={sans}")
        ext.write_text("\n".join(lines) + "\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca_crt), "-CAkey", str(self.ca_key),
                 "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext))
        return crt, key


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Process:
    """One component: its command line, its log file, stop with SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self._log = open(log, "ab")  # noqa: SIM115 - held open for the process's life
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fail(self, what: str) -> ControlPlaneError:
        return ControlPlaneError(f"{self.name} {what} (exit {self.proc.poll()}); last lines of {self.log}:\n"
                                 f"{_tail(self.log)}")

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class ControlPlane:
    """etcd + kube-apiserver (and, on demand, kube-controller-manager and kube-scheduler) on loopback."""

    def __init__(self, assets: Path, workdir: Path | None = None) -> None:
        missing = missing_assets(assets)
        if missing:
            raise ControlPlaneError(f"KUBEBUILDER_ASSETS={assets} lacks {', '.join(missing)}")
        self.assets = assets
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="accelstack-cp-"))
        self.pki = PKI(self.dir / "pki")
        self.procs: dict[str, Process] = {}
        self.port = 0
        self.url = ""
        self.sa_key, self.sa_pub = self.dir / "pki" / "sa.key", self.dir / "pki" / "sa.pub"
        _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(self.sa_key))
        _openssl("ec", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub))
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"
        self._tokens: dict[tuple[str, str], str] = {}

    # ---- life cycle -------------------------------------------------------------------------------------------
    def binary(self, name: str) -> str:
        path = self.assets / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError(f"KUBEBUILDER_ASSETS={self.assets} has no {name}")
        return str(path)

    def start(self, timeout: float = 90.0) -> ControlPlane:
        etcd_port, peer_port = free_port(), free_port()
        data = self.dir / "etcd"
        self.procs["etcd"] = Process("etcd", [
            self.binary("etcd"), "--data-dir", str(data), "--name", "test",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
            "--quota-backend-bytes", str(4 << 30), "--log-level", "warn",
            "--experimental-watch-progress-notify-interval", "1s"], self.dir / "etcd.log")
        crt, key = self.pki.issue("apiserver", "/CN=kube-apiserver",
                                  sans="IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc")
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        self.apiserver_args = [
            self.binary("kube-apiserver"), "--etcd-servers", self.etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
            "--cert-dir", str(self.dir / "apiserver-certs"),
            "--tls-cert-file", str(crt), "--tls-private-key-file", str(key),
            "--client-ca-file", str(self.pki.ca_crt),
            "--service-account-issuer", ISSUER, "--api-audiences", ISSUER,
            "--service-account-key-file", str(self.sa_pub),
            "--service-account-signing-key-file", str(self.sa_key),
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", "NodeRestriction",
            "--disable-admission-plugins", "TaintNodesByCondition",
            "--service-cluster-ip-range", "10.96.0.0/16", "--allow-privileged=true",
            "--endpoint-reconciler-type", "none", "--profiling=false", "--v", "1"]
        self.procs["kube-apiserver"] = Process("kube-apiserver", self.apiserver_args, self.dir / "kube-apiserver.log")
        admin_crt, admin_key = self.pki.issue("admin", "/O=system:masters/CN=accelstack-test-admin", client=True)
        self.write_kubeconfig(self.admin_kubeconfig, user={"client-certificate": str(admin_crt),
                                                            "client-key": str(admin_key)})
        self._admin_ctx = self.ssl_context()
        self._admin_ctx.load_cert_chain(str(admin_crt), str(admin_key))
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until ``/readyz`` answers 200 (RBAC's bootstrap roles in place) or the time is up."""
        deadline = time.monotonic() + timeout
        ctx = self.ssl_context()
        last = ""
        while time.monotonic() < deadline:
            for name in ("etcd", "kube-apiserver"):
                if not self.procs[name].alive():
                    raise self.procs[name].fail("exited")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", context=ctx, timeout=5) as r:
                    if r.status == 200:
                        # bootstrap policy is served once the RBAC post-start hook ran; also check one role
                        self.kubectl("get", "clusterrole", "system:node", "-o", "name")
                        return
            except (urllib.error.URLError, OSError, subprocess.CalledProcessError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise self.procs["kube-apiserver"].fail(f"not ready in {timeout:.0f} s ({last})")

    def restart_apiserver(self, down: float = 0.0, timeout: float = 90.0) -> None:
        """Stop the API server (SIGTERM), wait ``down`` seconds, start it again on the same port and etcd."""
        self.procs["kube-apiserver"].stop()
        time.sleep(down)
        self.procs["kube-apiserver"] = Process("kube-apiserver", self.apiserver_args, self.dir / "kube-apiserver.log")
        self.wait_ready(timeout)

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        self.procs.clear()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- components on demand ---------------------------------------------------------------------------------
    def start_controller_manager(self, controllers: str = "*,-node-lifecycle-controller") -> Process:
        """kube-controller-manager with its own credentials (a client certificate as ``system:kube-controller-
        manager``) and per-controller ServiceAccounts, as kubeadm runs it."""
        if "kube-controller-manager" in self.procs:
            return self.procs["kube-controller-manager"]
        crt, key = self.pki.issue("kcm", "/CN=system:kube-controller-manager", client=True)
        kubeconfig = self.dir / "kcm.kubeconfig"
        self.write_kubeconfig(kubeconfig, user={"client-certificate": str(crt), "client-key": str(key)})
        port = free_port()
        proc = Process("kube-controller-manager", [
            self.binary("kube-controller-manager"), "--kubeconfig", str(kubeconfig),
            "--authentication-kubeconfig", str(kubeconfig), "--authorization-kubeconfig", str(kubeconfig),
            "--bind-address", "127.0.0.1", "--secure-port", str(port),
            "--controllers", controllers, "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(self.sa_key), "--root-ca-file", str(self.pki.ca_crt),
            "--leader-elect=false", "--concurrent-gc-syncs", "5", "--horizontal-pod-autoscaler-sync-period", "2s",
            "--v", "1"], self.dir / "kube-controller-manager.log")
        self.procs["kube-controller-manager"] = proc
        return proc

    def start_scheduler(self, config: dict[str, Any] | str, name: str = "kube-scheduler",
                        kubeconfig: Path | None = None) -> Process:
        """kube-scheduler with ``config`` (a KubeSchedulerConfiguration, its ``clientConnection.kubeconfig``
        filled in with ``kubeconfig``, by default the credentials kubeadm gives it: ``system:kube-scheduler``)."""
        if kubeconfig is None:
            crt, key = self.pki.issue(name, "/CN=system:kube-scheduler", client=True)
            kubeconfig = self.dir / f"{name}.kubeconfig"
            self.write_kubeconfig(kubeconfig, user={"client-certificate": str(crt), "client-key": str(key)})
        cfg = json.loads(config) if isinstance(config, str) else json.loads(json.dumps(config))
        cfg.setdefault("clientConnection", {})["kubeconfig"] = str(kubeconfig)
        cfg.setdefault("leaderElection", {})["leaderElect"] = False
        path = self.dir / f"{name}.config.json"
        path.write_text(json.dumps(cfg))
        port = free_port()
        proc = Process(name, [self.binary("kube-scheduler"), "--config", str(path), "--bind-address", "127.0.0.1",
                              "--secure-port", str(port), "--v", "1"], self.dir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def stop_component(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.stop()

    # ---- credentials ------------------------------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki.ca_crt))

    def write_kubeconfig(self, path: Path, *, user: dict[str, str]) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                     "certificate-authority": str(self.pki.ca_crt)}}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user"}}],
            "current-context": "test"}))
        return path

    def token(self, namespace: str, name: str, *, seconds: int = 7200, bound: dict[str, str] | None = None) -> str:
        """A real ServiceAccount token (TokenRequest), optionally bound to an object (``{"kind": "Node",
        "name": ...}`` gives it the node-name the kubelet's projected tokens carry)."""
        spec: dict[str, Any] = {"audiences": [ISSUER], "expirationSeconds": seconds}
        if bound:
            spec["boundObjectRef"] = {"apiVersion": "v1", **bound}
        out = self.kubectl("create", "--raw", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                           "-f", "-", stdin=json.dumps({"apiVersion": "authentication.k8s.io/v1",
                                                        "kind": "TokenRequest", "spec": spec}))
        return str(json.loads(out)["status"]["token"])

    def sa_kubeconfig(self, namespace: str, name: str, *, bound: dict[str, str] | None = None) -> Path:
        """A kubeconfig that authenticates as ``system:serviceaccount:NAMESPACE:NAME`` with a real token."""
        suffix = f"-{bound['kind']}-{bound['name']}" if bound else ""
        path = self.dir / f"sa-{namespace}-{name}{suffix}.kubeconfig"
        return self.write_kubeconfig(path, user={"token": self.token(namespace, name, bound=bound)})

    def user_kubeconfig(self, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for a person (a client certificate with CN=user, O=each group)."""
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
        safe = "".join(c if c.isalnum() else "-" for c in user)
        crt, key = self.pki.issue(f"user-{safe}", subject, client=True)
        return self.write_kubeconfig(self.dir / f"user-{safe}.kubeconfig",
                                     user={"client-certificate": str(crt), "client-key": str(key)})

    # ---- the API as the admin (tests' own reads and writes) ----------------------------------------------------
    def api(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
            ok: tuple[int, ...] = (200, 201, 202)) -> dict[str, Any]:
        """One REST call as the admin; raises :class:`ApiCallError` (with ``status``) on any other code."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(f"{self.url}/{path.lstrip('/')}", data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self._admin_ctx, timeout=30) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        obj = json.loads(raw) if raw else {}
        if status not in ok:
            raise ApiCallError(status, obj)
        return dict(obj)

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or None when it does not exist."""
        try:
            return self.api("GET", path)
        except ApiCallError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self.api("POST", path, obj)

    def patch(self, path: str, patch: dict[str, Any], kind: str = "merge") -> dict[str, Any]:
        types = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json"}
        return self.api("PATCH", path, patch, content_type=types[kind])

    def delete(self, path: str, *, force: bool = False) -> None:
        body = {"gracePeriodSeconds": 0} if force else None
        try:
            self.api("DELETE", path, body)
        except ApiCallError as exc:
            if exc.status != 404:
                raise

    # ---- kubectl ----------------------------------------------------------------------------------------------
    def kubectl(self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None,
                check: bool = True, timeout: float = 60.0) -> str:
        cmd = [self.binary("kubectl"), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args]
        res = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)
        return res.stdout if check else res.stdout + res.stderr

    def apply(self, objects: list[dict[str, Any]] | dict[str, Any]) -> None:
        items = objects if isinstance(objects, list) else [objects]
        self.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager", "accelstack-test",
                     "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def can_i(self, kubeconfig: Path, verb: str, resource: str, *, namespace: str | None = None,
              subresource: str = "") -> bool:
        """``kubectl auth can-i`` as the identity in ``kubeconfig``."""
        args = ["auth", "can-i", verb, resource]
        if subresource:
            args += ["--subresource", subresource]
        args += ["-n", namespace] if namespace else ["--all-namespaces"]
        out = self.kubectl(*args, kubeconfig=kubeconfig, check=False).strip().splitlines()
        return bool(out) and out[0].strip() == "yes"


@contextlib.contextmanager
def running(assets: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(assets)
    try:
        yield cp.start()
    finally:
        cp.cleanup()
