"""The product's own processes on the real control plane, each under its shipped ServiceAccount.

:class:`Product` runs ``python -m MODULE`` with a kubeconfig that holds a real token of the ServiceAccount the
shipped Deployment or DaemonSet names, logs to a file beside the control plane's, and waits for ``/readyz``.
:class:`Stack` is what the shipped ``accelstack-extender`` Deployment runs: the extender container (verbs,
webhooks, REST API; ``--controller=false``) and the controller container (GPR and workspace controllers,
leader-elected), with the shipped webhook configurations pointed at the extender, and — on demand — kube-scheduler
with the shipped ``accelstack-scheduler`` profile under its shipped ServiceAccount. As shipped, the verbs are on
a listener of their own that requires a client certificate of the fixture's CA with the common name
``accelstack-scheduler``, which the profile's ``tlsConfig`` presents (only the file paths and the URL changed).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import yaml

from tests.realcluster.controlplane import ControlPlane, ControlPlaneError, free_port
from tests.realcluster.shipped import ROOT, pick, webhooks_to

SYSTEM_NS = "accelstack-system"


class Product:
    """One process of the product: started, waited for, signalled, its log kept."""

    def __init__(self, cp: ControlPlane, name: str, module: str, args: list[str], *,
                 env: dict[str, str] | None = None, health: str = "", ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.cp, self.name, self.module, self.args = cp, name, module, args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.health, self.ssl_ctx = health, ssl_ctx
        self.log = cp.dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 60.0) -> Product:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        if self.health:
            self.wait_ready(ready_timeout)
        return self

    def status(self, path: str = "/readyz") -> int:
        try:
            with urllib.request.urlopen(self.health + path, context=self.ssl_ctx, timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, OSError):
            return 0

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ControlPlaneError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if self.status() == 200:
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"{self.name} not ready in {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Stack:
    """The extender and the GPR controller as the shipped Deployment runs them, plus the scheduler on demand."""

    def __init__(self, cp: ControlPlane, objects: list[dict[str, Any]], extender_args: tuple[str, ...] = ()) -> None:
        self.cp, self.objects, self.extender_args = cp, objects, list(extender_args)
        self.kubeconfig = cp.sa_kubeconfig(SYSTEM_NS, "accelstack-extender")
        self.port, self.verbs_port = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.verbs_url = f"https://127.0.0.1:{self.verbs_port}"
        self.cert, self.key = cp.pki.issue("extender", "/CN=accelstack-extender.accelstack-system.svc",
                                           sans="IP:127.0.0.1,DNS:accelstack-extender.accelstack-system.svc")
        # kube-scheduler's client certificate for the verbs (cert-manager issues it in the shipped manifests)
        self.client_cert, self.client_key = cp.pki.issue("scheduler-client", "/CN=accelstack-scheduler", client=True)
        self.extender = self._extender()
        self.controllers: list[Product] = []
        self.scheduler_name = ""

    def _extender(self, name: str = "extender", port: int = 0, verbs_port: int = 0) -> Product:
        port, verbs_port = port or self.port, verbs_port or self.verbs_port
        return Product(self.cp, name, "scheduler_extender.cmd.extender", [
            "--kubeconfig", str(self.kubeconfig), "--listen", f"127.0.0.1:{port}",
            "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key), "--url-prefix", "/scheduler",
            "--scheduler-listen", f"127.0.0.1:{verbs_port}", "--scheduler-client-ca-file", str(self.cp.pki.ca_crt),
            "--controller=false", "--ledger=memory", "--log-format", "json", *self.extender_args],
            health=f"https://127.0.0.1:{port}", ssl_ctx=self.cp.ssl_context())

    def second_extender(self, name: str = "extender-1") -> tuple[Product, str]:
        """Another replica of the extender container, on ports of its own (started, not binding while the first
        holds the binder Lease); (it, its verbs URL)."""
        verbs_port = free_port()
        return self._extender(name, free_port(), verbs_port).start(), f"https://127.0.0.1:{verbs_port}"

    def controller(self, identity: str = "controller-0", lease_seconds: float = 4.0, *args: str) -> Product:
        """A replica of the controller container (its own /readyz port); ``args`` after the test's defaults."""
        port = free_port()
        return Product(self.cp, identity, "scheduler_extender.cmd.controller", [
            "--kubeconfig", str(self.kubeconfig), "--listen", f"127.0.0.1:{port}", "--identity", identity,
            "--lease-seconds", str(lease_seconds), "--resync", "2", "--estimate-every", "5", "--ledger=memory",
            "--log-format", "json", *args], env={"POD_NAMESPACE": SYSTEM_NS}, health=f"http://127.0.0.1:{port}")

    def wait_binding(self, timeout: float = 60.0, extender: Product | None = None) -> None:
        """Until the extender (``extender``, else the stack's) binds (``--ledger=memory``: it holds the binder Lease
        and has read the pods)."""
        product = extender or self.extender
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(product.health + "/metrics", context=self.cp.ssl_context(),
                                            timeout=5) as r:
                    if "accelstack_extender_binder_active 1.0" in r.read().decode():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise ControlPlaneError(f"{product.name} did not start binding in {timeout:.0f} s:\n{product.tail()}")

    def verbs_connections(self) -> dict[str, float]:
        """The TLS connections the extender's verbs listener accepted so far, by the protocol each settled on
        (``accelstack_http_connections_total``)."""
        with urllib.request.urlopen(self.extender.health + "/metrics", context=self.cp.ssl_context(), timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("accelstack_http_connections_total{"):
                out[line.split('protocol="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return out

    def start(self, controller: bool = True) -> Stack:
        """The extender, the shipped webhooks pointed at it, and (``controller``) one controller replica."""
        self.extender.start()
        self.wait_binding()
        self.cp.apply(webhooks_to(self.objects, self.url, self.cp.pki.ca_crt.read_bytes()))
        if controller:
            self.controllers.append(self.controller().start())
        return self

    def restart_extender(self) -> None:
        self.extender.stop()
        self.extender = self._extender().start()
        self.wait_binding()

    def scheduler_config(self) -> dict[str, Any]:
        """The shipped profile with only the extender's URL and the CA, certificate and key files changed."""
        cm = pick(self.objects, "ConfigMap", "accelstack-scheduler-config")
        cfg = yaml.safe_load(cm["data"]["config.yaml"])
        for ext in cfg["extenders"]:
            ext["urlPrefix"] = f"{self.verbs_url}/scheduler"
            ext["tlsConfig"] = {**ext.get("tlsConfig", {}), "caFile": str(self.cp.pki.ca_crt),
                                "certFile": str(self.client_cert), "keyFile": str(self.client_key)}
        return copy.deepcopy(cfg)

    def stop_scheduler(self) -> None:
        if self.scheduler_name:
            self.cp.stop_component(self.scheduler_name)
            self.scheduler_name = ""

    def start_scheduler(self, config: dict[str, Any] | None = None) -> None:
        if self.scheduler_name:
            return
        # as the shipped Deployment runs it: its own ServiceAccount, bound to system:kube-scheduler's roles
        self.cp.start_scheduler(json.dumps(config or self.scheduler_config()), name="accelstack-scheduler",
                                kubeconfig=self.cp.sa_kubeconfig(SYSTEM_NS, "accelstack-scheduler"))
        self.scheduler_name = "accelstack-scheduler"

    def stop(self) -> None:
        if self.scheduler_name:
            self.cp.stop_component(self.scheduler_name)
            self.scheduler_name = ""
        for ctl in self.controllers:
            with contextlib.suppress(Exception):
                ctl.stop()
        self.controllers.clear()
        self.extender.stop()
