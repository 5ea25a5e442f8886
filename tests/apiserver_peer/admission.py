"""Validating admission webhooks, called as the API server calls them: on CREATE and UPDATE of the resources a
webhook names (the main resource, not ``/status``), after the object is built and before it is stored, with an
``admission.k8s.io/v1`` AdmissionReview; a refusal becomes the API server's error Status (``ToStatusErr`` in
k8s.io/apiserver's webhook errors: the webhook's code, 400 when below 400, and ``admission webhook "NAME" denied
the request: MESSAGE``); a call that fails or outlives ``timeoutSeconds`` answers 500 ``InternalError`` under
``failurePolicy: Fail`` and lets the write through under ``Ignore``."""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tests.apiserver_peer.wire import Refused, plural_of


def timeout_param(seconds: float) -> str:
    """The ``timeout`` query parameter the API server puts on a webhook call: the time left to its deadline,
    rounded up to whole seconds, as Go prints a duration ("5s")."""
    return f"{max(1, math.ceil(seconds))}s"


@dataclass
class ValidatingWebhook:
    name: str  # "gprs.accelstack.io"
    url: str  # where the AdmissionReview is POSTed
    resources: frozenset[str]  # plurals: {"gpuprovisioningrequests"}
    operations: frozenset[str] = frozenset({"CREATE", "UPDATE"})
    timeout: float = 5.0  # timeoutSeconds
    failure_policy: str = "Fail"  # or "Ignore"
    calls: int = 0
    failures: list[str] = field(default_factory=list)  # why calls failed (timeouts, refused connections, ...)


def _group_version(obj: dict[str, Any]) -> tuple[str, str]:
    api_version = str(obj.get("apiVersion") or "v1")
    group, _, version = api_version.rpartition("/")
    return group, version


class Admission:
    """The webhooks a peer calls (``peer.admission.validating.append(ValidatingWebhook(...))``)."""

    def __init__(self) -> None:
        self.validating: list[ValidatingWebhook] = []
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def admit(self, request: web.Request, user: dict[str, Any], resource: str, operation: str,
                    obj: dict[str, Any], old: dict[str, Any] | None, kind: str, dry: bool) -> None:
        """Raise :class:`Refused` when a webhook refuses ``obj`` (or cannot be called and fails closed)."""
        plural = plural_of(resource)
        hooks = [h for h in self.validating if plural in h.resources and operation in h.operations]
        if not hooks:
            return
        if self._http is None:
            self._http = aiohttp.ClientSession()
        group, version = _group_version(obj)
        meta = obj.get("metadata") or {}
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": str(uuid.uuid4()), "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": plural},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": plural},
            "name": meta.get("name", ""), "namespace": meta.get("namespace", ""), "operation": operation,
            "userInfo": user, "object": obj, "oldObject": old, "dryRun": dry,
            "options": {"apiVersion": "meta.k8s.io/v1",
                        "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"}}}
        answers = await asyncio.gather(*(self._call(h, review) for h in hooks))
        for hook, answer in zip(hooks, answers, strict=True):
            if answer is None or answer.get("allowed"):
                continue
            result = dict(answer.get("status") or {})
            code = int(result.get("code") or 0)
            code = code if code >= 400 else 400
            denied = f'admission webhook "{hook.name}" denied the request'
            text = result.get("message") or result.get("reason")
            raise Refused(code, f"{denied}: {text}" if text else f"{denied} without explanation",
                          str(result.get("reason") or ""), result.get("details"))

    async def _call(self, hook: ValidatingWebhook, review: dict[str, Any]) -> dict[str, Any] | None:
        """The webhook's ``response``; None when it could not be had and the policy is Ignore."""
        hook.calls += 1
        assert self._http is not None
        try:
            # the API server tells the webhook its deadline (``?timeout=5s``)
            async with self._http.post(hook.url, json=review, params={"timeout": timeout_param(hook.timeout)},
                                       timeout=aiohttp.ClientTimeout(total=hook.timeout)) as r:
                if r.status != 200:
                    raise ValueError(f"expected response code 200, got {r.status}")
                answer = (await r.json()).get("response")
                if not isinstance(answer, dict) or answer.get("uid") != review["request"]["uid"]:
                    raise ValueError("the response's uid does not match the request's")
                return answer
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            why = "context deadline exceeded" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            hook.failures.append(why)
            if hook.failure_policy == "Ignore":
                return None
            raise Refused(500, f'Internal error occurred: failed calling webhook "{hook.name}": failed to call '
                          f'webhook: Post "{hook.url}": {why}', "InternalError") from exc
