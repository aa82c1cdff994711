"""ERNIE's SentencePiece tokenizer (`tokenizer.model`): encode and decode, and its end-of-turn ids.

ERNIE's tokenizer derives from LlamaTokenizer in legacy mode with no BOS added (ERNIE45_SPEC.md section
6): `encode` adds no special token. `decode` drops control pieces (<s>, </s>, <unk>, <|...|> markers).
"""

from __future__ import annotations

import os

import sentencepiece as spm

END_OF_TURN_PIECES = ("</s>", "<|end_of_sentence|>")


class Tokenizer:
    def __init__(self, model_file: str):
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.model_file = model_file

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer.model (token-id-only use)."""
        file = os.path.join(path, "tokenizer.model")
        return cls(file) if os.path.isfile(file) else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def token_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return None if i == self.sp.unk_id() and piece != self.sp.id_to_piece(i) else i

    @property
    def eos_token_ids(self) -> list[int]:
        return [i for i in (self.token_id(p) for p in END_OF_TURN_PIECES) if i is not None]

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        n = self.vocab_size
        keep = [i for i in ids if 0 <= i < n and not (self.sp.is_control(i) or self.sp.is_unknown(i))]
        return self.sp.decode(keep)
