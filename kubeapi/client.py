"""``KubeClient``: REST calls to the API server with client-go's discipline.

Built on a ``kubernetes_asyncio`` ``ApiClient`` (its configuration loading, TLS and credential refresh), but the
requests go straight through the client's aiohttp session so that every call gets:

- a client-side timeout (``timeout``; a watch gets a read timeout instead, so a half-open stream ends). It is an
  ``asyncio.timeout`` around the call, not aiohttp's total timer: that timer, entered twice per request, swallowed
  a caller's cancellation that landed in the same tick as its own expiry and retried instead, so a leader's
  renewal bounded to 1 s ran 5 s and a cancelled leader-only task went on writing;
- the HTTP status checked: an error answer raises :class:`~kubeapi.errors.ApiError` (by status: ``NotFound``,
  ``Conflict``, ``Expired``, ``Forbidden``, ``TooManyRequests``), never data;
- retries of reads (and of writes marked idempotent) on 429, 5xx and transport errors, with exponential backoff
  and full jitter, honouring ``Retry-After``, bounded in attempts;
- the component's ``fieldManager`` on every write, and a ``User-Agent`` naming it;
- paginated lists (``limit``/``continue``; an expired continue token restarts the list);
- a Prometheus histogram per verb, resource and status code;
- the proxy decided once per client from ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY``, as client-go decides it
  (the library's session looked up the environment and ``~/.netrc`` on every request: about a quarter of a
  millisecond of the event loop per API call, two per bind).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import aiohttp
import msgspec
import orjson
from prometheus_client import CollectorRegistry

from kubeapi.errors import ApiError, Expired, TransportError, error_for
from kubeapi.metrics import api_metrics
from kubeapi.resources import Resource

JSON = "application/json"
PATCH_TYPES = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
               "json": "application/json-patch+json"}


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: uniform in [base/2, min(cap, base * 2^(attempt-1))]."""
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return rng.uniform(min(base / 2, ceiling), ceiling)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``/``HTTP_PROXY`` by its scheme), None when
    there is none or ``NO_PROXY`` exempts its host."""
    parts = urlsplit(url)
    if not parts.hostname or proxy_bypass(parts.hostname):
        return None
    return getproxies().get(parts.scheme) or None


class _Page(msgspec.Struct):
    """A list answer with its items left undecoded (each is decoded on its own, and the caller can pace that)."""
    metadata: dict[str, Any] = {}
    items: list[msgspec.Raw] | None = None


_PAGE = msgspec.json.Decoder(_Page)


def _decode_page(raw: bytes) -> _Page:
    try:
        return _PAGE.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(500, "BadList", f"not a list: {str(exc)[:200]}") from None


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return {"message": raw[:300].decode(errors="replace")}
    return body if isinstance(body, dict) else {"message": str(body)[:300]}


class KubeClient:
    def __init__(self, api_client: Any, *, field_manager: str, timeout: float = 10.0, max_retries: int = 4,
                 backoff_base: float = 0.2, backoff_cap: float = 5.0, registry: CollectorRegistry | None = None,
                 rng: random.Random | None = None) -> None:
        if not field_manager:
            raise ValueError("field_manager: every component writes under its own name")
        self.api_client = api_client
        self.configuration = api_client.configuration
        self.host = str(self.configuration.host).rstrip("/")
        self.field_manager = field_manager
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.rng = rng or random.Random()
        self.metrics = api_metrics(registry)
        self._server_hostname = getattr(self.configuration, "tls_server_name", None)
        rest = api_client.rest_client
        if rest.pool_manager.trust_env:  # the same connection pool, without the per-request lookups
            old = rest.pool_manager
            rest.pool_manager = aiohttp.ClientSession(connector=old.connector, trust_env=False, read_bufsize=2**21)
            old.detach()
        self.proxy = rest.proxy = self.configuration.proxy or proxy_for(self.host)
        self.impersonate = ""  # a user name sent as Impersonate-User (:meth:`impersonating`)

    @property
    def session(self) -> aiohttp.ClientSession:
        session: aiohttp.ClientSession = self.api_client.rest_client.pool_manager
        return session

    async def close(self) -> None:
        await self.api_client.close()

    def impersonating(self, user: str) -> KubeClient:
        """This client acting as ``user`` (``Impersonate-User``; the caller needs RBAC ``impersonate`` on it, and
        the API server then authorises each call as that user): the same connections, so never closed itself."""
        other = copy.copy(self)
        other.impersonate = user
        return other

    async def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": JSON, "User-Agent": f"accelstack/{self.field_manager}"}
        if self.impersonate:
            headers["Impersonate-User"] = self.impersonate
        if content_type:
            headers["Content-Type"] = content_type
        settings = await self.configuration.auth_settings()
        for setting in settings.values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    # ------------------------------------------------------------------------------------------- raw calls
    async def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None, body: Any = None,
                      content_type: str = JSON, timeout: float | None = None, retry: bool | None = None,
                      resource: str = "") -> dict[str, Any]:
        """One API call, retried (reads by default) on transient failures; the decoded JSON answer."""
        answer: dict[str, Any] = await self._call(method, path, query, body, content_type, timeout, retry, resource,
                                                  _decode)
        return answer

    async def _call(self, method: str, path: str, query: Mapping[str, Any] | None, body: Any, content_type: str,
                    timeout: float | None, retry: bool | None, resource: str, decode: Callable[[bytes], Any]) -> Any:
        retry = method == "GET" if retry is None else retry
        attempt = 0
        while True:
            try:
                return await self._once(method, path, query, body, content_type, timeout, resource, decode)
            except ApiError as exc:
                attempt += 1
                if not (retry and exc.transient) or attempt > self.max_retries:
                    raise
                delay = exc.retry_after if exc.retry_after is not None else backoff_delay(
                    attempt, self.backoff_base, self.backoff_cap, self.rng)
                self.metrics.retries.labels(method, resource or "-").inc()
                await asyncio.sleep(min(delay, self.backoff_cap))

    async def _once(self, method: str, path: str, query: Mapping[str, Any] | None, body: Any, content_type: str,
                    timeout: float | None, resource: str, decode: Callable[[bytes], Any]) -> Any:
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = await self._headers(content_type if data is not None else None)
        params = {k: _param(v) for k, v in (query or {}).items() if v is not None and v != ""}
        limit = self.timeout if timeout is None else timeout
        kwargs: dict[str, Any] = {"params": params, "data": data, "headers": headers,
                                  "timeout": aiohttp.ClientTimeout(total=None), "proxy": self.proxy}
        if self._server_hostname:
            kwargs["server_hostname"] = self._server_hostname
        started = time.perf_counter()
        code = "error"
        try:
            async with asyncio.timeout(limit), self.session.request(method, self.host + path, **kwargs) as response:
                raw = await response.read()
                code = str(response.status)
                if response.status >= 300:
                    raise error_for(response.status, _decode(raw), _retry_after(response.headers))
                return decode(raw) if raw else decode(b"{}")
        except TimeoutError:
            code = "timeout"
            raise TransportError(f"{method} {path}: no answer within {limit:g}s") from None
        except aiohttp.ClientError as exc:
            raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}"[:300]) from None
        finally:
            self.metrics.latency.labels(method, resource or "-", code).observe(time.perf_counter() - started)

    # ------------------------------------------------------------------------------------- typed helpers
    def _write_query(self, query: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {"fieldManager": self.field_manager, **(query or {})}

    async def get(self, res: Resource, name: str, namespace: str | None = None, subresource: str | None = None,
                  timeout: float | None = None) -> dict[str, Any]:
        return await self.request("GET", res.path(namespace, name, subresource), timeout=timeout, resource=res.plural)

    async def list_until(self, res: Resource, stop: asyncio.Event, on_failure: Callable[[ApiError], None]
                         ) -> tuple[list[dict[str, Any]], str] | None:
        """:meth:`list` of every ``res``, retried with backoff (0.5 s up to 10 s) until it succeeds; None when
        ``stop`` is set first. ``on_failure`` hears of each failed try (a log line). What a leader reads at the start
        of its term: a consistent read, taken before it acts."""
        failures = 0
        while not stop.is_set():
            try:
                return await self.list(res)
            except ApiError as exc:
                failures += 1
                on_failure(exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff_delay(failures, 0.5, 10.0, self.rng))
        return None

    async def list(self, res: Resource, namespace: str | None = None, *, label_selector: str = "",
                   field_selector: str = "", page_size: int = 500,
                   timeout: float | None = None) -> tuple[list[dict[str, Any]], str]:
        """Every item, page by page; returns (items, the list's resourceVersion). A continue token that expired
        in the middle restarts the list from the first page (as client-go's pager does)."""
        pages, rv = await self._pages(res, namespace, label_selector, field_selector, page_size, timeout, _decode)
        return [item for page in pages for item in page.get("items") or []], rv

    async def list_raw(self, res: Resource, namespace: str | None = None, *, label_selector: str = "",
                       field_selector: str = "", page_size: int = 500,
                       timeout: float | None = None) -> tuple[builtins.list[msgspec.Raw], str]:
        """As :meth:`list`, with each item left as its undecoded JSON (``orjson.loads(memoryview(item))``): a page of
        real Node objects (15-20 KB each, images and managedFields included) decoded at once holds the event loop
        for tens of milliseconds, so an informer decodes the items one by one and gives the loop back between."""
        pages, rv = await self._pages(res, namespace, label_selector, field_selector, page_size, timeout,
                                      _decode_page)
        return [item for page in pages for item in page.items or []], rv

    async def _pages(self, res: Resource, namespace: str | None, label_selector: str, field_selector: str,
                     page_size: int, timeout: float | None, decode: Callable[[bytes], Any]) -> tuple[builtins.list[Any], str]:
        for _ in range(3):
            pages: builtins.list[Any] = []
            token = ""
            try:
                while True:
                    query = {"limit": page_size, "continue": token, "labelSelector": label_selector,
                             "fieldSelector": field_selector}
                    page = await self._call("GET", res.path(namespace), query, None, JSON, timeout, None,
                                            res.plural, decode)
                    pages.append(page)
                    meta = (page.get("metadata") if isinstance(page, dict) else page.metadata) or {}
                    token = meta.get("continue") or ""
                    if not token:
                        return pages, str(meta.get("resourceVersion") or "")
            except Expired:
                if not token:
                    raise
                continue
        raise Expired(410, "Expired", f"list of {res.plural}: continue token kept expiring")

    async def create(self, res: Resource, body: Any, namespace: str | None = None, subresource: str | None = None,
                     name: str | None = None, timeout: float | None = None, retry: bool = False) -> dict[str, Any]:
        path = res.path(namespace, name, subresource) if subresource else res.path(namespace)
        return await self.request("POST", path, query=self._write_query(), body=body, timeout=timeout, retry=retry,
                                  resource=res.plural + (f"/{subresource}" if subresource else ""))

    async def replace(self, res: Resource, name: str, body: Any, namespace: str | None = None,
                      subresource: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """PUT: carries the object's resourceVersion, so a stale read answers Conflict (safe to retry)."""
        return await self.request("PUT", res.path(namespace, name, subresource), query=self._write_query(),
                                  body=body, timeout=timeout, retry=True,
                                  resource=res.plural + (f"/{subresource}" if subresource else ""))

    async def patch(self, res: Resource, name: str, body: Any, namespace: str | None = None, *,
                    patch_type: str = "merge", subresource: str | None = None, timeout: float | None = None,
                    retry: bool = False) -> dict[str, Any]:
        return await self.request("PATCH", res.path(namespace, name, subresource), query=self._write_query(),
                                  body=body, content_type=PATCH_TYPES[patch_type], timeout=timeout, retry=retry,
                                  resource=res.plural + (f"/{subresource}" if subresource else ""))

    async def delete(self, res: Resource, name: str, namespace: str | None = None, *, uid: str | None = None,
                     resource_version: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """DELETE, with preconditions on UID and resourceVersion when given (409 when they do not hold)."""
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions} if preconditions else None
        return await self.request("DELETE", res.path(namespace, name), body=body, timeout=timeout, retry=True,
                                  resource=res.plural)

    async def watch(self, res: Resource, namespace: str | None = None, *, resource_version: str = "",
                    timeout_seconds: int = 300, read_timeout: float | None = None, label_selector: str = "",
                    field_selector: str = "", on_open: Callable[[], None] | None = None,
                    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) events of one watch request, bookmarks included, until the server closes it.

        ``on_open`` is called once the server answered 200 (before any event): the server is reachable and the
        watch allowed, which an informer counts as healthy even while no event arrives for minutes.

        The status of the answer is checked (an error answer raises, it is never an event); an ``ERROR`` event
        raises (:class:`Expired` for 410); no byte for ``read_timeout`` seconds (default: the server's own
        timeout plus 30 s) raises :class:`TransportError`, so a half-open connection cannot stall the caller."""
        query = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": timeout_seconds,
                 "resourceVersion": resource_version, "labelSelector": label_selector,
                 "fieldSelector": field_selector}
        params = {k: _param(v) for k, v in query.items() if v is not None and v != ""}
        read = read_timeout if read_timeout is not None else timeout_seconds + 30.0
        kwargs: dict[str, Any] = {"params": params, "headers": await self._headers(None),
                                  "timeout": aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                                                   sock_read=read), "proxy": self.proxy}
        if self._server_hostname:
            kwargs["server_hostname"] = self._server_hostname
        path = res.path(namespace)
        started = time.perf_counter()
        code = "error"
        try:
            async with self.session.get(self.host + path, **kwargs) as response:
                code = str(response.status)
                if response.status >= 300:
                    raise error_for(response.status, _decode(await response.read()), _retry_after(response.headers))
                if on_open is not None:
                    on_open()
                while True:
                    line = await response.content.readline()
                    if not line:
                        return
                    if not line.strip():
                        continue
                    try:
                        event = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        raise ApiError(500, "BadWatchEvent", f"watch {res.plural}: not JSON: {line[:120]!r}") from None
                    kind = event.get("type") if isinstance(event, dict) else None
                    obj = event.get("object") if isinstance(event, dict) else None
                    if not isinstance(kind, str) or not isinstance(obj, dict):
                        raise ApiError(500, "BadWatchEvent", f"watch {res.plural}: not an event: {line[:120]!r}")
                    if kind == "ERROR":
                        raise error_for(int(obj.get("code") or 500), obj)
                    yield kind, obj
        except TimeoutError:
            code = "timeout"
            raise TransportError(f"watch {res.plural}: no data for {read:g}s (half-open connection?)") from None
        except aiohttp.ClientError as exc:
            raise TransportError(f"watch {res.plural}: {type(exc).__name__}: {exc}"[:300]) from None
        finally:
            self.metrics.watch_seconds.labels(res.plural, code).observe(time.perf_counter() - started)


class ConfigMissing(RuntimeError):
    """No usable credentials to reach the API server: the message is one line naming what is missing."""


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


async def from_config(kubeconfig: str = "", *, field_manager: str, **kwargs: Any) -> KubeClient:
    """A client from a kubeconfig file, else the in-cluster service account, else ~/.kube/config."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException as incluster:
                default = os.path.expanduser(os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or
                                             "~/.kube/config")
                if not os.path.exists(default):
                    raise ConfigMissing(
                        "no Kubernetes credentials: no --kubeconfig given, not in a cluster "
                        f"({str(incluster).rstrip('.')}), and no kubeconfig at {default} (set --kubeconfig or "
                        "KUBECONFIG)") from None
                kubeconfig = default
                await config.load_kube_config(config_file=default, client_configuration=configuration)
    except config.ConfigException as exc:  # e.g. "Expected key current-context": say which file
        raise ConfigMissing(f"kubeconfig {kubeconfig}: {exc}".replace("\n", " ")[:500]) from None
    return KubeClient(client.ApiClient(configuration), field_manager=field_manager, **kwargs)


@contextlib.asynccontextmanager
async def connected(host: str, *, field_manager: str, token: str = "", **kwargs: Any) -> AsyncIterator[KubeClient]:
    """A client for a plain address (tests, local API servers): ``async with connected(url, ...) as kube``."""
    from kubernetes_asyncio import client

    configuration = client.Configuration(host=host)
    if token:
        configuration.api_key = {"BearerToken": token}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
    kube = KubeClient(client.ApiClient(configuration), field_manager=field_manager, **kwargs)
    try:
        yield kube
    finally:
        await kube.close()
