"""Honest dispatch: the kernels run only on the GPUs they were built for, and
``backend_info()`` says what runs. A foreign GPU is faked on the CPU by replacing the
list of local CUDA devices (``devices._local_cuda_devices``)."""

from __future__ import annotations

import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.cuda import devices, ffi
from jax_grouped_mlp._src.op import backend, primitives

JGM_TARGET = "jgm_"  # every custom call target of the extension starts with it


@pytest.fixture
def fake_gpus(monkeypatch):
    """Makes the process see the given CUDA devices (compute capabilities)."""

    def install(*capabilities: str):
        fakes = [types.SimpleNamespace(id=i, device_kind=f"Fake GPU sm_{cc.replace('.', '')}", compute_capability=cc)
                 for i, cc in enumerate(capabilities)]
        monkeypatch.setattr(devices, "_local_cuda_devices", lambda: fakes)
        devices.cuda_devices.cache_clear()
        devices._warn_once.cache_clear()
        jax.clear_caches()  # programs traced for the previous devices

    yield install
    devices.cuda_devices.cache_clear()
    devices._warn_once.cache_clear()


def _inputs(rng, m=96, h=64, f=96, g=3):
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.bfloat16)
    gs = jnp.asarray([40, 0, 50], jnp.int32)
    p = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    return x, w1, w2, gs, p


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _grad_fn(x, w1, w2, gs, p):
    return jax.grad(lambda x, w1, w2: jnp.sum(jgm.grouped_mlp(x, w1, w2, gs, p).astype(jnp.float32) ** 2),
                    argnums=(0, 1, 2))(x, w1, w2)


def test_backend_info_on_this_machine():
    info = jgm.backend_info()
    assert isinstance(info, jgm.BackendInfo)
    assert info.extension == ffi.available()
    assert info.kernel_arch == ("sm_90a" if info.extension else None)
    assert set(info.paths) == set(primitives._REFERENCE)
    text = str(info)
    assert all(name in text for name in info.paths)
    assert f"layer_scan host copies: {info.layer_scan_copies}" in text
    if jax.default_backend() == "cpu":
        assert set(info.paths.values()) == {backend.REFERENCE} and info.reason
        assert info.layer_scan_copies == "XLA"


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
def test_foreign_gpu_runs_the_pure_jax_path_and_warns_once(rng, fake_gpus):
    """On an sm_80 GPU the CUDA lowering holds none of our custom calls (the dispatcher
    falls back), one warning says why, and nothing fails; on sm_90 the kernels are there."""
    args = _inputs(rng)
    fake_gpus("9.0")
    assert JGM_TARGET in _cuda_text(_grad_fn, *args)

    fake_gpus("8.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _cuda_text(_grad_fn, *args)
        _cuda_text(lambda *a: jgm.grouped_mlp(*a, recipe="bf16"), *args)  # a second program: no new warning
    assert JGM_TARGET not in text
    ours = [w for w in caught if "jax_grouped_mlp" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "sm_90a" in str(ours[0].message) and "compute capability 8.0" in str(ours[0].message)
    # The program still computes the op (here on the CPU): the reference's numbers.
    got = jax.jit(_grad_fn)(*args)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() and np.abs(np.asarray(g, np.float32)).max() > 0
               for g in got)


def test_mixed_gpus_take_the_pure_jax_path(rng, fake_gpus):
    fake_gpus("9.0", "10.0")
    with pytest.warns(RuntimeWarning, match="compute capability 10.0"):
        with pytest.raises(ffi.Unsupported):
            devices.check_kernels_run_here()
    assert [d.kernels for d in devices.cuda_devices()] == [True, False]


def test_backend_info_paths_with_faked_gpus(monkeypatch, fake_gpus):
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    fake_gpus("9.0")
    info = jgm.backend_info()
    if ffi.available():
        assert info.reason is None
        assert {n for n, p in info.paths.items() if p == backend.KERNEL} == set(primitives._CUDA_IMPLS)
        assert info.paths["quantize"] == backend.REFERENCE  # no kernel: the reference everywhere
    else:
        assert "not built" in info.reason
    from jax_grouped_mlp._src.op.recipes import Recipe

    assert set(info.recipes) == {r.value for r in Recipe}
    for recipe in ("mxfp8", "bf16", "fp8_block"):
        assert info.recipes[recipe] == (backend.KERNEL if ffi.available() else backend.REFERENCE)
    fake_gpus("8.0")
    info = jgm.backend_info()
    assert set(info.paths.values()) == {backend.REFERENCE}
    assert set(info.recipes.values()) == {backend.REFERENCE}
    assert "compute capability" in info.reason or "not built" in info.reason
    assert "8.0" in str(info)


@pytest.mark.gpu
def test_backend_info_on_the_h200():
    """On a Hopper GPU with the extension: every primitive takes its kernel, the device
    is reported as running them, and a jitted gradient calls the extension."""
    info = jgm.backend_info()
    assert info.extension and info.kernel_arch == "sm_90a" and info.default_platform == "gpu"
    assert info.cuda_devices and all(d.kernels and d.compute_capability == "9.0" for d in info.cuda_devices)
    # Every primitive of the training step has a kernel; `quantize`/`quantize_both` (real
    # MXFP8 tensors, for the public quantize_mxfp8) are XLA fusions since their standalone
    # kernel was removed, and are honestly reported as pure JAX.
    kernels = {"fake_quantize", "fake_quantize_pair", "grouped_gemm", "grouped_gemm_qw", "grouped_wgrad",
               "fc1_fused", "dgrad_fused", "fp8_block_pair", "fp8_block_pair_tm", "fp8_block_weight",
               "fp8_block_row", "fp8_block_fc1"}
    assert {n for n, p in info.paths.items() if p == backend.KERNEL} == kernels, info
    assert {n for n, p in info.paths.items() if p == backend.REFERENCE} == {"quantize", "quantize_both"}, info
    assert info.reason is None
    assert info.layer_scan_copies == "library streams"
    args = _inputs(np.random.default_rng(0))
    hlo = jax.jit(_grad_fn).lower(*args).compile().as_text()
    assert 'custom_call_target="' + JGM_TARGET in hlo


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
@pytest.mark.parametrize("weights_in_gemm", [True, False])
def test_a_build_without_the_fused_kernels_composes_them_from_its_others(rng, fake_gpus, monkeypatch,
                                                                        weights_in_gemm):
    """A build whose extension lacks the fused kernels (the ``_qw`` GEMM, FC1 with its
    epilogue, the FC2 dgrad with its epilogue) runs them on CUDA as the composition of
    the kernels it has, not as the pure-JAX reference: every GEMM of the mxfp8 step is
    still a ``jgm_grouped_gemm`` call, and ``backend_info`` says "other cuda kernels"."""
    from jax_grouped_mlp._src.cuda import gemm_ffi
    from jax_grouped_mlp._src.op.heuristics import KernelChoices
    from jax_grouped_mlp._src.op.mlp import grouped_mlp_with

    if not gemm_ffi.grouped_gemm_variants():
        pytest.skip("this build has no grouped GEMM kernel")
    fake_gpus("9.0")
    monkeypatch.setattr(primitives, "_CUDA_IMPLS",
                        {k: v for k, v in primitives._CUDA_IMPLS.items() if k not in primitives.COMPOSED})
    choices = KernelChoices(quantize_weights_in_gemm=weights_in_gemm)

    def grad_fn(x, w1, w2, gs, p):
        loss = lambda x, w1, w2: jnp.sum(grouped_mlp_with(choices, x, w1, w2, gs, p).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    text = _cuda_text(grad_fn, *_inputs(rng))  # 32 rows a group: small enough for the _qw path
    for target in (gemm_ffi.GROUPED_GEMM_QW_TARGET, gemm_ffi.GROUPED_GEMM_FC1_TARGET,
                   gemm_ffi.GROUPED_GEMM_DGRAD_TARGET):
        assert f"@{target}(" not in text, target
    assert text.count(f"@{gemm_ffi.GROUPED_GEMM_TARGET}(") == 4  # FC1, FC2 and both dgrads
    assert text.count(f"@{gemm_ffi.GROUPED_WGRAD_TARGET}(") == 2
    monkeypatch.setattr(backend.jax, "default_backend", lambda: "gpu")
    paths = jgm.backend_info().paths
    assert {n for n, p in paths.items() if p == backend.COMPOSED} == set(primitives.COMPOSED), paths


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
def test_fp8_block_recipe_lowers_to_its_kernels(rng, fake_gpus):
    """recipe="fp8_block" lowered for CUDA: FC1 is the FP8 block-scaled kernel with its
    epilogue (srelu(h)'s two copies), FC2 and the data gradients the plain one (3 calls),
    the weight gradients the FP8 weight-gradient kernel (2) on token-major operands: the
    kept residuals x and srelu(h) laid out by the layout kernel (2), dy and dh written so
    by the pair quantizer itself (3 pair calls in all: x, dy, dh); a hidden size off the
    FP8 GEMM's contract (K % 16) sends the GEMMs that reduce over it to the bf16 kernel
    instead, on the dequantized operands (FC1 then unfused: its GEMM and srelu(h)'s pair
    quantizer), and the layout of x to XLA."""
    from jax_grouped_mlp._src.cuda import fp8_block_fc1_ffi, fp8_block_ffi, gemm_ffi

    if not gemm_ffi.grouped_gemm_fp8_block_variants():
        pytest.skip("this build has no FP8 block-scaled GEMM (fp8_block then takes the bf16 kernel)")

    def grad_fn(x, w1, w2, gs, p):
        loss = lambda x, w1, w2: jnp.sum(jgm.grouped_mlp(x, w1, w2, gs, p, recipe="fp8_block").astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    fake_gpus("9.0")
    text = _cuda_text(grad_fn, *_inputs(rng))
    fused = 1 if fp8_block_fc1_ffi.variants() else 0  # (a build without the FC1 epilogue composes it)
    assert text.count(f'@{gemm_ffi.GROUPED_GEMM_FP8_BLOCK_TARGET}(') == 4 - fused, text.count(gemm_ffi.GROUPED_GEMM_FP8_BLOCK_TARGET)
    assert text.count(f'@{fp8_block_fc1_ffi.TARGET}(') == fused
    assert text.count(f'@{gemm_ffi.GROUPED_WGRAD_FP8_BLOCK_TARGET}(') == 2
    assert text.count(f'@{gemm_ffi.TOKEN_MAJOR_BLOCKS_TARGET}(') == 2  # x, srelu(h)
    assert text.count(f'@{fp8_block_ffi.PAIR_TARGET}(') == 4 - fused  # x, (srelu(h)); dy, dh token-major
    assert f'@{gemm_ffi.GROUPED_WGRAD_TARGET}(' not in text
    assert f'@{gemm_ffi.GROUPED_GEMM_TARGET}(' not in text

    # H = 72: FC1 (K = H) and FC2's dgrad (K = H) fall back to the bf16 kernel; x's
    # token-major layout (72 columns, not whole 16-byte chunks) to XLA; dy's still comes
    # from its pair quantizer (which takes K % 8 == 0).
    text = _cuda_text(grad_fn, *_inputs(rng, h=72))
    assert text.count(f'@{gemm_ffi.GROUPED_GEMM_FP8_BLOCK_TARGET}(') == 2
    assert f'@{fp8_block_fc1_ffi.TARGET}(' not in text
    assert text.count(f'@{gemm_ffi.GROUPED_GEMM_TARGET}(') == 2
    assert text.count(f'@{gemm_ffi.GROUPED_WGRAD_FP8_BLOCK_TARGET}(') == 2
    assert text.count(f'@{gemm_ffi.TOKEN_MAJOR_BLOCKS_TARGET}(') == 1
    assert text.count(f'@{fp8_block_ffi.PAIR_TARGET}(') == 4


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
def test_fp8_block_prepared_weights_need_no_transpose_on_cuda(rng, fake_gpus):
    """``prepare_weights(recipe="fp8_block")`` stores the forward copies K-major, so the
    forward FP8 GEMMs read them as they are: no FP8 weight transpose left in the CUDA
    program; nor without ``prepared``, where the weight quantizer writes the K-major
    copy itself (``fp8_block_weight(w, k_major=True)``), except for a weight whose rows
    are not whole 16-byte chunks (its tiles are then transposed by XLA)."""
    from jax_grouped_mlp._src.cuda import fp8_block_fc1_ffi, fp8_block_ffi, gemm_ffi

    if not gemm_ffi.grouped_gemm_fp8_block_variants():
        pytest.skip("this build has no FP8 block-scaled GEMM")
    x, w1, w2, gs, p = _inputs(rng)

    def grad_fn(x, w1, w2, gs, p, pw):
        loss = lambda x, w1, w2: jnp.sum(
            jgm.grouped_mlp(x, w1, w2, gs, p, recipe="fp8_block", prepared=pw).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    fake_gpus("9.0")
    fp8_transposes = re.compile(r"stablehlo\.transpose[^\n]*-> tensor<3x(?:96x64|64x96)xf8E4M3FN>")
    pw = jgm.prepare_weights(w1, w2, recipe="fp8_block")
    text = _cuda_text(grad_fn, x, w1, w2, gs, p, pw)
    # (FC1 with its epilogue reads the prepared K-major copy too)
    fused = text.count(f'@{fp8_block_fc1_ffi.TARGET}(')
    assert fused == (1 if fp8_block_fc1_ffi.variants() else 0)
    assert text.count(f'@{gemm_ffi.GROUPED_GEMM_FP8_BLOCK_TARGET}(') + fused == 4
    assert not fp8_transposes.findall(text)
    unprepared = _cuda_text(lambda x, w1, w2, gs, p: grad_fn(x, w1, w2, gs, p, None), x, w1, w2, gs, p)
    assert not fp8_transposes.findall(unprepared)
    assert unprepared.count(f'@{fp8_block_ffi.TARGET}(') >= 4  # w1 and w2, each K-major and as stored
    # The pattern finds what it looks for: the transposing fallback for A % 16 != 0.
    x, w1, w2, gs, p = _inputs(rng, h=72)
    odd = re.compile(r"stablehlo\.transpose[^\n]*-> tensor<3x96x72xf8E4M3FN>")
    assert len(odd.findall(_cuda_text(lambda x, w1, w2, gs, p: grad_fn(x, w1, w2, gs, p, None), x, w1, w2, gs, p))) == 1


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
def test_cuda_lowering_under_strict_dtype_promotion(rng, fake_gpus):
    """A user's ``jax.numpy_dtype_promotion("strict")`` lowers the CUDA program too,
    including the device-side token-tile choice of the weight-quantizing GEMMs."""
    from jax_grouped_mlp._src.cuda import gemm_ffi

    fake_gpus("9.0")
    with jax.numpy_dtype_promotion("strict"):
        text = _cuda_text(_grad_fn, *_inputs(rng))
    if gemm_ffi.grouped_gemm_qw_variants():
        assert f"@{gemm_ffi.GROUPED_GEMM_QW_TARGET}(" in text
