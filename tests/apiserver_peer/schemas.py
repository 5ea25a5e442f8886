"""The API server's handling of custom resources, for the peer: the CRDs under ``manifests/crds`` applied to
every write of their objects as kube-apiserver's apiextensions does, so a write a real cluster refuses (422) or
silently changes (pruning, defaults) does the same here.

``CustomSchemas().admit(resource_path, obj, old, subresource)`` -> warnings; mutates ``obj``; raises ``Refused``:

- resources without a CRD here (core and built-in groups, other groups, versions a CRD does not serve): ``obj``
  unchanged, ``[]``;
- a main-resource write (create, update, patch): ``apiVersion``/``kind`` filled in when missing (a mismatch: 422
  ``kind: Invalid value``); unknown fields pruned at every level (not below
  ``x-kubernetes-preserve-unknown-fields``; at the root ``apiVersion``/``kind``/``metadata`` stay, metadata
  keeping only ObjectMeta fields), each named in a warning ``unknown field "spec.foo"`` (``field_validation``
  "Warn", the API server's default; "Ignore": no warnings; "Strict": 400 ``strict decoding error: unknown field
  ...``); non-nullable nulls dropped or defaulted; schema defaults applied; then validated: on create
  ``metadata.name`` is a DNS subdomain, the OpenAPI schema (type, enum, pattern, bounds, lengths, items,
  properties, required, formats date-time/int32/int64, int-or-string), list-type set/map uniqueness (on update
  only where the old object had none) and the CEL rules, ``oldSelf`` from ``old`` (transition rules run only
  where an old value exists), not run when a schema error blocks them (wrong type, unsupported value, missing
  field, too long, too many), as the API server does. With a status subresource the ``status`` part is left
  as it is: the server keeps the stored status on such writes;
- a ``/status`` write: only ``status`` is pruned, defaulted and validated (against the status schema and the
  rules within it, ``oldSelf`` from the old status); the rest is the stored object and is not judged again. A
  CRD without a status subresource answers 404.

Refusals are ``Refused(422, 'GPUProvisioningRequest.accelstack.io "x" is invalid: spec.devicesPerNode: Invalid
value: 0: spec.devicesPerNode in body should be greater than or equal to 1', "Invalid", {"name", "group",
"kind", "causes": [{"reason", "message", "field"}]})``; several errors are joined ``[a, b]`` as the API server
aggregates them.

Not modelled: validation ratcheting (1.30+: unchanged invalid values pass an update), ``optionalOldSelf``,
CEL cost limits, the CEL types of formats (date-time and duration strings stay strings), defaulting on read,
ObjectMeta checks other than the name, embedded resources, conversion between versions, the scale subresource.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.apiserver_peer.wire import Refused
from tests.crd_schema import (
    BLOCKING,
    CRD_DIR,
    NOT_CHECKED,
    FieldError,
    apply_defaults,
    cel_field_errors,
    has_rules,
    invalid,
    list_type_errors,
    prune,
    prune_nulls,
    schema_errors,
    validator,
)

FIELD_VALIDATION = ("Ignore", "Warn", "Strict")
# k8s.io/apimachinery/pkg/util/validation IsDNS1123Subdomain, the rule for a custom resource's name
DNS1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
SUBDOMAIN_MESSAGE = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                     "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                     f"validation is '{DNS1123_SUBDOMAIN}')")
_TYPE_AND_OBJECT_META = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
# what the main endpoint of a resource with a status subresource does with status: nothing
_STATUS_AS_STORED = {"x-kubernetes-preserve-unknown-fields": True, "nullable": True}


@dataclass(frozen=True)
class CustomResource:
    """One served version of a CRD."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool
    schema: dict[str, Any]  # the version's openAPIV3Schema
    main: dict[str, Any]  # what a main-resource write is judged by (status left alone with a status subresource)
    main_check: jsonschema.Draft4Validator
    status_check: jsonschema.Draft4Validator | None
    has_rules: bool  # any CEL rule in the schema: blocking schema errors then say some rules were not checked

    @property
    def resource_path(self) -> str:
        return f"apis/{self.group}/{self.version}/{self.plural}"

    @property
    def status_schema(self) -> dict[str, Any] | None:
        return (self.schema.get("properties") or {}).get("status")


def _versions(crd: dict[str, Any]) -> list[CustomResource]:
    spec = crd["spec"]
    found = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = version["schema"]["openAPIV3Schema"]
        status = "status" in (version.get("subresources") or {})
        # a resource root always has apiVersion, kind and metadata, declared or not (model.WithTypeAndObjectMeta)
        main = {**schema, "properties": {**_TYPE_AND_OBJECT_META, **(schema.get("properties") or {})}}
        if status and "status" in main["properties"]:
            main["properties"]["status"] = _STATUS_AS_STORED
        status_schema = (schema.get("properties") or {}).get("status")
        found.append(CustomResource(
            group=spec["group"], version=version["name"], plural=spec["names"]["plural"],
            kind=spec["names"]["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            status_subresource=status, schema=schema, main=main, main_check=validator(main),
            status_check=validator(status_schema) if status and status_schema else None,
            has_rules=has_rules(schema)))
    return found


@functools.lru_cache(maxsize=8)
def _load(directory: str) -> dict[str, CustomResource]:
    """Every CRD in the directory (files that hold anything else are skipped), by resource path; parsed once."""
    resources: dict[str, CustomResource] = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition" \
                    and str(doc.get("apiVersion", "")).startswith("apiextensions.k8s.io/"):
                for resource in _versions(doc):
                    resources[resource.resource_path] = resource
    return resources


def warning_header(text: str) -> str:
    """A ``Warning`` response header value as the API server writes it: ``299 - "unknown field \\"spec.foo\\""``."""
    return f"299 - {json.dumps(text)}"


class CustomSchemas:
    """The CRDs of a directory (default ``manifests/crds``), read once per directory and shared."""

    def __init__(self, crd_dir: Path | str = CRD_DIR) -> None:
        self.resources = _load(str(Path(crd_dir).resolve()))

    def get(self, resource_path: str) -> CustomResource | None:
        """The CRD version serving 'apis/<group>/<version>/<plural>', or None."""
        return self.resources.get(resource_path.strip("/"))

    def has_status_subresource(self, resource_path: str) -> bool:
        resource = self.get(resource_path)
        return resource is not None and resource.status_subresource

    def admit(self, resource_path: str, obj: dict[str, Any], old: dict[str, Any] | None = None,
              subresource: str = "", *, field_validation: str = "Warn") -> list[str]:
        """Prune and default ``obj`` in place and validate it as the API server would store it; -> the warnings
        (``unknown field "spec.foo"``). ``old``: the stored object on an update (None on create);
        ``subresource``: "" or "status". Raises ``Refused`` (422 Invalid; 400 with ``field_validation="Strict"``
        and unknown fields; 404 for /status of a CRD without that subresource)."""
        resource = self.get(resource_path)
        if resource is None or subresource not in ("", "status"):
            return []
        if field_validation not in FIELD_VALIDATION:
            raise Refused(400, f'invalid fieldValidation "{field_validation}": must be one of Ignore, Warn, Strict')
        if subresource == "status":
            if not resource.status_subresource:
                raise Refused(404, "the server could not find the requested resource", "NotFound")
            pruned, errors = self._status(resource, obj, old)
        else:
            pruned, errors = self._main(resource, obj, old)
        if pruned and field_validation == "Strict":
            fields = ", ".join(f'unknown field "{p}"' for p in pruned)
            raise Refused(400, f'{resource.kind} in version "{resource.version}" cannot be handled as a '
                          f"{resource.kind}: strict decoding error: {fields}", "BadRequest")
        if errors:
            raise self.refusal(resource, obj, errors)
        return [] if field_validation == "Ignore" else [f'unknown field "{p}"' for p in pruned]

    # -- the two kinds of write ---------------------------------------------------------------------------------
    def _main(self, resource: CustomResource, obj: dict[str, Any],
              old: dict[str, Any] | None) -> tuple[list[str], list[FieldError]]:
        # prune and default the write's own copy: a patched object may share parts with the stored one (of
        # metadata only the top level changes, and the server hands over a metadata dict of the write's own)
        for key in [k for k in obj if k != "metadata" and not (k == "status" and resource.status_subresource)]:
            obj[key] = copy.deepcopy(obj[key])
        api_version = f"{resource.group}/{resource.version}"
        obj.setdefault("apiVersion", api_version)
        obj.setdefault("kind", resource.kind)
        type_errors = []
        if obj["kind"] != resource.kind:
            type_errors.append(invalid(("kind",), obj["kind"], f"must be {resource.kind}"))
        if obj["apiVersion"] != api_version:
            type_errors.append(invalid(("apiVersion",), obj["apiVersion"], f"must be {api_version}"))
        pruned = prune(resource.main, obj)
        prune_nulls(resource.main, obj)
        apply_defaults(resource.main, obj)
        if type_errors:  # ValidateTypeMeta: nothing else is judged
            return pruned, type_errors
        errors: list[FieldError] = []
        name = (obj.get("metadata") or {}).get("name")
        if old is None and isinstance(name, str) and name:
            if len(name) > 253:
                errors.append(invalid(("metadata", "name"), name, "must be no more than 253 characters"))
            if not re.fullmatch(DNS1123_SUBDOMAIN, name):
                errors.append(invalid(("metadata", "name"), name, SUBDOMAIN_MESSAGE))
        errors += schema_errors(resource.main_check, obj)
        if old is None or not list_type_errors(resource.main, old):  # ratcheting of list types on update
            errors += list_type_errors(resource.main, obj)
        return pruned, self._with_rules(resource, errors, resource.main, obj, old, ())

    def _status(self, resource: CustomResource, obj: dict[str, Any],
                old: dict[str, Any] | None) -> tuple[list[str], list[FieldError]]:
        schema, check = resource.status_schema, resource.status_check
        if "status" not in obj:
            return [], []
        if obj["status"] is None and not (schema or {}).get("nullable"):
            del obj["status"]
            return [], []
        if schema is None or check is None:  # a status subresource and no status in the schema: all unknown
            del obj["status"]
            return ["status"], []
        status = obj["status"] = copy.deepcopy(obj["status"])
        old_status = (old or {}).get("status")
        pruned = prune(schema, status, ("status",), root=False)
        prune_nulls(schema, status)
        apply_defaults(schema, status)
        errors = schema_errors(check, status, ("status",))
        if old_status is None or not list_type_errors(schema, old_status):
            errors += list_type_errors(schema, status, ("status",))
        return pruned, self._with_rules(resource, errors, schema, status, old_status, ("status",))

    @staticmethod
    def _with_rules(resource: CustomResource, errors: list[FieldError], schema: dict[str, Any], value: Any,
                    old: Any, base: tuple[str, ...]) -> list[FieldError]:
        """The CEL rules run unless a schema error blocks them (customresource.hasBlockingErr)."""
        if not resource.has_rules:
            return errors
        if any(e.type in BLOCKING for e in errors):
            return [*errors, invalid((), None, NOT_CHECKED)]
        return [*errors, *cel_field_errors(schema, value, old, base)]

    # -- the answer ---------------------------------------------------------------------------------------------
    @staticmethod
    def refusal(resource: CustomResource, obj: dict[str, Any], errors: list[FieldError]) -> Refused:
        """``apierrors.NewInvalid``: 422 Invalid, ``Kind.group "name" is invalid: <errors>`` (one error as it is,
        several as ``[a, b]``, repeated messages once) with the causes in ``details``."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        messages = list(dict.fromkeys(str(e) for e in errors))
        body = messages[0] if len(messages) == 1 else "[" + ", ".join(messages) + "]"
        details = {"name": name, "group": resource.group, "kind": resource.kind,
                   "causes": [e.cause() for e in errors]}
        return Refused(422, f'{resource.kind}.{resource.group} "{name}" is invalid: {body}', "Invalid", details)
