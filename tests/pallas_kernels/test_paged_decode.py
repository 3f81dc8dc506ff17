"""The Pallas paged decode-attention kernel (interpret mode on CPU) against its pure-jnp definition, and its
lowering for an H200 (Pallas -> Triton IR for the CUDA platform, no GPU needed)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_decode import (kernel_applies, max_pool_blocks, paged_decode_attention,
                                         paged_decode_reference)
from pallas_kernels.paged_decode.kernel import _merge_pallas, _merge_xla
from pallas_kernels.paged_decode.reference import MASKED
from tests.tolerances import reorder_atol


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


@pytest.mark.parametrize("partitions,qk,split,dtype", [(1, "fma", "length", jnp.float32),
                                                       (3, "dot", "table", jnp.bfloat16),
                                                       (3, "fma", "length", jnp.bfloat16),
                                                       (8, "fma", "table", jnp.float32),
                                                       (8, "dot", "length", jnp.float32)])
def test_pallas_merge_equals_xla_merge(partitions, qk, split, dtype):
    """merge="pallas" (partition outputs padded to a power of two, the unwritten ones masked off) computes what
    the XLA merge does: fp32 within 1e-6, a bf16 output within one bf16 unit (P = 3: 4 allocated, 3 written)."""
    q, k, v, table = _case(np.random.default_rng(3), dtype=dtype)
    lengths = jnp.asarray([1, 23, 0, 40], jnp.int32)
    kw = dict(block_size=4, partitions=partitions, qk=qk, split=split, blocks_per_iter=2 if qk == "dot" else 1)
    xla = np.asarray(paged_decode_attention(q, k, v, jnp.int32(1), table, lengths, merge="xla", **kw), np.float32)
    out = np.asarray(paged_decode_attention(q, k, v, jnp.int32(1), table, lengths, merge="pallas", **kw), np.float32)
    # both add the same P weighted partition outputs (each a convex mix of v rows: at most max|v|) in another
    # order, so an output near 0 (cancellation) differs by the sums' rounding, not by a fraction of itself
    atol = reorder_atol(partitions + 2, np.float32, float(np.abs(np.asarray(v, np.float32)).max()))
    rtol = 1e-6 if dtype == jnp.float32 else 2.0 ** -7
    np.testing.assert_allclose(out, xla, rtol=rtol, atol=atol)
    assert np.all(out[2] == 0) and np.all(np.isfinite(out))


def test_pallas_merge_never_reads_unwritten_partitions():
    """P = 3 partitions in a buffer of 4: the 4th (uninitialised on a GPU) poisoned with NaN / huge values must
    not change the merge; row 1 has no written weight at all (total 0 -> zeros)."""
    rng = np.random.default_rng(5)
    B, K, P, gp, G, H = 2, 2, 3, 4, 3, 16
    o = rng.standard_normal((B, K, P + 1, gp, H)).astype(np.float32)
    m = rng.standard_normal((B, K, P + 1, gp)).astype(np.float32)
    l = rng.uniform(0.5, 2.0, (B, K, P + 1, gp)).astype(np.float32)
    o[1, :, :P], m[1, :, :P], l[1, :, :P] = 0.0, MASKED, 0.0  # an empty row: every partition empty
    o[:, :, P], m[:, :, P], l[:, :, P] = np.nan, 1e30, 1e30
    out = _merge_pallas(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), partitions=P, rows=G, dtype=jnp.float32,
                        interpret=True)
    ref = _merge_xla(jnp.asarray(o[:, :, :P]), jnp.asarray(m[:, :, :P]), jnp.asarray(l[:, :, :P]), rows=G,
                     dtype=jnp.float32)
    # summed in another order (4 terms, one masked to 0): 1e-6 of the largest output absorbs cancellation
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    assert np.all(np.asarray(out)[1] == 0)


@pytest.mark.parametrize("qk", ["fma", "dot"])
def test_every_layer_reads_its_own_blocks(qk):
    """The kernel adds layer * NBLK to the block ids itself (the table stays one layer's): each of the pool's
    3 layers (distinct data) matches the reference at that layer."""
    q, k, v, table = _case(np.random.default_rng(4))
    lengths = jnp.asarray([1, 23, 0, 40], jnp.int32)
    outs = []
    for layer in range(k.shape[0]):
        out = paged_decode_attention(q, k, v, jnp.int32(layer), table, lengths, block_size=4, partitions=3, qk=qk)
        ref = paged_decode_reference(q, k, v, jnp.int32(layer), table, lengths, block_size=4)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=2e-6)
        outs.append(np.asarray(out))
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])


def test_bad_knob_is_a_clear_error():
    q, k, v, table = _case(np.random.default_rng(0))
    lengths = jnp.asarray([1, 2, 3, 4], jnp.int32)
    with pytest.raises(ValueError, match="qk='mma'"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, qk="mma")
    with pytest.raises(ValueError, match="split='rows'"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, split="rows")
    with pytest.raises(ValueError, match="merge='triton'"):
        paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, block_size=4, merge="triton")
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
    for qk, merge in (("dot", "xla"), ("fma", "xla"), ("dot", "pallas"), ("fma", "pallas")):
        fn = jax.jit(lambda *a: paged_decode_attention(*a, block_size=bs, interpret=False, qk=qk, merge=merge,
                                                       partitions=3))
        with jax.sharding.use_abstract_mesh(h200):
            exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args)
        assert exported.mlir_module().count("__gpu$xla.gpu.triton") == (2 if merge == "pallas" else 1)
