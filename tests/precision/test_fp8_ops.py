"""FP8 formats, scaling and the FP8 matmuls of recipe fp8_hybrid against independent jnp references (CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.kernel_settings import KernelSettings, use_kernel_settings
from surojax.precision.fp8_matmul import fp8_dot, fp8_dot_frozen, reference_dot
from surojax.precision.fp8_scaling import (E4M3, E5M2, SPECS, AmaxHistory, dequant_factor, quantize, quantize_both,
                                           quantize_current, round_fp8_reference, scale_from_amax)
from surojax.precision.fp8_transform import Fp8Linear, Fp8Weight, fp8_layer_mask
from surojax.precision.linear_swap import QuantLayerMask
from surojax.models.layers.linear import Linear, dot


def _values(fmt):
    """Normals, subnormals, exact ties, values past the max, signs, zero."""
    s = SPECS[fmt]
    rng = np.random.default_rng(0)
    wide = np.exp2(rng.uniform(s.min_exponent - s.mantissa_bits - 2, np.log2(s.max) + 1, 4000))
    step = 2.0 ** -s.mantissa_bits
    ties = np.array([1 + step / 2, 1 + 3 * step / 2, 2 ** s.min_exponent * step * 2.5, 0.0])  # round half to even
    big = np.array([s.max, s.max * 1.03, s.max * 4, 1e30])
    v = np.concatenate([wide, ties, big]).astype(np.float32)
    return jnp.asarray(np.concatenate([v, -v]))


@pytest.mark.parametrize("fmt,dtype", [("e4m3", E4M3), ("e5m2", E5M2)])
def test_quantize_is_round_to_nearest_even_with_saturation(fmt, dtype):
    x = _values(fmt)
    got = quantize(x, jnp.float32(1.0), dtype).astype(jnp.float32)
    want = round_fp8_reference(x, fmt)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.max(got)) == SPECS[fmt].max  # saturated, not inf / nan
    one_tie = round_fp8_reference(jnp.float32(1 + 2.0 ** -(SPECS[fmt].mantissa_bits + 1)), fmt)
    assert float(one_tie) == 1.0  # the tie goes to the even mantissa


def test_scale_is_the_largest_power_of_two_within_the_format_and_keeps_previous_when_not_finite():
    assert float(scale_from_amax(2.0, 448.0)) == 128.0  # 448 / 2 = 224 rounded down to a power of two
    assert float(scale_from_amax(448.0, 448.0)) == 1.0 and float(scale_from_amax(449.0, 448.0)) == 0.5
    assert float(scale_from_amax(2.0, 448.0, margin=1)) == 64.0
    for bad in (0.0, jnp.inf, jnp.nan):
        assert float(scale_from_amax(bad, 448.0, previous=3.5)) == 3.5
    # over fp32's normal range, for both formats: s = 2^k, amax * s <= max < amax * 2s (exact in float64)
    assert float(scale_from_amax(1e-37, 57344.0)) == 2.0 ** 126  # kept normal (its reciprocal too)
    amaxes = np.exp(np.random.default_rng(0).uniform(-60, 60, 20000)).astype(np.float32)
    for fmax in (448.0, 57344.0):
        s = np.asarray(scale_from_amax(jnp.asarray(amaxes), fmax), np.float64)
        np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
        a = amaxes.astype(np.float64)
        assert np.all(a * s <= fmax) and np.all(a * 2 * s > fmax)
        # so the dequantisation factor is exact in bf16: no compiler's choice of precision can change it
        d = np.asarray(dequant_factor(jnp.asarray(s, jnp.float32), jnp.bfloat16), np.float64)
        np.testing.assert_array_equal(d * s, 1.0)
    # end to end: the operand is the same whether d was rounded to bf16 (op by op) or kept in fp32 (inside an XLA GPU
    # program, which drops f32 -> bf16 -> f32 round trips); with s = 448 / amax ~1.5% of these values moved
    x = (3.0 * jax.random.normal(jax.random.key(3), (256, 512))).astype(jnp.bfloat16)
    q_op_by_op, d = quantize_current(x, E4M3, jnp.bfloat16)
    s = scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))), 448.0)
    q_program = jnp.clip(x.astype(jnp.float32) / (1.0 / s), -448.0, 448.0).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(q_program).view(np.uint8), np.asarray(q_op_by_op).view(np.uint8))


def test_amax_history_rolls_and_keeps_scale_on_nonfinite():
    h = AmaxHistory.init(3)
    h = h.update(4.0, 448.0)
    np.testing.assert_array_equal(np.asarray(h.history), [4.0, 0.0, 0.0])
    assert float(h.scale) == 64.0  # 448 / 4 = 112 -> 64
    h = h.update(8.0, 448.0).update(2.0, 448.0)
    np.testing.assert_array_equal(np.asarray(h.history), [2.0, 8.0, 4.0])
    assert float(h.scale) == 32.0  # max over the history (448 / 8 = 56 -> 32), not the newest amax
    h = h.update(1.0, 448.0)  # 4.0 drops out
    np.testing.assert_array_equal(np.asarray(h.history), [1.0, 2.0, 8.0])
    assert float(h.scale) == 32.0
    h = h.update(1.0, 448.0).update(1.0, 448.0)  # the 8.0 and 2.0 are gone: the scale follows the amaxes of 1
    assert float(h.scale) == 256.0
    kept = h.update(jnp.inf, 448.0)
    assert float(kept.scale) == 256.0 and not np.isfinite(float(kept.history[0]))
    assert float(kept.update(jnp.nan, 448.0).scale) == 256.0


def _operands(M=48, K=64, N=32, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = (3.0 * jax.random.normal(kx, (2, M // 2, K))).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (K, N)) / 8.0  # fp32 master weight
    g = (1e-3 * jax.random.normal(kg, (2, M // 2, N))).astype(jnp.bfloat16)
    return x, w, g


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_fp8_dot_forward_and_backward_match_dequantised_fp32_products():
    x, w, g = _operands()
    y, vjp = jax.vjp(fp8_dot, x, w)
    dx, dw = vjp(g)
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    x_q, x_d = quantize_current(x2, E4M3, jnp.bfloat16)
    w_q, w_d = quantize_current(w, E4M3, jnp.bfloat16)
    g_q, g_d = quantize_current(g2, E5M2, jnp.bfloat16)  # the gradient in E5M2
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    # bf16 output rounding (2^-9) and the bf16 product of q * d: well under 1e-2; a wrong scale, format or
    # transpose is off by O(1), E4M3 instead of E5M2 for dy by a few %
    assert _rel(y.reshape(x2.shape[0], -1), reference_dot(x_q, x_d, w_q, w_d)) < 1e-2
    assert _rel(dx.reshape(x2.shape), reference_dot(g_q, g_d, w_q.T, w_d)) < 1e-2
    assert _rel(dw, reference_dot(x_q.T, x_d, g_q, g_d)) < 1e-2
    # and FP8 is not a no-op: the exact product differs by about E4M3's precision
    exact = jnp.einsum("mk,kn->mn", x2.astype(jnp.float32), w, precision="highest")
    assert 1e-3 < _rel(y.reshape(exact.shape), exact) < 0.1


def test_fp8_dot_frozen_matches_reference_and_gives_no_weight_gradient():
    x, w, g = _operands(seed=1)
    fw = Fp8Weight.quantize(w[None])  # one layer
    q, d = fw.q[0], fw.d[0]
    assert fw.q.dtype == E4M3 and 224.0 < float(jnp.max(jnp.abs(fw.q.astype(jnp.float32)))) <= 448.0
    y, vjp = jax.vjp(fp8_dot_frozen, x, q, d)
    dx, dq, dd = vjp(g)
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_d = quantize_current(x2, E4M3, jnp.bfloat16)
    g_q, g_d = quantize_current(g.reshape(-1, g.shape[-1]), E5M2, jnp.bfloat16)
    assert _rel(y.reshape(x2.shape[0], -1), reference_dot(x_q, x_d, q, d)) < 1e-2
    assert _rel(dx.reshape(x2.shape), reference_dot(g_q, g_d, q.T, d)) < 1e-2
    assert not np.any(np.asarray(dq.astype(jnp.float32))) and float(dd) == 0.0
    np.testing.assert_allclose(np.asarray(fw.dequantize()[0]), np.asarray(w), rtol=0.07, atol=1e-3)


def test_layer_mask_picks_bf16_or_fp8_per_layer():
    assert fp8_layer_mask(4, 0, 0) is None
    np.testing.assert_array_equal(np.asarray(fp8_layer_mask(4, 1, 1)), [False, True, True, False])
    with pytest.raises(ValueError, match="at least one"):
        fp8_layer_mask(2, 1, 1)
    x, w, _ = _operands()
    base = Linear(w.shape[0], w.shape[1], ("embed", "mlp"), rngs=nnx.Rngs(0))
    base.kernel.set_value(w)
    for flag, want in ((False, dot(x, w)), (True, fp8_dot(x, w))):
        y = Fp8Linear(base, mask=QuantLayerMask(jnp.asarray(flag)))(x)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_direct_dot_form_matches_qdq():
    x, w, g = _operands(seed=2)
    outs = {}
    for form in ("qdq", "direct"):
        with use_kernel_settings(fp8_dot=form):
            y, vjp = jax.vjp(fp8_dot, x, w)  # traced anew: the form is read at trace time
            outs[form] = (y, *vjp(g))
    for a, b in zip(outs["qdq"], outs["direct"]):
        assert _rel(a, b) < 1e-2
    with pytest.raises(ValueError, match="SUROJAX_FP8_DOT='nope'"):
        KernelSettings.from_environ({"SUROJAX_FP8_DOT": "nope"})


def test_quantize_both_is_the_quantiser_in_both_layouts_and_the_switch_is_read():
    """quantize_both (the FP8 GEMMs' operands, fp8_scaling) = (quantize, its transpose, max |x|) bit for bit (XLA's
    passes here; on a GPU the fused kernel, which tests/pallas_kernels/test_fp8_cast.py holds to the same bits); an
    unknown SUROJAX_FP8_CAST is refused."""
    x = (jax.random.normal(jax.random.key(3), (64, 128)) * 30).astype(jnp.bfloat16)
    d = jnp.asarray(0.05, jnp.bfloat16)
    q, qt, a = quantize_both(x, d, E4M3)
    want = np.asarray(quantize(x, d, E4M3)).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want)
    np.testing.assert_array_equal(np.asarray(qt).view(np.uint8), want.T)
    assert float(a) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    with use_kernel_settings(fp8_cast="xla"):  # XLA's passes whatever the device: the same bits
        np.testing.assert_array_equal(np.asarray(quantize_both(x, d, E4M3)[1]).view(np.uint8), want.T)
    with pytest.raises(ValueError, match="SUROJAX_FP8_CAST"):
        KernelSettings.from_environ({"SUROJAX_FP8_CAST": "triton"})


def test_wgrad_in_the_weights_dtype_skips_the_bf16_rounding():
    """SUROJAX_FP8_WGRAD=weight: the weight-gradient GEMM of a trainable fp32 weight writes fp32 (no bf16 rounding
    of dW): closer to the fp32 product of the same FP8 operands than the default's bf16 result, same dx."""
    from surojax.precision.fp8_matmul import _current_both

    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32, 48), jnp.float32) * 0.1
    g = jax.random.normal(jax.random.key(2), (64, 48), jnp.float32).astype(jnp.bfloat16)
    x_q, _, x_d = _current_both(x, E4M3, jnp.bfloat16)
    g_q, _, g_d = _current_both(g, E5M2, jnp.bfloat16)
    ref = (x_q.astype(jnp.float32) * x_d.astype(jnp.float32)).T @ (g_q.astype(jnp.float32) * g_d.astype(jnp.float32))

    def grads():
        return jax.jit(lambda x, w: jax.vjp(fp8_dot, x, w)[1](g))(x, w)

    dx0, dw0 = grads()
    with use_kernel_settings(fp8_wgrad="weight"):
        dx1, dw1 = grads()
    assert dw1.dtype == jnp.float32 and dw0.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dx0), np.asarray(dx1))
    err0 = float(jnp.max(jnp.abs(dw0 - ref))) / float(jnp.max(jnp.abs(ref)))
    err1 = float(jnp.max(jnp.abs(dw1 - ref))) / float(jnp.max(jnp.abs(ref)))
    assert err1 < err0 / 4 and err0 > 1e-4, (err0, err1)
