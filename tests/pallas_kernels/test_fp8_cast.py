"""pallas_kernels/fp8_cast: the FP8 operand in both layouts and its amax in one pass, bit for bit the pure-jnp
reference (quantise, transpose, amax) for both formats, bf16 and fp32 inputs, saturating values included; and the
kernel lowers to Triton for an H200 (the fp8 converts need compute capability >= 8.9). On a GPU the same test runs
the Triton kernel itself (interpret only off the GPU)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_cast import CastTiles, cast_transpose, cast_transpose_kernel, cast_transpose_reference

FORMATS = [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_equals_reference_bit_for_bit(dtype):
    x = jax.random.normal(jax.random.key(0), (128, 192), jnp.float32) * 40.0
    x = x.at[0, :4].set(jnp.array([0.0, -0.0, 1e-9, -3e4])).astype(dtype)  # zeros, an underflow, a saturating value
    inv = jnp.float32(11.3)  # |x| * inv reaches past both formats' max: the clip is exercised
    for fmt, bound in FORMATS:
        got = cast_transpose(x, inv, fmt, bound, tiles=CastTiles(32, 64), use_kernel=True)
        want = cast_transpose_reference(x, inv, fmt, bound)
        assert got[0].dtype == fmt and got[1].shape == (192, 128)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(_bits(g), _bits(w))
        assert float(got[2]) == 3e4 if dtype == jnp.float32 else float(got[2]) == float(jnp.bfloat16(3e4))
        assert np.abs(np.asarray(got[0], np.float32)).max() == bound  # saturated, not inf / nan


def test_reference_when_the_tiles_do_not_fit():
    x = jnp.ones((48, 64), jnp.bfloat16)  # 48 rows: no 64-row tile
    q, qt, a = cast_transpose(x, jnp.float32(2.0), jnp.float8_e4m3fn, 448.0)
    assert q.shape == (48, 64) and qt.shape == (64, 48) and float(a) == 1.0
    with pytest.raises(ValueError, match="do not divide"):
        cast_transpose(x, jnp.float32(2.0), jnp.float8_e4m3fn, 448.0, use_kernel=True)


def test_lowers_to_triton_for_an_h200():
    h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    triton = "__gpu$xla.gpu.triton"
    x, inv = jnp.zeros((128, 256), jnp.bfloat16), jnp.float32(1.0)  # made outside the abstract mesh
    for fmt, bound in FORMATS:
        fn = jax.jit(lambda x, inv: cast_transpose_kernel(x, inv, dtype=jnp.dtype(fmt), bound=bound))
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(h200):
            warnings.simplefilter("ignore")
            exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call(triton)])(x, inv)
        assert triton in exp.mlir_module()


def test_vmapped_over_layers_is_one_batched_kernel_with_each_layers_bits():
    """The per-step FP8 weight cache casts a [L, K, N] kernel stack with jax.vmap (no loop): the batched kernel gives
    every layer the bits of casting it alone, each with its own scale."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.fp8_cast import cast_transpose

    w = jax.random.normal(jax.random.key(0), (3, 128, 256), jnp.float32)
    inv = jnp.array([100.0, 200.0, 50.0], jnp.float32)
    cast = lambda x, i: cast_transpose(x, i, jnp.float8_e4m3fn, 448.0, use_kernel=True, interpret=True)  # noqa: E731
    qs, qts, amaxes = jax.vmap(cast)(w, inv)
    for layer in range(3):
        q, qt, a = cast(w[layer], inv[layer])
        np.testing.assert_array_equal(np.asarray(qs[layer]).view(np.uint8), np.asarray(q).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(qts[layer]).view(np.uint8), np.asarray(qt).view(np.uint8))
        assert float(amaxes[layer]) == float(a)
