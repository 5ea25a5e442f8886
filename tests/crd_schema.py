"""CustomResourceDefinition schemas applied the way kube-apiserver's apiextensions applies them: one
implementation for the API-server peer (``tests/apiserver_peer/schemas.py``) and the CRD tests
(``tests/extender/test_crds.py``).

- ``structural_problems``: the rules of a structural schema that matter here;
- ``as_json_schema``/``validator``: the OpenAPI v3 subset as JSON Schema draft 4 (jsonschema) with the formats the
  CRDs use (``FORMATS``: date-time, int32, int64); ``x-kubernetes-int-or-string`` is an integer or a string,
  ``nullable`` admits null;
- ``prune``: unknown fields dropped at every level, except under ``x-kubernetes-preserve-unknown-fields`` (whose
  declared properties are still pruned) and, at a resource root, ``apiVersion``/``kind``/``metadata`` (metadata
  keeps the ObjectMeta fields); returns the dropped paths, as the API server's ``unknown field`` warnings name
  them;
- ``prune_nulls`` + ``apply_defaults``: defaulting (a property that is absent, or null and not nullable, gets its
  default; other non-nullable nulls are dropped);
- ``schema_errors``: the validator's errors as the API server's field errors (kube-openapi's words, the
  ``field.Error`` types ``Invalid``/``Required``/``Unsupported``/``Too long``/``Too many``, the same paths);
- ``list_type_errors``: ``x-kubernetes-list-type`` set and map uniqueness (``Duplicate value``);
- ``cel_failures``/``cel_field_errors``: ``x-kubernetes-validations`` (cel-python) with ``self`` and, for transition
  rules, ``oldSelf`` (only where an old value exists: map properties, and list-type map items by key),
  ``fieldPath``, ``message``/``messageExpression`` and ``reason``.

Facts from k8s.io/apiextensions-apiserver (pkg/apiserver/schema/{pruning,defaulting,listtype,cel},
pkg/registry/customresource) and k8s.io/apimachinery/pkg/util/validation/field.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

CRD_DIR = Path(__file__).resolve().parents[1] / "manifests" / "crds"


class MapKey(str):
    """A key of a map under ``additionalProperties``: CEL and list-type errors name it ``path[key]``."""


Part = str | int
FieldPath = tuple[Part, ...]


# ---- structural schemas -----------------------------------------------------------------------------------------
def structural_problems(node: dict[str, Any], path: str = "") -> list[str]:
    """The rules of a structural schema (apiextensions 'Specifying a structural schema') that matter here."""
    problems = []
    if "type" not in node and not node.get("x-kubernetes-int-or-string") \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path or '/'}: no type")
    if "properties" in node and node.get("type") != "object":
        problems.append(f"{path}: properties on a non-object")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties")
    if node.get("type") == "array" and "items" not in node:
        problems.append(f"{path}: array without items")
    if node.get("x-kubernetes-list-type") == "map":
        keys = node.get("x-kubernetes-list-map-keys") or []
        if not keys or any(k not in node["items"].get("required", []) for k in keys):
            problems.append(f"{path}: map list keys must be required")
    if "default" in node:
        errors = list(validator(node).iter_errors(node["default"]))
        if errors:
            problems.append(f"{path or '/'}: default does not validate: {errors[0].message}")
    for key, child in (node.get("properties") or {}).items():
        problems += structural_problems(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        problems += structural_problems(node["items"], f"{path}[]")
    return problems


# ---- OpenAPI v3 as JSON Schema draft 4 ----------------------------------------------------------------------------
def as_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 (Kubernetes subset) -> JSON Schema draft 4: drop the x-kubernetes-* extensions; objects with
    properties refuse other fields (strict field validation); sets are unique; int-or-string is either type
    (as the API server's schema conversion types it); nullable admits null."""
    out = {k: v for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in ("properties", "items", "additionalProperties", "nullable")}
    if node.get("x-kubernetes-int-or-string") and "type" not in node:
        out["type"] = ["integer", "string"]
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [*(out["type"] if isinstance(out["type"], list) else [out["type"]]), "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node:
        out["properties"] = {k: as_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = as_json_schema(node["additionalProperties"])
    elif "additionalProperties" in node:
        out["additionalProperties"] = node["additionalProperties"]
    if isinstance(node.get("items"), dict):
        out["items"] = as_json_schema(node["items"])
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


FORMATS = jsonschema.FormatChecker(formats=())
# kube-openapi's strfmt.IsDateTime: a date, 't' (any case), hh:mm:ss[.frac] and 'z' or an offset
_DATE_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[tT](\d\d):(\d\d):(\d\d)(\.\d+)?([zZ]|[+-]\d\d:\d\d)")


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    match = _DATE_TIME.fullmatch(value)
    if not match:
        raise ValueError(f"{value!r} is not RFC 3339")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    dt.date(year, month, day)  # ValueError for a day the calendar lacks
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError(f"{value!r} is not RFC 3339")
    return True


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def validator(node: dict[str, Any]) -> jsonschema.Draft4Validator:
    schema = as_json_schema(node)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema, format_checker=FORMATS)


# ---- the API server's field errors ---------------------------------------------------------------------------------
INVALID, REQUIRED, NOT_SUPPORTED = "FieldValueInvalid", "FieldValueRequired", "FieldValueNotSupported"
DUPLICATE, FORBIDDEN, TOO_LONG = "FieldValueDuplicate", "FieldValueForbidden", "FieldValueTooLong"
TOO_MANY, TYPE_INVALID = "FieldValueTooMany", "FieldValueTypeInvalid"
WORDS = {INVALID: "Invalid value", REQUIRED: "Required value", NOT_SUPPORTED: "Unsupported value",
         DUPLICATE: "Duplicate value", FORBIDDEN: "Forbidden", TOO_LONG: "Too long", TOO_MANY: "Too many",
         TYPE_INVALID: "Invalid value"}
# schema errors after which the API server does not run the CEL rules (customresource.hasBlockingErr)
BLOCKING = frozenset({NOT_SUPPORTED, REQUIRED, TOO_LONG, TOO_MANY, TYPE_INVALID})
NOT_CHECKED = ("some validation rules were not checked because the object was invalid; correct the existing "
               "errors to complete validation")


@dataclass(frozen=True)
class FieldError:
    """A ``field.Error``: ``str()`` is what the API server writes, ``field: Invalid value: 0: detail``."""

    type: str
    field: str
    value: Any = None
    detail: str = ""
    show_value: bool = True

    def body(self) -> str:
        """``ErrorBody``: the words without the field (a Status cause's message)."""
        word = WORDS[self.type]
        if self.type in (REQUIRED, FORBIDDEN, TOO_LONG) or not self.show_value:
            text = word
        else:
            text = f"{word}: {go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def cause(self) -> dict[str, str]:
        return {"reason": self.type, "message": self.body(), "field": self.field}

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def field_path(parts: Sequence[Part]) -> str:
    """``field.Path.String()``: ``spec.models[0]``, map keys ``labels[key]``, the root ``<nil>``."""
    if not parts:
        return "<nil>"
    out = ""
    for part in parts:
        if isinstance(part, int | MapKey):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def dotted(parts: Sequence[Part]) -> str:
    """A path as kube-openapi and pruning name it: map keys with a dot (``limits.nvidia.com/gpu``), indexes
    ``[0]``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def invalid(path: Sequence[Part], value: Any, detail: str) -> FieldError:
    return FieldError(INVALID, field_path(path), value, detail)


def required(path: Sequence[Part], detail: str = "") -> FieldError:
    return FieldError(REQUIRED, field_path(path), "", detail)


def forbidden(path: Sequence[Part], detail: str) -> FieldError:
    return FieldError(FORBIDDEN, field_path(path), "", detail)


def duplicate(path: Sequence[Part], value: Any) -> FieldError:
    return FieldError(DUPLICATE, field_path(path), value)


def not_supported(path: Sequence[Part], value: Any, values: Sequence[Any]) -> FieldError:
    allowed = [v if isinstance(v, str) else json.dumps(v) for v in values]
    detail = "supported values: " + ", ".join(go_quote(v) for v in allowed) if allowed else ""
    return FieldError(NOT_SUPPORTED, field_path(path), value, detail)


def too_long(path: Sequence[Part], value: Any, most: int) -> FieldError:
    return FieldError(TOO_LONG, field_path(path), value, f"may not be longer than {most}")


def too_many(path: Sequence[Part], actual: int, most: int) -> FieldError:
    return FieldError(TOO_MANY, field_path(path), actual, f"must have at most {most} items")


def type_invalid(path: Sequence[Part], value: Any, detail: str) -> FieldError:
    return FieldError(TYPE_INVALID, field_path(path), value, detail)


def go_quote(text: str) -> str:
    """Go's %q of a string (strconv.Quote), close enough: JSON's escaping."""
    return json.dumps(text, ensure_ascii=False)


def go_float(value: float) -> str:
    """Go's %v of a float64: the shortest digits, %e form for exponents below -4 or from 6 up."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exponent, int)
    text = "".join(map(str, digits))
    point = len(text) + exponent  # digits before the decimal point
    exp = point - 1
    prefix = "-" if sign else ""
    if exp < -4 or exp >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{prefix}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{text}"
    if point >= len(text):
        return f"{prefix}{text}{'0' * (point - len(text))}"
    return f"{prefix}{text[:point]}.{text[point:]}"


def go_value(value: Any) -> str:
    """How ``field.Error`` prints a bad value: numbers and booleans as they are, strings quoted, maps and
    lists as Go's %#v of unstructured JSON."""
    if value is None:
        return '"null"'  # Go: a nil value reads "null", then is quoted as the string it now is
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, str):
        return go_quote(value)
    return go_sharp(value)


def go_sharp(value: Any) -> str:
    """Go's %#v of a JSON value held in an ``interface{}``."""
    if value is None:
        return "interface {}(nil)"
    if isinstance(value, dict):
        return "map[string]interface {}{" + ", ".join(f"{go_quote(k)}:{go_sharp(value[k])}"
                                                     for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[]interface {}{" + ", ".join(go_sharp(v) for v in value) + "}"
    return go_value(value)


# ---- pruning and defaulting -----------------------------------------------------------------------------------------
META_FIELDS = ("apiVersion", "kind", "metadata")
OBJECT_META = frozenset({"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
                         "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
                         "annotations", "ownerReferences", "finalizers", "managedFields"})


def prune(node: dict[str, Any] | None, value: Any, base: FieldPath = (), *, root: bool = True) -> list[str]:
    """Drop the fields the schema does not specify, in place; -> the dropped paths, sorted (``spec.foo``,
    ``spec.access[0].foo``, ``metadata.foo``). ``root``: ``value`` is a whole resource."""
    pruned: list[str] = []
    _prune(value, node, list(base), pruned, root)
    return sorted(pruned)


def _prune(value: Any, node: dict[str, Any] | None, path: list[Part], pruned: list[str], embedded: bool) -> None:
    if node is not None and node.get("x-kubernetes-preserve-unknown-fields"):
        _skip_prune(value, node, path, pruned, embedded)
        return
    if isinstance(value, dict):
        if node is None:
            pruned.extend(dotted([*path, k]) for k in value)
            value.clear()
            return
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key in list(value):
            if embedded and key in META_FIELDS:
                if key == "metadata" and isinstance(value[key], dict):
                    for meta_key in [k for k in value[key] if k not in OBJECT_META]:
                        del value[key][meta_key]
                        pruned.append(dotted([*path, "metadata", meta_key]))
                continue
            if key in props:
                _prune(value[key], props[key], [*path, key], pruned,
                       bool(props[key].get("x-kubernetes-embedded-resource")))
            elif isinstance(extra, dict):
                _prune(value[key], extra, [*path, key], pruned, bool(extra.get("x-kubernetes-embedded-resource")))
            elif extra is not True:
                del value[key]
                pruned.append(dotted([*path, key]))
    elif isinstance(value, list):
        items = node.get("items") if node is not None else None
        for i, item in enumerate(value):
            _prune(item, items if isinstance(items, dict) else None, [*path, i], pruned,
                   bool(isinstance(items, dict) and items.get("x-kubernetes-embedded-resource")))


def _skip_prune(value: Any, node: dict[str, Any], path: list[Part], pruned: list[str], embedded: bool) -> None:
    """Under x-kubernetes-preserve-unknown-fields: unknown fields stay, declared ones are pruned within."""
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, item in value.items():
            if embedded and key in META_FIELDS:
                continue
            if key in props:
                _prune(item, props[key], [*path, key], pruned, bool(props[key].get("x-kubernetes-embedded-resource")))
            elif isinstance(extra, dict):
                _prune(item, extra, [*path, key], pruned, bool(extra.get("x-kubernetes-embedded-resource")))
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            _skip_prune(item, node["items"], [*path, i], pruned, False)


def _child(node: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    if node is None:
        return None
    props = node.get("properties") or {}
    if key in props:
        return props[key]
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def prune_nulls(node: dict[str, Any] | None, value: Any) -> None:
    """Drop nulls of fields that are not nullable and have no default (those with one are defaulted)."""
    if isinstance(value, dict):
        for key in list(value):
            child = _child(node, key)
            if value[key] is None and child is not None and not child.get("nullable") and "default" not in child:
                del value[key]
            else:
                prune_nulls(child, value[key])
    elif isinstance(value, list):
        items = node.get("items") if node is not None else None
        for item in value:
            prune_nulls(items if isinstance(items, dict) else None, item)


def apply_defaults(node: dict[str, Any] | None, value: Any) -> Any:
    """Defaulting as the API server does it, in place (returns ``value``): a property that is absent, or null
    and not nullable, gets a copy of its default; then every value below is defaulted the same way."""
    if node is None:
        return value
    if isinstance(value, dict):
        props = node.get("properties") or {}
        for key, child in props.items():
            if "default" in child and (key not in value or (value[key] is None and not child.get("nullable"))):
                value[key] = copy.deepcopy(child["default"])
        extra = node.get("additionalProperties")
        for key in value:
            if key in props:
                apply_defaults(props[key], value[key])
            elif isinstance(extra, dict):
                if value[key] is None and not extra.get("nullable") and "default" in extra:
                    value[key] = copy.deepcopy(extra["default"])
                apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        items = node["items"]
        for i, item in enumerate(value):
            if item is None and not items.get("nullable") and "default" in items:
                value[i] = copy.deepcopy(items["default"])
            apply_defaults(items, value[i])
    return value


# ---- the OpenAPI schema's errors as the API server words them --------------------------------------------------------
def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


_BOUNDS = {("minimum", False): "greater than or equal to", ("minimum", True): "greater than",
           ("maximum", False): "less than or equal to", ("maximum", True): "less than"}


def _number(value: Any) -> str:
    return go_float(value) if isinstance(value, float) else str(value)


def _field_error(error: jsonschema.ValidationError, path: FieldPath) -> FieldError | None:
    """One jsonschema error as ``apiservervalidation.ValidateCustomResource`` reports kube-openapi's."""
    keyword, expected, value = error.validator, error.validator_value, error.instance
    name = dotted(path)
    if keyword == "type":
        actual = json_type(value)
        wanted = ",".join(t for t in expected if t != "null") if isinstance(expected, list) else expected
        return type_invalid(path, actual, f"{name} in body must be of type {wanted}: {go_quote(actual)}")
    if keyword == "format":
        return type_invalid(path, value, f"{name} in body must be of type {expected}: {go_quote(str(value))}")
    if keyword == "enum":
        return not_supported(path, value, [v for v in expected if v is not None])
    if keyword in ("minimum", "maximum"):
        exclusive = bool(error.schema.get("exclusiveMinimum" if keyword == "minimum" else "exclusiveMaximum"))
        return invalid(path, value, f"{name} in body should be {_BOUNDS[keyword, exclusive]} {_number(expected)}")
    if keyword == "multipleOf":
        return invalid(path, value, f"{name} in body should be a multiple of {_number(expected)}")
    if keyword == "minLength":
        return invalid(path, value, f"{name} in body should be at least {expected} chars long")
    if keyword == "maxLength":
        return too_long(path, value, expected)
    if keyword == "pattern":
        return invalid(path, value, f"{name} in body should match '{expected}'")
    if keyword == "minItems":
        return invalid(path, len(value), f"{name} in body should have at least {expected} items")
    if keyword in ("maxItems", "maxProperties"):
        return too_many(path, len(value), expected)
    if keyword == "minProperties":
        return invalid(path, len(value), f"{name} in body should have at least {expected} properties")
    if keyword == "required":
        (missing,) = [k for k in expected if error.message == f"{k!r} is a required property"]
        return required((*path, missing))
    if keyword == "uniqueItems":
        return None  # a list-type set: list_type_errors names each duplicate, as the API server does
    return invalid(path, value, f"{name} in body {error.message}")


def schema_errors(check: jsonschema.Draft4Validator, value: Any, base: FieldPath = ()) -> list[FieldError]:
    """``value`` (at ``base`` in the object) against the OpenAPI schema, as the API server's field errors.
    A string's length error hides its pattern error (kube-openapi stops at the first)."""
    found: list[tuple[str, FieldError]] = []
    for error in check.iter_errors(value):
        field_error = _field_error(error, (*base, *error.absolute_path))
        if field_error is not None:
            found.append((error.validator, field_error))
    lengths = {e.field for keyword, e in found if keyword in ("minLength", "maxLength")}
    return [e for keyword, e in found if not (keyword == "pattern" and e.field in lengths)]


# ---- x-kubernetes-list-type ------------------------------------------------------------------------------------------
_UNSPECIFIED = object()


def _scalar_key(value: Any) -> Any:
    if isinstance(value, dict | list):
        return ("json", json.dumps(value, sort_keys=True))
    return (json_type(value), value)


def _non_unique(values: list[Any]) -> list[int]:
    """The index of each value's second appearance (listtype.validateListSet)."""
    seen: dict[Any, int] = {}
    repeats = []
    for i, value in enumerate(values):
        key = ("unspecified",) if value is _UNSPECIFIED else _scalar_key(value)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 2:
            repeats.append(i)
    return repeats


def list_type_errors(node: dict[str, Any] | None, value: Any, base: FieldPath = ()) -> list[FieldError]:
    """Sets hold each element once, map lists each key once (listtype.ValidateListSetsAndMaps)."""
    if node is None:
        return []
    errors: list[FieldError] = []
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                errors += list_type_errors(props[key], item, (*base, key))
            elif isinstance(extra, dict):
                errors += list_type_errors(extra, item, (*base, MapKey(key)))
    elif isinstance(value, list):
        kind = node.get("x-kubernetes-list-type")
        if kind == "set":
            errors += [duplicate((*base, i), value[i]) for i in _non_unique(value)]
        elif kind == "map":
            errors += _map_list_errors(node, value, base)
        if isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                errors += list_type_errors(node["items"], item, (*base, i))
    return errors


def _map_list_errors(node: dict[str, Any], value: list[Any], base: FieldPath) -> list[FieldError]:
    for i, item in enumerate(value):
        if item is not None and not isinstance(item, dict):
            return [invalid((*base, i), item, "must be an object for an array of list-type map")]
    keys = node.get("x-kubernetes-list-map-keys") or []
    if len(keys) == 1:
        (key,) = keys
        values = [item[key] if item is not None and key in item else _UNSPECIFIED for item in value]
        return [duplicate((*base, i), {} if values[i] is _UNSPECIFIED else {key: values[i]})
                for i in _non_unique(values)]
    compound = [{k: item[k] for k in keys if k in item} if item is not None else {} for item in value]
    return [duplicate((*base, i), compound[i]) for i in _non_unique(compound)]


def _map_list_old(node: dict[str, Any], value: list[Any], old: Any) -> list[Any]:
    """The old item each item of a list-type map list corresponds to (by its keys); None elsewhere: transition
    rules below other lists have no oldSelf."""
    keys = node.get("x-kubernetes-list-map-keys") or []
    if node.get("x-kubernetes-list-type") != "map" or not keys or not isinstance(old, list):
        return [None] * len(value)

    def key_of(item: Any) -> str | None:
        if not isinstance(item, dict) or any(k not in item for k in keys):
            return None
        return json.dumps([item[k] for k in keys])

    olds = {key_of(item): item for item in old if key_of(item) is not None}
    return [olds.get(k) if (k := key_of(item)) is not None else None for item in value]


# ---- CEL: x-kubernetes-validations -------------------------------------------------------------------------------------
CEL = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}
_OLD_SELF = re.compile(r"\boldSelf\b")


def cel_program(expression: str) -> Any:
    """A compiled CEL program, once per expression."""
    program = _PROGRAMS.get(expression)
    if program is None:
        program = _PROGRAMS[expression] = CEL.program(CEL.compile(expression))
    return program


def has_rules(node: Any) -> bool:
    """Whether a schema holds any x-kubernetes-validations (the API server builds a CEL validator only then)."""
    if isinstance(node, dict):
        return bool(node.get("x-kubernetes-validations")) or any(has_rules(v) for v in node.values())
    if isinstance(node, list):
        return any(has_rules(v) for v in node)
    return False


def is_transition_rule(rule: dict[str, Any]) -> bool:
    return bool(_OLD_SELF.search(rule["rule"]))


@dataclass(frozen=True)
class RuleFailure:
    """A rule that did not hold at ``path`` (the node that carries it): it evaluated to false (``error`` None;
    ``message`` is what its messageExpression made, when that worked) or could not be evaluated (``error``)."""

    path: FieldPath
    rule: dict[str, Any]
    node_type: str
    error: str | None = None
    message: str | None = None


def _cel_error_text(exc: BaseException) -> str:
    return str(exc.args[0]) if exc.args else str(exc)


def _message_expression(rule: dict[str, Any], activation: dict[str, Any]) -> str | None:
    """A messageExpression's message; None (the rule's message is used) when it fails, is not a string, is
    empty or has a line break."""
    expression = rule.get("messageExpression")
    if not expression:
        return None
    try:
        result = cel_program(expression).evaluate(activation)
    except celpy.CELEvalError:
        return None
    if not isinstance(result, str):
        return None
    text = str(result).strip()
    return text if text and "\n" not in text else None


def cel_failures(node: dict[str, Any] | None, value: Any, old: Any = None, path: FieldPath = ()) -> list[RuleFailure]:
    """Every ``x-kubernetes-validations`` rule at and below ``node`` that does not hold for ``value``; transition
    rules (those naming ``oldSelf``) only where ``old`` has a value (an update of an existing field)."""
    if node is None or value is None:
        return []
    failures: list[RuleFailure] = []
    rules = node.get("x-kubernetes-validations") or []
    if rules:
        this = celpy.json_to_cel(value)
        that = celpy.json_to_cel(old) if old is not None else None
        for rule in rules:
            activation = {"self": this}
            if is_transition_rule(rule):
                if that is None:
                    continue
                activation["oldSelf"] = that
            node_type = node.get("type", "")
            try:
                result = cel_program(rule["rule"]).evaluate(activation)
            except celpy.CELEvalError as exc:  # e.g. an unparsable duration: the API server reports it too
                failures.append(RuleFailure(path, rule, node_type, error=_cel_error_text(exc)))
                continue
            if isinstance(result, celpy.CELEvalError):
                failures.append(RuleFailure(path, rule, node_type, error=_cel_error_text(result)))
            elif not isinstance(result, celtypes.BoolType):
                failures.append(RuleFailure(path, rule, node_type, error=f"no such overload: {type(result).__name__}"))
            elif not result:
                failures.append(RuleFailure(path, rule, node_type, message=_message_expression(rule, activation)))
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        olds = old if isinstance(old, dict) and node.get("x-kubernetes-map-type") != "atomic" else {}
        for key, child in props.items():
            if key in value:
                failures += cel_failures(child, value[key], olds.get(key), (*path, key))
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in props:
                    failures += cel_failures(extra, item, olds.get(key), (*path, MapKey(key)))
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, (item, old_item) in enumerate(zip(value, _map_list_old(node, value, old), strict=True)):
            failures += cel_failures(node["items"], item, old_item, (*path, i))
    return failures


def rule_error_string(rule: dict[str, Any]) -> str:
    return str(rule.get("message") or rule["rule"]).strip()


def rule_message(rule: dict[str, Any]) -> str:
    """``ruleMessageOrDefault``."""
    message = str(rule.get("message") or "").strip()
    return message or f"failed rule: {str(rule['rule']).strip()}"


def rule_field_path(rule: dict[str, Any]) -> FieldPath:
    """A rule's ``fieldPath`` (``.a.b``, ``['a.b']``) as path parts."""
    parts: list[Part] = []
    for dot_name, quoted in re.findall(r"\.([^.\[\]]+)|\['((?:[^'\\]|\\.)*)'\]", rule.get("fieldPath") or ""):
        parts.append(dot_name or quoted)
    return tuple(parts)


def cel_field_errors(node: dict[str, Any] | None, value: Any, old: Any = None,
                     base: FieldPath = ()) -> list[FieldError]:
    """The rules that do not hold, as the API server reports them: at the rule's node plus its ``fieldPath``,
    ``Invalid value: "<schema type>": <message>`` (or the ``reason``'s error type); an evaluation error at the
    node: ``<error> evaluating rule: <message or rule>``."""
    errors: list[FieldError] = []
    for failure in cel_failures(node, value, old):
        rule, where = failure.rule, (*base, *failure.path)
        if failure.error is not None:
            if failure.error.startswith("no such overload"):
                detail = (f"'{failure.error}': call arguments did not match a supported operator, function or macro "
                          f"signature for rule: {rule_error_string(rule)}")
            else:
                detail = f"{failure.error} evaluating rule: {rule_error_string(rule)}"
            errors.append(invalid(where, failure.node_type, detail))
            continue
        where = (*where, *rule_field_path(rule))
        detail = failure.message or rule_message(rule)
        reason = rule.get("reason")
        if reason == FORBIDDEN:
            errors.append(forbidden(where, detail))
        elif reason == REQUIRED:
            errors.append(required(where, detail))
        elif reason == DUPLICATE:
            errors.append(duplicate(where, failure.node_type))
        else:
            errors.append(invalid(where, failure.node_type, detail))
    return errors
