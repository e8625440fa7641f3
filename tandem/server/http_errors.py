"""HTTP errors in the OpenAI error body: `APIError`, and the conversions of a pydantic validation error and of a
tandem RequestError into one that names the request field at fault."""
from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tandem.errors import ContextLengthError, RequestError
from tandem.server.protocol import ErrorInfo, ErrorResponse

class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(mode="json"), status_code=self.status)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages.0.content' (pydantic's union tags dropped)."""
    parts = [str(p) for p in loc if isinstance(p, int) or (p not in _TYPE_TAGS and re.fullmatch(r"\w+", p))]
    return ".".join(parts) or None


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = _loc_to_param(first["loc"])
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {first['msg']}")
    same = [err for err in errors if _loc_to_param(err["loc"]) == param]
    if first["type"] == "missing":
        return APIError(400, f"'{param}' is required", param=param, code="missing_field")
    if len(same) > 1:  # a union: say what each accepted form wanted
        msgs = "; ".join(dict.fromkeys(err["msg"] for err in same))
        return APIError(400, f"'{param}' is invalid ({msgs}); got {_short(first.get('input'))}", param=param)
    return APIError(400, f"'{param}' is invalid: {first['msg']}; got {_short(first.get('input'))}", param=param)


_HUGE_EXPONENT = re.compile(rb"\d[eE]\+?\d{3}")  # a number that may be past a float's range


def non_finite_error(raw: bytes) -> APIError | None:
    """A 400 naming the first NaN / Infinity in a request body (Python's JSON reader takes them;
    JSON has none, and a field echoed back would make the reply invalid JSON), or None."""
    if b"NaN" not in raw and b"Infinity" not in raw and _HUGE_EXPONENT.search(raw) is None:  # the usual body:
        return None  # no second parse (1e999 is read as inf too)
    try:
        path = _non_finite_path(json.loads(raw))
    except (ValueError, RecursionError):  # (what pydantic's reader took and Python's does not: left to pass)
        return None
    if path is None:  # the words were inside strings
        return None
    param = ".".join(map(str, path)) or None
    return APIError(400, f"'{param}' is not a finite number; JSON has no NaN or Infinity: send a number",
                    param=param)


def _non_finite_path(value: Any) -> list | None:
    if isinstance(value, float):
        return None if math.isfinite(value) else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        rest = _non_finite_path(item)
        if rest is not None:
            return [key, *rest]
    return None


def request_error(e: RequestError, fields: dict[str, str], prompt_param: str) -> APIError:
    """Map tandem's RequestError ("SamplingParams.top_p=2 is invalid: ...") onto the API's field names."""
    msg = str(e)
    m = re.match(r"SamplingParams\.(\w+)=", msg)
    if m:
        name = m.group(1)
        param = fields.get(name, name)
        return APIError(400, param + msg[len("SamplingParams.") + len(name):], param=param)
    if msg.startswith("prompt"):
        where = "" if prompt_param == "prompt" else f"the prompt built from '{prompt_param}': "
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None  # OpenAI's code
        return APIError(400, where + msg, param=prompt_param, code=code)
    if msg.startswith("cache_salt"):
        return APIError(400, msg, param="cache_salt")
    return APIError(400, msg)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
