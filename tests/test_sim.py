"""The PD simulator: the engine's scheduler and policy in virtual time against the H200 and fitted cost models."""

import numpy as np
import pytest

from ernie_jax.engine.instance import StepRecord
from ernie_jax.sim.__main__ import main
from ernie_jax.engine.policy import PDPolicy
from ernie_jax.sim.cost import FittedCost, H200Cost, _overlaps, h800_cost
from ernie_jax.sim.simulator import SimConfig, simulate
from ernie_jax.sim.traces import TRACES, TraceRequest, make_trace


@pytest.mark.parametrize("trace", TRACES)
def test_every_request_finishes_with_its_output_length_and_no_page_leaks(trace):
    reqs = make_trace(trace, 6.0, 40, seed=1)
    for mode in ("colocated", "static", "dynamic"):
        r = simulate(reqs, H200Cost(), SimConfig(mode, 8, 4, max_num_seqs=32))
        assert [len(q.output_ids) for q in r.requests] == [t.output_len for t in reqs]
        assert all(q.metrics.first_token_time >= q.metrics.arrival_time for q in r.requests)
        assert all(0 <= u <= 1 + 1e-9 for u in r.utilisation.values()) and sum(r.utilisation.values()) > 0
        if mode == "static":
            assert not r.role_switches and {p for p, _ in r.pd_requests} == {"prefill"}
        if mode == "dynamic" and trace == "shifting":
            assert r.role_switches


@pytest.mark.parametrize("concurrency", [1, 3])
def test_clients_in_a_closed_loop_send_when_their_last_request_has_finished(concurrency):
    """A benchmark client's closed loop: never more than `concurrency` requests out, each next one sent when
    one finishes (not before its own arrival), so with one client the requests run one after another."""
    trace = [TraceRequest(0.0, 40, 8)] * 6 + [TraceRequest(100.0, 40, 8)]
    r = simulate(trace, H200Cost(), SimConfig("static", 8, 4, max_num_seqs=8), concurrency=concurrency)
    spans = [(q.metrics.arrival_time, q.metrics.finished_time) for q in r.requests]
    for t, _ in spans:
        assert sum(a <= t < f for a, f in spans) <= concurrency
    assert [a for a, _ in spans[:concurrency]] == [0.0] * concurrency
    finished = sorted(f for _, f in spans)
    for i in range(concurrency, 6):  # each later request goes out the moment the i - concurrency'th finishes
        assert spans[i][0] == pytest.approx(finished[i - concurrency])
    assert spans[-1][0] == 100.0  # not before its own arrival
    with pytest.raises(ValueError, match="concurrency=0"):
        simulate(trace, H200Cost(), SimConfig("static", 8, 4), concurrency=0)


def test_instances_behind_a_router_switch_whole_roles_under_shifting_load():
    """Four H800 nodes, an instance each: the dynamic policy turns whole instances between prefill and decode
    as the shifting trace moves between prompt-heavy and decode-heavy phases (no switch reversing one within
    the dwell time, each side keeping one instance); static roles never move; colocated runs mixed
    instances; every request finishes with its length."""
    cost = h800_cost()
    reqs = make_trace("shifting", 60.0, 160, seed=2)
    pd = (("prefill", 8),) * 2 + (("decode", 8),) * 2
    settings = dict(max_num_seqs=32, max_model_len=16384)
    dyn = simulate(reqs, cost, SimConfig("dynamic", 32, instances=pd, **settings),
                   PDPolicy("dynamic", switch_wait=0.2, switch_dwell=2.0))
    static = simulate(reqs, cost, SimConfig("static", 32, instances=pd, **settings))
    mixed = simulate(reqs, cost, SimConfig("colocated", 32, instances=(("mixed", 8),) * 4, **settings))
    for r in (dyn, static, mixed):
        assert [len(q.output_ids) for q in r.requests] == [t.output_len for t in reqs]
    assert not static.instance_switches and not mixed.instance_switches and len(mixed.utilisation) == 4
    assert {to for _, _, _, to in dyn.instance_switches} == {"prefill", "decode"}, dyn.instance_switches
    homes = {"prefill0": "prefill", "prefill1": "prefill", "decode2": "decode", "decode3": "decode"}
    for (t, name, old, new), before in zip(dyn.instance_switches, [None] + dyn.instance_switches):
        assert homes[name] == old and (before is None or before[3] == new or t - before[0] >= 2.0)
        homes[name] = new
        assert sorted(set(homes.values())) == ["decode", "prefill"]
    with pytest.raises(ValueError, match="colocated means mixed instances only"):
        simulate(reqs, cost, SimConfig("colocated", 16, instances=(("prefill", 8), ("decode", 8))))
    from ernie_jax.sim.goodput import instance_modes  # the goodput sweep's modes for such a deployment
    sweep_modes = instance_modes(4, 8)
    assert [m.label for m in sweep_modes] == ["colocated x4", "static 1:3", "static 2:2", "static 3:1",
                                              "dynamic 2:2", "dynamic+SLO 2:2"]
    P, D = ("prefill", 8), ("decode", 8)
    assert sweep_modes[1].instances == (P, D, D, D) and sweep_modes[3].instances == (P, P, P, D)
    assert sweep_modes[4].instances == pd == sweep_modes[5].instances and sweep_modes[5].targets


def test_h200_cost_model_follows_the_roofline():
    cost = H200Cost()
    # a batch-1 decode step on 8 GPUs: 47.9 GB at 85 % of 38.4 TB/s plus the step overhead (H200Cost)
    assert 1.3e-3 < cost.step(0, (0, 0), 0, 1, 1, 0, 8) - cost.step_overhead < 1.6e-3
    assert cost.step(0, (0, 0), 0, 64, 64, 0, 8) > 4 * cost.step(0, (0, 0), 0, 1, 1, 0, 8) - 4 * cost.step_overhead
    with pytest.raises(ValueError, match="cannot hold"):
        cost.pages(2, 64)


def test_cli_prints_the_three_modes(capsys):
    assert main(["--trace", "mixed", "--num-requests", "20", "--rate", "4", "--splits"]) == 0
    out = capsys.readouterr().out
    assert all(f"| mixed | 4 | {m} |" in out for m in ("colocated", "static", "dynamic"))
    assert "best static split" in out


def _fitted(tmp_path):
    """A FittedCost fitted to synthetic steps of known cost, saved and loaded back."""
    rng = np.random.default_rng(0)
    truth = {4: [2e-3, 1e-5, 4e-6, 3e-3, 5e-4, 1e-6], 8: [1.5e-3, 6e-6, 2e-6, 2e-3, 3e-4, 5e-7]}
    steps = {}
    for devices, coef in truth.items():
        records = []
        for _ in range(200):
            prefill, decode = rng.random() < 0.5, rng.random() < 0.8
            B, T = (int(rng.choice([1, 2])), int(rng.choice([16, 32, 64, 128]))) if prefill else (0, 0)
            tokens = B * T - int(rng.integers(0, 8)) if prefill else 0
            context = B * int(rng.integers(T, 512)) if prefill else 0
            rows = int(rng.integers(1, 9)) if decode or not prefill else 0
            batch = 1 << (rows - 1).bit_length() if rows else 0
            dctx = rows * int(rng.integers(10, 500)) if rows else 0
            x = [tokens > 0, B * T, T * context / 1e3, rows > 0, batch, dctx]
            seconds = float(np.dot(coef, x)) * (1 + 0.02 * rng.standard_normal())
            records.append(StepRecord(0.0, seconds + 1e-3, tokens, (B, T), context, rows, batch, dctx, 1e-3))
        steps[devices] = [records]
    cost = FittedCost.fit(steps, transfer_seconds=0.5, transfer_tokens=10_000, num_pages={4: 300, 8: 600},
                          settings=dict(max_num_seqs=8, max_num_batched_tokens=128, block_size=16, max_model_len=512,
                                        min_decode_rows=1, scale=0.25), name="synthetic", ttft_slo=1.0, tpot_slo=0.1)
    path = str(tmp_path / "cost.json")
    cost.save(path)
    return FittedCost.load(path), truth


def test_fitted_cost_recovers_known_step_costs_and_round_trips(tmp_path):
    cost, truth = _fitted(tmp_path)
    for devices in truth:
        for shape in [(100, (1, 128), 300, 0, 0, 0), (0, (0, 0), 0, 5, 8, 900), (60, (2, 32), 400, 3, 4, 200)]:
            x = [shape[0] > 0, shape[1][0] * shape[1][1], shape[1][1] * shape[2] / 1e3, shape[3] > 0, shape[4], shape[5]]
            assert cost.step(*shape, devices) == pytest.approx(float(np.dot(truth[devices], x)), rel=0.05)
    assert cost.transfer(100, 4) == pytest.approx(5e-3)
    assert cost.pages(4, 16) == 300
    with pytest.raises(ValueError, match="fitted on instances of \\[4, 8\\] devices, not 2"):
        cost.step(10, (1, 16), 10, 0, 0, 0, 2)
    with pytest.raises(ValueError, match="page size 16, not 64"):
        cost.pages(4, 64)


def test_cli_runs_a_fitted_cost_model_with_its_settings(tmp_path, capsys):
    cost, _ = _fitted(tmp_path)
    assert main(["--cost", str(tmp_path / "cost.json"), "--trace", "mixed", "--num-requests", "20", "--rate", "2",
                 "--splits"]) == 0
    out = capsys.readouterr().out
    assert "cost model: synthetic" in out and "max_num_seqs 8, max_num_batched_tokens 128, max_model_len 512" in out
    assert "best static split 4:4" in out  # the only split both of whose instance sizes were measured


def test_fit_recovers_how_much_slower_steps_run_beside_the_other_instance():
    """Two instances stepping back to back, each step (1 + 0.8) x slower for the part of it the other
    instance spends in a prefill step and (1 + 0.3) x for a decode step; the fit finds both factors."""
    rng = np.random.default_rng(1)
    coef, slow = [0.05, 2e-4, 0.0, 0.02, 2e-3, 0.0], np.array([0.8, 0.3])
    shapes = [[(int(T), (1, int(T)), int(T), 0, 0, 0) if rng.random() < 0.3 else (0, (0, 0), 0, int(b), int(b), 100)
               for T, b in zip(rng.choice([64, 128], 150), rng.choice([1, 2, 4, 8], 150))] for _ in range(2)]
    base = [np.array([float(np.dot(coef, [s[0] > 0, s[1][0] * s[1][1], 0, s[3] > 0, s[4], s[5]])) for s in sh])
            for sh in shapes]
    seconds = [b.copy() for b in base]
    for _ in range(30):  # the overlaps depend on the durations: iterate to the fixed point
        timelines = [[StepRecord(t0, t0 + d, *shape, 0.0) for t0, d, shape in
                      zip(np.concatenate([[0], np.cumsum(sec)[:-1]]), sec, sh)] for sec, sh in zip(seconds, shapes)]
        seconds = [b * (1 + _overlaps(timelines[k], timelines[1 - k]) @ slow) for k, b in enumerate(base)]
    cost = FittedCost.fit({4: timelines}, transfer_seconds=0.0, transfer_tokens=0, num_pages={4: 100},
                          settings={"block_size": 16}, name="pair", ttft_slo=1.0, tpot_slo=0.1)
    assert cost.contention["prefill"] == pytest.approx(0.8, abs=0.1)
    assert cost.contention["decode"] == pytest.approx(0.3, abs=0.1)
    assert cost.step(0, (0, 0), 0, 4, 4, 100, 4) == pytest.approx(0.028, rel=0.1)


def test_steps_beside_the_other_instance_share_the_machine(tmp_path):
    """Processor sharing in the simulator: a request decoding alone is unaffected by contention; a prompt
    prefilled beside its decode steps slows them, and the prefill itself is slowed in turn."""
    import dataclasses
    cost, _ = _fitted(tmp_path)
    shared = dataclasses.replace(cost, contention={"prefill": 1.0, "decode": 1.0})
    cfg = SimConfig("static", 8, 4, **{k: v for k, v in cost.settings.items() if k != "scale"})
    alone = [TraceRequest(0.0, 20, 100)]
    beside = alone + [TraceRequest(0.1, 128, 2)]  # while r0 decodes (~0.35 s)
    r0, r1 = simulate(alone, cost, cfg), simulate(alone, shared, cfg)
    assert r0.requests[0].tpot == pytest.approx(r1.requests[0].tpot)
    r0, r1 = simulate(beside, cost, cfg), simulate(beside, shared, cfg)
    assert r1.requests[0].tpot > r0.requests[0].tpot
    assert r1.requests[1].metrics.ttft > r0.requests[1].metrics.ttft


def test_calibrate_fits_the_real_engine_and_predicts_it(tmp_path, capsys):
    """The real CPU engine serves two short traces per mode; the fitted model loads and runs the CLI. (How
    close its predictions come is the calibration's own output; a short trace is too noisy to assert.)"""
    from ernie_jax.sim.calibrate import main as calibrate
    out = str(tmp_path / "cpu.json")
    assert calibrate(["--out", out, "--num-requests", "10", "--rate", "4", "--tolerance", "100"]) == 0
    table = capsys.readouterr().out
    assert "| colocated |" in table and "| dynamic |" in table
    cost = FittedCost.load(out)
    assert set(cost.coefficients) == {8, 4} and cost.transfer_per_token > 0
    assert main(["--cost", out, "--trace", "decode-heavy", "--num-requests", "10", "--rate", "1"]) == 0
