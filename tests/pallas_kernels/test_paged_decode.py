"""The Pallas paged decode-attention kernel (interpret mode on CPU) against its pure-jnp definition, and its
lowering for an H200 (Pallas -> Triton IR for the CUDA platform, no GPU needed)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_decode import (kernel_applies, max_pool_blocks, paged_decode_attention,
                                         paged_decode_reference)


def _case(rng, L=3, nblk=40, bs=4, K=2, H=16, G=3, B=4, NB=10, dtype=jnp.float32):
    k = jnp.asarray(rng.standard_normal((L, nblk * bs, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((L, nblk * bs, K, H)), dtype)
    q = jnp.asarray(rng.standard_normal((B, K * G, H)), dtype)
    table = jnp.asarray(rng.permutation(nblk)[: B * NB].reshape(B, NB), jnp.int32)
    return q, k, v, table


@pytest.mark.parametrize("partitions", [None, 1, 3])
def test_kernel_equals_reference(partitions):
    q, k, v, table = _case(np.random.default_rng(0))
    lengths = jnp.asarray([1, 23, 0, 40], jnp.int32)  # one token, mid-block, padding row, the whole table
    out = paged_decode_attention(q, k, v, jnp.int32(1), table, lengths, block_size=4, partitions=partitions)
    ref = paged_decode_reference(q, k, v, jnp.int32(1), table, lengths, block_size=4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)
    assert np.all(np.asarray(out)[2] == 0)  # length 0: zeros, not NaN


@pytest.mark.parametrize("knobs", [dict(qk="fma"), dict(qk="fma", blocks_per_iter=1, partitions=3),
                                   dict(qk="dot", blocks_per_iter=2, min_programs=64),
                                   dict(qk="fma", blocks_per_iter=8, min_programs=1),
                                   dict(split="length", partitions=3), dict(split="length", blocks_per_iter=1),
                                   dict(qk="fma", split="length", blocks_per_iter=2, partitions=4)])
def test_tuning_knobs_equal_reference(knobs):
    """Every tuning knob computes the same attention (G = 3: the fma path pads the kv head's query rows to 4)."""
    q, k, v, table = _case(np.random.default_rng(1))
    lengths = jnp.asarray([1, 23, 0, 40], jnp.int32)
    out = paged_decode_attention(q, k, v, jnp.int32(2), table, lengths, block_size=4, **knobs)
    ref = paged_decode_reference(q, k, v, jnp.int32(2), table, lengths, block_size=4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)
    assert np.all(np.asarray(out)[2] == 0)


def test_fma_one_query_head_bf16():
    """G = 1 (no padding at all in the fma path) with a bf16 pool, within bf16 rounding of the fp32 reference."""
    q, k, v, table = _case(np.random.default_rng(2), G=1, dtype=jnp.bfloat16)
    lengths = jnp.asarray([40, 17, 4, 5], jnp.int32)
    out = paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, qk="fma")
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = paged_decode_reference(*f32[:1], *f32[1:], jnp.int32(0), table, lengths, block_size=4)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=2e-2)


def test_bad_knob_is_a_clear_error():
    q, k, v, table = _case(np.random.default_rng(0))
    lengths = jnp.asarray([1, 2, 3, 4], jnp.int32)
    with pytest.raises(ValueError, match="qk='mma'"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, qk="mma")
    with pytest.raises(ValueError, match="split='rows'"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, split="rows")
    with pytest.raises(ValueError, match="blocks_per_iter=0"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, blocks_per_iter=0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, blocks_per_iter=3,
                               interpret=False)


def test_max_pool_blocks():
    n = max_pool_blocks(28, 16, 8, 128)  # Qwen3-0.6B: 2^31 slots over 28 layers, 4.8M blocks (77M tokens)
    assert n == (2 ** 31 - 1) // (28 * 16)
    assert kernel_applies((28, n * 16, 8, 128), 1, None) and not kernel_applies((28, (n + 1) * 16, 8, 128), 1, None)


def test_kernel_applies():
    assert kernel_applies((28, 1024, 8, 128), 1, None)
    assert not kernel_applies((28, 1024, 8, 128), 4, None)  # prefill rows gather
    assert not kernel_applies((28, 1024, 8, 128), 1, 4096)
    assert kernel_applies((28, 2 ** 20, 8, 128), 1, None)  # 2^35 elements: 64-bit offsets in the lowering
    assert not kernel_applies((28, 2 ** 27, 1, 1), 1, None)  # slot indices past int32


def test_lowers_for_h200():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    L, nblk, bs, K, H, G, B, NB = 28, 300, 16, 8, 128, 2, 8, 48
    pool = jax.ShapeDtypeStruct((L, nblk * bs, K, H), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((B, K * G, H), jnp.bfloat16), pool, pool, jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((B, NB), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for qk in ("dot", "fma"):
        fn = jax.jit(lambda *a: paged_decode_attention(*a, block_size=bs, interpret=False, qk=qk))
        with jax.sharding.use_abstract_mesh(h200):
            exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args)
        assert "triton" in exported.mlir_module()
