"""Who may call which endpoint: API keys from Secrets, the endpoint's access map, per-key rate limits. Pure.

An API key is a Secret labelled ``accelstack.io/api-key: "true"`` whose ``data.key`` holds the token. The key's
caller is ``<secret namespace>/<secret name>``; its namespace is the Secret's, its workspace the
``accelstack.io/workspace`` annotation (default: the namespace). Only the SHA-256 of a token is kept in memory,
and nothing here ever formats a token into a message.

A caller may also present a Kubernetes service-account token instead of an API key (an application in the
cluster, with its projected token): the gateway asks the API server who it is (TokenReview), and the caller is
``<namespace>/<service account>`` of kind ``serviceaccount``, in that namespace and workspace, without a rate
limit.

An endpoint admits a caller when the caller's namespace is the endpoint's own, is listed in
``spec.access.namespaces`` (``"*"``: every namespace), its workspace is in ``spec.access.workspaces``, the key
itself is in ``spec.access.apiKeys``, or the service account in ``spec.access.serviceAccounts`` (``name`` in
the endpoint's namespace or ``namespace/name``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inference.names import (
    ANNOTATION_BURST,
    ANNOTATION_RATE_LIMIT,
    ANNOTATION_WORKSPACE,
    LABEL_API_KEY,
    SECRET_KEY_FIELD,
)


class KeyError_(ValueError):
    """A Secret labelled as an API key is malformed; the message names the Secret and the field, never the token."""


@dataclass(frozen=True)
class Caller:
    name: str  # namespace/secret-name
    namespace: str
    workspace: str
    rate: float = 0.0  # requests per second; 0: unlimited
    burst: float = 0.0
    kind: str = "apikey"  # or "serviceaccount"


@dataclass(frozen=True)
class Access:
    """An endpoint's access map (its ``spec.access``) and its namespace."""

    namespace: str
    namespaces: frozenset[str] = frozenset()
    workspaces: frozenset[str] = frozenset()
    api_keys: frozenset[str] = frozenset()  # namespace/name
    service_accounts: frozenset[str] = frozenset()  # namespace/name

    @classmethod
    def from_spec(cls, namespace: str, spec: Mapping[str, Any] | None) -> Access:
        spec = spec or {}

        def qualified(field: str) -> frozenset[str]:
            return frozenset(k if "/" in k else f"{namespace}/{k}" for k in spec.get(field) or ())  # type: ignore[union-attr]

        return cls(namespace, frozenset(spec.get("namespaces") or ()), frozenset(spec.get("workspaces") or ()),
                   qualified("apiKeys"), qualified("serviceAccounts"))


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def caller_from_secret(secret: Mapping[str, Any]) -> tuple[str, Caller]:
    """(token digest, caller) from an API-key Secret; KeyError_ naming the Secret when it is malformed."""
    meta = secret.get("metadata") or {}
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    where = f"Secret {namespace}/{name}"
    raw = (secret.get("data") or {}).get(SECRET_KEY_FIELD)
    plain = (secret.get("stringData") or {}).get(SECRET_KEY_FIELD)
    if raw is None and plain is None:
        raise KeyError_(f"{where}: data.{SECRET_KEY_FIELD} is missing")
    if plain is not None:
        token = str(plain)
    else:
        try:
            token = base64.b64decode(str(raw), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise KeyError_(f"{where}: data.{SECRET_KEY_FIELD} is not base64 of UTF-8 text") from None
    token = token.strip()
    if len(token) < 16:
        raise KeyError_(f"{where}: data.{SECRET_KEY_FIELD} must be at least 16 characters")
    notes = meta.get("annotations") or {}
    rate = _number(where, ANNOTATION_RATE_LIMIT, notes.get(ANNOTATION_RATE_LIMIT, "0"))
    burst = _number(where, ANNOTATION_BURST, notes.get(ANNOTATION_BURST, str(max(1.0, rate))))
    caller = Caller(f"{namespace}/{name}", namespace, notes.get(ANNOTATION_WORKSPACE) or namespace, rate, burst)
    return digest(token), caller


def _number(where: str, key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise KeyError_(f"{where}: annotation {key}: not a number: {value!r}") from None
    if number < 0 or number != number:
        raise KeyError_(f"{where}: annotation {key}: must be >= 0, got {value!r}")
    return number


def is_api_key_secret(secret: Mapping[str, Any]) -> bool:
    labels = (secret.get("metadata") or {}).get("labels") or {}
    return str(labels.get(LABEL_API_KEY, "")).lower() == "true"


def key_table(secrets: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Caller], list[str]]:
    """Token digest → caller for every well-formed API-key Secret, and one error line per malformed one."""
    table: dict[str, Caller] = {}
    errors: list[str] = []
    for secret in secrets:
        if not is_api_key_secret(secret):
            continue
        try:
            token_digest, caller = caller_from_secret(secret)
        except KeyError_ as exc:
            errors.append(str(exc))
            continue
        table[token_digest] = caller
    return table, errors


SERVICE_ACCOUNT_USER = "system:serviceaccount:"


def caller_from_user(user: Mapping[str, Any] | None) -> Caller | None:
    """The caller a TokenReview's ``status.user`` names, when it is a service account; None otherwise."""
    name = str((user or {}).get("username") or "")
    if not name.startswith(SERVICE_ACCOUNT_USER):
        return None
    namespace, sep, account = name.removeprefix(SERVICE_ACCOUNT_USER).partition(":")
    if not sep or not namespace or not account:
        return None
    return Caller(f"{namespace}/{account}", namespace, namespace, kind="serviceaccount")


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def admits(access: Access, caller: Caller) -> tuple[bool, str]:
    """Whether the endpoint admits the caller, with the reason (for the caller and the logs)."""
    if caller.namespace == access.namespace:
        return True, "same namespace"
    if "*" in access.namespaces or caller.namespace in access.namespaces:
        return True, f"namespace {caller.namespace} is listed"
    if caller.workspace in access.workspaces:
        return True, f"workspace {caller.workspace} is listed"
    if caller.kind == "apikey" and caller.name in access.api_keys:
        return True, "key is listed"
    if caller.kind == "serviceaccount" and caller.name in access.service_accounts:
        return True, "service account is listed"
    return False, (f"callers from namespace {caller.namespace} (workspace {caller.workspace}) are not in the "
                   f"endpoint's access list")


@dataclass
class TokenBucket:
    """Rate limit: ``rate`` tokens a second up to ``burst``; time is passed in."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    updated: float = 0.0

    def take(self, now: float) -> float:
        """0 when a request may go now (and takes a token), else the seconds until one may."""
        if self.rate <= 0:
            return 0.0
        if self.tokens < 0:
            self.tokens, self.updated = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate
