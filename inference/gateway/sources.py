"""Where the gateway learns its routes and keys: a file of Kubernetes objects, or the API server.

Both feed the same pure functions (``discovery.route_table``, ``access.key_table``) with InferenceEndpoints,
EndpointSlices and API-key Secrets; the file form runs the gateway outside a cluster (a static deployment, a
benchmark) with exactly the objects a cluster would hold. The file is re-read when it changes; a malformed
re-read is logged and the routes in force stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from inference.access import key_table
from inference.discovery import route_table
from inference.gateway.server import Gateway
from inference.names import KIND

log = logging.getLogger("accelstack.gateway")

ENDPOINT_SLICE = "EndpointSlice"
SECRET = "Secret"


class SourceError(ValueError):
    """A malformed objects file; the message names the file and the document."""


def apply_objects(gateway: Gateway, endpoints: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]],
                  secrets: Iterable[Mapping[str, Any]]) -> None:
    notes: list[str] = []
    table, problems = route_table(endpoints, slices, notes)
    keys, key_problems = key_table(secrets)
    gateway.apply(table, keys, problems + key_problems, notes)


def load_objects(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(InferenceEndpoints, EndpointSlices, Secrets) from a multi-document YAML file (``kind: List`` allowed)."""
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except OSError as exc:
        raise SourceError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SourceError(f"{path}: not YAML: {exc}") from None
    found: dict[str, list[dict[str, Any]]] = {KIND: [], ENDPOINT_SLICE: [], SECRET: []}
    objects: list[tuple[str, Any]] = []
    for index, doc in enumerate(docs, 1):
        if doc is None:
            continue
        if isinstance(doc, dict) and doc.get("kind") == "List":
            objects.extend((f"document {index} item {i}", item) for i, item in enumerate(doc.get("items") or [], 1))
        else:
            objects.append((f"document {index}", doc))
    for where, obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise SourceError(f"{path}: {where}: not a Kubernetes object with metadata")
        kind = obj.get("kind")
        if kind not in found:
            raise SourceError(f"{path}: {where}: kind {kind!r} is not one of {', '.join(found)}")
        if not obj["metadata"].get("name"):
            raise SourceError(f"{path}: {where}: metadata.name is required")
        obj["metadata"].setdefault("namespace", "default")
        found[kind].append(obj)
    return found[KIND], found[ENDPOINT_SLICE], found[SECRET]


class FileSource:
    def __init__(self, path: Path, gateway: Gateway, interval: float = 1.0) -> None:
        self.path, self.gateway, self.interval = path, gateway, interval
        self.seen = 0.0  # mtime of the last version read, good or not

    def load(self) -> None:
        """Read and apply the file now; SourceError when it is malformed."""
        mtime = os.stat(self.path).st_mtime if self.path.exists() else 0.0
        apply_objects(self.gateway, *load_objects(self.path))
        self.seen = mtime

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                mtime = os.stat(self.path).st_mtime
            except OSError:
                continue
            if mtime == self.seen:
                continue
            try:
                self.load()
                log.info("objects file reloaded", extra={"path": str(self.path)})
            except SourceError as exc:
                self.seen = mtime
                log.error("objects file not reloaded; the routes in force stay", extra={"error": str(exc)})
