"""ERNIE's SentencePiece tokenizer: special tokens, the chat template, and streaming detokenization.

ERNIE's tokenizer derives from LlamaTokenizer in legacy mode with no BOS added (docs/model.md §6):
`encode` adds no special token; with `allow_special` the special-token strings in the text (e.g. the
`<|begin_of_sentence|>` of a rendered chat) become their single ids instead of being spelled out.
`decode` drops special and control pieces. `apply_chat_template` renders ERNIE's template:
`<|begin_of_sentence|>`, each system text + "\\n", "User: " + text + "\\n", "Assistant: " + text +
`<|end_of_sentence|>`, and a trailing "Assistant: " when a reply is wanted. `IncrementalDetokenizer`
turns a growing id list into text deltas that never split a UTF-8 character.
"""

from __future__ import annotations

import json
import os
import re

import sentencepiece as spm

END_OF_TURN_PIECES = ("</s>", "<|end_of_sentence|>")
SPECIAL_PIECES = ("<s>", "</s>", "<unk>", "<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>", "<mask:4>",
                  "<mask:5>", "<mask:6>", "<mask:7>")
BOS_CHAT, EOS_CHAT = "<|begin_of_sentence|>", "<|end_of_sentence|>"


class ChatTemplateError(ValueError):
    """A chat message the template cannot render; the message says which one."""


def check_text(text: str) -> None:
    """Refuse what SentencePiece cannot take: a non-string, or a string that is not valid Unicode (a lone
    surrogate such as "\\ud800", which JSON can carry but UTF-8 cannot)."""
    if not isinstance(text, str):
        raise TypeError(f"the text must be a string, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}: "
                         "it is not valid Unicode") from None


class Tokenizer:
    def __init__(self, model_file: str, config: dict | None = None):
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.model_file = model_file
        self.config = config or {}
        added = [t.get("content") for t in self.config.get("added_tokens_decoder", {}).values() if isinstance(t, dict)]
        self.special_ids = {p: i for p in dict.fromkeys(SPECIAL_PIECES + tuple(a for a in added if a))
                            if (i := self.token_id(p)) is not None}
        pattern = "|".join(re.escape(p) for p in sorted(self.special_ids, key=len, reverse=True))
        self._special_re = re.compile(f"({pattern})") if pattern else None
        self._skip = set(self.special_ids.values())

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer.model (token-id-only use)."""
        file = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(file):
            return None
        config_file = os.path.join(path, "tokenizer_config.json")
        config = None
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
        return cls(file, config)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def token_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return None if i == self.sp.unk_id() and piece != self.sp.id_to_piece(i) else i

    @property
    def eos_token_ids(self) -> list[int]:
        return [i for i in (self.token_id(p) for p in END_OF_TURN_PIECES) if i is not None]

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        check_text(text)
        if not allow_special or self._special_re is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for part in self._special_re.split(text):
            if part in self.special_ids:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        n = self.vocab_size
        keep = [i for i in ids if 0 <= i < n and not (skip_special_tokens and (
            i in self._skip or self.sp.is_control(i) or self.sp.is_unknown(i)))]
        return self.sp.decode(keep)

    def _byte(self, token_id: int) -> int | None:
        """NN of a byte-fallback piece "<0xNN>"; None for any other token."""
        if 0 <= token_id < self.vocab_size and self.sp.is_byte(token_id):
            return int(self.sp.id_to_piece(token_id)[3:5], 16)
        return None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's logprobs `bytes` carry them: a byte piece "<0xNN>" is
        the single byte NN, so a client can join a multi-byte character's tokens back into text."""
        byte = self._byte(token_id)
        return self.token_text(token_id).encode() if byte is None else bytes([byte])

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it: its piece with SentencePiece's word marker as a space; a byte
        piece is its character when that byte is a whole one (ASCII: "<0x0A>" is a newline) and stays
        "<0xNN>" when it is part of a multi-byte character, since alone it is not text."""
        if not 0 <= token_id < self.vocab_size:
            return f"<id:{token_id}>"  # an embedding row past the tokenizer's pieces
        piece, byte = self.sp.id_to_piece(token_id), self._byte(token_id)
        if byte is not None:
            return chr(byte) if byte < 0x80 else piece
        return piece.replace("\u2581", " ")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ERNIE's chat template; message content is a string or a list of {"type": "text", "text": ...}."""
        out = [BOS_CHAT]
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
            text = message_text(m.get("content"), i)
            role = m["role"]
            if role == "system":
                out.append(f"{text}\n")
            elif role == "user":
                out.append(f"User: {text}\n")
            elif role == "assistant":
                out.append(f"Assistant: {text}{EOS_CHAT}")
            else:
                raise ChatTemplateError(f"messages[{i}].role {role!r} is not one of 'system', 'user', 'assistant'")
        if add_generation_prompt:
            out.append("Assistant: ")
        return "".join(out)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), allow_special=True)


def message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")


class IncrementalDetokenizer:
    """Text deltas for a growing list of ids. Decoding starts from a recent prefix (not from the first id),
    and a delta that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until it completes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0  # decode window [prefix, ...); text up to `read` already emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
