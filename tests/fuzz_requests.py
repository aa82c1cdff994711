"""Property-based request bodies for the server's routes, drawn from its own OpenAPI schema and then
roughened: up to three fields (or a message's content, or a prompt's first element) replaced by hostile
values a client could send: huge or negative integers, NaN and the infinities (Python's JSON parser takes
them), lone surrogates, NUL bytes, nulls, wrong types, long strings.

`from_schema` covers the JSON Schema that FastAPI writes for pydantic models (object, array, string,
integer, number, boolean, null, enum, anyOf, $ref, min/maxItems, maxProperties); a keyword it does not
know fails the test rather than being ignored.
"""

from hypothesis import strategies as st

# Optional fields whose random values are nearly always refused (a random dict is no JSON schema, a random
# string rarely a tool_choice): drawn into a quarter of the bodies, so most bodies still reach the engine.
RARE = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
        "tools", "tool_choice", "tool_calls", "tool_call_id"}
# Optional in the schema, needed in practice: a message's content may be omitted only beside tool_calls.
ALWAYS = {"content"}
_KNOWN = {"type", "properties", "required", "items", "anyOf", "$ref", "enum", "const", "title", "default",
          "minItems", "maxItems", "maxProperties", "additionalProperties", "description"}


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid for a JSON Schema node (small: at most 3 list items or extra keys)."""
    unknown = set(schema) - _KNOWN
    assert not unknown, f"schema keywords the fuzzer does not know: {unknown}"
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ())) | (ALWAYS & set(props))
        if not props:  # a free-form object (tools, response_format, logit_bias)
            values = from_schema(schema["additionalProperties"], components, depth + 1) \
                if isinstance(schema.get("additionalProperties"), dict) else st.integers(-3, 3) | st.text(max_size=5)
            return st.dictionaries(st.text(max_size=8), values, max_size=min(3, schema.get("maxProperties", 3)))
        fields = {k: from_schema(v, components, depth + 1) for k, v in props.items()}
        optional = sorted(set(props) - required)
        # required fields and at most three optional ones, so a fair share of bodies are valid throughout
        if not optional:
            return st.fixed_dictionaries(fields)
        common = [k for k in optional if k not in RARE]
        keys = st.lists(st.sampled_from(optional), max_size=3, unique=True)
        if common and len(common) < len(optional):
            plain = st.lists(st.sampled_from(common), max_size=3, unique=True)
            keys = st.one_of(plain, plain, plain, keys)
        return keys.flatmap(lambda keys: st.fixed_dictionaries({k: fields[k] for k in sorted(required) + keys}))
    if kind == "array":
        items = from_schema(schema.get("items", {"type": "integer"}), components, depth + 1)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(3, schema.get("maxItems", 3))))
    # numbers: plausible ones half the time, any the other half
    return {"string": st.text(max_size=40), "integer": st.integers(0, 20) | st.integers(),
            "number": st.floats(0, 2) | st.floats(allow_nan=False, allow_infinity=False),
            "boolean": st.booleans(), "null": st.none()}[kind]

HOSTILE = [2**80, -2**80, 2**64, 2**63, 2**31, -1, 0, 10**9, 1e308, -1e308, float("nan"), float("inf"),
           float("-inf"), 1e-45, "\ud800", "a\udfffb", "a\x00b", "", None, True, False, [], {}, [None], [-1],
           [2**40], {"a": 1}, {"1": 1e9}, {"99999999999999999999": 1}, "x" * 5000, [[]], [{"type": "image_url"}]]
NESTED = ["messages.0.content", "messages.0.role", "messages.0", "prompt.0", "messages.0.content.0.text"]


def _set(body: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.get(key)
        if not isinstance(node, (dict, list)) or (isinstance(node, list) and not node):
            return  # the generated body has nothing at this path
    if isinstance(node, list):
        node[int(last) % len(node)] = value
    else:
        node[last] = value


def request_bodies(openapi: dict, name: str, model: str, max_tokens: int, max_model_len: int):
    """Bodies for the request schema `name`: the schema's own, with hostile edits. Tokens to generate are
    capped at `max_tokens` where a body asks for more, up to max_model_len (beyond it the request is refused
    anyway), so a case costs at most a few decode steps."""
    components = openapi["components"]["schemas"]
    fields = sorted(openapi["components"]["schemas"][name]["properties"]) + NESTED
    edits = st.just([]) | st.lists(st.tuples(st.sampled_from(fields), st.sampled_from(HOSTILE)), min_size=1,
                                   max_size=3)

    def build(args):
        body, changes = args
        if not isinstance(body.get("model"), str) or not body["model"] or body["model"] != model:
            body["model"] = model  # a wrong model name is refused before anything else runs
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if type(value) is int and max_tokens < value <= max_model_len:
                body[key] = max_tokens
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None and \
                ("messages" in body or "max_tokens" in body):
            body["max_tokens"] = max_tokens  # a request without a limit runs to max_model_len
        for path, value in changes:
            _set(body, path, value)
        return body
    return st.tuples(from_schema(components[name], components), edits).map(build)
