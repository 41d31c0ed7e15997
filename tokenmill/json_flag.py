"""JSON-object flags (--speculative-config, --kv-transfer-config): their value, as text or a dict, checked against
the keys the flag knows. Its own module so each config that takes such a flag can use it without importing the
others."""

from __future__ import annotations

from typing import Any

from tokenmill.errors import ConfigError


def json_flag(value: dict[str, Any] | str, flag: str, keys: tuple[str, ...], example: str) -> dict[str, Any]:
    """A JSON-object flag's value (its text, or a dict from LLM(...)) with only known keys; one clear ConfigError."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} is not valid JSON ({e.msg} at {e.pos}); e.g. {example}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, e.g. {example}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{flag}: unknown key(s) {', '.join(unknown)}; known: {', '.join(keys)}")
    return dict(value)
