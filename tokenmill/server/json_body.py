"""JSON request bodies, from raw bytes to a validated pydantic model: Content-Type, UTF-8, JSON, no lone
surrogates, then the model's own checks. Every failure is a BadRequest naming the field (HTTP 400); what the
fields mean is protocol.py's job."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from tokenmill.server.errors import BadRequest


def parse_json(raw: bytes, content_type: str | None) -> dict:
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise BadRequest(f"Content-Type must be application/json, got {content_type or 'none'!r}")
    surrogates = bool(_SURROGATE_ESCAPE.search(raw))
    try:
        text = raw.decode("utf-8")  # JSON is UTF-8 (RFC 8259); json.loads(bytes) would also take UTF-16
    except UnicodeDecodeError as e:
        try:  # a surrogate spelled in bytes (ED A0 80): decode it anyway, so the walk below names its field
            text, surrogates = raw.decode("utf-8", "surrogatepass"), True
        except UnicodeDecodeError:
            raise BadRequest(f"the body is not valid UTF-8 (byte {e.start}): JSON bodies must be UTF-8") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if surrogates:  # only a \uD800-\uDFFF escape or surrogate bytes make one: skip the walk otherwise
        _refuse_lone_surrogates(body)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: dict) -> None:
    """A lone UTF-16 surrogate is valid JSON but not text: no tokenizer can encode it. 400 naming the field."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if _has_surrogate(key):
                    raise BadRequest(f"{path or 'the body'}: a key holds a lone UTF-16 surrogate; text must be "
                                     "valid Unicode", param=path or None)
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))
        elif isinstance(value, str) and _has_surrogate(value):
            raise BadRequest(f"{path}: the text holds a lone UTF-16 surrogate; text must be valid Unicode",
                             param=path)


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def validate(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _loc(err["loc"]) or None
        if param == "prompt" and len(e.errors()) > 1:  # every member of the union failed: say what fits
            raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids", param="prompt") from None
        raise BadRequest(first_error(e), param=param) from None


def _loc(loc: tuple) -> str:
    # unions add their member type names to the location ('prompt.list[int].0'): keep only field names and indices
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in ("str", "int"))]
    return ".".join(parts)


def first_error(e: ValidationError) -> str:
    errors = e.errors(include_url=False)
    err = errors[0]
    where = _loc(err["loc"])
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{where}: {err['msg']}{more}" if where else f"{err['msg']}{more}"
