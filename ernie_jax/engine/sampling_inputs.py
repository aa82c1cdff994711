"""The per-row sampling inputs of a step's batch, as numpy arrays the runner puts on the device.

Built from the requests alone: temperature, top-p, top-k, the 32-bit seed and the index of the token
being sampled (so a seeded request draws the same tokens whatever batch it runs in), and, only when a
row needs them, min-p and the penalty block (presence, frequency and repetition penalties over token
counts, logit_bias, and min_tokens' suppression of the stop tokens), and structured output's token masks.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ernie_jax.engine.request import Request
from ernie_jax.sampling import GREEDY_BELOW

SAMPLING_ARGS = ("temperature", "top_p", "top_k", "seeds", "steps")  # the step programs' sampling arrays, in order


def sampling_arrays(reqs: list[Request], B: int, *, vocab_size: int,
                    stop_ids: Callable[[Request], set[int]]) -> tuple[dict, int]:
    """Per-row sampling inputs for the next token of each request (its index: len(output_ids); the caller
    adds the tokens still in flight to `steps`), padded to B rows; and the most logprob alternatives any row
    asks for. stop_ids(req): the tokens min_tokens suppresses."""
    pad = B - len(reqs)
    steps = [len(r.output_ids) for r in reqs]
    f = lambda xs, fill=0.0: np.asarray(list(xs) + [fill] * pad, np.float32)  # noqa: E731
    p = [r.params for r in reqs]
    arrays = {"temperature": f(x.temperature if x.temperature >= GREEDY_BELOW else 0.0 for x in p),
              "top_p": f((x.top_p for x in p), 1.0),
              "top_k": np.asarray([x.top_k for x in p] + [0] * pad, np.int32),
              "seeds": np.asarray([r.seed for r in reqs] + [0] * pad, np.uint32),
              "steps": np.asarray(steps + [0] * pad, np.int32),
              "min_p": f(x.min_p for x in p) if any(x.min_p for x in p) else None, "penalties": None,
              "allowed": None}  # structured output's token masks: the runner adds them (ModelRunner._mask)
    suppress = [step < r.params.min_tokens for r, step in zip(reqs, steps)]  # step: the token's index
    if any(x.uses_penalties for x in p) or any(suppress):
        V = vocab_size
        counts, prompt_mask = np.zeros((B, V), np.float32), np.zeros((B, V), bool)
        bias = np.zeros((B, V), np.float32)
        for i, r in enumerate(reqs):
            np.add.at(counts[i], r.output_ids, 1)
            prompt_mask[i, r.prompt_ids] = True
            if r.params.logit_bias:
                bias[i, list(r.params.logit_bias)] += list(r.params.logit_bias.values())
            if suppress[i]:  # min_tokens: no stop token before then
                bias[i, list(stop_ids(r))] = -np.inf
        arrays["penalties"] = (f(x.presence_penalty for x in p), f(x.frequency_penalty for x in p),
                               f((x.repetition_penalty for x in p), 1.0), counts, prompt_mask, bias)
    return arrays, max((x.logprobs or 0) for x in p)


def plain_sampling(arrays: dict, num_logprobs: int) -> bool:
    """Whether the step program's own sampling (temperature, top-p, top-k) serves a batch with these
    sampling arrays: no min-p, no penalty block, no token mask, no logprob alternatives."""
    return arrays["min_p"] is None and arrays["penalties"] is None and arrays["allowed"] is None and num_logprobs == 0

