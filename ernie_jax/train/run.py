"""The training run: tokenizer, token streams, the step loop, Orbax checkpoints, progress and the loss curve.

    python -m ernie_jax.train --corpus CORPUS --out RUN [--recipe embedded] [--steps N] [--mesh SPEC]

RUN holds run.json (recipe, model and train config, corpus and tokenizer hashes: a later call with other
settings is refused, naming the field), tokenizer/ (trained on the train split on the first call),
cache/ (token streams), checkpoints/ (Orbax, every --checkpoint-every steps and at the end), log.jsonl
(one line per step) and loss.png. Calling the same command again resumes from the last checkpoint; the
batches depend only on (seed, step), so a resumed run continues exactly as an uninterrupted one.
`--mesh` trains data- and expert-parallel on a mesh (e.g. "data=2,expert=4,tensor=1") through the same
logical-axis rules as serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ernie_jax.config import ErnieConfig
from ernie_jax.train import data, recipes
from ernie_jax.train.corpus import load_corpus
from ernie_jax.train.step import TrainConfig, TrainState, eval_losses, init_params, init_state, train_step
from ernie_jax.train.vocab import VocabError, train_sentencepiece, write_tokenizer_files

HELDOUT_EVAL_BATCHES = 4


class RunError(RuntimeError):
    """A run folder that does not match the requested run; the message names the field."""


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def model_config(recipe: recipes.Recipe, pieces: int) -> dict:
    """The recipe's model config; vocab_size, unless the recipe sets it, is the pieces rounded up to 128."""
    return {"vocab_size": -(-pieces // 128) * 128, **recipe.model}


def prepare_tokenizer(run: str, corpus: str, recipe: recipes.Recipe, max_len: int) -> bytes:
    folder = os.path.join(run, "tokenizer")
    path = os.path.join(folder, "tokenizer.model")
    if not os.path.exists(path):
        docs = load_corpus(corpus, "train")
        lines = [line for d in docs for line in d["text"].split("\n") if line.strip()]
        try:
            proto = train_sentencepiece(lines, recipe.num_pieces)
        except VocabError as e:
            raise RunError(f"recipe {recipe.name}: its tokenizer is too small for {corpus}: {e}; choose a recipe "
                           "with more pieces (--recipe embedded)") from None
        write_tokenizer_files(folder + ".partial", proto, max_len)
        os.replace(folder + ".partial", folder)
    with open(path, "rb") as f:
        return f.read()


def check_run_info(run: str, info: dict) -> None:
    """Write run.json, or check an existing one field by field."""
    path = os.path.join(run, "run.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        for section in ("recipe", "corpus_manifest_sha256", "tokenizer_sha256", "model_config", "train_config"):
            if old.get(section) != info[section]:
                diff = section
                if isinstance(info[section], dict) and isinstance(old.get(section), dict):
                    keys = sorted(k for k in set(old[section]) | set(info[section])
                                  if old[section].get(k) != info[section].get(k))
                    diff = f"{section}.{keys[0]}" if keys else section
                raise RunError(f"{path}: this run folder was made for another run ({diff} differs: "
                               f"{_field(old, diff)!r} there, {_field(info, diff)!r} now); use a new --out")
        return
    with open(path + ".tmp", "w") as f:
        json.dump(info, f, indent=2, ensure_ascii=False)
    os.replace(path + ".tmp", path)


def _field(info: dict, dotted: str):
    for k in dotted.split("."):
        info = info.get(k) if isinstance(info, dict) else None
    return info


def checkpoint_manager(run: str, every: int):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(os.path.abspath(os.path.join(run, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every))


def restore_latest(manager, state: TrainState) -> TrainState:
    import orbax.checkpoint as ocp
    step = manager.latest_step()
    if step is None:
        return state
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def place(state: TrainState, plan) -> TrainState:
    """The state on the plan's mesh: params by the serving rules; each optimizer leaf shaped like a param (Adam's
    moments, whose tree paths end with that param's path) sharded like it; scalars replicated."""
    if plan is None:
        return state
    from jax.sharding import NamedSharding, PartitionSpec as P
    param_shardings = plan.shardings(state.params)
    by_path = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shardings)}
    replicated = NamedSharding(plan.mesh, P())

    def opt_sharding(path, a):
        key = jax.tree_util.keystr(path)
        matches = [s for p, s in by_path.items() if key.endswith(p)]
        return matches[0] if matches and a.ndim else replicated
    opt = jax.tree_util.tree_map_with_path(lambda p, a: jax.device_put(a, opt_sharding(p, a)), state.opt_state)
    return TrainState(jax.device_put(state.step, replicated), jax.device_put(state.params, param_shardings), opt)


def batch_on(tokens: np.ndarray, plan) -> jax.Array:
    if plan is None:
        return jnp.asarray(tokens)
    return jax.device_put(tokens, plan.activation(("batch", None), tokens.shape))


class Progress:
    """One status line: step, losses, tokens/s and ETA, rewritten in place on a terminal."""

    def __init__(self, total: int, start: int, tokens_per_step: int, stream=sys.stderr):
        self.total, self.start, self.tps, self.stream = total, start, tokens_per_step, stream
        self.t0 = time.time()
        self.tty = stream.isatty()

    def update(self, step: int, loss: float, mtp: float, lr: float) -> str:
        done = step - self.start
        elapsed = time.time() - self.t0
        rate = done * self.tps / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) * elapsed / done if done else 0.0
        width = 24
        filled = int(width * step / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} loss {loss:.3f} mtp {mtp:.3f} "
                f"lr {lr:.2e} | {rate:,.0f} tok/s | ETA {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:"
                f"{int(eta % 60):02d}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()
        return line


def plot_loss(log_path: str, png: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed, so {png} was not drawn (pip install 'ernie_jax[train]'); "
              f"the curve is in {log_path}", file=sys.stderr)
        return
    rows = [json.loads(line) for line in open(log_path)]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["lm_loss"] for r in rows], lw=0.8, label="next token")
    ax.plot(steps, [r["mtp_loss"] for r in rows], lw=0.8, label="MTP (token t+2)")
    held = [r for r in rows if "heldout_lm_loss" in r]
    if held:
        ax.plot([r["step"] for r in held], [r["heldout_lm_loss"] for r in held], "o-", label="held-out next token")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def train(corpus: str, run: str, recipe_name: str = "embedded", steps: int | None = None, mesh: str | None = None,
          checkpoint_every: int = 200, eval_every: int = 250, stop_after: int | None = None,
          quiet: bool = False) -> dict:
    """Train (or resume) the run; returns the last step's metrics. stop_after: leave after that many steps
    of this call (an interrupted run, for tests), checkpointing first."""
    recipe = recipes.get(recipe_name)
    tc = recipe.train if steps is None else dataclasses.replace(recipe.train, steps=steps)
    os.makedirs(run, exist_ok=True)
    max_len = recipe.model["max_position_embeddings"]
    proto = prepare_tokenizer(run, corpus, recipe, max_len)
    import sentencepiece as spm
    pieces = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    cfg_dict = model_config(recipe, pieces)
    cfg = ErnieConfig.from_dict(cfg_dict)
    if cfg.vocab_size < pieces:
        raise RunError(f"recipe {recipe.name}: vocab_size {cfg.vocab_size} is smaller than the tokenizer's "
                       f"{pieces} pieces")
    with open(os.path.join(corpus, "manifest.json"), "rb") as f:
        manifest_sha = _sha(f.read())
    check_run_info(run, {"recipe": recipe.name, "corpus_manifest_sha256": manifest_sha,
                         "tokenizer_sha256": _sha(proto), "model_config": cfg_dict, "train_config": tc.to_dict()})
    cache = os.path.join(run, "cache")
    train_stream = data.load_stream(corpus, "train", proto, cache, with_chat=True)
    held_stream = data.load_stream(corpus, "heldout", proto, cache)
    if int(train_stream.max()) >= cfg.vocab_size:
        raise RunError(f"token id {int(train_stream.max())} in the train stream is outside vocab_size {cfg.vocab_size}")

    plan = None
    if mesh:
        from ernie_jax.sharding import ShardingPlan, make_mesh
        plan = ShardingPlan.create(make_mesh(mesh), fused_layout=False)  # checkpoints keep the release layout
    manager = checkpoint_manager(run, checkpoint_every)
    state = restore_latest(manager, init_state(init_params(cfg, tc.seed), tc))
    state = place(state, plan)
    start = int(state.step)
    log_path = os.path.join(run, "log.jsonl")
    if os.path.exists(log_path):  # drop lines past the checkpoint (steps an interrupted call did not save)
        rows = [line for line in open(log_path) if json.loads(line)["step"] <= start]
        with open(log_path, "w") as f:
            f.writelines(rows)
    held_batches = [data.batch_at(held_stream, i, tc.seed + 1, tc.batch_size, tc.seq_len + 2)
                    for i in range(HELDOUT_EVAL_BATCHES)]
    progress = Progress(tc.steps, start, tc.batch_size * tc.seq_len)
    last: dict = {"step": start}
    step, t_last = start, time.time()
    with open(log_path, "a") as log:
        while step < tc.steps and (stop_after is None or step - start < stop_after):
            tokens = data.batch_at(train_stream, step, tc.seed, tc.batch_size, tc.seq_len + 2)
            state, m = train_step(state, batch_on(tokens, plan), cfg=cfg, tc=tc, plan=plan)
            step += 1
            loads = [np.asarray(x) for x in m.expert_load]
            now = time.time()
            last = {"step": step, "seconds": round(now - t_last, 3), "loss": float(m.loss),
                    "lm_loss": float(m.lm_loss), "mtp_loss": float(m.mtp_loss),
                    "grad_norm": float(m.grad_norm), "lr": float(m.learning_rate),
                    "max_over_mean_load": max(float(x.max() / x.mean()) for x in loads) if loads else 1.0}
            if step % eval_every == 0 or step == tc.steps:
                held = [eval_losses(state.params, batch_on(b, plan), cfg=cfg, tc=tc, plan=plan) for b in held_batches]
                last["heldout_lm_loss"] = float(np.mean([h[0] for h in held]))
                last["heldout_mtp_loss"] = float(np.mean([h[1] for h in held]))
            log.write(json.dumps(last) + "\n")
            log.flush()
            manager.save(step, args=_save_args(state), force=step == tc.steps)
            if not quiet:
                progress.update(step, last["lm_loss"], last["mtp_loss"], last["lr"])
            t_last = time.time()
    if stop_after is not None and step < tc.steps:
        manager.save(step, args=_save_args(state), force=True)
    manager.wait_until_finished()
    manager.close()
    if not quiet:
        print(file=sys.stderr)
    plot_loss(log_path, os.path.join(run, "loss.png"))
    return last


def _save_args(state: TrainState):
    import orbax.checkpoint as ocp
    return ocp.args.StandardSave(state)


def load_trained(run: str) -> tuple[ErnieConfig, dict, dict]:
    """(config, f32 params, run info) of a run's latest checkpoint; raises RunError when there is none."""
    path = os.path.join(run, "run.json")
    if not os.path.exists(path):
        raise RunError(f"{run}: no run.json; not a training run folder")
    with open(path) as f:
        info = json.load(f)
    cfg = ErnieConfig.from_dict(info["model_config"])
    tc = TrainConfig(**info["train_config"])
    manager = checkpoint_manager(run, 1)
    if manager.latest_step() is None:
        raise RunError(f"{run}: no checkpoint in checkpoints/")
    state = restore_latest(manager, init_state(init_params(cfg, tc.seed), tc))
    manager.close()
    return cfg, state.params, {**info, "step": int(state.step)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="corpus folder (python -m ernie_jax.train.corpus --out DIR)")
    ap.add_argument("--out", required=True, help="run folder (created; an existing one is resumed)")
    ap.add_argument("--recipe", default="embedded", choices=sorted(recipes.RECIPES))
    ap.add_argument("--steps", type=int, default=None, help="total steps (default: the recipe's)")
    ap.add_argument("--mesh", default=None, help='train on a device mesh, e.g. "data=2,expert=4,tensor=1"')
    ap.add_argument("--checkpoint-every", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=250)
    args = ap.parse_args(argv)
    from ernie_jax.train.corpus import CorpusError
    try:
        last = train(args.corpus, args.out, args.recipe, args.steps, args.mesh, args.checkpoint_every,
                     args.eval_every)
    except (RunError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(last))
    return 0
