"""The offline API, shaped like vLLM's and FastDeploy's: `LLM(model=...).generate(...)`.

`LLM` loads a checkpoint folder (by default the trained `ernie-4.5-tiny-fp8` shipped in the package) or builds
a preset with random weights, places it on a mesh if asked (`mesh=8`: prefill on the first `prefill_devices`,
decode on the rest, unless `disaggregate=False`), and runs every `generate` call through the continuous-batching
engine (engine/engine.py). Requests are independent: a prompt gets the same greedy tokens alone or in any
batch.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ernie_jax.assets import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from ernie_jax.config import PRESETS, ErnieConfig
from ernie_jax.engine.config import EngineConfig
from ernie_jax.engine.engine import Engine
from ernie_jax.engine.request import RequestError
from ernie_jax.engine.output_processor import check_requests, samples
from ernie_jax.engine.outputs import CompletionOutput, RequestOutput, completion, request_output
from ernie_jax.model import ErnieForCausalLM
from ernie_jax.sampling import SamplingParams
from ernie_jax.tokenizer import Tokenizer

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "RequestError"]


_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}  # config.DTYPES
_GEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty")


class LLM:
    """model: a checkpoint folder, a preset name ("tiny", "ernie-4.5-21b-a3b", ...; random weights) or an
    ErnieForCausalLM; default: the trained model shipped in the package.

    settings: the engine's, with vLLM's names (engine/config.py EngineConfig.create), or `config=` an
    EngineConfig. The common ones: dtype ("bfloat16" or "float32"); quantization / fp8_compute (as in
    load_pretrained); kv_cache_dtype ("auto", "bfloat16", "fp8"); mesh (None: one device, or a device count
    / mesh spec) with disaggregate (default: prefill on the first `prefill_devices`, default half, decode on
    the others, each with its own weight copy) and pd_policy ("dynamic" role switching, "static", or a
    PDPolicy); max_num_seqs; max_model_len (prompt + output; default min(the model's, 2048));
    max_num_batched_tokens (prompt tokens per prefill step: a long prompt's chunk, short ones' batch);
    block_size, num_gpu_blocks_override, gpu_memory_utilization, enable_prefix_caching;
    compilation_cache_dir (JAX's persistent cache; None: off; one already configured wins);
    batch_invariant; background_compile; kernels ("auto", "pallas", "xla": ops/execution.py);
    num_scheduler_steps (decode steps one program runs while nothing else waits: multi-step decode);
    speculative_config ({"method": "mtp", "num_speculative_tokens": k}, engine/speculative.py);
    eplb_config ({"num_redundant_experts": R, "window_size": W, "step_interval": S}, needs a mesh that splits
    the experts; engine/expert_balance.py).
    """

    def __init__(self, model: str | ErnieForCausalLM | None = None, *, config: EngineConfig | None = None,
                 **settings):
        if config is None:
            config = EngineConfig.create(**settings)
        elif settings:
            raise ValueError(f"give either config or settings, not both ({sorted(settings)})")
        load = config.load
        jdtype = _DTYPES[load.dtype]
        t0 = time.perf_counter()
        if load.compilation_cache_dir and not jax.config.jax_compilation_cache_dir:
            # Every bucket is compiled at start-up; a warm restart reads them back from this folder.
            jax.config.update("jax_compilation_cache_dir", os.path.expanduser(load.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        self.tokenizer: Tokenizer | None = None
        self.generation_config: dict = {}
        if model is None or model == EMBEDDED_MODEL_NAME:  # the trained model shipped in the package, as `serve` uses
            model = EMBEDDED_MODEL_DIR
        if isinstance(model, ErnieForCausalLM):
            cfg, weights, given = model.config, None, model
        elif isinstance(model, str) and os.path.isdir(model):
            from ernie_jax.checkpoint import read_pretrained
            # Host memory first: under a mesh each tensor then goes straight onto its shards, per submesh.
            cfg, weights = read_pretrained(model, jdtype, quantization=load.quantization, fp8_compute=load.fp8_compute,
                                           quant_group_size=load.quant_group_size)
            given = None
            self.tokenizer = Tokenizer.from_pretrained(model)
            gen_file = os.path.join(model, "generation_config.json")
            if os.path.isfile(gen_file):
                with open(gen_file) as f:
                    self.generation_config = json.load(f)
        elif isinstance(model, str) and model.lower() in PRESETS:
            given = ErnieForCausalLM(ErnieConfig.preset(model), rngs=nnx.Rngs(load.seed), dtype=jdtype)
            cfg, weights = given.config, None
        else:
            raise ValueError(f"model {model!r} is neither a checkpoint folder, {EMBEDDED_MODEL_NAME!r} (the default) "
                             f"nor a preset ({sorted(PRESETS)})")
        max_model_len = config.scheduler.max_model_len
        if max_model_len is not None and not 1 <= max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len}: must be from 1 to the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 2048)
        self.config = config = config.with_max_model_len(self.max_model_len)
        eos = set(cfg.eos_token_id)
        gen_eos = self.generation_config.get("eos_token_id", [])
        eos.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        speculative = config.speculative
        if speculative is not None and speculative.model is not None:
            own = [os.path.normpath(os.path.join(model, sub)) for sub in ("", "mtp")] if isinstance(model, str) else []
            if os.path.normpath(speculative.model) not in own:
                raise ValueError(f"speculative_config.model={speculative.model!r}: the MTP weights are read "
                                 "from the served checkpoint (its ernie.mtp_block.0.* tensors or its mtp/ folder); "
                                 "give its path, its mtp/ folder, or leave the field out")
        t_read = time.perf_counter()
        decode_model, prefill_model, balancer = self._place(cfg, given, weights, jdtype, config.parallel,
                                                            load.kernels, config.eplb)
        self.model = decode_model  # the decode-side model (on the decode submesh under PD)
        t_place = time.perf_counter()
        self.engine = Engine(decode_model, config, prefill_model=prefill_model, tokenizer=self.tokenizer,
                             eos_token_ids=frozenset(eos), expert_balancer=balancer)
        # Seconds per start-up phase: reading the checkpoint into host memory, placing the weights on the
        # devices, and the engine's KV pools and start-up programs.
        self.startup_phases = {"read": t_read - t0, "place": t_place - t_read,
                               "engine": time.perf_counter() - t_place}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @staticmethod
    def _place(cfg, given, weights, dtype, parallel, kernels, eplb=None):
        """(decode model, prefill model or None, ExpertBalancer or None) from a built model (`given`, whose
        execution config is kept unless `kernels` asks for a choice) or host weights, on the devices
        `parallel` (a ParallelConfig) names; with `eplb` (an EPLBConfig) the routed experts go into its first
        placement's slots."""
        mesh, prefill_devices, disaggregate, sharding = (parallel.mesh, parallel.prefill_devices,
                                                         parallel.disaggregate, parallel.sharding)
        execution = None
        if given is not None:
            weights, dtype = given.checkpoint_weights(), given.dtype
            execution = given.execution if kernels == "auto" else None
        if eplb is not None and (mesh is None or cfg.num_moe_layers == 0):
            raise ValueError("eplb_config: EPLB needs expert parallelism (a mesh that splits the experts, e.g. "
                             "mesh=8) and a MoE model")
        if mesh is None:
            if given is not None and execution is not None:
                return given, None, None
            return ErnieForCausalLM.from_host(cfg, weights, dtype, None, execution, kernels), None, None
        from ernie_jax.engine.expert_balance import ExpertBalancer
        from ernie_jax.sharding import ShardingPlan, make_mesh

        full = make_mesh(mesh)
        devices = list(full.devices.flat)
        meshes = [full]
        if disaggregate:
            n_prefill = prefill_devices or len(devices) // 2
            if not 1 <= n_prefill < len(devices):
                raise ValueError(f"prefill_devices={n_prefill} must leave at least one of the {len(devices)} "
                                 "devices for decode")
            meshes = [make_mesh(len(devices) - n_prefill, devices[n_prefill:]), make_mesh(n_prefill, devices[:n_prefill])]
        plans = [ShardingPlan.create(m, sharding) for m in meshes]
        balancer = None
        if eplb is not None:
            ep = {p.size_of(p.axes_of("experts")) for p in plans}
            if len(ep) > 1 or min(ep) < 2:
                raise ValueError(f"eplb_config: EPLB needs expert parallelism of one size on every submesh; the "
                                 f"experts are split {sorted(ep)} ways")
            from ernie_jax.sharding.eplb import node_count
            balancer = ExpertBalancer(eplb, cfg.num_moe_layers, cfg.moe_num_experts, ep.pop(),
                                      num_nodes=node_count(plans[0].expert_devices()))
        placement = balancer.placement if balancer else None
        models = [ErnieForCausalLM.from_host(cfg, weights, dtype, p, execution, kernels, expert_placement=placement)
                  for p in plans]
        return models[0], (models[1] if len(models) > 1 else None), balancer

    @property
    def sampling_defaults(self) -> dict:
        """The sampling values generation_config.json sets (ERNIE: temperature 0.8, top_p 0.8)."""
        return {k: self.generation_config[k] for k in _GEN_KEYS if k in self.generation_config}

    def get_default_sampling_params(self) -> SamplingParams:
        """generation_config.json's sampling values, else vLLM's."""
        return SamplingParams(**self.sampling_defaults)

    def _prompts(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompts is not None and prompt_token_ids is not None:
            raise RequestError("pass either prompts or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            return [(None, [int(t) for t in ids]) for ids in prompt_token_ids]
        if prompts is None:
            raise RequestError("generate() needs prompts or prompt_token_ids")
        out = []
        for p in [prompts] if isinstance(prompts, (str, dict)) else prompts:
            if isinstance(p, dict):
                out.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
            elif isinstance(p, str):
                if self.tokenizer is None:
                    raise RequestError("text prompts need a tokenizer (tokenizer.model in the model folder); "
                                       "pass prompt_token_ids instead")
                out.append((p, self.tokenizer.encode(p)))
            else:
                raise RequestError(f"prompt of type {type(p).__name__}: expected str or {{'prompt_token_ids': [...]}}")
        return out

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, rendered with ERNIE's
        chat template (tokenizer.Tokenizer.apply_chat_template)."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer (tokenizer.model in the model folder)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": self.tokenizer.apply_chat_template(c, add_generation_prompt),
                    "prompt_token_ids": self.tokenizer.encode_chat(c, add_generation_prompt)} for c in conversations]
        return self.generate(prompts, sampling_params)

    def generate(self, prompts: str | Sequence | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        reqs = self._prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(reqs)
        if len(params) != len(reqs):
            raise RequestError(f"{len(params)} sampling_params for {len(reqs)} prompts")
        check_requests(self.engine.validate, [ids for _, ids in reqs], params)
        groups = [[self.engine.requests[self.engine.add_request(ids, s)] for s in samples(sp)]
                  for (_, ids), sp in zip(reqs, params)]
        while any(not r.finished for g in groups for r in g):
            self.engine.step()
        outputs = []
        for (text, ids), group in zip(reqs, groups):
            outputs.append(request_output(group[0], text, [completion(r, j) for j, r in enumerate(group)], True))
        return outputs

