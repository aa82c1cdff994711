"""One training step of ErnieForCausalLM's weights pytree: loss, optimizer and router-bias balancing.

The loss is the next-token cross entropy plus `mtp_weight` times the MTP block's cross entropy for token
t+2 (docs/model.md §5: the block sees x_{t+1} and the main model's final-normed h_t, exactly what the
serving path's forward.mtp_forward computes). Master weights are f32; the forward runs in `compute_dtype`
(bf16) with the router, its bias and the logits in f32 as at inference.

Optimizer (optax): global-norm clipping, then AdamW with linear warmup and cosine decay; norms and the
embedding take no weight decay. The router's correction bias (`router_bias`, which picks experts but does not
weight them) is not trained by gradients: after each step it moves toward balance, up for experts that took
fewer than the mean assignments in the step's batch and down for those that took more (DeepSeek-V3's
auxiliary-loss-free balancing), so routing stays dropless and spread without an aux loss. DeepSeek moves it
by a constant `bias_rate` (the sign of the imbalance); here the step is `bias_rate` times the relative
imbalance (mean - load) / mean, because a softmax router collapses onto one expert within a few warmup
steps, faster than a constant step undoes, while near balance a proportional step is gentle.

Shapes: tokens [B, T+2]; B batch, T tokens, V vocab, L layers of a segment, E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ernie_jax.config import ErnieConfig
from ernie_jax.model.forward import forward, mtp_forward
from ernie_jax.model.weights import F32_LEAVES, init_weights
from ernie_jax.ops.execution import ExecutionConfig

# The training forward: the XLA references (differentiable), with the sorted-tiles routed experts
# (ops/routed_experts/sorted_tiles.py): static shapes and at most one tile of padding per expert whatever the
# routing. (The capacity form pads every expert to the largest load, up to 4x the rows while the router is
# still unbalanced; the tiled form's loops have data-dependent trip counts, which reverse mode cannot
# differentiate; XLA:CPU runs the ragged form as every row through every expert.)
TRAIN_EXECUTION = ExecutionConfig(routed_experts="sorted_tiles")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    mtp_weight: float = 0.3  # DeepSeek-V3's MTP loss weight for most of its training
    bias_rate: float = 0.005  # bias change per unit of relative load imbalance per step
    compute_dtype: str = "bfloat16"
    seed: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: steps taken
    params: dict[str, Any]  # f32 weights pytree (weights.py)
    opt_state: Any


class StepMetrics(NamedTuple):
    loss: jax.Array
    lm_loss: jax.Array
    mtp_loss: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    expert_load: tuple[jax.Array, ...]  # per MoE segment [L, E] assignments in the batch


def _leaf_name(path) -> str:
    keys = [str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)]
    return keys[-1] if keys else ""


def schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps,
                                              max(tc.steps, tc.warmup_steps + 1), tc.learning_rate * tc.min_lr_ratio)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "balance" if _leaf_name(p) == "router_bias" else "train", params)

    def decays(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: not (_leaf_name(p).endswith("norm") or _leaf_name(p) == "embed"), params)

    adamw = optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                        optax.adamw(schedule(tc), tc.b1, tc.b2, weight_decay=tc.weight_decay, mask=decays))
    return optax.multi_transform({"train": adamw, "balance": optax.set_to_zero()}, labels)


def init_params(cfg: ErnieConfig, seed: int) -> dict[str, Any]:
    """f32 weights to train from: normal(0, 0.02) linears and embedding (GPT-2's init; the tied head then
    starts with small logits), norm gains 1, router correction bias 0."""
    params = init_weights(cfg, seed, jnp.float32, scale=0.02)

    def fix(path, a):
        name = _leaf_name(path)
        if name.endswith("norm"):
            return jnp.ones_like(a)
        if name == "router_bias":
            return jnp.zeros_like(a)
        return a * 0.02 if name == "embed" else a
    return jax.tree_util.tree_map_with_path(fix, params)


def init_state(params: dict[str, Any], tc: TrainConfig) -> TrainState:
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(tc).init(params))


def compute_weights(params: dict[str, Any], dtype) -> dict[str, Any]:
    """The f32 master weights in the compute dtype (router, bias and KV scales stay f32)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a: a if _leaf_name(p) in F32_LEAVES else a.astype(dtype), params)


def _xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy; logits [B,T,V] f32, targets [B,T]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def losses(params, tokens: jax.Array, cfg: ErnieConfig, tc: TrainConfig, plan=None):
    """tokens [B, T+2] -> (total loss, (lm loss, mtp loss, expert loads per MoE segment [L, E]))."""
    w = compute_weights(params, jnp.dtype(tc.compute_dtype))
    B, T2 = tokens.shape
    T = T2 - 2
    x, next1, next2 = tokens[:, :T], tokens[:, 1:T + 1], tokens[:, 2:]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = forward(w, cfg, x, positions, plan=plan, ex=TRAIN_EXECUTION)
    lm = _xent(out.logits, next1)
    total, mtp = lm, jnp.zeros((), jnp.float32)
    if cfg.has_mtp:
        mtp = _xent(mtp_forward(w, cfg, next1, out.hidden, positions, TRAIN_EXECUTION), next2)
        total = lm + tc.mtp_weight * mtp
    loads = tuple(jnp.sum(jax.nn.one_hot(ids, cfg.moe_num_experts, dtype=jnp.int32), axis=(1, 2))
                  for ids in out.expert_ids)  # [L, E] each
    return total, (lm, mtp, loads)


def balance_router_bias(params: dict[str, Any], loads: tuple[jax.Array, ...], cfg: ErnieConfig, rate: float):
    """router_bias += rate * (mean load - load) / mean load, per MoE layer (loads [L, E] per MoE segment)."""
    segments, moe = [], iter(loads)
    for seg, seg_w in zip(cfg.layer_segments(), params["segments"]):
        if seg.kind == "moe":
            load = next(moe).astype(jnp.float32)
            mean = jnp.mean(load, axis=-1, keepdims=True)
            step = rate * (mean - load) / jnp.maximum(mean, 1.0)
            seg_w = {**seg_w, "router_bias": seg_w["router_bias"] + step}
        segments.append(seg_w)
    return {**params, "segments": segments}


@functools.partial(jax.jit, static_argnames=("cfg", "tc", "plan"), donate_argnames=("state",))
def train_step(state: TrainState, tokens: jax.Array, *, cfg: ErnieConfig, tc: TrainConfig, plan=None
               ) -> tuple[TrainState, StepMetrics]:
    (loss, (lm, mtp, loads)), grads = jax.value_and_grad(losses, has_aux=True)(state.params, tokens, cfg, tc, plan)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    params = balance_router_bias(params, loads, cfg, tc.bias_rate)
    metrics = StepMetrics(loss, lm, mtp, optax.tree.norm(grads), schedule(tc)(state.step), loads)
    return TrainState(state.step + 1, params, opt_state), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "tc", "plan"))
def eval_losses(params, tokens: jax.Array, *, cfg: ErnieConfig, tc: TrainConfig, plan=None):
    """(lm loss, mtp loss) of a batch without updating anything."""
    _, (lm, mtp, _) = losses(params, tokens, cfg, tc, plan)
    return lm, mtp
