"""The PD simulator: the engine's scheduler and policy in virtual time against the H200 cost model."""

import pytest

from ernie_jax.sim.__main__ import main
from ernie_jax.sim.cost import H200Cost
from ernie_jax.sim.simulator import SimConfig, simulate
from ernie_jax.sim.traces import TRACES, make_trace


@pytest.mark.parametrize("trace", TRACES)
def test_every_request_finishes_with_its_output_length_and_no_page_leaks(trace):
    reqs = make_trace(trace, 6.0, 40, seed=1)
    for mode in ("colocated", "static", "dynamic"):
        r = simulate(reqs, H200Cost(), SimConfig(mode, 8, 4, max_num_seqs=32))
        assert [len(q.output_ids) for q in r.requests] == [t.output_len for t in reqs]
        assert all(q.metrics.first_token_time >= q.metrics.arrival_time for q in r.requests)
        assert all(0 <= u <= 1 + 1e-9 for u in r.utilisation.values()) and sum(r.utilisation.values()) > 0
        if mode == "static":
            assert not r.role_switches and {p for p, _ in r.placements} == {"prefill"}
        if mode == "dynamic" and trace == "shifting":
            assert r.role_switches


def test_h200_cost_model_follows_the_roofline():
    cost = H200Cost()
    # a batch-1 decode step on 8 GPUs: 47.9 GB at 85 % of 38.4 TB/s plus the step overhead (PERFORMANCE.md 3.5)
    assert 1.3e-3 < cost.step(0, 0, 0, 1, 1, 0, 8) - cost.step_overhead < 1.6e-3
    assert cost.step(0, 0, 0, 64, 64, 0, 8) > 4 * cost.step(0, 0, 0, 1, 1, 0, 8) - 4 * cost.step_overhead
    with pytest.raises(ValueError, match="cannot hold"):
        cost.pages(2, 64)


def test_cli_prints_the_three_modes(capsys):
    assert main(["--trace", "mixed", "--num-requests", "20", "--rate", "4", "--splits"]) == 0
    out = capsys.readouterr().out
    assert all(f"| mixed | 4 | {m} |" in out for m in ("colocated", "static", "dynamic"))
    assert "best static split" in out
