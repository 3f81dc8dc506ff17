"""The decode prologue (pallas_kernels/decode_prologue) in interpret mode against its pure-jnp reference, and the
reference against the decoder's own ops (surojax's rms_norm / rms_norm_zero_centered / apply_rope and the pool's
`.at[layer, slots].set`).

Tolerance: bf16 results must be the same bf16 numbers (the kernel rounds after each op as XLA does); fp32 results
may differ by one fp32 rounding of rope's sum, which XLA may contract into an FMA (x cos + x' sin), and by the
order of the norm's sum: rtol = atol = 1e-6 on values of order 1."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_prologue import decode_prologue, decode_prologue_ref, unsupported
from surojax.models.layers.norm import rms_norm, rms_norm_zero_centered
from surojax.models.layers.rope import apply_rope

B, N, K, H, L, S = 3, 4, 2, 16, 2, 12
LAYER = 1
SLOTS = (5, S, 0)  # row 1 is padding (slot >= S): nothing written


def _operands(dtype, norm, seed=0):
    rng = np.random.default_rng(seed)
    a = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    qkv, cos, sin, kp, vp = a(B, (N + 2 * K) * H), a(B, H), a(B, H), a(L, S, K, H), a(L, S, K, H)
    w = {} if norm is None else dict(q_norm_weight=a(H) * 0.1 + (norm == "plain"),
                                     k_norm_weight=a(H) * 0.1 + (norm == "plain"))
    return qkv, cos, sin, kp, vp, jnp.asarray(SLOTS, jnp.int32), w


def _reference(qkv, cos, sin, kp, vp, slots, w, norm):
    return decode_prologue_ref(qkv, cos, sin, kp, vp, LAYER, slots, num_heads=N, num_kv_heads=K,
                               zero_centered=norm == "zero_centered", eps=1e-6, **w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [None, "plain", "zero_centered"])
def test_matches_the_reference_and_writes_only_the_rows_slots(norm, dtype):
    qkv, cos, sin, kp, vp, slots, w = _operands(dtype, norm)
    got = decode_prologue(qkv, cos, sin, kp, vp, LAYER, slots, num_heads=N, norm=norm, eps=1e-6, interpret=True,
                          **w)
    want = _reference(qkv, cos, sin, kp, vp, slots, w, norm)
    assert [g.shape for g in got] == [(B, N, H), kp.shape, vp.shape]
    for g, r in zip(got, want):
        assert g.dtype == r.dtype == dtype
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(g, r)
    # the pools: exactly the non-padding rows' slots of this layer changed, everything else bit-identical
    written = np.zeros((L, S), bool)
    written[LAYER, [s for s in SLOTS if s < S]] = True
    for pool, new in ((kp, got[1]), (vp, got[2])):
        same = np.all(np.asarray(pool, np.float32) == np.asarray(new, np.float32), axis=(2, 3))
        np.testing.assert_array_equal(same, ~written)
    # v is copied as is: row 0's v heads at its slot
    np.testing.assert_array_equal(np.asarray(got[2][LAYER, SLOTS[0]], np.float32),
                                  np.asarray(qkv[0, (N + K) * H:].reshape(K, H), np.float32))


def test_stacked_norm_weights_are_read_at_their_row():
    """q / k norm weights given as layer stacks [L', H] with norm_layer (StackedVectors, read in place) give the
    same bits as their rows given alone."""
    qkv, cos, sin, kp, vp, slots, w = _operands(jnp.bfloat16, "plain", seed=2)
    rng = np.random.default_rng(3)
    stacks = {name: jnp.asarray(1 + 0.1 * rng.standard_normal((3, H)), jnp.bfloat16) for name in w}
    run = lambda **kw: decode_prologue(qkv, cos, sin, kp, vp, LAYER, slots, num_heads=N, norm="plain",  # noqa: E731
                                       interpret=True, **kw)
    want = run(**{name: s[2] for name, s in stacks.items()})
    got = run(**stacks, norm_layer=2)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))


@pytest.mark.parametrize("norm", ["plain", "zero_centered"])
def test_reference_is_the_decoders_ops(norm):
    """The reference's norm + rope equal surojax's own functions, bit for bit (bf16)."""
    qkv, cos, sin, kp, vp, slots, w = _operands(jnp.bfloat16, norm, seed=1)
    q, k_pool, _ = _reference(qkv, cos, sin, kp, vp, slots, w, norm)
    norm_fn = rms_norm if norm == "plain" else rms_norm_zero_centered
    q_in = qkv[:, :N * H].reshape(B, 1, N, H)
    k_in = qkv[:, N * H:(N + K) * H].reshape(B, 1, K, H)
    q_model = apply_rope(norm_fn(q_in, w["q_norm_weight"], 1e-6), cos[:, None], sin[:, None])[:, 0]
    k_model = apply_rope(norm_fn(k_in, w["k_norm_weight"], 1e-6), cos[:, None], sin[:, None])[:, 0]
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_model, np.float32))
    np.testing.assert_array_equal(np.asarray(k_pool[LAYER, SLOTS[0]], np.float32),
                                  np.asarray(k_model[0], np.float32))


def test_refuses_what_it_cannot_take():
    qkv, cos, sin, kp, vp, slots, w = _operands(jnp.bfloat16, None)
    assert unsupported(9, qkv.shape[1], N, kp.shape, qkv.dtype, kp.dtype, H).startswith("decode prologue: 9 rows")
    assert "fp8" in unsupported(B, qkv.shape[1], N, kp.shape, qkv.dtype, jnp.float8_e4m3fn, H).lower()
    assert "partial rope" in unsupported(B, qkv.shape[1], N, kp.shape, qkv.dtype, kp.dtype, H // 2)
    with pytest.raises(ValueError, match="qkv width"):
        decode_prologue(qkv[:, :-H], cos, sin, kp, vp, LAYER, slots, num_heads=N, interpret=True)
    with pytest.raises(ValueError, match="come together"):
        decode_prologue(qkv, cos, sin, kp, vp, LAYER, slots, num_heads=N, norm="plain", interpret=True)


def test_lowers_to_triton_for_an_h200_with_the_pools_aliased():
    """jax.export for cuda under an abstract H200 runs the Pallas Triton lowering (no GPU needed); the pools are
    the custom call's aliased outputs (written in place)."""
    h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    triton = "__gpu$xla.gpu.triton"
    qkv, cos, sin, kp, vp, slots, w = _operands(jnp.bfloat16, "plain")
    fn = jax.jit(lambda qkv, cos, sin, kp, vp, slots, qw, kw: decode_prologue(
        qkv, cos, sin, kp, vp, LAYER, slots, num_heads=N, q_norm_weight=qw, k_norm_weight=kw, norm="plain",
        interpret=False), donate_argnums=(3, 4))
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(h200):
        warnings.simplefilter("ignore")
        exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(triton)])(qkv, cos, sin, kp, vp, slots, *w.values())
    text = exp.mlir_module()
    assert triton in text and "output_operand_aliases" in text
