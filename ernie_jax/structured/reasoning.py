"""The reasoning parser of the family's thinking models (`--reasoning-parser ernie45`, vLLM's name): the
text before `</think>` is the reasoning (`reasoning_content`), what follows is the answer (`content`).

The prompt may already open the `<think>` block, so a leading `<think>` is optional. A reply with no
`</think>` is all reasoning while it streams (the model is still thinking) and, once finished, all
reasoning too, as vLLM's parser reads it. Leading newlines of the answer are dropped.
"""

from __future__ import annotations

from ernie_jax.structured.tools import partial_suffix

START, END = "<think>", "</think>"
PARSERS = ("ernie45",)


def split(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished reply."""
    body = text[len(START):] if text.startswith(START) else text
    at = body.find(END)
    if at < 0:
        return body or None, None
    reasoning, content = body[:at], body[at + len(END):].lstrip("\n")
    return reasoning or None, content or None


class StreamSplitter:
    """Streamed deltas split into (reasoning delta, content delta); a possible start of `</think>` is held
    until the next delta says what it is."""

    def __init__(self):
        self.buffer, self.answering, self.started = "", False, False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if self.answering:
            out = (self.buffer + delta) if self.started else (self.buffer + delta).lstrip("\n")
            self.started = self.started or bool(out)
            self.buffer = ""
            return "", out
        self.buffer += delta
        if self.buffer.startswith(START):
            self.buffer = self.buffer[len(START):]
        elif START.startswith(self.buffer) and not final:
            return "", ""  # may still be the opening tag
        at = self.buffer.find(END)
        if at >= 0:
            reasoning, rest = self.buffer[:at], self.buffer[at + len(END):]
            self.answering, self.buffer = True, ""
            _, content = self.feed(rest, final)
            return reasoning, content
        keep = 0 if final else partial_suffix(self.buffer, END)
        reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return reasoning, ""
