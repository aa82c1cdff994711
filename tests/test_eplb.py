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


# ---- EPLB in the engine -----------------------------------------------------------------------------------
def _moe_model():
    import jax.numpy as jnp
    from flax import nnx
    from ernie_jax import ErnieConfig, ErnieForCausalLM
    cfg = ErnieConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                      moe_layer_start_index=1, tie_word_embeddings=False, num_nextn_predict_layers=0,
                      moe_num_shared_experts=1)
    return ErnieForCausalLM(cfg, rngs=nnx.Rngs(5), dtype=jnp.float32)


@pytest.mark.parametrize("mode", ["colocated8", "pd"])
def test_greedy_unchanged_across_rebalances_mid_generation(mode):
    """R = 8 redundant experts re-placed every 5 steps while requests generate (the experts move between
    devices at step boundaries): every greedy output equals the run without EPLB, the placement changed,
    and the balancedness gauge and report read the window."""
    from ernie_jax import LLM, SamplingParams
    model = _moe_model()
    kw = dict(max_model_len=64, max_num_seqs=4, mesh=8,
              **({"disaggregate": False} if mode == "colocated8" else {"prefill_devices": 4}))
    prompts = [np.random.default_rng(i).integers(3, 256, n).tolist() for i, n in enumerate((5, 17, 9, 30))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = LLM(model, **kw, eplb_config={"num_redundant_experts": 8, "window_size": 20, "step_interval": 5,
                                        "log_balancedness": True})
    balancer = llm.engine.balancer
    first = balancer.placement
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert got == want
    assert balancer.rebalances >= 2 and not np.array_equal(first.slot_expert, balancer.placement.slot_expert)
    for inst in llm.engine.instances:
        assert inst.programs.expert_placement is balancer.placement  # every instance applied the last one
    report = balancer.report()
    assert len(report["balancedness"]) == 2 and all(0 < b <= 1 for b in report["balancedness"])
    from ernie_jax.serve.metrics import ServerMetrics
    text = ServerMetrics(llm.engine.stats, "m").render().decode()
    assert 'ernie_jax:eplb_balancedness{layer="1",model_name="m"}' in text
    assert 'ernie_jax:eplb_rebalances_total{model_name="m"}' in text


def test_eplb_config_errors_name_the_field():
    from ernie_jax import LLM
    from ernie_jax.engine.expert_balance import EPLBConfig, EPLBConfigError
    assert EPLBConfig.parse('{"num_redundant_experts": 8, "window_size": 10}') == EPLBConfig(8, 10)
    for bad, field in [('{"num_redundant_experts": 8', "not valid JSON"), ({"window_size": 0}, "window_size=0"),
                       ({"num_redundant_experts": -8}, "num_redundant_experts=-8"),
                       ({"num_redundant_expert": 8}, "unknown field"), ({"log_balancedness": "yes"}, "log_balancedness")]:
        with pytest.raises(EPLBConfigError, match=field):
            EPLBConfig.parse(bad)
    model = _moe_model()
    with pytest.raises(ValueError, match="needs expert parallelism"):
        LLM(model, max_model_len=64, max_num_seqs=2, eplb_config={"num_redundant_experts": 8})
    with pytest.raises(ValueError, match="num_redundant_experts must be a non-negative multiple of the expert-parallel size 8, got 4"):
        LLM(model, max_model_len=64, max_num_seqs=2, mesh=8, disaggregate=False, eplb_config={"num_redundant_experts": 4})


def test_admin_rebalance_route_needs_the_api_key_and_keeps_outputs():
    """POST /v1/admin/rebalance_experts (in process, over the routes the server runs): 401 without the API key;
    with it, a re-placement from the load the first request measured; the same request then gets the same
    greedy tokens from the re-placed experts."""
    import asyncio

    import httpx

    from ernie_jax import LLM
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    from ernie_jax.engine.async_engine import AsyncEngine
    from ernie_jax.serve.api import Server, create_app
    from ernie_jax.serve.metrics import ServerMetrics
    from ernie_jax.tokenizer import Tokenizer

    llm = LLM(_moe_model(), max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64, mesh=8, disaggregate=False,
              eplb_config={"num_redundant_experts": 8, "window_size": 50, "step_interval": 0})
    metrics = ServerMetrics(llm.engine.stats, "m")
    runner = AsyncEngine(llm.engine, on_finish=metrics.on_finish)
    app = create_app(Server(runner, Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR), "m", {}, metrics, api_key="k"))
    auth = {"Authorization": "Bearer k"}
    body = {"prompt": list(range(3, 40)), "max_tokens": 12, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.post("/v1/admin/rebalance_experts")).status_code == 401
            first = (await c.post("/v1/completions", json=body, headers=auth)).json()["choices"][0]["text"]
            r = await c.post("/v1/admin/rebalance_experts", headers=auth)
            assert r.status_code == 200 and r.json()["rebalanced"], r.text
            assert min(r.json()["balancedness_after"]) >= min(r.json()["balancedness_before"])
            again = (await c.post("/v1/completions", json=body, headers=auth)).json()["choices"][0]["text"]
            return first, again
    try:
        first, again = asyncio.run(run())
    finally:
        runner.shutdown()
    assert first == again
    assert all(i.programs.expert_placement is llm.engine.balancer.placement for i in llm.engine.instances)


def test_hierarchical_placement_keeps_replicas_on_their_node():
    """2 nodes x 4 devices, 16 experts, R = 8: each node holds 8 experts and all their replicas (16 + 8 slots,
    12 per node), every expert has a slot, node loads are within the greedy packing's bound, and devices
    are far more even than without EPLB. (An expert cannot span nodes, so a layer where one expert carries
    80 % of the tokens stays uneven: flat placement balances it better, at the price of cross-node traffic.)"""
    from ernie_jax.sharding.eplb import node_count
    rng = np.random.default_rng(0)
    load = rng.pareto(1.2, (3, 16)) * 100 + 1
    p = plan(load, 8, 8, num_nodes=2)
    assert p.slot_expert.shape == (3, 24) and (p.replicas.sum(1) == 24).all()
    for layer in range(3):
        halves = p.slot_expert[layer].reshape(2, 12)
        assert not set(halves[0]) & set(halves[1])  # no expert on both nodes
        assert set(halves[0]) | set(halves[1]) == set(range(16))
        node_load = [load[layer, sorted(set(h))].sum() for h in halves]
        assert max(node_load) <= load[layer].sum() / 2 + load[layer].max()  # LPT's bound
    hier = balancedness(p.device_load(load))
    assert (hier > 1.5 * balancedness(identity_placement(3, 16, 8).device_load(load))).all()
    assert (hier[1:] > 0.95).all()  # the layers without a dominant expert
    Dev = type("Dev", (), {})
    devices = [Dev() for _ in range(8)]
    for i, d in enumerate(devices):
        d.process_index = i // 4
    assert node_count(devices) == 2 and node_count(devices[:4]) == 1
    devices[1].process_index, devices[5].process_index = 1, 0  # hosts interleaved: no hierarchical form
    assert node_count(devices) == 1
    with pytest.raises(ValueError, match="the nodes must divide both"):
        plan(load, 8, 8, num_nodes=3)


def test_expert_devices_follow_the_slot_order():
    """ShardingPlan.expert_devices lists one EP group's devices in the order the experts axis is split: the
    i-th device holds the i-th block of an experts leaf placed by the plan (tp_ep on (1,4,2), and
    dp_attn_ep, whose experts span the data axis too)."""
    import jax
    from ernie_jax.sharding import ShardingPlan, make_mesh
    for spec, preset in (("data=1,expert=4,tensor=2", "tp_ep"), ("data=2,expert=2,tensor=2", "dp_attn_ep"),
                         ("data=2,expert=2,tensor=2", "tp_ep")):
        plan = ShardingPlan.create(make_mesh(spec), preset)
        experts = np.arange(16 * 2 * 2, dtype=np.float32).reshape(16, 2, 2)  # [E, H, F]: expert e's values start 4e
        placed = jax.device_put(experts, plan.named(plan.param_spec("experts_up_gate", experts)))
        held = {sh.device: int(np.asarray(sh.data)[0, 0, 0]) // 4 for sh in placed.addressable_shards}
        order = plan.expert_devices()
        per = 16 // len(order)
        assert [held[d] for d in order] == [i * per for i in range(len(order))], (spec, preset)
