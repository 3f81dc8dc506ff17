"""The Pallas paged decode-attention kernel (interpret mode on CPU) against its pure-jnp definition, and its
lowering for an H200 (Pallas -> Triton IR for the CUDA platform, no GPU needed)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.models.layers.paged_decode import (kernel_applies, max_pool_blocks, paged_decode_attention,
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


def test_max_pool_blocks():
    n = max_pool_blocks(28, 16, 8, 128)  # Qwen3-0.6B
    assert kernel_applies((28, n * 16, 8, 128), 1, None) and not kernel_applies((28, (n + 1) * 16, 8, 128), 1, None)


def test_kernel_applies():
    assert kernel_applies((28, 1024, 8, 128), 1, None)
    assert not kernel_applies((28, 1024, 8, 128), 4, None)  # prefill rows gather
    assert not kernel_applies((28, 1024, 8, 128), 1, 4096)
    assert not kernel_applies((28, 2 ** 20, 8, 128), 1, None)  # offsets past int32


def test_lowers_for_h200():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    h200 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    L, nblk, bs, K, H, G, B, NB = 28, 300, 16, 8, 128, 2, 8, 48
    pool = jax.ShapeDtypeStruct((L, nblk * bs, K, H), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((B, K * G, H), jnp.bfloat16), pool, pool, jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((B, NB), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    fn = jax.jit(lambda *a: paged_decode_attention(*a, block_size=bs, interpret=False))
    with jax.sharding.use_abstract_mesh(h200):
        exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=check)(*args)
    assert "triton" in exported.mlir_module()
