"""Test setup: 8 fake CPU devices (set before JAX starts) and shared fixtures."""

import os

# The tests' programs are compiled without LLVM's optimisations: the suite compiles hundreds of small
# programs and runs each a few times, so compile time is most of its time (the role-switching test: 74 s
# cold with the default level, 37 s with this). What the tests check -- tokens, logits within tolerance,
# pages, protocol -- holds at any level; speed is the benchmarks' business, on default flags. Every process
# a test starts (servers, distributed workers) gets the same flag (serving.launch, test_multihost*).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS} "
                           "--xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

# Engines compile every bucket at start-up; identical programs across tests come from this cache.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "ernie_jax_test_xla_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The default suite's time budget (a fresh clone's `make test` under 10 minutes on 2 cores with an empty XLA
# cache): these cases run only under `make test-all` (-m ""). Each entry is a test and the parameter ids
# that stay in the default suite (none: the whole test is slow); every other case of it is marked slow.
SLOW_CASES: dict[str, tuple[str, ...]] = {
    "test_int_quant.py::test_model_runs_through_the_integer_kernels": (),
    "test_converters.py::test_export_hf_equals_the_transformers_save": ("shared_untied",),
    "test_converters.py::test_export_hf_of_the_fp8_release_equals_its_bf16_export": (),
    "test_int_quant.py::test_sharded_equals_unsharded": ("wint4-16",),
    # 8 and 4 bits, per channel and grouped, W4A8 at decode and prefill sizes by default; all of M = 1, 7, 64, 300
    # and every scheme in make test-all
    "test_int_quant.py::test_kernel_matches_its_reference": ("8--1-weight_only-1", "4-128-weight_only-300",
                                                             "4--1-w4a8-1", "4--1-w4a8-300"),
    "test_int_quant.py::test_converted_checkpoint_loads_bit_identically_to_load_time_quantization": (
        "wint4-16", "w4a8--1"),  # w4a8 writes both int8 and int4 tensors
    "test_int_quant.py::test_grouped_kernel_matches_its_reference": tuple(
        f"{s}-sizes2" for s in ("8--1-weight_only", "4-64-weight_only", "4--1-w4a8")),
    "test_embedded_model.py::test_generate_cli_defaults_to_the_shipped_model": (),
    "test_sharding.py::test_all_to_all_dispatch_matches_unsharded": (),
    "test_sharding.py::test_sharded_matches_unsharded": (),
    "test_sharding.py::test_other_presets": (),
    "test_sharding.py::test_skewed_routing_drops_nothing_under_ep": (),
    "test_sharding.py::test_plan_cli_on_tiny": (),
    "test_sharding.py::test_plan_cli_compiles_the_speculative_programs": (),
    "test_sharding.py::test_redundant_experts_leave_the_logits_unchanged": (),
    "test_sharding.py::test_fused_columns_need_no_collective_before_attention_or_activation": (),
    "test_sharding.py::test_fused_layout_moves_whole_fp8_scale_blocks_and_back": (),
    "test_sharding.py::test_disjoint_submeshes": (),
    "test_serve.py::test_sigterm_drains_requests_in_flight": (),
    "test_pd_servers.py::test_a_decode_server_killed_mid_stream_fails_its_stream_and_a_restarted_one_rejoins": (),
    "test_pd_servers.py::test_split_with_mtp_fp8_kv_and_different_meshes": (),
    "test_pd_servers.py::test_dynamic_roles_across_servers_take_a_prompt_burst_on_the_decode_servers": (),
    "test_pd_servers.py::test_a_kv_transfer_port_in_use_stops_the_server_naming_the_flag": (),
    "test_serve.py::test_fuzzed_requests_never_get_a_5xx_or_break_the_server": ("20",),
    "test_serve_soak.py::test_hundreds_of_clients_with_disconnects_and_malformed_requests": (),
    "test_fp8.py::test_fp8_paddle_checkpoint_weight_only_matches_dequantized_reference": (),
    "test_fp8.py::test_accuracy_report_bounds": (),
    "test_fp8.py::test_fp8_kv_cache_dynamic_and_static_scales": (),
    "test_engine.py::test_sharded_programs_never_copy_the_kv_pool": (),
    "test_engine.py::test_greedy_matches_hf_in_every_mode": ("single",),
    "test_engine.py::test_pd_programs_run_on_their_submeshes_and_pages_move_bit_identically": (),
    "test_engine.py::test_pd_prefills_a_burst_of_prompts_in_batches": (),
    "test_engine.py::test_decode_steps_chain_on_device_without_changing_tokens": ("single",),
    "test_engine.py::test_fp8_kv_cache_same_in_pd_and_colocated": (),
    "test_engine.py::test_cpu_decode_reads_bf16_weights_as_stored": (),
    "test_engine.py::test_64_concurrent_requests_more_than_the_cache_holds": (),
    "test_engine.py::test_greedy_matches_hf_with_tiled_prefill_experts": (),
    "test_ops.py::test_sharded_programs_use_kernels_where_shards_allow": (),
    "test_ops.py::test_sharded_fp8_linears_run_the_kernel_per_device": (),
    "test_serve.py::test_64_concurrent_streams_equal_alone_runs": (),
    "test_serve.py::test_full_queue_answers_429_and_keeps_serving": (),
    "test_serve.py::test_echo_prompt_logprobs": (),
    "test_parity.py::test_greedy_continuations_match_hf_generate": ("shared_untied-paddle",),
    "test_parity.py::test_incremental_decode_through_kv_cache": ("shared_untied-paddle",),
    "test_converters.py::test_paddle_to_jax_round_trip": (),
    "test_expert_impls.py::test_cpu_paths_match_ragged_path": ("0-8-random-1",),
    "test_expert_impls.py::test_ragged_expert_parallel_matches": ("data=2,expert=2,tensor=2",),
    "test_expert_impls.py::test_ragged_path_matches_hf": ("shared_untied",),
    "test_expert_impls.py::test_ragged_fp8_grouped_path_matches_capacity_path": (),
    "test_ops.py::test_block_fp8_matmul": ("float32-7-200-136", "bfloat16-33-384-256"),
    "test_ops.py::test_block_fp8_matmul_k_major": ("pallas_triton-5-256-256", "xla-7-200-136"),
    "test_ops.py::test_grouped_block_fp8_matmul": ("sizes0-True", "sizes2-False"),
    "test_ops.py::test_paged_decode_attention": ("10-2-False",),
    "test_ops.py::test_xla_paged_attention_reads_only_what_positions_reach": ("16-decode-xla_cpu",),
    "test_ops.py::test_paged_prefill_attention": ("16-7-True",),
    "test_train.py::test_mesh_step_matches_one_device_step": (),
    "test_llm.py::test_batched_equals_alone_greedy": (),
    "test_tokenizer.py::test_llm_chat_and_text_stream": (),
    "test_multihost.py::test_two_processes_match_single_process": (),
    "test_multihost_serve.py::test_mtp_and_expert_replacements_mid_generation_across_processes_then_a_drained_stop": (),
    "test_multihost_serve.py::test_processes_launched_differently_both_exit_naming_the_setting": (),
    "test_multihost_serve.py::test_an_unreachable_coordinator_is_a_clear_error_within_the_timeout": (),
    "test_multihost_serve.py::test_a_killed_leader_ends_the_follower": (),
    "test_multihost_serve.py::test_prefix_caching_and_preemption_across_processes": (),
    "test_multihost_serve.py::test_fp8_kv_and_a_json_schema_across_processes": (),
    "test_multihost_serve.py::test_pd_with_a_submesh_per_process_matches_one_process": (),
    "test_multihost_serve.py::test_pd_with_submeshes_that_span_processes": (),
    "test_multihost_serve.py::test_role_servers_across_processes_behind_the_router": (),
    "test_notebooks.py::test_notebook_runs": (),
    "test_kv_memory.py::test_greedy_unchanged_by_prefix_caching_and_preemption": ("single-auto",),
    "test_pd.py::test_decode_keeps_stepping_while_a_2000_token_prompt_prefills": (),
    "test_sim.py::test_calibrate_fits_the_real_engine_and_predicts_it": (),
    "test_engine.py::test_async_engine_takes_requests_during_a_step_and_survives_a_device_error": ("single",),
    "test_speculative.py::test_greedy_with_mtp_equals_greedy_without_on_golden": (),
    "test_speculative.py::test_greedy_with_mtp_equals_greedy_without_under_pd": (),
    "test_speculative.py::test_preemption_and_prefix_caching_stay_exact_with_mtp": (),
    "test_eplb.py::test_greedy_unchanged_across_rebalances_mid_generation": (),
    "test_structured.py::test_constrained_replies_survive_preemption": (),
    "test_structured.py::test_constrained_rows_decode_without_drafts_beside_speculating_ones": (),
}


@pytest.hookimpl(tryfirst=True)  # before the -m filter deselects by marker
def pytest_collection_modifyitems(config, items):
    kept = {}
    for item in items:
        key = f"{item.path.name}::{item.originalname}"
        if key not in SLOW_CASES:
            continue
        case = item.callspec.id if hasattr(item, "callspec") else None
        kept.setdefault(key, set()).add(case)
        if case not in SLOW_CASES[key]:
            item.add_marker(pytest.mark.slow)
    for key, seen in kept.items():  # a misspelt id would silently move its case out of the default suite
        missing = set(SLOW_CASES[key]) - seen
        assert not missing, f"SLOW_CASES[{key!r}] keeps {sorted(missing)}, which are not cases of that test"


# The embedded model's engine shape for every test file that needs one engine of it (chat, kernel fallback,
# MTP): after the first file compiles its 3 programs (prefill chunks of 16 and 32, decode batch 2), the
# others load them from the XLA cache.
EMBEDDED_ENGINE = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)

GOLDEN = pathlib.Path(__file__).parent / "golden"
GOLDEN_MODELS = ["shared_untied", "noshared_tied", "interval2_headdim"]


@pytest.fixture(scope="session")
def golden():
    def get(name: str):
        return np.load(GOLDEN / name / "golden.npz")
    return get


def rewrite_safetensors(folder, edit):
    """Rewrite folder/model.safetensors after `edit(tensors, header_dtypes)` changed the dicts in place."""
    from ernie_jax.checkpoint.safetensors_io import SafetensorsCheckpoint, read_tensor, save_file
    file = folder / "model.safetensors"
    ckpt = SafetensorsCheckpoint(str(file))
    tensors = {k: np.array(read_tensor(ckpt.info(k), bitcast=False)) for k in ckpt.keys()}
    names = {k: ckpt.info(k).dtype for k in ckpt.keys()}
    edit(tensors, names)
    save_file(tensors, str(file), dtype_names={k: v for k, v in names.items() if k in tensors})
