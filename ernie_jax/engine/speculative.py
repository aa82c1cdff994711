"""MTP speculative decoding: its configuration (vLLM's / FastDeploy's `--speculative-config`) and counters.

ERNIE-4.5 ships one MTP layer that predicts the token after next from the main model's state and the next
token (docs/model.md §5). With `{"method": "mtp", "num_speculative_tokens": k}` every decode step
verifies the k tokens the MTP block drafted in the previous step (the target scores the last token and
the k drafts in one pass, engine/programs.py `_verify_step`) and drafts k more; k > 1 chains the one
layer on its own output. Greedy requests accept a draft iff it is the target's argmax, so their tokens
are those of plain greedy decoding; sampled requests verify by rejection sampling, which keeps the
target's distribution exactly (sampling.speculative_verify). Requests that ask for logprobs, penalties,
logit_bias, min_p, or that are still below min_tokens, take one token per step (their sampler needs
every previous token on the host).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ernie_jax.engine.json_config import json_object

METHODS = ("mtp", "ernie_mtp")  # FastDeploy's name, vLLM's name
MAX_SPECULATIVE_TOKENS = 4


class SpeculativeConfigError(ValueError):
    """A malformed speculative config; the message names the field."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1
    # Where FastDeploy and vLLM read the MTP weights: here always the served checkpoint's own (its
    # ernie.mtp_block.0.* tensors or its mtp/ folder); LLM refuses a path that names anything else.
    model: str | None = None

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """None, a dict, a JSON string (the CLI flag) or a SpeculativeConfig -> a config (None: off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", [f.name for f in dataclasses.fields(cls)],
                            SpeculativeConfigError)
        method = value.get("method", "mtp")
        if method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config.method={method!r}: expected one of {list(METHODS)} "
                                         "(the model's own MTP layer)")
        k = value.get("num_speculative_tokens", 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"speculative_config.num_speculative_tokens={k!r}: expected an integer "
                                         f"in [1, {MAX_SPECULATIVE_TOKENS}]")
        model = value.get("model")
        if model is not None and not isinstance(model, str):
            raise SpeculativeConfigError(f"speculative_config.model={model!r}: expected a path")
        return cls(method, k, model)


class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts verified, draft tokens, accepted tokens, accepted per position."""

    def __init__(self, k: int):
        self.k = k
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def observe(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.k
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def report(self) -> dict[str, Any]:
        return {"num_speculative_tokens": self.k, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_pos),
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4)}
