"""`python -m ernie_jax.bench offline`: the offline engine on a batch of random prompts, optionally against HF.

    python -m ernie_jax.bench offline --model bench-512 --num-prompts 16 --input-len 128 --output-len 128 \\
        [--compare-hf] [--compare-llamacpp LLAMA_CPP_DIR [--gguf FILE]] [--mesh 8 --prefill-devices 4] \\
        [--dtype float32]

All prompts are submitted at once (random token ids, `ignore_eos`, greedy), so the engine batches them;
reported: output tokens/s (median of --repeats runs), TTFT and TPOT percentiles (per request, as vLLM
defines them, over all runs), and the compile report. `--compare-hf` builds the same random weights in HF
transformers (saved and loaded through the HF layout, so both stacks run identical numbers), times
`generate` on the same batch, alternating with the engine's runs, and prints the ratio. `--compare-llamacpp`
does the same with llama.cpp's batched bench on a GGUF of the same weights (llamacpp.py says how).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np


def _percentiles(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return " ".join(f"p{q}={np.percentile(xs, q) * 1e3:.1f}ms" for q in (50, 90, 99))


def hf_model(cfg, folder: str, dtype: str):
    """A random HF Ernie4_5_MoeForCausalLM of this config in `dtype`, saved to `folder` (so both stacks
    run the same weights in the same dtype)."""
    import torch
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
    torch.manual_seed(0)
    hf_cfg = Ernie4_5_MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        moe_intermediate_size=cfg.moe_intermediate_size, moe_k=cfg.moe_k, moe_num_experts=cfg.moe_num_experts,
        moe_num_shared_experts=cfg.moe_num_shared_experts, moe_layer_start_index=cfg.moe_layer_start_index,
        moe_layer_end_index=cfg.moe_layer_end_index, moe_layer_interval=cfg.moe_layer_interval,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps)
    model = Ernie4_5_MoeForCausalLM(hf_cfg).eval().to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return model


def offline(args) -> int:
    from ernie_jax.sharding.mesh import request_host_devices
    request_host_devices(args.mesh)
    from ernie_jax import LLM, SamplingParams
    from ernie_jax.config import PRESETS, ErnieConfig

    hf = None
    model = args.model
    tmp = tempfile.TemporaryDirectory()
    if args.compare_hf:
        cfg = ErnieConfig.preset(model) if model.lower() in PRESETS else ErnieConfig.from_pretrained(model)
        hf = hf_model(cfg, tmp.name, args.dtype)
        model = tmp.name
    llama = None
    if args.compare_llamacpp is not None:
        from ernie_jax.bench import llamacpp
        llama = llamacpp.find_binary(args.compare_llamacpp)
        if hf is not None:  # --compare-hf saved the weights: the GGUF converter also needs a tokenizer there
            model = llamacpp.with_tokenizer(model)
        else:
            model = llamacpp.hf_folder(model, args.dtype, tmp.name)
        gguf = args.gguf or llamacpp.make_gguf(args.compare_llamacpp, model, os.path.join(tmp.name, "model.gguf"),
                                               args.dtype)
    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.max_num_seqs or args.num_prompts, mesh=args.mesh, prefill_devices=args.prefill_devices,
              disaggregate=not args.no_disaggregate, kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=args.speculative_config,
              num_scheduler_steps=args.num_scheduler_steps)
    startup = time.perf_counter() - t0
    cfg = llm.model.config
    rng = np.random.default_rng(0)
    # Every run has prompts of its own, so no run is served by the prefix cache the one before filled (llama.cpp's
    # batched bench processes its prompts every run).
    fresh = lambda: rng.integers(3, cfg.vocab_size, (args.num_prompts, args.input_len)).tolist()  # noqa: E731
    prompts = fresh()
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up on the timed batch's shapes (for both stacks): a program's first run pays one-off costs (with
    # multi-step decode, enough tokens that its program runs too).
    warm = SamplingParams(temperature=0, max_tokens=max(2, args.num_scheduler_steps + 1), ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=warm)
    if hf is not None:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        ids = torch.tensor(prompts)
        kw = {"do_sample": False, "max_new_tokens": args.output_len, "min_new_tokens": args.output_len,
              "eos_token_id": None, "pad_token_id": 0}
        with torch.no_grad():
            hf.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
    # The stacks alternate, so a slow spell of a shared machine hits both; the ratio is the median of the
    # ratios of adjacent runs.
    walls, hf_walls, llama_runs, ttft, tpot = [], [], [], [], []
    for _ in range(args.repeats):
        prompts = fresh()
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        walls.append(time.perf_counter() - t0)
        ttft += [o.metrics["ttft"] for o in outs]
        tpot += [o.metrics["tpot"] for o in outs]
        if hf is not None:
            ids = torch.tensor(prompts)
            with torch.no_grad():
                t0 = time.perf_counter()
                hf_out = hf.generate(ids, **kw)
                hf_walls.append(time.perf_counter() - t0)
        if llama is not None:
            llama_runs.append(llamacpp.batched_bench(llama, gguf, args.num_prompts, args.input_len, args.output_len,
                                                     args.threads))
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    wall = float(np.median(walls))
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.moe_num_experts} "
          f"experts top-{cfg.moe_k}, vocab {cfg.vocab_size}; {args.dtype}; engine start-up {startup:.1f}s")
    print("compile report: " + ", ".join(f"{name} {b}: {s:.2f}s" for name, b, s in llm.engine.compile_report.programs))
    print(f"{args.repeats} runs per stack; wall s and tok/s are medians")
    print("| stack | requests | output tokens | wall s | output tok/s | TTFT | TPOT |")
    print("|---|---|---|---|---|---|---|")
    print(f"| ernie_jax | {len(outs)} | {n_out} | {wall:.2f} | {n_out / wall:.1f} | {_percentiles(ttft)} | "
          f"{_percentiles(tpot)} |")
    if llm.engine.speculative:
        r = llm.engine.spec_stats.report()
        print(f"speculative decoding ({llm.engine.speculative.method}, k = {r['num_speculative_tokens']}): acceptance "
              f"rate {r['acceptance_rate']:.3f}, per position {r['accepted_per_position']} of {r['num_drafts']} "
              f"drafts, {r['mean_accepted_length']:.3f} tokens per step (warm-up included)")
    if hf is not None:
        hf_n = (hf_out.shape[1] - args.input_len) * hf_out.shape[0]
        hf_wall = float(np.median(hf_walls))
        print(f"| HF transformers generate | {len(prompts)} | {hf_n} | {hf_wall:.2f} | {hf_n / hf_wall:.1f} | - | - |")
        ratios = [(n_out / w) / (hf_n / h) for w, h in zip(walls, hf_walls)]
        print(f"throughput ratio ernie_jax / HF = {np.median(ratios):.2f}x (median; runs: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
        same = sum(o.outputs[0].token_ids == hf_out[i, args.input_len:].tolist() for i, o in enumerate(outs))
        print(f"greedy outputs identical to HF for {same}/{len(outs)} requests")
    if llama is not None:
        tok_s = [r["output_tok_s"] for r in llama_runs]
        print(f"| llama.cpp batched-bench ({args.threads} threads) | {args.num_prompts} | "
              f"{args.num_prompts * args.output_len} | {np.median([r['t'] for r in llama_runs]):.2f} | "
              f"{np.median(tok_s):.1f} | prompt {np.median([r['t_pp'] for r in llama_runs]) * 1e3:.1f}ms | "
              f"{np.median([r['t_tg'] for r in llama_runs]) / args.output_len * 1e3:.1f}ms a step |")
        ratios = [(n_out / w) / t for w, t in zip(walls, tok_s)]
        print(f"output tok/s ratio ernie_jax / llama.cpp = {np.median(ratios):.2f}x (median; runs: "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")
    tmp.cleanup()
    return 0


def add_parsers(sub) -> None:
    off = sub.add_parser("offline", help="the offline engine on a batch of random prompts")
    off.add_argument("--model", default="bench-512", help="preset or checkpoint folder")
    off.add_argument("--num-prompts", type=int, default=16)
    off.add_argument("--input-len", type=int, default=128)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts")
    off.add_argument("--num-scheduler-steps", type=int, default=1,
                     help="decode steps one program runs while nothing else waits (multi-step decode)")
    off.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="prompt tokens per prefill step (several prompts' chunks batch up to it)")
    off.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                     help="weights and activations of both stacks (--compare-hf runs HF in the same dtype)")
    off.add_argument("--kv-cache-dtype", default="auto")
    off.add_argument("--mesh", default=None)
    off.add_argument("--prefill-devices", type=int, default=None)
    off.add_argument("--no-disaggregate", action="store_true")
    off.add_argument("--speculative-config", default=None, metavar="JSON",
                     help='MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\' '
                          '(random prompts: `bench mtp` measures it on text)')
    off.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate (needs torch)")
    off.add_argument("--compare-llamacpp", default=None, metavar="LLAMA_CPP_DIR",
                     help="also run llama.cpp's llama-batched-bench on a GGUF of the same weights (llamacpp.py)")
    off.add_argument("--gguf", default=None, help="with --compare-llamacpp: this GGUF instead of converting")
    off.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    off.add_argument("--repeats", type=int, default=3, help="timed runs per stack (alternating between stacks)")
    off.set_defaults(run=offline)
