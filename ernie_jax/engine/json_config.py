"""JSON-valued engine configs (`--speculative-config`, `--eplb-config`): the object a flag or a dict gives."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, name: str, known: list[str], error: type[ValueError]) -> dict:
    """A dict, or its JSON text as a CLI flag passes it -> the dict; `error` (naming `name`) for text that is
    not JSON, a value that is not an object, or a field not in `known`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise error(f"{name} is not valid JSON ({e.msg} at character {e.pos}): {value!r}") from None
    if not isinstance(value, dict):
        raise error(f"{name} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise error(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return value
