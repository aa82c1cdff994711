"""EPLB placement (ernie_jax/sharding/eplb.py): replicas and packing against brute force on small cases."""

import itertools

import numpy as np
import pytest

from ernie_jax.sharding.eplb import balancedness, identity_placement, plan


def _optimum(load: np.ndarray, num_slots: int, num_devices: int) -> float:
    """The smallest possible maximum device load: every replica count vector, every equal-size partition."""
    E, per = len(load), num_slots // num_devices
    best = np.inf
    for counts in itertools.product(range(1, num_slots - E + 2), repeat=E):
        if sum(counts) != num_slots:
            continue
        items = [load[e] / c for e, c in enumerate(counts) for _ in range(c)]
        for labels in set(itertools.permutations(np.repeat(np.arange(num_devices), per))):
            sums = np.zeros(num_devices)
            np.add.at(sums, np.asarray(labels), items)
            best = min(best, sums.max())
    return best


@pytest.mark.parametrize("E,R,D", [(4, 2, 2), (4, 0, 2), (3, 3, 3)])
def test_plan_is_near_the_brute_force_optimum(E, R, D):
    rng = np.random.default_rng(E * 10 + R + D)
    ratios = []
    for _ in range(12):
        load = rng.pareto(1.5, E) * 100 + 1
        p = plan(load[None], R, D)
        assert sorted(np.bincount(p.slot_expert[0], minlength=E)) == sorted(p.replicas[0])
        assert (p.replicas >= 1).all() and p.replicas.sum() == E + R
        got = p.device_load(load[None]).max()
        ratios.append(got / _optimum(load, E + R, D))
        assert p.device_load(load[None]).sum() == pytest.approx(load.sum())  # no load lost or doubled
    assert max(ratios) <= 4 / 3 + 1e-9 and np.mean(ratios) <= 1.05, ratios


def test_redundant_slots_even_out_a_skewed_router():
    """Zipf-skewed loads over the 300B shape (64 experts, EP 8): balancedness rises with R."""
    rng = np.random.default_rng(0)
    load = np.stack([rng.permutation(1 / np.arange(1, 65) ** 1.0) * 1e5 for _ in range(4)])  # 4 layers
    before = balancedness(identity_placement(4, 64, 8).device_load(load))
    after = {R: balancedness(plan(load, R, 8).device_load(load)) for R in (0, 8, 16)}
    assert (after[0] >= before - 1e-12).all() and (after[8] > after[0]).all() and (after[16] >= after[8] - 1e-9).all()
    assert balancedness(np.ones((1, 8)))[0] == 1.0


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="num_redundant_experts must be a non-negative multiple of the "
                                         "expert-parallel size 8, got 4"):
        plan(np.ones((1, 64)), 4, 8)
    with pytest.raises(ValueError, match="64 experts do not split over 3"):
        plan(np.ones((1, 64)), 0, 3)
    with pytest.raises(ValueError, match="layers, experts"):
        plan(np.ones(64), 8, 8)
    with pytest.raises(ValueError, match="non-negative"):
        plan(-np.ones((1, 64)), 8, 8)
