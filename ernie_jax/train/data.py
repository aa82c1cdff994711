"""Token streams for training and evaluation, and the deterministic batch of every step.

A split becomes one token stream: each document's tokens then `</s>`. The training stream also holds chat
turns made from the train documents (consecutive paragraphs a, b as ERNIE's chat template renders them:
`<|begin_of_sentence|>User: a\\nAssistant: b<|end_of_sentence|>`), so the served model answers a chat prompt
in the corpus's voice and ends its turn. Turns come from prose (every pair) and verse (every CHAT_EVERY-th
pair, which keeps the many short ci from outweighing the prose), never from drama: a play's consecutive
paragraphs are a speaker's name and a speech or a stage direction, and a model taught on them answered
every English prompt with a stage direction. The batch of step s is a function of (seed, s) alone, so a
resumed run reads exactly the batches an uninterrupted one would.

Streams are cached as .npy files keyed by the corpus manifest and tokenizer hashes.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ernie_jax.train.corpus import SOURCES, load_corpus
from ernie_jax.train.vocab import CLS, EOS, SEP

CHAT_EVERY = {"prose": 1, "verse": 12}  # one chat turn per this many paragraph pairs, by the source's form
CHAT_MAX_CHARS = 600  # longer paragraphs are not made into chat turns


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks when a document has them (drama: speaker and speech), else lines."""
    parts = text.split("\n\n") if "\n\n" in text else text.split("\n")
    return [p.strip() for p in parts if p.strip()]


def chat_turns(docs: list[dict]) -> list[tuple[str, str]]:
    """(user, assistant) pairs of consecutive short paragraphs of each prose or verse document."""
    forms = {s.name: s.form for s in SOURCES}
    out = []
    for d in docs:
        every = CHAT_EVERY.get(forms[d["source"]])
        if every is None:
            continue
        paras = paragraphs(d["text"])
        for i in range(0, len(paras) - 1, every):
            a, b = paras[i], paras[i + 1]
            if len(a) <= CHAT_MAX_CHARS and len(b) <= CHAT_MAX_CHARS:
                out.append((a, b))
    return out


def build_stream(sp, docs: list[dict], with_chat: bool) -> np.ndarray:
    """The split as one int32 stream (documents, then chat turns, each with its end token)."""
    eos, cls, sep = sp.piece_to_id(EOS), sp.piece_to_id(CLS), sp.piece_to_id(SEP)
    parts = [ids + [eos] for ids in sp.encode([d["text"] for d in docs])]
    if with_chat:
        turns = chat_turns(docs)
        users = sp.encode([f"User: {a}\nAssistant: " for a, _ in turns])
        answers = sp.encode([b for _, b in turns])
        parts += [[cls] + u + a + [sep] for u, a in zip(users, answers)]
    return np.fromiter((t for p in parts for t in p), np.int32)


def _key(corpus: str, tokenizer_model: bytes, split: str, with_chat: bool) -> str:
    with open(os.path.join(corpus, "manifest.json"), "rb") as f:
        manifest = f.read()
    settings = f"{split}:{with_chat}:{sorted(CHAT_EVERY.items())}:{CHAT_MAX_CHARS}"
    h = hashlib.sha256(manifest + tokenizer_model + settings.encode())
    return h.hexdigest()[:16]


def load_stream(corpus: str, split: str, tokenizer_model: bytes, cache_dir: str, with_chat: bool = False
                ) -> np.ndarray:
    """The split's token stream, from the cache when the corpus and tokenizer are unchanged."""
    import sentencepiece as spm

    docs = load_corpus(corpus, split)  # checks the files against the manifest
    path = os.path.join(cache_dir, f"{split}{'-chat' if with_chat else ''}-"
                                   f"{_key(corpus, tokenizer_model, split, with_chat)}.npy")
    if os.path.exists(path):
        return np.load(path)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)
    stream = build_stream(sp, docs, with_chat)
    os.makedirs(cache_dir, exist_ok=True)
    np.save(path + ".tmp.npy", stream)
    os.replace(path + ".tmp.npy", path)
    return stream


def batch_at(stream: np.ndarray, step: int, seed: int, batch_size: int, length: int) -> np.ndarray:
    """[batch_size, length] windows at offsets drawn from (seed, step) only."""
    if len(stream) <= length:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window of {length}")
    starts = np.random.default_rng([seed, step]).integers(0, len(stream) - length, batch_size)
    return np.stack([stream[s:s + length] for s in starts])
