"""Tool calls in ERNIE-4.5's format: the tools rendered into the conversation, the grammar that makes the
model call one (`tool_choice` "required" or a named function), and the calls parsed back out of its text.

A call is written as vLLM's `ernie45` tool parser and FastDeploy's `ernie-x1` parser read it:
`<tool_call>` + newline + `{"name": ..., "arguments": {...}}` + newline + `</tool_call>`, several calls one
after another. The tools are described in a system turn (each as its OpenAI JSON, then the call format);
an assistant turn that called tools is rendered as those blocks, and a tool's result (`role: "tool"`) as a
user turn holding `<tool_response>` ... `</tool_response>` (the Qwen-style convention that community templates
of the family's thinking models use). Plain Python.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from ernie_jax.structured.spec import JSON_OPTIONS, StructuredOutputError, StructuredOutputsParams

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names


def _error(field: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(field, f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of the arguments object

    def as_json(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(tools: list) -> list[Tool]:
    """OpenAI's `tools` list, checked: each {"type": "function", "function": {"name", "description"?,
    "parameters"?}} with a unique, well-formed name and an object schema (or none: any arguments object)."""
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise _error("tools", f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _error("tools", f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-' "
                         f"(got {name!r})")
        if name in seen:
            raise _error("tools", f"{where}: the function name {name!r} is given twice")
        seen.add(name)
        description = f.get("description") or ""
        if not isinstance(description, str):
            raise _error("tools", f"{where}.function.description must be a string")
        parameters = f.get("parameters")
        if parameters is None:
            parameters = {"type": "object"}
        if not isinstance(parameters, dict):
            raise _error("tools", f"{where}.function.parameters must be a JSON schema object")
        out.append(Tool(name, description, parameters))
    return out


def resolve_choice(tools: list[Tool], choice) -> str | Tool | None:
    """OpenAI's tool_choice: "none" -> None, "auto" -> "auto", "required" -> "required", a named function
    ({"type": "function", "function": {"name": ...}}) -> that Tool. Default: "auto" with tools, else None."""
    if choice is None:
        return "auto" if tools else None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise _error("tool_choice", f"tool_choice {choice!r} needs tools")
        return None if choice == "none" else choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        for t in tools:
            if t.name == name:
                return t
        raise _error("tool_choice", f"the function {name!r} is not among the request's tools "
                     f"({', '.join(t.name for t in tools) or 'none given'})")
    raise _error("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                 "\"function\": {\"name\": ...}}")


def constraint(tools: list[Tool], choice: str | Tool, parallel: bool) -> StructuredOutputsParams | None:
    """The grammar that makes the reply tool calls: one call of a named function (as OpenAI's named
    tool_choice), or calls of any of the tools ("required"): one, or (parallel) one or more. None for "auto":
    the model decides, and its text is parsed."""
    if choice == "auto":
        return None
    chosen = [choice] if isinstance(choice, Tool) else tools
    schemas = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    # the JSON options travel inside the schema (llguidance's x-guidance): compact, as spec.py's JSON
    call_schema = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_OPTIONS}
    repeat = ' ("\\n" call)*' if parallel and not isinstance(choice, Tool) else ""
    start, end = json.dumps(CALL_START + "\n"), json.dumps("\n" + CALL_END)
    lark = f"start: call{repeat}\ncall: {start} body {end}\nbody: %json {json.dumps(call_schema)}\n"
    return StructuredOutputsParams(grammar=lark, field="tools")


def render(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """The conversation with the tools described in a system turn and tool calls and results as text, in
    the plain roles the chat template takes (system, user, assistant)."""
    out = []
    if tools:
        listing = "\n".join(json.dumps(t.as_json(), ensure_ascii=False) for t in tools)
        text = ("You may call the functions below, each described as JSON:\n" + listing +
                "\nTo call functions, reply with one block per call, each holding a JSON object with the "
                f"function's name and arguments:\n{CALL_START}\n"
                '{"name": <function-name>, "arguments": <arguments-object>}\n' + CALL_END)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + text})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": text})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{CALL_START}\n{json.dumps(c, ensure_ascii=False)}\n{CALL_END}"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(the text before the first call, or None when empty; the calls as OpenAI's tool_calls entries). A
    block that is not a JSON object with a string name is left as text, not dropped."""
    calls = []
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        calls.append({"id": call_id(), "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False)}})
    if not calls:
        return (text or None), []
    content = text[:text.find(CALL_START)].rstrip("\n")
    return (content or None), calls


class StreamParser:
    """Streamed tool calls: text deltas in, (content delta, completed calls) out. Content is passed on as
    it comes except what may be the start of a `<tool_call>` block; a block is held until it closes and
    then sent whole as one call (name and all arguments in one delta, which the openai client assembles
    like any other)."""

    def __init__(self):
        self.buffer, self.calls = "", 0
        self.in_calls = False  # after the first call, text between blocks is not content

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            start = self.buffer.find(CALL_START)
            if start < 0:
                keep = 0 if final else partial_suffix(self.buffer, CALL_START)
                while not final and keep < len(self.buffer) and self.buffer[-keep - 1] == "\n":
                    keep += 1  # newlines before a call are not content
                head = self.buffer[:len(self.buffer) - keep]
                if not self.in_calls:
                    content += head
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            if not self.in_calls:
                content += self.buffer[:start].rstrip("\n") if start else ""
            end = self.buffer.find(CALL_END, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                if final:  # an unclosed block at the end (cut by max_tokens): left as text
                    content += self.buffer if not self.in_calls else ""
                    self.buffer = ""
                break
            _, parsed = parse(self.buffer[start:end + len(CALL_END)])
            for c in parsed:
                calls.append({"index": self.calls, **c})
                self.calls += 1
            self.in_calls = self.in_calls or bool(parsed)
            self.buffer = self.buffer[end + len(CALL_END):]
        return content, calls


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token: what a stream parser holds back
    until the next delta says whether the token starts there."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0
