"""The scheduler and the KV cache manager on their own: plain Python, a fake runner, no model, no device.

Each test drives a Scheduler through its step-boundary contract (drop_aborted, receive, schedule,
dispatched, update) with a fake runner that gives every completed prompt and every decode row the token
100 + its output index, and checks the page pool's invariant after every step."""

import pytest

from ernie_jax.engine.kv_cache_manager import KVCacheManager
from ernie_jax.engine.output_processor import OutputProcessor
from ernie_jax.engine.pages import PagePool
from ernie_jax.engine.policy import PDPolicy
from ernie_jax.engine.request import Request, RequestMetrics, RequestStatus
from ernie_jax.engine.scheduler import Scheduler
from ernie_jax.engine.shapes import ShapeTable
from ernie_jax.engine.speculative import SpecDecodeStats
from ernie_jax.engine.step import Handoff, RowOutput, StepResult
from ernie_jax.sampling import SamplingParams

PAGE = 4


def make(num_pages: int, *, name="mixed", home="mixed", waiting=None, policy=PDPolicy(), max_num_seqs=4,
         budget=16, lookahead=0, max_model_len=64, caching=True, max_bypass=16, spec_stats=None) -> Scheduler:
    pool = PagePool(num_pages + 1, PAGE, enable_caching=caching, salt=b"test")
    kv = KVCacheManager(pool, max_pages=-(-max_model_len // PAGE), lookahead=lookahead)
    shapes = ShapeTable([(1, 4), (1, 8), (1, 16)], [1, 2, 4])
    return Scheduler(name, home, kv, [] if waiting is None else waiting, policy=policy, shapes=shapes,
                     outputs=OutputProcessor(max_model_len=max_model_len, clock=lambda: 0.0),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, spec_stats=spec_stats,
                     max_bypass=max_bypass, overlap=False)


def request(name: str, prompt_len: int, max_tokens: int, first: int = 3) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(name, list(range(first, first + prompt_len)), params, 0, RequestMetrics(0.0))


def fake_run(plan) -> StepResult:
    """Every completed prompt and every decode row: the token 100 + its index in the output."""
    rows = [RowOutput(c.req, "prefill", [100 + len(c.req.output_ids)]) for c in plan.prefill if c.completes]
    return StepResult(rows + [RowOutput(r, "decode", [100 + len(r.output_ids)]) for r in plan.decode])


def step(s: Scheduler, peer=None, run=fake_run):
    s.drop_aborted()
    plan = s.schedule(0.0, peer.view() if peer else None, s.receive(0.0))
    s.dispatched(plan)
    s.update(run(plan))
    s.kv.check()
    return plan


def run_all(s: Scheduler, reqs: list[Request], limit: int = 500) -> None:
    for _ in range(limit):
        if all(r.finished for r in reqs):
            break
        step(s)
    assert all(r.finished for r in reqs)
    assert s.pool.free == s.pool.capacity and not s.seats_taken  # every page back (cached ones count as free)


def test_fifo_admits_past_a_head_that_does_not_fit_only_max_bypass_times():
    s = make(8, max_bypass=2)  # 8 pages of 4 tokens
    first = request("first", 16, 8)
    s.waiting.append(first)
    step(s)  # admitted and prefilled: 4 pages, one token out
    assert first.status is RequestStatus.RUNNING and first.output_ids == [100]
    long = request("long", 24, 4, first=200)  # 6 pages: does not fit beside `first`
    short = [request(f"s{i}", 2, 20, first=50 + i) for i in range(3)]
    s.waiting += [long] + short
    plan = step(s)
    assert plan.admitted == short[:2]  # two went past the head, the third waits behind it
    assert s.waiting == [long, short[2]] and long.bypassed == 2
    run_all(s, [first, long] + short)
    assert long.output_ids == [100, 101, 102, 103]


def test_a_request_waits_for_a_page_another_request_is_computing():
    s = make(16, budget=4)
    a, b = request("a", 12, 2), request("b", 12, 2)  # the same 12-token prompt: 3 pages, 4 tokens per step
    s.waiting += [a, b]
    plans = [step(s) for _ in range(4)]
    assert plans[0].admitted == [a] and all(b not in p.admitted for p in plans[:3])  # a computes, b waits
    assert plans[3].admitted == [b] and b.num_cached_tokens == 8  # the two cached pages; the last recomputed
    run_all(s, [a, b])
    assert s.prefill_tokens == 12 + 4 and s.prefix_hits == 8
    assert a.output_ids == b.output_ids == [100, 101]


def test_preemption_takes_the_latest_admitted_and_it_resumes_with_its_tokens():
    s = make(6, max_num_seqs=3, max_model_len=24)
    reqs = [request(n, 4, 12, first=10 * i + 3) for i, n in enumerate("abc")]
    s.waiting += reqs
    preempted = []
    for _ in range(200):
        if all(r.finished for r in reqs):
            break
        preempted += step(s).preempted
    assert preempted and preempted[0] is reqs[2]  # the most recently admitted goes first
    assert s.num_preemptions == len(preempted) and reqs[2].num_preemptions >= 1
    for r in reqs:  # nothing lost or repeated across a preemption: the tokens of an uninterrupted run
        assert r.output_ids == list(range(100, 112)), r.request_id
    assert s.pool.free == s.pool.capacity


def test_preempted_request_goes_back_to_the_front_and_prefills_prompt_and_output():
    s = make(6, max_num_seqs=3, max_model_len=24)
    reqs = [request(n, 4, 12, first=10 * i + 3) for i, n in enumerate("abc")]
    s.waiting += reqs
    while not s.num_preemptions:
        step(s)
    victim = reqs[2]
    assert s.waiting[0] is victim and victim.status is RequestStatus.WAITING and not victim.pages
    produced = list(victim.output_ids)
    while victim.status is RequestStatus.WAITING:
        step(s)
    assert victim.prefill_ids == victim.prompt_ids + produced


def test_speculative_lookahead_pages_and_a_stop_inside_accepted_drafts():
    stats = SpecDecodeStats(3)
    s = make(16, lookahead=3, spec_stats=stats)
    req = request("r", 4, 5)
    s.waiting.append(req)
    step(s)  # prefilled (1 page), first token out: 5 tokens
    assert len(req.pages) == 1

    pages = []

    def accept_all(plan):  # every draft accepted: 4 tokens per decode row
        pages.extend(len(r.pages) for r in plan.decode)
        return StepResult([RowOutput(r, "decode", [100 + len(r.output_ids) + i for i in range(4)], accepted=3)
                           for r in plan.decode])
    plan = step(s, run=accept_all)
    assert plan.decode == [req] and pages == [2]  # 5 tokens + 3 lookahead slots
    assert req.finished and req.output_ids == [100, 101, 102, 103, 104]  # max_tokens 5 ends it inside the run
    assert stats.num_accepted_tokens == 3 and not req.pages


def test_hand_over_moves_a_request_with_its_pages_and_an_abort_between_instances_frees_it():
    waiting: list[Request] = []
    policy = PDPolicy("static")
    p = make(8, name="prefill", home="prefill", waiting=waiting, policy=policy)
    d = make(8, name="decode", home="decode", waiting=waiting, policy=policy)
    keep, drop = request("keep", 6, 4), request("drop", 5, 4, first=40)
    waiting += [keep, drop]

    def boundary(s, peer):  # what the instance driver does with a plan's hand-overs
        s.drop_aborted()
        plan = s.schedule(0.0, peer.view(), s.receive(0.0))
        for req, pages in plan.hand_over:
            assert req.status is RequestStatus.HANDING_OVER and s.holds(req) and pages
            s.sent(req)
            req.holder = peer.name
            peer.incoming.append(Handoff(req, None, pages, 0.0))
        s.dispatched(plan)
        s.update(fake_run(plan))
        s.kv.check()
        return plan
    moved = [r for _ in range(3) for r, _ in boundary(p, d).hand_over]  # static: each moves once prefilled
    assert moved == [keep, drop] and p.pool.free == p.pool.capacity and not p.seats_taken
    assert keep.prefilled_on == "prefill" and drop.prefilled_on == "prefill" and keep.output_ids == [100]
    assert [h.req for h in d.incoming] == [keep, drop] and d.holds(drop) and not p.holds(drop)
    drop.abort_requested = True
    while not keep.finished:
        boundary(d, p)
    assert drop.finish_reason == "abort" and keep.decoded_on == "decode"
    assert keep.output_ids == [100, 101, 102, 103]
    assert d.pool.free == d.pool.capacity and not d.incoming and not p.outgoing


@pytest.mark.parametrize("tokens,expected", [(8, None), (64, None), (65, "more than the whole KV pool")])
def test_check_fits_names_the_pool_limit(tokens, expected):
    kv = make(16).kv
    why = kv.check_fits(tokens)
    assert why is None if expected is None else expected in why


def test_a_handed_over_request_reuses_cached_prompt_pages_or_is_recomputed_when_they_left():
    """KV from another server arrives less the leading prompt pages this pool caches: those come from the
    prefix cache (a reference each), fresh pages take the rest; when the cached pages were evicted before the
    request arrived, it goes back to the queue and its prompt is recomputed here (prompt + first token)."""
    s = make(12)
    first = request("first", 12, 2)
    s.waiting.append(first)
    run_all(s, [first])  # 3 full pages of its prompt now cached
    req = request("remote", 13, 4)
    req.output_ids, req.status, req.holder = [100], RequestStatus.HANDING_OVER, s.name
    assert s.kv.cached_prompt_pages(req.prompt_ids) == 3
    s.incoming.append(Handoff(req, None, [0], 0.0, reused=3))
    (h, fresh), = s.receive(0.0)
    assert req.pages[:3] == first_pages(s, first) and req.pages[3:] == fresh and len(fresh) == 1
    assert all(s.pool.refs(p) == 1 for p in req.pages) and req.status is RequestStatus.RUNNING
    run_all(s, [req])
    # evicted: a request that needs every page of the pool takes the cached ones first
    other = request("other", 13, 4, first=50)
    other.output_ids, other.status, other.holder = [100], RequestStatus.HANDING_OVER, s.name
    s.pool.reset_cache()
    s.incoming.append(Handoff(other, None, [0], 0.0, reused=3))
    assert s.receive(0.0) == [] and s.waiting == [other] and other.status is RequestStatus.WAITING
    run_all(s, [other])
    assert other.output_ids[0] == 100 and len(other.output_ids) == 4


def first_pages(s: Scheduler, req: Request) -> list[int]:
    """The pages the prefix cache holds for req's prompt's full pages."""
    from ernie_jax.engine.pages import page_hashes
    return s.pool.lookup(page_hashes(req.prompt_ids, PAGE, s.pool.salt, [])[:len(req.prompt_ids) // PAGE])


def multi_run(plan) -> StepResult:
    """fake_run for plans that may run several decode steps: plan.decode_steps tokens a decode row, whose
    pages must hold the KV those steps write (the newest token's and the next decode_steps - 1)."""
    for r in plan.decode:
        assert len(r.pages) >= -(-(r.num_tokens + plan.decode_steps - 1) // PAGE)
    rows = [RowOutput(c.req, "prefill", [100 + len(c.req.output_ids)]) for c in plan.prefill if c.completes]
    return StepResult(rows + [RowOutput(r, "decode", [100 + len(r.output_ids) + i for i in range(plan.decode_steps)])
                              for r in plan.decode])


def test_multi_step_decode_runs_only_while_nothing_waits_and_rows_take_every_token():
    """With a 4-step program compiled, the batch takes 4 steps a program while no request waits or prefills,
    every row samples on the device alone and needs all 4 tokens (pages allocated first); else single steps."""
    s = make(16)
    s.shapes.add("multi", (1, 4))
    s.shapes.add("multi", (2, 4))
    b = request("b", 5, 14)
    s.waiting.append(b)
    steps = lambda n: [step(s, run=multi_run).decode_steps for _ in range(n)]  # noqa: E731
    assert steps(3) == [1, 4, 4]  # the prefill (its token), then b alone: 9 tokens
    logprobs = request("lp", 3, 3, first=40)
    logprobs.params.logprobs = 1  # sampled on the host
    s.waiting.append(logprobs)
    assert steps(3) == [1, 1, 1]  # it prefills beside b's step, then decodes beside b until it ends
    assert logprobs.finished and len(b.output_ids) == 12
    assert steps(2) == [1, 1]  # b needs 2 more tokens: fewer than 4
    assert b.finished and b.output_ids == list(range(100, 114))
    assert s.pool.free == s.pool.capacity
