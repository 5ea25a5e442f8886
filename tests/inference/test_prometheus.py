"""The autoscalers' metrics on a real Prometheus (Debian's prometheus) scraping the gateway: the Prometheus
Adapter's queries, expanded as the adapter expands them for an HPA, give the CG pod's requests in flight and the
model's mean queue wait; the exposition passes ``promtool check metrics``."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.inference.harness import KEY_A, endpoint, slices
from tests.inference.test_inference_manifests import adapter_config
from tests.npd.promtools import need
from tests.npd.test_prometheus_integration import free_port, query


def expand(template: str, series: str, matchers: str, group_by: str) -> str:
    """The adapter's Go-template placeholders, filled as it fills them for one request."""
    return (template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", group_by))


async def wait_for(port: int, expr: str, check: Any, timeout: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    result: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            result = await asyncio.to_thread(query, port, expr)
        except OSError:
            result = []
        if result and check(result):
            return result
        await asyncio.sleep(0.2)
    raise AssertionError(f"{expr} never satisfied the check; last {result}")


async def test_adapter_queries_on_prometheus_scraping_the_gateway(make_peers: Any, make_gateway: Any,
                                                                   tmp_path: Path) -> None:
    prometheus = need("prometheus")
    promtool = need("promtool")
    (peer,) = await make_peers(1, latency=3)
    gw = await make_gateway()
    gw.load([endpoint("llm", models=["m"], max_inflight=2)], slices("llm", [peer.url]))
    url = await gw.start()
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        exposition = await r.text()
    lint = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr

    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
              "scrape_configs": [{"job_name": "accelstack-gateway",
                                  "static_configs": [{"targets": [url.removeprefix("http://")]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_for(port, 'up{job="accelstack-gateway"}', lambda r: r[0]["value"][1] == "1")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY_A}"}) as client:
            calls = [asyncio.create_task(client.post(url + "/v1/embeddings", json={"model": "m", "input": "x"}))
                     for _ in range(4)]  # two at the replica, two queued behind them
            rules = adapter_config()
            (custom,) = rules["rules"]
            pods = expand(custom["metricsQuery"], "accelstack_gateway_replica_inflight",
                          'replica_namespace="team-a",replica_pod=~"llm-primary-0"', "replica_pod")
            found = await wait_for(port, pods, lambda r: r[0]["value"][1] == "2")
            assert found[0]["metric"] == {"replica_pod": "llm-primary-0"}
            (external,) = rules["externalRules"]
            queue = expand(external["metricsQuery"], "", 'model=~"m"', "")
            responses = await asyncio.gather(*calls)
            assert [r.status for r in responses] == [200] * 4
            waited = await wait_for(port, queue, lambda r: float(r[0]["value"][1]) > 0)
            assert waited[0]["metric"] == {"model": "m"}
            assert 0 < float(waited[0]["value"][1]) < 10  # two waited ~3 s, two not at all
            for r in responses:
                r.release()
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            assert re.search(r'accelstack_gateway_queue_seconds_count\{model="m"\} 4\.0', await r.text())
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

