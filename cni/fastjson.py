"""JSON in and out without the ``json`` package's start-up cost.

``import json`` pulls in ``re`` (and with it ``enum``, ``functools``, ``collections``...): about 6 ms here,
a sixth of what DEL costs. The parser and the serializer themselves are C code in the ``_json`` extension,
which needs none of that; this module drives them directly, with the settings ``json.loads``/``json.dumps``
use by default (strict strings, no NaN/Infinity on input, ASCII-escaped output). Should ``_json`` not offer
these entry points (another interpreter, a future Python), the ``json`` package is used instead: the
results are the same, only slower to import.
"""

from __future__ import annotations

_WS = " \t\n\r"

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def _unserializable(obj: object) -> object:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


class _Context:
    """The attributes ``_json.make_scanner`` reads from a ``json.JSONDecoder``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_reject_constant)


_scan: Callable[[str, int], tuple[Any, int]] | None
_make_encoder: Callable[..., Any] | None
try:
    import _json

    _scan = _json.make_scanner(_Context())  # type: ignore[arg-type]  # duck-typed like JSONDecoder
    _make_encoder = _json.make_encoder
    _ascii = _json.encode_basestring_ascii
    if (
        "".join(
            _make_encoder({}, _unserializable, _ascii, None, ": ", ", ", False, False, False)(
                {"a": [1, 2.5, None, True, "\u00e9"]}, 0
            )
        )
        != '{"a": [1, 2.5, null, true, "\\u00e9"]}'
    ):
        raise TypeError("unexpected _json behaviour")
except (ImportError, AttributeError, TypeError):
    _scan = _make_encoder = None


def loads(data: bytes | str) -> Any:
    """Parse one JSON document (UTF-8 when bytes); ValueError when it is not one."""
    text = data.decode("utf-8-sig") if isinstance(data, bytes | bytearray) else data
    if _scan is None:
        import json

        return json.loads(text)
    start = len(text) - len(text.lstrip(_WS))
    try:
        value, end = _scan(text, start)
    except StopIteration as stop:
        raise ValueError(f"Expecting value: char {stop.value}") from None
    except ValueError:
        raise
    except Exception:
        # _json raises most syntax errors as json.decoder.JSONDecodeError, which it only finds when the json
        # package is loaded (else: SystemError). An error path: pay for the import and let json say it.
        import json

        return json.loads(text)
    if text[end:].strip(_WS):
        raise ValueError(f"Extra data: char {end}")
    return value


def dumps(obj: Any) -> str:
    """Serialize like ``json.dumps(obj)`` (NaN and Infinity refused, as the spec's JSON has none)."""
    if _make_encoder is None:
        import json

        return json.dumps(obj, allow_nan=False)
    # a fresh encoder each time: its circular-reference markers must start empty
    encode = _make_encoder({}, _unserializable, _ascii, None, ": ", ", ", False, False, False)
    return "".join(encode(obj, 0))
