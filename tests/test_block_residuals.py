"""What the MoE block keeps for its backward pass besides the op's residuals.

* From its combine step only the count of valid pairs and the permutation, not
  ``jnp.where``'s ``[T*k, H]`` mask (what JAX saves). The masking is the same as
  ``jnp.where``'s, values and gradients bit for bit, NaN rows included; the public
  ``combine`` keeps ``jnp.where`` (forward mode works). (The float32 ``[49152, 2688]``
  buffers XLA kept per Nano layer were the backward's scatter-add zero fills:
  tests/test_gather_pairs.py.)
* From its router the tokens in their own dtype, not their float32 copy; the same
  gradients bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # (private: jax.ad_checkpoint.print_saved_residuals prints the same list)
    from jax._src.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover - a jax that moved it
    pytest.skip("this jax has no jax._src.ad_checkpoint.saved_residuals", allow_module_level=True)

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.moe import block
from jax_grouped_mlp._src.moe.routing import rows_below

T, H, F, E, K = 64, 32, 16, 8, 6


def test_rows_below_is_where_bit_for_bit(rng):
    y = jnp.asarray(rng.standard_normal((50, 7)), jnp.float32).at[45].set(jnp.nan).at[3].set(jnp.inf)
    ct = jnp.asarray(rng.standard_normal((50, 7)), jnp.float32)
    for n in (0, 1, 44, 50, 80, -3):
        want_fn = lambda y: jnp.where((jnp.arange(50) < n)[:, None], y, 0.0)  # noqa: E731
        got_y, got_vjp = jax.vjp(lambda y: rows_below(y, jnp.int32(n)), y)
        want_y, want_vjp = jax.vjp(want_fn, y)
        np.testing.assert_array_equal(got_y, want_y)
        np.testing.assert_array_equal(got_vjp(ct)[0], want_vjp(ct)[0])
    assert np.isnan(np.asarray(rows_below(y, jnp.int32(50)))).any()  # (NaN rows below n stay)


def test_moe_block_keeps_no_pair_sized_combine_residual(rng):
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((H, E)) * 0.1, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) * 0.1, jnp.float32)
    routing = jgm.RoutingConfig(top_k=K, score_function="sigmoid", routed_scaling_factor=2.5)

    def loss(x, router, w1, w2):
        y = jgm.moe_block(x, router, w1, w2, routing=routing, recipe="bf16")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    saved = saved_residuals(loss, x, router, w1, w2)
    combine = [(aval.str_short(), why) for aval, why in saved if "combine" in why]
    assert combine, "expected the combine's own residuals (its valid count, the inverse permutation)"
    big = [(s, why) for s, why in combine if s.endswith(f"[{T * K},{H}]")]
    assert not big, f"the combine keeps pair-sized arrays for the backward: {big}"


def test_public_combine_stays_forward_differentiable(rng):
    """``jgm.combine`` keeps ``jnp.where`` (``rows_below`` is reverse mode only): ``jax.jvp``
    works, and gives what ``jax.vjp`` implies (the map is linear in ``y_sorted``)."""
    ids = jnp.asarray(rng.integers(0, E + 1, (T, 2)), jnp.int32)  # (id E: a skipped pair)
    x = jnp.zeros((T, H), jnp.float32)
    *_, perm = jgm.permute(x, ids, None, E)
    y = jnp.asarray(rng.standard_normal((T * 2, H)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((T * 2, H)), jnp.float32)
    out, tangent = jax.jvp(lambda y: jgm.combine(y, perm), (y,), (t,))
    np.testing.assert_array_equal(tangent, jgm.combine(t, perm))
    np.testing.assert_array_equal(out, jgm.combine(y, perm))


def _block_inputs(rng):
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((H, E)) * 0.1, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) * 0.1, jnp.float32)
    return x, router, w1, w2


def _stats_loss(x, router, w1, w2):
    routing = jgm.RoutingConfig(top_k=3, score_function="sigmoid", routed_scaling_factor=2.5)
    y, stats = jgm.moe_block(x, router, w1, w2, routing=routing, recipe="bf16", return_stats=True)
    return jnp.sum(y.astype(jnp.float32) ** 2) + stats.load_balancing_loss + stats.z_loss


def test_router_keeps_the_tokens_in_their_dtype(rng, monkeypatch):
    args = _block_inputs(rng)
    token_sized = lambda: sorted(a.str_short() for a, why in saved_residuals(_stats_loss, *args)  # noqa: E731
                                 if a.shape == (T, H) and "block.py" in why)
    grads = jax.jit(jax.grad(_stats_loss, argnums=(0, 1, 2, 3)))(*args)
    assert token_sized() == [], "the router keeps a float32 copy of the tokens"
    # Plain AD of the same product (what the block did before): the float32 copy is kept,
    # and every gradient is the same, bit for bit.
    monkeypatch.setattr(block, "_router_logits", block._logits)
    assert token_sized() == [f"float32[{T},{H}]"]
    plain = jax.jit(jax.grad(lambda *a: _stats_loss(*a), argnums=(0, 1, 2, 3)))(*args)
    for got, want in zip(grads, plain):
        np.testing.assert_array_equal(got, want)
        assert np.abs(np.asarray(want, np.float32)).max() > 0


@pytest.mark.parametrize("placement", [("device",) * 3, ("recompute",) * 3, ("offload", "recompute", "device")])
def test_moe_block_keeps_its_input_in_every_placement(rng, placement):
    """The block keeps x for its backward whatever the policy (the router's weight
    gradient reads it), which ``plan_offload(layer="moe_block")`` relies on: recomputing
    the op's residuals from x costs a block no memory, unlike a bare ``grouped_mlp``."""
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((H, E)) * 0.1, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) * 0.1, jnp.float32)
    routing = jgm.RoutingConfig(top_k=2)
    block = jax.checkpoint(lambda x, router, w1, w2: jgm.moe_block(x, router, w1, w2, routing=routing),
                           policy=jgm.offload_policy(*placement))
    saved = saved_residuals(lambda *a: jnp.sum(block(*a).astype(jnp.float32)), x, router, w1, w2)
    assert any(aval.shape == (T, H) and aval.dtype == jnp.bfloat16 and why == "from the argument a[0]"
               for aval, why in saved), saved
