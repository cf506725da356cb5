"""Typed reads of untrusted JSON and the ``encoded_*`` field codec; pure, no I/O.

Every reader either returns a value of the promised Python type or raises
:class:`~protocol.openai.errors.InvalidRequestError` naming the offending
parameter, whatever the input: random types, non-finite numbers, lone
surrogates, nesting too deep for the parser. Nothing else escapes.

JSON values that proto3 cannot type travel as base64 (URL-safe alphabet,
padded) of their compact JSON text, exactly as LLMariner's inference-manager
encodes them (Go's ``base64.URLEncoding``), so an LLMariner engine and an
infx engine decode each other's gateways' requests.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from protocol.openai.errors import InvalidRequestError

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

JSONObject = dict[str, Any]
T = TypeVar("T")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


#: One decoder for every read: ``json.loads`` with an argument builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _loads(data: bytes | str) -> Any:
    """``json.loads(data, parse_constant=_reject_constant)``, the same in every outcome."""
    if isinstance(data, str):
        if data.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", data, 0)
        return _DECODER.decode(data)
    return _DECODER.decode(data.decode(json.detect_encoding(data), "surrogatepass"))


def loads_object(body: bytes | str) -> JSONObject:
    """Parse a request body that must be a JSON object.

    Python's parser accepts ``NaN`` and ``Infinity`` and recurses per nesting
    level; both are turned into the 400 a client deserves, as are invalid
    UTF-8 and lone surrogates (which the protobuf runtime would refuse later).
    """
    try:
        value = _loads(body)
    except RecursionError:
        raise InvalidRequestError("The request body is nested too deeply.") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return value


def dumps(value: Any) -> str:
    """Compact JSON text; raises the client's 400 if a string holds a lone surrogate."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("The request contains a string that is not valid Unicode.") from None
    except RecursionError:
        raise InvalidRequestError("The request body is nested too deeply.") from None
    return text


def encode_json_field(value: Any) -> str:
    """A JSON value as an ``encoded_*`` field: base64url (padded) of its compact JSON text."""
    return base64.urlsafe_b64encode(dumps(value).encode("utf-8")).decode("ascii")


def decode_json_field(encoded: str, param: str) -> Any:
    """The JSON value an ``encoded_*`` field carries.

    Accepts both base64 alphabets, missing padding, and plain JSON text of an
    object or array (a leading ``{`` or ``[`` cannot start base64), so that a
    gateway that put JSON text into the field is understood too.
    """
    stripped = encoded.strip()
    if stripped[:1] in ("{", "["):
        raw = stripped.encode("utf-8", "surrogatepass")
    else:
        normalized = stripped.replace("+", "-").replace("/", "_")
        normalized += "=" * (-len(normalized) % 4)
        try:
            raw = base64.b64decode(normalized.encode("ascii"), altchars=b"-_", validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise InvalidRequestError(f"{param} is not valid base64.", param=param) from None
    try:
        return _loads(raw)
    except RecursionError:
        raise InvalidRequestError(f"{param} is nested too deeply.", param=param) from None
    except ValueError:
        raise InvalidRequestError(f"{param} does not hold valid JSON.", param=param) from None


def join(path: str, key: str | int) -> str:
    """The parameter name OpenAI reports: ``messages[0].content``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_error(param: str, expected: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)}.",
        param=param,
        code="invalid_type",
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def check_text(value: str, param: str) -> str:
    """A string that can go into a proto3 string field (valid UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"'{param}' is not valid Unicode.", param=param) from None
    return value


def as_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _type_error(param, "a string", value)
    return check_text(value, param)


def as_nonempty_str(value: Any, param: str) -> str:
    text = as_str(value, param)
    if not text:
        raise InvalidRequestError(f"'{param}' must not be empty.", param=param, code="empty_string")
    return text


def as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _type_error(param, "a boolean", value)
    return value


def as_int(value: Any, param: str, minimum: int = INT32_MIN, maximum: int = INT32_MAX) -> int:
    """An integer (integral floats such as ``2.0`` accepted) within bounds and within int32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(param, "an integer", value)
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise _type_error(param, "an integer", value)
        value = int(value)
    result: int = value
    _check_range(result, param, max(minimum, INT32_MIN), min(maximum, INT32_MAX))
    return result


def as_number(value: Any, param: str, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(param, "a number", value)
    number = float(value) if isinstance(value, float) or abs(value) < 2**1023 else math.inf
    if not math.isfinite(number):
        raise InvalidRequestError(f"'{param}' must be a finite number.", param=param)
    _check_range(number, param, minimum, maximum)
    return number


def _check_range(value: float, param: str, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise InvalidRequestError(
            f"{value!r} is less than the minimum of {minimum} - '{param}'", param=param, code="invalid_value"
        )
    if maximum is not None and value > maximum:
        raise InvalidRequestError(
            f"{value!r} is greater than the maximum of {maximum} - '{param}'", param=param, code="invalid_value"
        )


def as_object(value: Any, param: str) -> JSONObject:
    if not isinstance(value, dict):
        raise _type_error(param, "an object", value)
    return value


def as_list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise _type_error(param, "an array", value)
    return value


def one_of(value: str, param: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise InvalidRequestError(
            f"Invalid value for '{param}': {value!r}; supported values are {', '.join(map(repr, allowed))}.",
            param=param,
            code="invalid_value",
        )
    return value


def optional(obj: JSONObject, key: str, path: str, read: Callable[[Any, str], T]) -> T | None:
    """``read`` applied to ``obj[key]``; ``None`` when the key is absent or null (OpenAI's "not set")."""
    value = obj.get(key)
    if value is None:
        return None
    return read(value, join(path, key))


def required(obj: JSONObject, key: str, path: str, read: Callable[[Any, str], T]) -> T:
    param = join(path, key)
    value = obj.get(key)
    if value is None:
        raise InvalidRequestError(
            f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    return read(value, param)
