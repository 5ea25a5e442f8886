"""Errors of API calls, by the HTTP status and ``Status.reason`` the API server answered."""

from __future__ import annotations

import logging
from typing import Any


class ApiError(Exception):
    """The API server answered an error (``status`` is the HTTP code; 0 for a transport failure)."""

    def __init__(self, status: int, reason: str = "", message: str = "", retry_after: float | None = None,
                 body: dict[str, Any] | None = None) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.body = body or {}
        super().__init__(f"{status} {reason}: {message}".strip(" :") if status else message)

    @property
    def transient(self) -> bool:
        """Worth retrying later: throttled, timed out, or the server (or something in front of it) failed."""
        return self.status in (0, 408, 429, 500, 502, 503, 504)


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    """409 on an update: the object changed since it was read (re-read and decide again)."""


class AlreadyExists(Conflict):
    """409 with reason AlreadyExists on a create."""


class Expired(ApiError):
    """410 Gone: the resourceVersion (or a list's continue token) is too old; list again."""


class Forbidden(ApiError):
    pass


class TooManyRequests(ApiError):
    """429: throttled by API Priority and Fairness, or an eviction refused by a PodDisruptionBudget."""


class TransportError(ApiError):
    """No answer: connection refused or reset, or the client-side timeout passed."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "Transport", message)


_BY_STATUS: dict[int, type[ApiError]] = {404: NotFound, 409: Conflict, 410: Expired, 403: Forbidden,
                                         429: TooManyRequests}


def error_for(status: int, body: dict[str, Any], retry_after: float | None = None) -> ApiError:
    reason = str(body.get("reason") or "")
    message = str(body.get("message") or "")[:1000]
    cls = AlreadyExists if status == 409 and reason == "AlreadyExists" else _BY_STATUS.get(status, ApiError)
    return cls(status, reason, message, retry_after, body)


def log_failure(logger: logging.Logger, msg: str, exc: BaseException, extra: dict[str, Any] | None = None) -> None:
    """Log a failed pass or task: the API server not answering at all (connection refused or reset, no answer in
    time: a :class:`TransportError`) is an outage the caller rides out, not a bug, so it is one warning line with
    the error; anything else keeps its traceback, which is what finds the bug."""
    fields = {**(extra or {}), "error": str(exc)[:300]}
    if isinstance(exc, TransportError):
        logger.warning(msg, extra=fields)
    else:
        logger.error(msg, exc_info=exc, extra=fields)
