"""Prefill/decode disaggregation: independent instance loops, hand-over of KV, dynamic role switching."""

import dataclasses
import functools
import threading
import time

import numpy as np
import pytest

from ernie_jax import LLM, SamplingParams
from ernie_jax.engine.policy import InstanceView, PDPolicy
from tests.test_engine import SMALL, all_free, golden_model, llm


@functools.lru_cache(maxsize=None)
def static_pd() -> LLM:
    return LLM(golden_model(), mesh=8, prefill_devices=4, pd_policy="static", **SMALL)


def _requests(n: int, seed: int, max_tokens=(6, 13)):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 256, int(k)).tolist() for k in rng.integers(3, 40, n)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(*max_tokens, n)]
    return prompts, params


def _run(engine, prompts, params) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    reqs = [engine.requests[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in reqs]


def test_policy_rules():
    view = lambda home, prefilling=0, running=0, backlog=0, free=100: InstanceView(  # noqa: E731
        home, home, prefilling, running, backlog, 8, free, 100)
    dyn, static = PDPolicy("dynamic"), PDPolicy("static")
    # the prefill instance admits while the decode side's backlog is short
    assert dyn.admit_seats(view("prefill"), 3, view("decode")) == 8
    assert dyn.admit_seats(view("prefill"), 3, view("decode", backlog=8)) == 0
    # the decode instance prefills only while the prefill instance is busy, up to half its batch, with pages
    assert dyn.admit_seats(view("decode", running=1), 3, view("prefill")) == 0
    assert dyn.admit_seats(view("decode", running=1), 3, view("prefill", prefilling=2)) == 3
    assert dyn.admit_seats(view("decode", running=5), 3, view("prefill", prefilling=2)) == 0
    assert dyn.admit_seats(view("decode", running=1, free=10), 3, view("prefill", prefilling=2)) == 0
    assert static.admit_seats(view("decode"), 3, view("prefill", prefilling=2)) == 0
    # hand-over: static always; dynamic keeps (sharing the decoding evenly) while nothing waits
    assert static.handover_count(view("prefill", running=3), 0, view("decode")) == 3
    assert dyn.handover_count(view("prefill", running=4), 0, view("decode")) == 2
    assert dyn.handover_count(view("prefill", running=2), 0, view("decode", running=4)) == 0
    assert dyn.handover_count(view("prefill", running=4), 1, view("decode", running=6)) == 2
    assert dyn.acting_role(view("prefill", running=1)) == "decode"
    assert dyn.acting_role(view("decode", prefilling=1)) == "prefill"
    # a role whose programs are still compiling (behind a serving engine) is never switched to
    busy = view("prefill", prefilling=2)
    assert dyn.admit_seats(dataclasses.replace(view("decode", running=1), can_prefill=False), 3, busy) == 0
    assert dyn.handover_count(dataclasses.replace(view("prefill", running=4), can_decode=False), 0,
                              view("decode")) == 4
    with pytest.raises(ValueError, match="pd policy"):
        PDPolicy("sometimes")
    with pytest.raises(ValueError, match="tpot_target must be a positive"):
        PDPolicy("dynamic", tpot_target=0)


def test_policy_targets():
    """tpot_target: no decoding in place while either side's decode steps are slower than it; ttft_target:
    a prompt that has waited half of it may take any free seat of the decode instance."""
    view = lambda home, prefilling=0, running=0, step=0.0: InstanceView(  # noqa: E731
        home, home, prefilling, running, 0, 8, 100, 100, step)
    targeted = PDPolicy("dynamic", ttft_target=2.0, tpot_target=0.05)
    assert targeted.handover_count(view("prefill", running=4, step=0.03), 0, view("decode", step=0.04)) == 2
    assert targeted.handover_count(view("prefill", running=4, step=0.03), 0, view("decode", step=0.08)) == 4
    assert targeted.handover_count(view("prefill", running=4, step=0.08), 0, view("decode", running=6)) == 2
    busy = view("prefill", prefilling=2)
    assert targeted.admit_seats(view("decode", running=5), 3, busy, oldest_wait=0.5) == 0  # over half full
    assert targeted.admit_seats(view("decode", running=5), 3, busy, oldest_wait=1.5) == 3
    assert PDPolicy("dynamic").admit_seats(view("decode", running=5), 3, busy, oldest_wait=1.5) == 0
    # the decode instance takes prompts only while its decode steps leave half the TPOT target free
    assert targeted.admit_seats(view("decode", running=1, step=0.02), 3, busy) == 3
    assert targeted.admit_seats(view("decode", running=1, step=0.03), 3, busy) == 0
    assert targeted.admit_seats(view("decode", running=0, step=0.03), 3, busy) == 4  # nothing of its own to slow
    assert PDPolicy("dynamic").admit_seats(view("decode", running=1, step=0.03), 3, busy) == 3  # no target
    with pytest.raises(ValueError, match="steal_step_fraction"):
        PDPolicy("dynamic", steal_step_fraction=2)


def test_whole_instances_switch_roles_with_hysteresis():
    """More than two PD instances (a router's deployment): queued prompts turn the least loaded decode
    instance into a prefill instance when the other decode instances have seats for its requests; a loaded
    decode side with nothing queued turns the least busy prefill instance into a decode one; no switch
    reverses one made within `switch_dwell` seconds, each side keeps one instance, and two instances never
    switch whole."""
    def view(name, home, prefilling=0, running=0, backlog=0, step=0.0):
        return InstanceView(name, home, prefilling, running, backlog, 8, 100, 100, step)
    policy = PDPolicy("dynamic", switch_wait=1.0, switch_dwell=30.0)
    p0, p1 = view("p0", "prefill", prefilling=4), view("p1", "prefill", prefilling=2)
    d0, d1, d2 = view("d0", "decode", running=6), view("d1", "decode", running=2), view("d2", "decode", running=3)
    # prompts queued 1.5 s: d1 (the least loaded) moves; d0 and d2 have 2 + 5 seats for its 2 requests
    assert policy.instance_roles([p0, d0, d1, d2], 5, 1.5, 100.0, {}) == {"d1": "prefill"}
    assert policy.instance_roles([p0, d0, d1, d2], 5, 0.5, 100.0, {}) == {}  # not queued long enough
    # hysteresis: within switch_dwell of a switch to decode, none back to prefill; later, or after one the
    # same way, it may
    assert policy.instance_roles([p0, d0, d1, d2], 5, 1.5, 100.0, {"d1": (80.0, "decode")}) == {}
    assert policy.instance_roles([p0, d0, d1, d2], 5, 1.5, 100.0, {"d1": (60.0, "decode")}) == {"d1": "prefill"}
    assert policy.instance_roles([p0, p1, d0, d1, d2], 5, 1.5, 100.0, {"p1": (90.0, "prefill")}) == \
        {"d1": "prefill"}
    crowded = [p0, view("d0", "decode", running=8), view("d1", "decode", running=7)]
    assert policy.instance_roles(crowded, 5, 9.0, 100.0, {}) == {}  # d0 has no seat for d1's 7 requests
    assert PDPolicy("dynamic", ttft_target=1.0).instance_roles([p0, d0, d1, d2], 5, 0.6, 100.0, {}) == \
        {"d1": "prefill"}  # with a TTFT target: half of it
    # nothing queued and the decode side 3/4 full: the least busy prefill instance decodes
    full = [p0, p1, view("d0", "decode", running=7), view("d1", "decode", running=5)]
    assert policy.instance_roles(full, 0, 0.0, 100.0, {}) == {"p1": "decode"}
    assert policy.instance_roles(full, 2, 0.1, 100.0, {}) == {}  # prompts queued: the gap between the rules
    assert policy.instance_roles(full, 0, 0.0, 100.0, {"d2": (95.0, "prefill")}) == {}  # just switched the other way
    assert policy.instance_roles([p0, p1, d0, d1], 0, 0.0, 100.0, {}) == {}  # 8 of 16 seats: not loaded
    slow = [p0, p1, view("d0", "decode", running=2, step=0.03), d1]
    assert PDPolicy("dynamic", tpot_target=0.05).instance_roles(slow, 0, 0.0, 100.0, {}) == {"p1": "decode"}
    assert policy.instance_roles([p0, view("d0", "decode", running=8), view("d1", "decode", running=8)],
                                 0, 0.0, 100.0, {}) == {}  # one prefill instance: it stays
    assert policy.instance_roles([p0, d0], 9, 9.0, 100.0, {}) == {}  # two instances: the pair's rules
    assert PDPolicy("static").instance_roles([p0, d0, d1, d2], 5, 9.0, 100.0, {}) == {}
    with pytest.raises(ValueError, match="switch_decode_occupancy"):
        PDPolicy("dynamic", switch_decode_occupancy=1.5)


def test_role_switching_across_servers_uses_the_same_rules():
    """The router's choice for a new request (router/routing.whole_on) over two servers' published views:
    a role server's instance is "mixed" at home; the router gives it its role."""
    from ernie_jax.router.routing import whole_on
    view = lambda prefilling=0, running=0, free=100: InstanceView(  # noqa: E731
        "mixed", "mixed", prefilling, running, 0, 8, free, 100)
    dyn, static = PDPolicy("dynamic"), PDPolicy("static")
    # static: always split
    assert whole_on(static, view(prefilling=2), 5, view()) is None
    assert whole_on(static, view(), 0, view(running=4)) is None
    # the prefill server is busy prefilling with prompts queued: the decode server takes it while half empty
    assert whole_on(dyn, view(prefilling=2), 3, view(running=1)) == "decode"
    assert whole_on(dyn, view(prefilling=2), 3, view(running=5)) is None  # over half full: split
    assert whole_on(dyn, view(prefilling=2), 3, view(running=1, free=10)) is None  # short of pages: split
    # the prefill server is idle: it decodes what it prefills while decoding stays even, else splits
    assert whole_on(dyn, view(), 0, view(running=4)) == "prefill"
    assert whole_on(dyn, view(running=3), 0, view(running=0)) is None


def test_roles_switch_and_outputs_match_colocated_and_static():
    """A prefill-only burst makes the decode instance prefill, a decode-only load makes the prefill instance
    decode; greedy tokens equal the colocated and static-PD ones and every page ends free."""
    dynamic, static, single = llm("pd").engine, static_pd().engine, llm("single").engine
    burst = _requests(12, 0, max_tokens=(1, 3))
    load = _requests(3, 1, max_tokens=(20, 30))
    switches = dict(dynamic.role_switches)
    outs = {name: _run(e, *burst) + _run(e, *load) for name, e in
            (("dynamic", dynamic), ("static", static), ("colocated", single))}
    assert outs["dynamic"] == outs["colocated"] and outs["static"] == outs["colocated"]
    new = {k: v - switches.get(k, 0) for k, v in dynamic.role_switches.items()}
    assert new.get(("decode", "decode", "prefill"), 0) >= 1  # the burst: the decode instance prefilled
    assert new.get(("prefill", "prefill", "decode"), 0) >= 1  # the load: the prefill instance decoded
    assert ("decode", "decode") in dynamic.pd_requests and ("prefill", "prefill") in dynamic.pd_requests
    # static: everything prefilled on the prefill instance (a 1-token request ends there), decoded on the other
    assert set(static.pd_requests) <= {("prefill", "decode"), ("prefill", "prefill")} and not static.role_switches
    for e in (dynamic, static, single):
        assert all_free(e)


def test_abort_mid_hand_over_frees_everything():
    engine = llm("pd").engine
    prefill, decode = engine.instance("prefill"), engine.instance("decode")
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = [engine.add_request([5 + i, 6, 7, 8], sp) for i in range(3)]
    prefill.step()  # prefilled; kept on the prefill instance (nothing waits)
    assert len(prefill.running) == 3 and not decode.running
    late = engine.add_request(list(range(3, 40)), sp)
    prefill.step()  # a prompt waits: the decoding requests are handed over, the new prompt admitted
    assert [h.req.request_id for h in decode.inbox] == first[:len(decode.inbox)] and decode.inbox
    engine.abort(decode.inbox[0].req.request_id)  # between the two instances
    engine.abort(late)  # mid-prefill on the prefill instance
    assert engine.requests[first[1]] in [h.req for h in decode.inbox] + prefill.running
    while engine.has_unfinished():
        engine.step()
    assert all_free(engine)


@pytest.mark.parametrize("policy", ["dynamic", "static"])
def test_decode_keeps_stepping_while_a_2000_token_prompt_prefills(policy):
    """On their own threads, the decode instance completes many decode steps between the first and the last
    chunk of a 2,000-token prompt (in lockstep it completed at most one per chunk)."""
    engine = LLM(golden_model(), mesh=8, prefill_devices=4, max_model_len=2112, max_num_seqs=4, max_num_batched_tokens=256,
                 pd_policy=policy).engine
    prefill, decode = engine.instance("prefill"), engine.instance("decode")
    got_tokens, errors = threading.Event(), []

    def on_output(req):
        if len(req.output_ids) >= 3:
            got_tokens.set()
    engine.start(on_output, lambda req, e: errors.append(e))
    try:
        stream = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
        assert got_tokens.wait(60)
        t_long = time.perf_counter()
        rid = engine.add_request(np.random.default_rng(0).integers(3, 256, 2000).tolist(),
                                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        long = engine.requests[rid]
        deadline = time.time() + 300
        while not long.finished and time.time() < deadline:
            time.sleep(0.05)
        engine.abort(stream)
        while engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.stop()
    assert not errors and long.finish_reason == "length"
    assert long.prefilled_on == "prefill" and engine.requests.get(stream) is None
    chunks = [s for s in list(prefill.timeline) if s.prefill_tokens and s.t0 >= t_long]
    assert [s.prefill_tokens for s in chunks] == [256] * 7 + [208]  # 2,000 tokens in chunks of 256
    during = [s for s in list(decode.timeline) if s.decode_rows and chunks[0].t0 < s.t1 < chunks[-1].t1]
    assert len(during) > len(chunks)
    assert all_free(engine)
