"""``accelstack-device-plugin``: one process advertising every enabled backend's devices to the kubelet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from device_plugin.config import SCHEMA, Config, ConfigError, load
from device_plugin.devices import Backend, DeviceTable
from device_plugin.handover import ANNOTATION, NR1_ANNOTATION, PodResourcesWatch
from device_plugin.labeller import NodeLabeller, in_cluster_client
from device_plugin.nr1_backend import NR1Backend
from device_plugin.nr1_sysfs import check_sysfs_root
from device_plugin.nvml_backend import BackendInitError, NvmlBackend
from device_plugin.server import POLL_INTERVAL, PluginRunner, RegistrationError, SocketPathError
from service.observability import PluginMetrics, setup_logging, start_http

log = logging.getLogger("accelstack.device_plugin")


def build_backends(config: Config, nvml: Any = None) -> list[Backend]:
    """The enabled backends, discovered. A backend that cannot start either stops the process
    (``failOnInitError``) or is advertised with zero devices and a warning that says why: a documented state,
    not an error. A sysfs root that is not there is a configuration error (ConfigError naming
    ``flags.sysfsRoot``), whatever ``failOnInitError`` says: a node whose modules cannot be seen must not pass
    for a node without modules."""
    problem = check_sysfs_root(config["flags.sysfsRoot"], need_pci=config["nr1.enabled"])
    if problem:
        raise ConfigError(f"flags.sysfsRoot: {problem}")
    backends: list[Backend] = []
    if config["nvidia.enabled"]:
        nvidia = NvmlBackend(config.section("nvidia"), config["flags.sysfsRoot"], config["flags.devRoot"], nvml=nvml)
        try:
            nvidia.discover()
        except BackendInitError as exc:
            if config["flags.failOnInitError"]:
                raise
            log.warning("nvidia backend disabled (failOnInitError=false): advertising zero GPUs",
                        extra={"reason": str(exc)})
            nvidia.devices = []
        backends.append(nvidia)
    if config["nr1.enabled"]:
        nr1 = NR1Backend(config.section("nr1"), config["flags.sysfsRoot"])
        nr1.discover()
        backends.append(nr1)
    return backends


class DevicePluginProcess:
    """All runners of this process plus their health threads; ``run`` returns on ``stop``."""

    def __init__(self, config: Config, backends: list[Backend], metrics: PluginMetrics | None = None,
                 poll_interval: float = POLL_INTERVAL, kube: Any = None) -> None:
        self.config = config
        self.kube = kube  # kubeapi.KubeClient for the labeller; in-cluster when None
        self.backends = backends
        self.metrics = metrics or PluginMetrics()
        self.poll_interval = poll_interval
        self.tables: dict[str, DeviceTable] = {}
        self.runners: list[PluginRunner] = []
        self.watch: PodResourcesWatch | None = None  # the kubelet's pod-resources view (handover.py)
        self.labeller_poke = asyncio.Event()
        self.stop = asyncio.Event()
        self._threads_stop = threading.Event()

    def ready(self) -> bool:
        return bool(self.runners) and all(r.registered for r in self.runners)

    def _update_gauges(self, resource: str, table: DeviceTable) -> None:
        for health, count in table.counts().items():
            self.metrics.devices.labels(resource, health).set(count)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threads = []
        for backend in self.backends:
            table = DeviceTable(backend.devices, replicas=backend.replicas)
            resource = backend.resource_name
            self.tables[resource] = table
            self._update_gauges(resource, table)

            def apply(pid: str, healthy: bool, reason: str, table: DeviceTable = table, resource: str = resource) -> None:
                if table.set_health(pid, healthy, reason):
                    self.metrics.health_changes.labels(resource, "Healthy" if healthy else "Unhealthy").inc()
                    self._update_gauges(resource, table)

            def report(pid: str, healthy: bool, reason: str, apply: Any = apply) -> None:
                loop.call_soon_threadsafe(apply, pid, healthy, reason)

            thread = threading.Thread(target=self._health, args=(backend, report), name=f"health-{resource}",
                                      daemon=True)
            threads.append(thread)
            self.runners.append(PluginRunner(backend, table, self.config["flags.devicePluginPath"], self.metrics,
                                             register_retry=self.config["flags.registerRetry"],
                                             poll_interval=self.poll_interval))
        self._start_watch()
        http = start_http(self.config["flags.metricsAddress"], self.metrics, self.ready)
        labeller_task, own_client = await self._start_labeller()
        for thread in threads:
            thread.start()
        tasks = [asyncio.create_task(r.run(self.stop), name=f"runner-{r.backend.resource_name}")
                 for r in self.runners]
        if self.watch is not None:
            tasks.append(asyncio.create_task(self.watch.run(self.stop), name="pod-resources"))
        try:
            done, _ = await asyncio.wait([*tasks, asyncio.create_task(self.stop.wait())],
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task in tasks and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            self.stop.set()
            self._threads_stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            if labeller_task is not None:
                await asyncio.gather(labeller_task, return_exceptions=True)
            if own_client is not None:
                await own_client.close()
            if http is not None:
                http.close()
            for thread in threads:
                thread.join(timeout=2)
            for backend in self.backends:
                backend.close()

    def _start_watch(self) -> None:
        """The pod-resources watch over every resource, read at each registration and after each Allocate;
        none when ``podResources.socket`` is empty."""
        socket_path = self.config["podResources.socket"]
        if not socket_path:
            return
        keys = {b.resource_name: NR1_ANNOTATION if isinstance(b, NR1Backend) else ANNOTATION for b in self.backends}
        self.watch = PodResourcesWatch(
            socket_path, self.config["podResources.interval"], self.tables, keys, self.metrics.registry,
            on_change=self.labeller_poke.set, on_fence=lambda r: self._update_gauges(r, self.tables[r]))
        for runner in self.runners:
            runner.on_registered = self.watch.registered
            runner.on_allocate = self.watch.allocated

    def node_labels(self) -> dict[str, str]:
        labels: dict[str, str] = {}
        for backend in self.backends:
            labels.update(backend.labels())
        return labels

    async def _start_labeller(self) -> tuple[asyncio.Task[None] | None, Any]:
        node = self.config["labeller.nodeName"]
        if not self.config["labeller.enabled"]:
            return None, None
        if not node:
            log.warning("labeller disabled: no node name (set NODE_NAME from the downward API)")
            return None, None
        from kubeapi.client import ConfigMissing
        from kubeapi.tasks import supervise

        kube, own_client = self.kube, None
        if kube is None:
            try:
                kube = own_client = await in_cluster_client(self.metrics.registry)
            except ConfigMissing as exc:  # one line, whole: it names the kubeconfig looked for and the remedy
                log.warning("labeller disabled", extra={"error": str(exc)})  # (cut at 200, both were lost)
                return None, None
            except Exception as exc:
                log.warning("labeller disabled: no Kubernetes credentials", extra={"error": str(exc)[:200]})
                return None, None
        labeller = NodeLabeller(kube, node, self.node_labels, self.config["labeller.interval"],
                                annotations=self.watch.annotations if self.watch is not None else None)

        async def run(stop: asyncio.Event) -> None:
            await labeller.run(stop, self.labeller_poke)

        return asyncio.create_task(supervise("labeller", run, self.stop), name="labeller"), own_client

    def _health(self, backend: Backend, report: Any) -> None:
        try:
            backend.run_health(report, self._threads_stop.is_set)
        except Exception:
            log.exception("health loop crashed; devices keep their last health", extra={
                "resource": backend.resource_name})


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = load(argv)
    except ConfigError as exc:
        print(f"accelstack-device-plugin: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(SCHEMA.print_tree(config), end="")
        return 0
    setup_logging(config["flags.logLevel"], config["flags.logFormat"])
    try:
        backends = build_backends(config)
    except ConfigError as exc:
        print(f"accelstack-device-plugin: configuration error: {exc}", file=sys.stderr)
        return 2
    except BackendInitError as exc:
        log.error("cannot start (set failOnInitError=false to run with zero devices)", extra={"reason": str(exc)})
        return 1
    process = DevicePluginProcess(config, backends)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, process.stop.set)
        await process.run()

    try:
        asyncio.run(run())
    except RegistrationError as exc:
        log.error("registration refused; exiting", extra={"reason": str(exc)})
        return 1
    except SocketPathError as exc:
        log.error("cannot serve the device-plugin socket; exiting", extra={"reason": str(exc)})
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
