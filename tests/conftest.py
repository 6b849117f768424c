"""Shared fixtures: fresh random inputs every run (the seed is printed on failure)."""

from __future__ import annotations

import os

import numpy as np
import pytest

# Several xdist workers share one GPU: JAX's default preallocation (75 % of the GPU's
# memory per process) made the GPU tests under ``-n 4`` fail with RESOURCE_EXHAUSTED on
# an H100 (2026-12-06). Read when the backend starts, after this import.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Without a GPU, the CPU tests spend most of their time in XLA's CPU compiler; LLVM at
# optimization level 0 cuts that time by about a third (a 6-layer gradient: backend
# compile 37-42 s -> 28 s) and the fast suite's by a fifth (1347 -> 1057 s on 2 cores,
# 2026-12-07). It changes no number: XLA emits the arithmetic without fast-math flags,
# so LLVM may not reorder or contract it, and every program a test compares is
# compiled the same way. Read when the backend starts (after this import), and
# inherited by the tests' subprocesses. A GPU machine (its driver's /dev/nvidiactl)
# keeps XLA's defaults; so does JGM_TEST_XLA_OPT=1, and so does an XLA_FLAGS that
# already names an optimization level.
_OPT_LEVEL = "--xla_backend_optimization_level"
if (not os.path.exists("/dev/nvidiactl") and os.environ.get("JGM_TEST_XLA_OPT") != "1"
        and _OPT_LEVEL not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT_LEVEL}=0".strip()

from gpu_helpers import has_gpu  # noqa: E402


# The long CPU cases (>= 10 s each on the 2-core CI machine: multi-device
# subprocesses, all-policy sweeps, end-to-end runs, second-order and export checks):
# marked ``slow`` so that ``make test`` (-m "not slow") stays the shorter half there;
# ``make test-slow`` runs them, and CI runs both. Re-measure with
# ``pytest --durations=60`` when the suite changes.
SLOW = frozenset({
    "tests/test_bench_offload.py::test_inprocess_run_estimates_the_peak_from_the_serialized_assignment",
    "tests/test_bench_offload.py::test_layouts_layer_counts_and_bars_inprocess",
    "tests/test_bench_offload.py::test_tiny_run_end_to_end",
    "tests/test_bench_offload.py::test_scan_and_loop_layouts_give_the_same_gradients",
    "tests/test_moe_stats.py::test_flax_moe_block_sows_stats_and_shared_expert",
    "tests/test_flax.py::test_float32_params_get_float32_gradients",
    "tests/test_fp8_block.py::test_recipe_keeps_fp8_residuals_and_sends_only_its_gemms_to_cuda",
    "tests/test_fp8_block.py::test_recipe_semantics_exact",
    "tests/test_prepared_weights.py::test_moe_block_and_flax_modules_take_prepared_weights",
    "tests/test_flax.py::test_params_and_forward",
    "tests/test_flax.py::test_sharded_cases_on_four_cpu_devices",
    "tests/test_grouped_gemm_dgrad_gpu.py::test_static_empty_cases_are_exact_in_jax",
    "tests/test_grouped_gemm_fc1_gpu.py::test_static_empty_cases_are_exact_in_jax",
    "tests/test_heuristics.py::test_grouped_mlp_is_the_default_choices",
    "tests/test_higher_order.py::test_grad_of_grad_same_on_every_path",
    "tests/test_higher_order.py::test_prepared_weights_same_second_order_without_excess_precision",
    "tests/test_higher_order.py::test_vmap_same_on_every_path",
    "tests/test_mlp.py::test_backward_order_barrier",
    "tests/test_mlp.py::test_float32_weights_take_the_bf16_path",
    "tests/test_mlp.py::test_mxfp8_gemm_semantics_exact",
    "tests/test_mlp.py::test_weights_quantized_in_the_gemm_same_bits",
    "tests/test_moe.py::test_flax_moe_block_trains",
    "tests/test_moe.py::test_fuse_fc1_epilogue_reaches_the_mlp",
    "tests/test_moe.py::test_no_tokens",
    "tests/test_moe_sharded.py::test_expert_parallel_cases_on_four_cpu_devices",
    "tests/test_moe_stats.py::test_flax_aux_loss_trains_the_router_towards_balance",
    "tests/test_moe_stats.py::test_shared_expert_against_float64",
    "tests/test_mxfp8.py::test_grouped_matches_per_group_quantization",
    "tests/test_offload_policies.py::test_backward_recomputes_what_the_policy_says",
    "tests/test_offload_policies.py::test_gradients_bitwise_equal_under_every_policy",
    "tests/test_offload_policies.py::test_gradients_bitwise_equal_under_every_policy_fp8_block",
    "tests/test_offload_policies.py::test_rebuilt_fc2_input_under_vmap_and_second_order",
    "tests/test_offload_policies.py::test_reloads_wait_for_the_layers_cotangent",
    "tests/test_offload_policies.py::test_train_step_compiles_once",
    "tests/test_planner.py::test_measure_layer_time_runs",
    "tests/test_planner.py::test_planned_policy_gradients_match_no_offload",
    "tests/test_policy.py::test_recomputing_fc2_input_never_reruns_fc1",
    "tests/test_primitives.py::test_shape_polymorphic_export_for_cpu_and_cuda",
    "tests/test_primitives.py::test_shape_polymorphic_export_of_the_gradient",
    "tests/test_shard_map.py::test_user_shard_map_cases_on_four_cpu_devices",
    "tests/test_train_moe.py::test_demo_balances_with_the_aux_loss",
    "tests/test_train_moe.py::test_demo_resumes_from_its_checkpoint",
    "tests/test_train_moe.py::test_demo_trains_under_the_planned_policy",
})


# Tests that also run under the oldest jax the package supports (README: "Supported"),
# in its own environment (``make test-oldest-jax``, tools/venv_oldest_jax.sh; CI runs it
# after the suites): the offload machinery reads JAX internals (``jax._src``: remat's
# policies, partial evaluation, memory kinds), whose behaviour changes between releases.
# The GPU image runs an older jax than CI's newest one, and a difference of this kind
# (``jax.checkpoint``'s per-argument ``prevent_cse`` under jax 0.11.2, 2026-12-07) once
# failed only on the GPU. One case of each mechanism, not the sweeps: a few minutes.
OLDEST_JAX = frozenset({
    "tests/test_layer_stack.py::test_without_prefetch_and_without_gradient_it_is_the_loop",
    "tests/test_layer_stack.py::test_layer_scan_one_scan_over_all_layers_is_bitwise_the_loop",
    "tests/test_layer_stack.py::test_per_argument_prevent_cse_probe_matches_the_jax_version",
    "tests/test_layer_stack.py::test_layer_scan_recomputes_scanned_layers_without_remat_barrier",
    "tests/test_layer_stack.py::test_layer_scan_carries_its_layer_index",
    "tests/test_layer_stack.py::test_with_flax_nnx_modules",
    "tests/test_layer_stack.py::test_layer_scan_eager_gradient_compiles_once",
    "tests/test_policy.py::test_gradients_identical_across_policies",
    "tests/test_policy.py::test_otherwise_decides_what_the_policy_does_not_name",
    "tests/test_offload_policies.py::test_train_step_compiles_once",
    "tests/test_offload_policies.py::test_eager_calls_compile_only_the_first_time",
    "tests/test_moe.py::test_leading_axes_and_jit_grad_under_offload_policy",
    "tests/test_moe.py::test_block_against_float64",
    "tests/test_flax.py::test_trains_under_jit_and_remat",
})


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated here for runs outside the source tree
    # (tools/check_wheel.sh copies tests/ next to an installed wheel).
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU with the compiled kernels (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: a long CPU case (tests/conftest.py SLOW)")
    config.addinivalue_line("markers", "oldest_jax: also run under the oldest supported jax (tests/conftest.py OLDEST_JAX)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.split("[")[0]
        if name in SLOW:
            item.add_marker(pytest.mark.slow)
        if name in OLDEST_JAX:
            item.add_marker(pytest.mark.oldest_jax)
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def gpu():
    """The first CUDA device; skips without one or without the built extension."""
    import jax

    from jax_grouped_mlp._src.cuda import ffi

    devs = [d for d in jax.devices() if d.platform == "gpu"]
    if not devs or not ffi.available():
        pytest.skip("needs a GPU and the built extension")
    return devs[0]


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator with a fresh seed (set JGM_SEED to reproduce a failure)."""
    seed = int(os.environ.get("JGM_SEED", np.random.SeedSequence().entropy % (2**32)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
