"""What a request's output must match, in vLLM's terms (`StructuredOutputsParams`: json, json_object,
regex, choice, grammar), and its translation to an llguidance grammar.

Exactly one constraint per request. A JSON schema becomes llguidance's JSON grammar with compact
separators (", " and ": ", no free whitespace: a model cannot pad a reply with newlines until max_tokens);
a choice becomes a Lark rule of string literals; a grammar is Lark (llguidance's dialect) or, when it
reads as GBNF (`root ::= ...`), llama.cpp's GBNF converted to Lark. Whether the grammar compiles is
checked against the tokenizer in guide.py; here only the shape of the request.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 256 * 1024
# Compact JSON: the separators JSON writers use by default, and no whitespace between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """A constraint that cannot be served; `field` is the request field it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass
class StructuredOutputsParams:
    """One constraint on the generated text. json: a JSON schema (an object or its JSON text); json_object:
    any JSON object; regex; choice: exactly one of these strings; grammar: Lark or GBNF. field: the request
    field it came from (named in errors: response_format, guided_json, structured_outputs, tools, ...)."""
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    field: str = "structured_outputs"

    def __post_init__(self):
        self.check()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def check(self) -> None:
        """The request's shape: exactly one constraint, each of its type."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(self.field, f"{self.field}: give exactly one of {', '.join(KINDS)} "
                                        f"(got {', '.join(given) or 'none'})")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    self.json = value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise StructuredOutputError(self.field, f"{self.field}: the JSON schema is not valid JSON: "
                                                f"{e}") from None
            if not isinstance(value, (dict, bool)):
                raise StructuredOutputError(self.field, f"{self.field}: a JSON schema must be an object, not "
                                            f"{type(value).__name__}")
        elif kind == "json_object" and value is not True:
            raise StructuredOutputError(self.field, f"{self.field}: json_object must be true")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise StructuredOutputError(self.field, f"{self.field}: {kind} must be a non-empty string")
            if len(value) > MAX_GRAMMAR_CHARS:
                raise StructuredOutputError(self.field, f"{self.field}: the {kind} has {len(value)} characters; "
                                            f"at most {MAX_GRAMMAR_CHARS}")
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise StructuredOutputError(self.field, f"{self.field}: choice must be a non-empty list of "
                                            "non-empty strings")
            if len(value) > MAX_CHOICES:
                raise StructuredOutputError(self.field, f"{self.field}: {len(value)} choices; at most "
                                            f"{MAX_CHOICES}")

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles to."""
        kind = self.kind
        if kind in ("json", "json_object"):
            schema: Any = self.json if kind == "json" else {"type": "object"}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise StructuredOutputError(self.field, f"{self.field}: {e}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        text = self.grammar
        if "::=" in text and not is_lark_syntax(text):
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 -- the converter raises plain Exceptions on bad GBNF
                raise StructuredOutputError(self.field, f"{self.field}: the GBNF grammar does not parse: {e}") \
                    from None
        return llguidance.LLMatcher.grammar_from_lark(text)

    def cache_key(self) -> str:
        return json.dumps([self.kind, getattr(self, self.kind)], sort_keys=True, ensure_ascii=False)
