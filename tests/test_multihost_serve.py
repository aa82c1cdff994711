"""One server instance over two processes (jax.distributed, 2 processes x 4 CPU devices on loopback): the
leader serves, the follower replays its device calls (engine/multihost.py, serve/distributed.py)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import sentencepiece as spm

from tests.conftest import GOLDEN, TEST_XLA_FLAGS

from tests.serving import AUTH, ROOT, free_port, launch, server_state, wait_healthy

# One prefill bucket and one decode batch (few programs to compile); heads split within a process, experts
# across the two (the layout of one instance over two 8-GPU hosts: only the MoE's all-reduce crosses them).
SETTINGS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, batch_invariant=True)
MESH = "data=1,expert=2,tensor=4"
ENGINE = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
ENGINE += ["--no-background-compile"]
PROMPTS = ["Tell me about the sea.", "The king said"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """A golden checkpoint (4 layers, 8 experts) with a SentencePiece tokenizer trained here on random words, one
    piece per id of the model's 256: programs that compile in a fraction of the embedded model's time, and
    texts that tell its tokens apart."""
    d = tmp_path_factory.mktemp("multihost") / "model"
    shutil.copytree(GOLDEN / "shared_untied" / "paddle", d)
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 7))) for _ in range(400)]
    text = [" ".join(rng.choice(words, 12)) for _ in range(600)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(d / "tokenizer"), vocab_size=256,
                                   model_type="bpe", character_coverage=1.0,
                                   user_defined_symbols=["<|end_of_sentence|>"], minloglevel=2)
    return str(d)



def _job(extra: list[str] = (), follower_extra: list[str] = (), timeout: float = 60, mesh: str = MESH,
         processes: int = 2) -> tuple[dict, ...]:
    """A leader and its followers of one instance on `mesh`, started (not waited for)."""
    common = ["--mesh", mesh, "--num-processes", str(processes), "--coordinator-address",
              f"127.0.0.1:{free_port()}", "--distributed-timeout", str(timeout), *ENGINE, *extra]
    followers = [launch("ernie_jax.serve", [*common, "--process-id", str(i), *follower_extra])
                 for i in range(1, processes)]
    leader = launch("ernie_jax.serve", [*common, "--process-id", "0"])
    return leader, *followers


@contextlib.contextmanager
def _serving(extra: list[str], mesh: str = MESH, processes: int = 2):
    """A leader and its followers (_job), all healthy; killed on the way out if they still run."""
    job = _job(extra, mesh=mesh, processes=processes)
    try:
        deadline = time.time() + 900
        for s in job:
            wait_healthy(s, deadline)
        yield job
    finally:
        _kill(*job)


def _kill(*servers) -> None:
    for s in servers:
        if s["proc"].poll() is None:
            s["proc"].kill()
            s["proc"].wait()


def _complete(url: str, prompt: str | list[int], logprobs: int | None = 0, **extra) -> tuple[str, list[float] | None]:
    """(text, each token's logprob rounded to 1e-5; None when logprobs is None)."""
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": logprobs, **extra})  # extra may override
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], logprobs if logprobs is None else [round(x, 5) for x in choice["logprobs"]["token_logprobs"]]


def _reference(model: str | None = None, ignore_eos: bool = False, logprobs: int | None = 0, **settings) -> list:
    """The same model, settings and mesh in one process (this test process with its 8 devices), each prompt
    alone; colocated unless settings say how to split the mesh."""
    from ernie_jax import LLM
    from ernie_jax.sampling import SamplingParams
    settings = {"mesh": MESH, "disaggregate": "prefill_devices" in settings, **settings}
    llm = LLM(model, **SETTINGS, **settings)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=ignore_eos, logprobs=logprobs)
    outs = [llm.generate([p], params)[0].outputs[0] for p in PROMPTS]
    return [(o.text, logprobs if logprobs is None else [round(e["logprob"], 5) for e in o.logprobs]) for o in outs]


def test_two_processes_serve_as_one_and_a_killed_follower_ends_the_job(small_model):
    with _serving(["--model", small_model]) as (leader, follower):
        health = httpx.get(follower["url"] + "/health", timeout=5).json()
        assert health["role"] == "follower" and health["process_id"] == 1
        assert httpx.get(follower["url"] + "/v1/models", timeout=5).status_code == 404  # only /health
        got = [_complete(leader["url"], p) for p in PROMPTS]
        assert got == _reference(small_model), server_state(leader)
        assert httpx.get(follower["url"] + "/health", timeout=5).json()["calls"] > 0
        _kill_follower_mid_stream(leader, follower)


def _kill_follower_mid_stream(leader: dict, follower: dict) -> None:
    """kill -9 the follower mid-stream: the stream ends with an error event, the leader exits non-zero within
    30 s."""
    events: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.stream("POST", leader["url"] + "/v1/completions", headers=AUTH, timeout=60, json={
                "prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60), server_state(leader)
    follower["proc"].send_signal(signal.SIGKILL)
    t0 = time.time()
    reader.join(60)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert "lost a process" in json.loads(events[-2])["error"]["message"]
    assert leader["proc"].wait(timeout=30) != 0, server_state(leader)
    assert time.time() - t0 < 30


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "ernie_jax.serve", "--port", str(free_port()), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_process_flags_are_refused_naming_the_flag():
    from ernie_jax.serve.cli import parse_args
    from ernie_jax.serve.distributed import disaggregated, distributed_args, transfer_address
    from ernie_jax.sharding.mesh import MeshError, request_host_devices

    def refused(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            distributed_args(parse_args(["--mesh", "8", "--num-processes", "2", *argv]))
        return str(e.value)
    assert "--process-id 2 is out of range for --num-processes 2 (0 .. 1)" in refused("--process-id", "2")
    assert "needs --coordinator-address HOST:PORT" in refused("--process-id", "1")
    coordinator = ["--coordinator-address", "127.0.0.1:1"]
    assert "--prefill-devices with --no-disaggregate" in refused(*coordinator, "--prefill-devices", "4",
                                                                 "--no-disaggregate")
    # across processes, prefill and decode submeshes when --prefill-devices says how to split the mesh
    two = ["--mesh", "8", "--num-processes", "2", *coordinator]
    assert distributed_args(parse_args([*two, "--prefill-devices", "4"]))[0] == 2
    assert disaggregated(parse_args([*two, "--prefill-devices", "4"]), 2)
    assert not disaggregated(parse_args(two), 2) and disaggregated(parse_args(["--mesh", "8"]), 1)
    assert transfer_address("127.0.0.1:1", None).startswith("127.0.0.1:")
    assert not transfer_address("127.0.0.1:1", None).endswith(":0")  # the transfer library needs a real port
    assert transfer_address("127.0.0.1:1", "10.1.2.3:5555") == "10.1.2.3:5555"
    with pytest.raises(SystemExit, match="--kv-transfer-address 203.0.113.9: no address for the cross-host"):
        transfer_address("127.0.0.1:1", "203.0.113.9")  # not this host's: nothing to listen on
    with pytest.raises(MeshError, match="a mesh of 6 devices does not split evenly over 4 processes"):
        request_host_devices("6", 4)


def test_an_unreachable_coordinator_is_a_clear_error_within_the_timeout():
    """Nobody at the coordinator: the follower says so within --distributed-timeout (the runtime itself would
    abort the process without naming the flag)."""
    t0 = time.time()
    r = _run(["--mesh", "8", "--num-processes", "2", "--process-id", "1", "--coordinator-address",
              f"127.0.0.1:{free_port()}", "--distributed-timeout", "2"])
    assert r.returncode == 1 and "--coordinator-address" in r.stderr, r.stderr[-2000:]
    assert "nothing answered there within 2 s" in r.stderr
    assert time.time() - t0 < 30


@pytest.mark.parametrize("follower_extra, message", [
    (["--max-num-seqs", "4"], "--max-num-seqs differs between processes: process 0 has 2, process 1 has 4"),
    (["--num-processes", "4"], "--num-processes differs between processes"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype differs between processes"),
    (["--mesh", "data=1,expert=4,tensor=2"], "--mesh differs between processes"),
    (["--model", str(GOLDEN / "shared_untied" / "paddle")], "the model (--model's config and weight files) differs"),
    (["--pd-role", "decode", "--router", "http://127.0.0.1:9"], "--pd-role differs between processes"),
], ids=["max-num-seqs", "num-processes", "kv-cache-dtype", "mesh", "model", "pd-role"])
def test_processes_launched_differently_both_exit_naming_the_setting(follower_extra, message):
    leader, follower = _job(follower_extra=follower_extra, timeout=20)
    try:
        for s in (leader, follower):
            assert s["proc"].wait(timeout=60) == 1, server_state(s)
            with open(s["log"]) as f:
                assert message in f.read(), server_state(s)
    finally:
        _kill(leader, follower)


def test_mtp_and_expert_replacements_mid_generation_across_processes_then_a_drained_stop():
    """MTP (k = 1) and EPLB re-placing the experts every 8 steps (expert moves between the processes' devices):
    the greedy texts equal one process's with the same settings; SIGTERM to the leader drains, stops the
    follower, and both exit 0. In float32: the cross-process all-reduce (gloo here, NCCL on GPUs) adds the
    devices' shares in another order than one process does, and in bfloat16 that flipped a near-tie of the
    second prompt after the re-placements (docs/multihost.md)."""
    from tests.serving import metric, metrics
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    eplb = {"num_redundant_experts": 8, "window_size": 16, "step_interval": 8}
    with _serving(["--dtype", "float32", "--speculative-config", json.dumps(spec), "--eplb-config",
                   json.dumps(eplb)]) as (leader, follower):
        got = [_complete(leader["url"], p, None, ignore_eos=True) for p in PROMPTS]  # no logprobs: MTP drafts
        r = httpx.post(leader["url"] + "/v1/admin/rebalance_experts", headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        got.append(_complete(leader["url"], PROMPTS[0], None, ignore_eos=True))
        assert metric(metrics(leader["url"]), "ernie_jax:eplb_rebalances_total") >= 2, server_state(leader)
        assert got[:2] == _reference(None, True, None, dtype="float32", speculative_config=spec,
                                       eplb_config=eplb) and got[2] == got[0]
        leader["proc"].send_signal(signal.SIGTERM)
        assert leader["proc"].wait(timeout=60) == 0, server_state(leader)
        assert follower["proc"].wait(timeout=60) == 0, server_state(follower)


def test_a_killed_leader_ends_the_follower(small_model):
    with _serving(["--model", small_model]) as (leader, follower):
        leader["proc"].send_signal(signal.SIGKILL)
        t0 = time.time()
        assert follower["proc"].wait(timeout=30) == 1, server_state(follower)
        assert time.time() - t0 < 30
        with open(follower["log"]) as f:
            assert "the leader is lost" in f.read()


def test_prefix_caching_and_preemption_across_processes(small_model):
    """A pool of 5 usable pages for two concurrent 30-token prompts that each grow to 4 pages: one is
    preempted and recomputed; the same prompt again reuses a cached page. Every answer equals the prompt
    alone in one process with the same pool."""
    from tests.serving import metric, metrics
    prompts = [np.random.default_rng(i).integers(4, 256, 30).tolist() for i in range(2)]  # 2 pages each, 4 at the end
    pool = ["--num-gpu-blocks-override", "6"]
    with _serving(["--model", small_model, *pool]) as (leader, _):
        results: dict[int, tuple] = {}
        # tokens only: a recomputed request's later logits come from prefill programs (last digits differ)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(
            leader["url"], prompts[i], None, max_tokens=20, ignore_eos=True))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        again = _complete(leader["url"], prompts[0], None, max_tokens=20, ignore_eos=True)
        m = metrics(leader["url"])
        assert metric(m, "ernie_jax:num_preemptions_total") >= 1, server_state(leader)
        assert metric(m, "ernie_jax:prefix_cache_hits_total") >= 16, server_state(leader)  # a full page at least
    from ernie_jax import LLM
    from ernie_jax.sampling import SamplingParams
    llm = LLM(small_model, mesh=MESH, disaggregate=False, num_gpu_blocks_override=6, **SETTINGS)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [(llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].text, None) for p in prompts]
    assert [results[0], results[1], again] == [want[0], want[1], want[0]]


def _pd_totals(url: str) -> tuple[float, float]:
    """(requests prefilled on the prefill submesh and decoded on the decode submesh, KV bytes handed over)."""
    from tests.serving import metric, metrics
    m = metrics(url)
    return (metric(m, "ernie_jax:pd_requests_total", prefill="prefill", decode="decode"),
            metric(m, "ernie_jax:kv_transfer_bytes_total"))


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp_and_eplb"])
def test_pd_with_a_submesh_per_process_matches_one_process(small_model, mtp):
    """Prefill on process 0's 4 devices, decode on process 1's (--prefill-devices 4, static roles so every
    request is handed over): every process builds both instances, each program runs where its devices are,
    the hand-over's pages and the decode results the leader reads cross with JAX's cross-host transfers.
    Greedy text (and logprobs without MTP) equal to one process with the same submeshes, alone and with two
    requests at once; then with MTP both exit 0 after a drained stop, without it the follower is killed
    mid-stream (an error event, the leader exits non-zero). MTP (k = 1) with EPLB re-placements (every 8 steps
    and once more through the admin route) on the embedded model (it has the MTP block), in float32 (the
    reference's and the job's reductions may order differently, docs/multihost.md)."""
    pd = ["--prefill-devices", "4", "--pd-policy", "static"]
    settings = dict(prefill_devices=4, pd_policy="static")
    if mtp:  # and EPLB re-placing the experts on both submeshes every 8 steps
        spec = {"method": "mtp", "num_speculative_tokens": 1}
        eplb = {"num_redundant_experts": 8, "window_size": 16, "step_interval": 8}
        pd += ["--dtype", "float32", "--speculative-config", json.dumps(spec), "--eplb-config", json.dumps(eplb)]
        settings.update(dtype="float32", speculative_config=spec, eplb_config=eplb)
    model, logprobs = (None, None) if mtp else (small_model, 0)
    with _serving(["--model", model, *pd] if model else pd, mesh="8") as (leader, follower):
        got = [_complete(leader["url"], p, logprobs, ignore_eos=True) for p in PROMPTS]
        together: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, _complete(
            leader["url"], PROMPTS[i], logprobs, ignore_eos=True))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        split, moved = _pd_totals(leader["url"])
        assert split == 4 and moved > 0, server_state(leader)
        if mtp:
            from tests.serving import metric, metrics
            r = httpx.post(leader["url"] + "/v1/admin/rebalance_experts", headers=AUTH, timeout=60)
            assert r.status_code == 200, r.text
            assert _complete(leader["url"], PROMPTS[0], logprobs, ignore_eos=True) == got[0]
            assert metric(metrics(leader["url"]), "ernie_jax:eplb_rebalances_total") >= 2, server_state(leader)
            leader["proc"].send_signal(signal.SIGTERM)
            assert leader["proc"].wait(timeout=60) == 0, server_state(leader)
            assert follower["proc"].wait(timeout=60) == 0, server_state(follower)
        else:  # the decode submesh's process dies while the leader reads its results
            _kill_follower_mid_stream(leader, follower)
    want = _reference(model, True, logprobs, mesh=8, **settings)
    assert got == want and [together[0], together[1]] == want


def test_pd_with_submeshes_that_span_processes(small_model):
    """4 processes x 2 devices: prefill on processes 0-1's devices, decode on 2-3's, each submesh across two
    processes (its programs run on both, the hand-over crosses from two processes to two others, the decode
    results come to the leader from process 2). Greedy text and logprobs equal to one process with the same
    submeshes."""
    with _serving(["--model", small_model, "--prefill-devices", "4", "--pd-policy", "static"], mesh="8",
                  processes=4) as (leader, *_):
        got = [_complete(leader["url"], p, ignore_eos=True) for p in PROMPTS]
        assert _pd_totals(leader["url"])[0] == 2, server_state(leader)
    assert got == _reference(small_model, True, mesh=8, prefill_devices=4, pd_policy="static")


def test_role_servers_across_processes_behind_the_router(small_model):
    """A prefill server and a decode server, each one instance over 2 processes x 2 devices, behind the router:
    each split request's KV is gathered on every process of the prefill server (process 0 offers its copy),
    pulled by the decode server's process 0 and written into its pool by every process of it. Greedy text
    and logprobs equal to one process with the same 4-device mesh."""
    from tests.serving import metric, metrics
    router = launch("ernie_jax.router", ["--api-key", "test-key", "--heartbeat", "3"])
    join = ["--model", small_model, "--router", router["url"]]
    jobs = [_job([*join, "--pd-role", role], mesh="4") for role in ("prefill", "decode")]
    try:
        deadline = time.time() + 900
        for s in (*jobs[0], *jobs[1]):
            wait_healthy(s, deadline)
        while metric(metrics(router["url"]), "ernie_jax_router:up") < 2:
            assert time.time() < deadline, "the servers did not register with the router"
            time.sleep(0.5)
        got = [_complete(router["url"], p, ignore_eos=True) for p in PROMPTS]
        assert metric(metrics(router["url"]), "ernie_jax_router:requests_total", path="split") == len(PROMPTS)
        pulled = httpx.get(jobs[1][0]["url"] + "/v1/pd/info", headers=AUTH, timeout=30).json()["transfers"]
        assert pulled["pulled"] == len(PROMPTS) and pulled["recomputed"] == 0, pulled
    finally:
        _kill(router, *jobs[0], *jobs[1])
    assert got == _reference(small_model, True, mesh=4, disaggregate=False)


def test_fp8_kv_and_a_json_schema_across_processes(small_model):
    """FP8 KV pages (values and scales sharded like the bf16 ones) and a constrained request (the leader's
    matcher masks the sampler every process runs): greedy text equal to one process with the same settings,
    and the constrained reply matches its regex."""
    import re
    with _serving(["--model", small_model, "--kv-cache-dtype", "fp8"]) as (leader, _):
        got = [_complete(leader["url"], p, None) for p in PROMPTS]
        guided = _complete(leader["url"], PROMPTS[0], None, guided_regex=r"[a-z]{2,5} [a-z]{2,5}")[0]
    assert got == _reference(small_model, logprobs=None, kv_cache_dtype="fp8")
    assert re.fullmatch(r"[a-z]{2,5} [a-z]{2,5}", guided), guided
