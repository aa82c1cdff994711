"""The offline API, shaped like vLLM's and FastDeploy's: `LLM(model=...).generate(...)`.

`LLM` loads a checkpoint folder (or builds a preset with random weights) and generates for a batch of
prompts with one batched prefill into a contiguous KV cache, then batched decode steps with on-device
sampling. Requests are independent: right padding never leaks into another row (causal masks by
position, dropless MoE), so a prompt gets the same greedy tokens alone or in a batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ernie_jax.config import PRESETS, ErnieConfig
from ernie_jax.model import ErnieForCausalLM
from ernie_jax.model import forward as fwd
from ernie_jax.sampling import SamplingParams, sample
from ernie_jax.tokenizer import Tokenizer


class RequestError(ValueError):
    """A prompt or request that cannot be served; the message says which one and why."""


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id, when finish_reason == "stop"


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}


def _bucket(n: int, minimum: int = 16) -> int:
    """Round up to a power of two so a handful of compiled shapes serve every request."""
    return max(minimum, 1 << (n - 1).bit_length())


class LLM:
    """model: a checkpoint folder, a preset name ("tiny", "ernie-4.5-21b-a3b", ...; random weights) or an
    ErnieForCausalLM. dtype: "bfloat16" (default) or "float32". quantization / fp8_compute: as in
    load_pretrained. kv_cache_dtype: "auto" (the model dtype), "bfloat16" or "fp8"."""

    def __init__(self, model: str | ErnieForCausalLM, *, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int | None = None, quantization: str | None = None, fp8_compute: str = "w8a8",
                 kv_cache_dtype: str = "auto"):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        jdtype = _DTYPES[dtype]
        self.tokenizer: Tokenizer | None = None
        self.generation_config: dict = {}
        if isinstance(model, ErnieForCausalLM):
            self.model = model
        elif isinstance(model, str) and os.path.isdir(model):
            from ernie_jax.checkpoint import load_pretrained
            self.model = load_pretrained(model, dtype=jdtype, quantization=quantization, fp8_compute=fp8_compute)
            self.tokenizer = Tokenizer.from_pretrained(model)
            gen_file = os.path.join(model, "generation_config.json")
            if os.path.isfile(gen_file):
                with open(gen_file) as f:
                    self.generation_config = json.load(f)
        elif isinstance(model, str) and model.lower() in PRESETS:
            self.model = ErnieForCausalLM(ErnieConfig.preset(model), rngs=nnx.Rngs(seed), dtype=jdtype)
        else:
            raise ValueError(f"model {model!r} is neither a checkpoint folder nor a preset ({sorted(PRESETS)})")
        cfg = self.model.config
        self.model.init_cache(1, 1, kv_cache_dtype)  # validates the name now rather than at the first request
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        eos = set(cfg.eos_token_id)
        gen_eos = self.generation_config.get("eos_token_id", [])
        eos.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self._weights = self.model.weights()
        self._rng = np.random.default_rng(seed)
        self._next_id = 0

    # ---- request normalisation --------------------------------------------------------------------------
    def _prompts(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompts is not None and prompt_token_ids is not None:
            raise RequestError("pass either prompts or prompt_token_ids, not both")
        out = []
        if prompt_token_ids is not None:
            out = [(None, [int(t) for t in ids]) for ids in prompt_token_ids]
        else:
            if prompts is None:
                raise RequestError("generate() needs prompts or prompt_token_ids")
            for p in [prompts] if isinstance(prompts, (str, dict)) else prompts:
                if isinstance(p, dict):
                    out.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
                elif isinstance(p, str):
                    if self.tokenizer is None:
                        raise RequestError("text prompts need a tokenizer (tokenizer.model in the model folder); "
                                           "pass prompt_token_ids instead")
                    out.append((p, self.tokenizer.encode(p)))
                else:
                    raise RequestError(f"prompt of type {type(p).__name__}: expected str or "
                                       "{'prompt_token_ids': [...]}")
        V = self.model.config.vocab_size
        for i, (_, ids) in enumerate(out):
            if not ids:
                raise RequestError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise RequestError(f"prompt {i} has token ids outside [0, {V}): {bad[:5]}")
        return out

    # ---- generation -------------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        reqs = self._prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(reqs)
        if len(params) != len(reqs):
            raise RequestError(f"{len(params)} sampling_params for {len(reqs)} prompts")
        max_new = []
        for i, ((_, ids), sp) in enumerate(zip(reqs, params)):
            room = self.max_model_len - len(ids)
            if room < 1:
                raise RequestError(f"prompt {i} has {len(ids)} tokens; max_model_len is {self.max_model_len}")
            if sp.max_tokens is not None and sp.max_tokens > room:
                raise RequestError(f"prompt {i}: {len(ids)} prompt tokens + max_tokens {sp.max_tokens} exceed "
                                   f"max_model_len {self.max_model_len}")
            max_new.append(sp.max_tokens or room)
        tokens = self._run(reqs, params, max_new)
        outputs = []
        for (text, ids), sp, (toks, reason, stop) in zip(reqs, params, tokens):
            rid = str(self._next_id)
            self._next_id += 1
            out_text = self.tokenizer.decode(toks) if self.tokenizer is not None else None
            outputs.append(RequestOutput(rid, text, ids, [CompletionOutput(0, out_text, toks, reason, stop)]))
        return outputs

    def _run(self, reqs, params, max_new) -> list[tuple[list[int], str, int | None]]:
        cfg, w = self.model.config, self._weights
        B = len(reqs)
        lens = np.array([len(ids) for _, ids in reqs], np.int32)
        T = _bucket(int(lens.max()))
        S = _bucket(int(max(lens + np.array(max_new))))
        ids = np.zeros((B, T), np.int32)
        for b, (_, p) in enumerate(reqs):
            ids[b, : len(p)] = p
        temperature = jnp.asarray([sp.temperature for sp in params], jnp.float32)
        top_p = jnp.asarray([sp.top_p for sp in params], jnp.float32)
        top_k = jnp.asarray([sp.top_k for sp in params], jnp.int32)
        seeds = jnp.asarray([sp.seed if sp.seed is not None else int(self._rng.integers(2**31)) for sp in params],
                            jnp.uint32)
        stops = [set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids)) for sp in params]

        cache = self.model.init_cache(B, S, self.kv_cache_dtype)
        positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
        out = fwd.forward_cached_jit(w, cfg, jnp.asarray(ids), jnp.asarray(positions), cache, jnp.asarray(lens - 1))
        results: list[list[int]] = [[] for _ in range(B)]
        done: list[tuple[str, int | None] | None] = [None] * B
        pos = lens.copy()
        for step in range(max(max_new)):
            tok = np.asarray(sample(out.logits, temperature, top_p, top_k, seeds, jnp.full((B,), step, jnp.int32)))
            for b in range(B):
                if done[b] is not None:
                    continue
                t = int(tok[b])
                results[b].append(t)
                if t in stops[b]:
                    done[b] = ("stop", t)
                elif len(results[b]) >= max_new[b]:
                    done[b] = ("length", None)
            if all(d is not None for d in done):
                break
            # Finished rows keep stepping (their output is ignored); clamp so they never write out of range.
            cur = np.minimum(pos, S - 1)
            out = fwd.forward_cached_jit(w, cfg, jnp.asarray(tok[:, None]), jnp.asarray(cur[:, None]), out.cache,
                                         jnp.zeros((B,), jnp.int32))
            pos = pos + 1
        return [(r, d[0], d[1]) for r, d in zip(results, done)]
