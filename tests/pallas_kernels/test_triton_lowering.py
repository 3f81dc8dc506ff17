"""The kernels lower to Triton IR for an H200 without a GPU: jax.export for platform cuda under an abstract mesh
whose device is an "NVIDIA H200" runs the Pallas Triton lowering (every primitive of the kernel bodies, the
power-of-2 load shapes, the fp8 casts for compute capability 9.0). What it cannot catch is Triton's own
compilation (layouts, shared memory), which only the GPU run does (benchmarks/quant_matmul_h200.py)."""
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.quant_matmul.kernel import Tiles, forward, transposed
from pallas_kernels.quant_matmul.layout import plain_layout
from surojax.quant.random_weights import random_weight

H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                               platform="gpu"))
TRITON = "__gpu$xla.gpu.triton"


def _lower(fn, *args) -> str:
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(H200):
        warnings.simplefilter("ignore")  # the Pallas Triton backend's deprecation notice
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exp.mlir_module()


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "nf4", "fp8"])  # nibble + offset, int8, table, float8
def test_kernels_lower_to_triton_for_an_h200(name):
    k, n, m = 512, 256, 256
    w = random_weight(name, k, n, jax.random.key(0))
    for tiles in (Tiles(128, 128, 128, 8, 3), Tiles(128, 64, 256, 4, 3, swap=True)):
        lw = w.kernel_layout(tiles.kt)
        x, g = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((m, n), jnp.bfloat16)
        assert TRITON in _lower(lambda x, lw: forward(x, lw, tiles=tiles), x, lw)
        assert TRITON in _lower(lambda g, lw: transposed(g, lw, tiles=tiles), g, lw)
        # the decode form: 8 rows, K split in 4 (fp32 partials), and a plain bf16 weight through it
        x1 = jnp.zeros((8, k), jnp.bfloat16)
        decode = Tiles(64, 64, tiles.kt, 4, 4)
        assert TRITON in _lower(lambda x, lw: forward(x, lw, tiles=decode, splits=4 // (tiles.kt // 128)), x1, lw)
        stack = jax.tree.map(lambda a: jnp.stack([a, a]), lw)  # a layer of a stack, read in place
        assert TRITON in _lower(lambda x, st, i: forward(x, st, tiles=decode, splits=2, layer=i), x1, stack,
                                jnp.int32(1))
    plain = plain_layout(jnp.zeros((k, n), jnp.bfloat16))
    assert TRITON in _lower(lambda x, lw: forward(x, lw, tiles=Tiles(64, 64, 128, 4, 4), splits=4), x1, plain)
