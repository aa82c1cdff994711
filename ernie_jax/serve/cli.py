"""`python -m ernie_jax.serve [--model DIR] --mesh 8 ...`: load, compile, serve, drain on SIGTERM.

Flag names follow vLLM and FastDeploy where they overlap. With no `--model` the package's embedded model
(ernie_jax/assets) is served. `--mesh N` on a machine whose accelerators are fewer than N (a CPU-only
machine) sets up N host devices before JAX starts, so the same command runs anywhere. On SIGTERM or
Ctrl-C the server stops accepting connections, lets the requests in flight finish (up to
`--shutdown-timeout` seconds), then stops the engine and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from ernie_jax.config import QUANTIZATION_SCHEMES as SCHEMES
from ernie_jax.structured.reasoning import PARSERS as REASONING_PARSERS

log = logging.getLogger("ernie_jax.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.serve", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--model", default=None, help="checkpoint folder (Paddle, FP8-Paddle, HF or ernie_jax layout); "
                                    "default: the embedded ernie-4.5-tiny-fp8")
    a("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    a("--host", default="127.0.0.1")
    a("--guided-decoding-backend", default="auto", choices=["auto", "guidance", "off"],
      help="structured output and forced tool calls (FastDeploy's flag; vLLM's backend name): auto and guidance "
           "use llguidance; off refuses response_format, guided_* and structured_outputs with a 400")
    a("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
      help="split a thinking model's <think>...</think> into reasoning_content (vLLM's flag and name; "
           "FastDeploy's is ernie-x1). Tool calls in ERNIE-4.5's <tool_call> format are parsed whenever a "
           "request has tools (vLLM's --tool-call-parser ernie45)")
    a("--port", type=int, default=8180)
    a("--mesh", default=None, help="device count or axis sizes ('data=1,expert=4,tensor=2'); default: one device")
    a("--prefill-devices", type=int, default=None, help="devices of the prefill submesh (default: half; with "
                                                      "--num-processes, the instance is disaggregated only if given)")
    a("--no-disaggregate", dest="disaggregate", action="store_false",
      help="run prefill and decode on the whole mesh (colocated) instead of on disjoint submeshes")
    a("--pd-policy", default="dynamic", choices=["static", "dynamic"],
      help="disaggregated: static keeps the prefill and decode roles fixed; dynamic lets an idle side take "
           "the other's work (the prefill submesh decodes when no prompt waits, the decode submesh prefills "
           "when prompts wait and its batch has room)")
    a("--pd-ttft-target", type=float, default=None, metavar="SECONDS",
      help="dynamic: once the oldest waiting prompt has waited half this, the decode submesh prefills "
           "prompts into any free batch slot")
    a("--pd-tpot-target", type=float, default=None, metavar="SECONDS",
      help="dynamic: the prefill submesh decodes in place only while both submeshes' decode steps take "
           "at most this, and the decode submesh prefills prompts only while its decode steps take at most half "
           "of it")
    a("--pd-role", default="mixed", choices=["mixed", "prefill", "decode"],
      help="prefill/decode on different servers behind `python -m ernie_jax.router` (FastDeploy's "
           "--splitwise-role, SGLang's --disaggregation-mode): prefill keeps each prompt's KV for a decode "
           "server to pull, decode pulls it and decodes; mixed serves whole requests. Not with --prefill-devices "
           "(a role server runs one instance on its whole mesh)")
    a("--kv-transfer-address", default=None, metavar="HOST[:PORT]",
      help="--pd-role prefill/decode: where this server's KV transfer server listens (default 127.0.0.1; port 0 "
           "or none: a free one); peers learn it through kv_transfer_params. --num-processes with "
           "--prefill-devices: this process's address for the hand-over's cross-host transfers (default: the "
           "address it reaches the coordinator from, a free port)")
    a("--kv-expiry-seconds", type=float, default=120.0,
      help="--pd-role prefill: a prompt's KV not pulled within this is dropped (and counted)")
    a("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
      help="--pd-role decode: when a request's KV cannot be pulled (after one retry), recompute its prompt here "
           "or fail the request (vLLM's name)")
    a("--router", default=None, metavar="URL",
      help="register with this router (python -m ernie_jax.router) once serving, and again at each of its "
           "heartbeats (5 s by default); required with --pd-role prefill|decode (FastDeploy's --router)")
    a("--advertise-url", default=None, metavar="URL",
      help="the URL the router and peers reach this server at (default: http://HOST:PORT)")
    a("--num-processes", type=int, default=None,
      help="processes one instance spans (jax.distributed; default $JAX_NUM_PROCESSES or 1): --mesh counts the "
           "devices of all of them, each brings its share; the instance serves colocated on the whole mesh, or "
           "disaggregated with --prefill-devices (e.g. one process's devices each), or as a --pd-role server; "
           "process 0 serves the API, the others only /health (docs/multihost.md)")
    a("--process-id", type=int, default=None, help="this process's index, 0 .. --num-processes - 1 (default "
                                                   "$JAX_PROCESS_ID or 0)")
    a("--coordinator-address", default=None, metavar="HOST:PORT",
      help="process 0's host and a free port for jax.distributed's coordinator (default $JAX_COORDINATOR_ADDRESS)")
    a("--distributed-timeout", type=float, default=60.0, metavar="SECONDS",
      help="--num-processes > 1: the longest wait for the other processes (joining, their settings, their "
           "channels), and the silence after which one counts as lost (the leader then exits 1)")
    a("--speculative-config", default=None, metavar="JSON",
      help='MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\' ("ernie_mtp" too; '
           'k from 1 to 4; k > 1 chains the one MTP layer)')
    a("--eplb-config", default=None, metavar="JSON",
      help='redundant experts re-placed from measured load, vLLM\'s keys: \'{"num_redundant_experts": 8, '
           '"window_size": 1000, "step_interval": 3000, "log_balancedness": true}\' (needs --mesh); '
           'POST /v1/admin/rebalance_experts re-places at once')
    a("--sharding", default="tp_ep", choices=["tp_ep", "tp", "dp_attn_ep"])
    a("--max-model-len", type=int, default=None, help="prompt + output tokens (default: min(model's, 2048))")
    a("--background-compile", action=argparse.BooleanOptionalAction, default=True,
      help="serve once the largest batch and prompt buckets are compiled; compile the others while serving")
    a("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    a("--max-num-batched-tokens", type=int, default=512, help="prompt tokens per prefill step: a long prompt's "
      "chunk length, and the budget several short prompts batch up to")
    a("--num-scheduler-steps", type=int, default=1, help="decode steps one program runs while no other request "
      "waits (multi-step decode: the host's work per step spread over that many tokens; 1: off; with MTP: 1)")
    a("--batch-invariant", action="store_true", help="decode at one batch shape, so a request's output never "
      "depends on what else runs (costs throughput at low load; fewer programs to compile)")
    a("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a("--quantization", default=None, choices=list(SCHEMES),
      help="quantize a BF16 checkpoint at load (FastDeploy's names): fp8 = block-wise FP8 (block_wise_fp8), "
           "wint8 / wint4 = weight-only int8 / int4, w4a8 = int4 routed experts with int8 activations (wint8 "
           "elsewhere). A checkpoint that is already quantized is served as stored")
    a("--quant-group-size", type=int, default=-1,
      help="wint4's scales: -1 per output channel (FastDeploy's), or one per group of this many input rows")
    a("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8"])
    a("--kernels", default="auto", choices=["auto", "pallas", "xla"],
      help="auto: the Pallas kernels where the device supports them and they pass a start-up self-check "
           "against their XLA references; pallas: force them (interpreted off GPUs); xla: none")
    a("--block-size", type=int, default=16, help="tokens per KV page")
    a("--num-gpu-blocks-override", type=int, default=None, help="KV pages per pool (each submesh's under PD)")
    a("--gpu-memory-utilization", type=float, default=None, help="size each KV pool to fill this fraction of "
      "device memory beside the weights (default 0.9 where devices report their memory; on CPU the pool "
      "holds max_num_seqs x max_model_len tokens unless --num-gpu-blocks-override)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
      help="reuse the KV of cached prompt prefixes (full pages, hash chained); on by default")
    a("--max-queue-len", type=int, default=256, help="waiting requests beyond which new ones get HTTP 429")
    a("--max-n", type=int, default=16, help="the largest n (samples per prompt) a request may ask for")
    a("--max-request-bytes", type=int, default=8 * 2**20, help="larger request bodies get HTTP 413")
    a("--api-key", default=os.environ.get("ERNIE_JAX_API_KEY"),
      help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ERNIE_JAX_API_KEY; none: open)")
    a("--seed", type=int, default=0)
    a("--compilation-cache-dir", default="~/.cache/ernie_jax/xla", help="JAX persistent compilation cache ('' = off)")
    a("--shutdown-timeout", type=float, default=300.0, help="seconds to let requests finish after SIGTERM")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    launched = time.perf_counter()
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ernie_jax.serve import distributed
    from ernie_jax.sharding.mesh import MeshError, request_host_devices
    processes, process_id, coordinator = distributed.distributed_args(args)
    if args.pd_role != "mixed" and not args.router:
        raise SystemExit(f"--pd-role {args.pd_role} needs --router URL: a {args.pd_role} server gets its part of split "
                         "requests from the router (python -m ernie_jax.router) and registers there; a router that is "
                         "not up yet is retried. Without a router, serve whole requests with --pd-role mixed")
    try:
        n_devices = request_host_devices(args.mesh, processes)
    except MeshError as e:
        raise SystemExit(f"--mesh: {e}") from None
    if processes > 1:
        if process_id:  # a follower answers /health (503 until it replays) from the start
            health = {"status": "loading", "role": "follower", "process_id": process_id}
            distributed.health_server(args.host, args.port, health)
        transfers = distributed.transfer_address(coordinator, args.kv_transfer_address) \
            if distributed.disaggregated(args, processes) else None
        kv_client = distributed.initialize(processes, process_id, coordinator, args.distributed_timeout, transfers)

    import jax
    import uvicorn

    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    from ernie_jax.engine.async_engine import AsyncEngine
    from ernie_jax.engine.config import EngineConfig
    from ernie_jax.engine.expert_balance import EPLBConfig
    from ernie_jax.engine.kv_connector import KVTransferError
    from ernie_jax.engine.policy import PDPolicy
    from ernie_jax.engine.speculative import SpeculativeConfig
    from ernie_jax.llm import LLM
    from ernie_jax.serve.api import Server, create_app
    from ernie_jax.serve.metrics import ServerMetrics

    model_dir = args.model or EMBEDDED_MODEL_DIR
    if not os.path.isdir(model_dir):
        raise SystemExit(f"--model {model_dir!r} is not a folder")
    name = args.served_model_name or os.path.basename(os.path.normpath(model_dir))
    if args.pd_role != "mixed" and args.prefill_devices is not None:
        raise SystemExit(f"--pd-role {args.pd_role} runs one instance on the whole mesh; --prefill-devices is for "
                         "prefill/decode inside one server (--pd-role mixed)")
    try:
        policy = PDPolicy(args.pd_policy, ttft_target=args.pd_ttft_target, tpot_target=args.pd_tpot_target)
    except ValueError as e:
        raise SystemExit(f"--pd-policy / --pd-ttft-target / --pd-tpot-target: {e}") from None
    try:
        speculative = SpeculativeConfig.parse(args.speculative_config)
    except ValueError as e:
        raise SystemExit(f"--speculative-config: {e}") from None
    try:
        eplb = EPLBConfig.parse(args.eplb_config)
    except ValueError as e:
        raise SystemExit(f"--eplb-config: {e}") from None
    try:
        config = EngineConfig.create(
            dtype=args.dtype, seed=args.seed, quantization=args.quantization, kernels=args.kernels,
            quant_group_size=args.quant_group_size,
            compilation_cache_dir=args.compilation_cache_dir or None, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            batch_invariant=args.batch_invariant, background_compile=args.background_compile,
            num_scheduler_steps=args.num_scheduler_steps,
            kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
            num_gpu_blocks_override=args.num_gpu_blocks_override, gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching, mesh=args.mesh if n_devices > 1 else None,
            prefill_devices=args.prefill_devices,
            disaggregate=distributed.disaggregated(args, processes),
            sharding=args.sharding,
            pd_policy=policy, speculative_config=speculative, eplb_config=eplb)
    except ValueError as e:  # the message names the setting (a JSON config's field included)
        raise SystemExit(f"error: {e}") from None
    if processes > 1:  # before anything else can fail differently on each process
        distributed.check_same_setup(kv_client, processes, process_id,
                                     distributed.setup_of(config, model_dir, processes, args.pd_role),
                                     args.distributed_timeout)
    if len(jax.devices()) < n_devices:
        raise SystemExit(f"--mesh {args.mesh} needs {n_devices} devices; this machine has {len(jax.devices())} "
                         f"({jax.default_backend()})")
    try:
        llm = LLM(model_dir, config=config)
    except ValueError as e:  # a bad checkpoint, config or setting: its message names it
        raise SystemExit(f"error: {e}") from None
    if llm.tokenizer is None:
        raise SystemExit(f"{model_dir} has no tokenizer.model; the server needs one to render chats and text")
    _log_startup(llm, model_dir, args)

    engine = llm.engine
    if processes > 1 and process_id:
        os._exit(distributed.follow(engine, kv_client, process_id, args.distributed_timeout, health))
    fatal = _Fatal()
    leader = distributed.lead(engine, kv_client, processes, coordinator, args.distributed_timeout, fatal) \
        if processes > 1 else None
    try:
        pd = _pd_server(engine, args)
    except KVTransferError as e:
        raise SystemExit(f"--kv-transfer-address: {e}") from None
    metrics = ServerMetrics(engine.stats, name)
    async_engine = AsyncEngine(engine, on_finish=metrics.on_finish)
    fatal.async_engine = async_engine
    server = Server(async_engine, llm.tokenizer, name, llm.sampling_defaults, metrics,
                    max_queue_len=args.max_queue_len, max_n=args.max_n, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, pd=pd, reasoning_parser=args.reasoning_parser,
                    structured_output=args.guided_decoding_backend != "off")
    app = create_app(server)

    class _Uvicorn(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                log.info("serving '%s' at http://%s:%d/v1 (ready %.1f s after launch)", name, args.host, args.port,
                         time.perf_counter() - launched)
                if args.router:
                    _register(args.router, args.advertise_url or f"http://{args.host}:{args.port}", pd,
                              args.api_key)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal to the handler it found; a no-op one
    # here makes a drained shutdown exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    _Uvicorn(config).run()  # returns once the connections in flight are done
    left = len(engine.requests)
    async_engine.shutdown()
    if leader is not None:
        leader.stop()
        jax.distributed.shutdown()
    log.info("shut down after draining (%d requests unfinished)", left)
    return 0


class _Fatal:
    """The instance lost a process (engine/multihost.py): fail the requests in flight with the reason, report
    unhealthy, and exit 1 once their error events had a moment to go out, so a supervisor restarts the job."""
    grace_seconds = 2.0

    def __init__(self):
        self.async_engine = None

    def __call__(self, reason: str) -> None:
        import threading
        if self.async_engine is not None:
            self.async_engine.fail_all(RuntimeError(f"the instance lost a process: {reason}"))
        log.error("exiting 1: the instance lost a process (%s)", reason)
        threading.Timer(self.grace_seconds if self.async_engine is not None else 0.0, os._exit, args=(1,)).start()


def _register(router: str, url: str, pd, api_key: str | None, every: float = 5.0) -> None:
    """Announce this server to the router now and every heartbeat (the router's answer says how often; `every`
    seconds until it has answered), from a daemon thread; a router that is away is retried, and told again
    once back. pd: the server's PDServer (its role now, after any role switch)."""
    import threading

    import httpx

    def run():
        registered, interval = None, every
        while True:
            try:
                r = httpx.post(router.rstrip("/") + "/register", json={"url": url, "role": pd.role}, timeout=interval,
                               headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
                ok, why = r.status_code == 200, f"{r.status_code} {r.text[:300]}"
                if ok:
                    interval = float(r.json().get("heartbeat", interval))
            except httpx.HTTPError as e:
                ok, why = False, repr(e)
            if ok != registered:
                (log.info if ok else log.warning)("router %s: %s", router,
                                                  f"registered as {pd.role} at {url}" if ok else f"not registered: {why}")
                registered = ok
            time.sleep(interval)
    threading.Thread(target=run, daemon=True, name="ernie-register").start()


def _pd_server(engine, args):
    """This server's part in prefill/decode across servers: a KV exporter (prefill) or importer (decode) on
    its one instance's runner, each built when its role first needs it (at start, or at a role switch)."""
    from ernie_jax.engine.kv_connector import KVExporter, KVImporter
    from ernie_jax.serve.pd import PDServer
    inst = engine.instances[-1]

    def exporter():
        inst.runner.exporter = KVExporter(inst.programs, args.kv_transfer_address or "127.0.0.1",
                                            args.kv_expiry_seconds)
        log.info("prompts' KV kept for decode servers, transfer server at %s", inst.runner.exporter.address)
        return inst.runner.exporter

    def importer():
        inst.runner.importer = KVImporter(inst.programs, args.kv_transfer_address or "127.0.0.1")
        log.info("KV pulled from prefill servers (on failure: %s)", args.kv_load_failure_policy)
        return inst.runner.importer

    pd = PDServer(args.pd_role, kv_load_failure_policy=args.kv_load_failure_policy, api_key=args.api_key,
                  make_exporter=exporter, make_importer=importer)
    if args.pd_role == "prefill":
        pd.exporter = exporter()
    elif args.pd_role == "decode":
        pd.importer = importer()
    log.info("pd role %s", args.pd_role)
    return pd


def _log_startup(llm, model_dir: str, args) -> None:
    from ernie_jax.engine.report import startup_lines
    cfg = llm.model.config
    q = " + ".join(_weight_formats(llm.model)) or args.dtype
    log.info("loaded %s: %d layers (%d MoE, %d experts top-%d), hidden %d, vocab %d, weights %s, KV cache %s",
             model_dir, cfg.num_hidden_layers, cfg.num_moe_layers, cfg.moe_num_experts, cfg.moe_k, cfg.hidden_size,
             cfg.vocab_size, q, args.kv_cache_dtype)
    for line in startup_lines(llm.engine):
        log.info("%s", line)
    log.info("start-up: %s", ", ".join(f"{phase} {sec:.1f} s" for phase, sec in llm.startup_phases.items()))


def _weight_formats(model) -> list[str]:
    """The quantized formats the model's linears are in ("block-FP8", "wint4", ...), or none."""
    import jax

    from ernie_jax.quant import BlockFP8, is_quantized
    leaves = [x for x in jax.tree.leaves(model.weights(), is_leaf=is_quantized) if is_quantized(x)]
    return sorted({"block-FP8" if isinstance(x, BlockFP8) else x.scheme for x in leaves})


if __name__ == "__main__":
    sys.exit(main())
