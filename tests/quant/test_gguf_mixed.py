"""GGUFMixed: layers of different GGUF types in one stacked pytree decode exactly as their own formats, also when
a scan slices the layers off."""
import jax
import jax.numpy as jnp
import numpy as np

from surojax.quant import quantize
from surojax.quant.gguf_mixed import GGUFMixed


def test_layers_decode_as_their_own_types():
    rng = np.random.default_rng(0)
    k, n = 512, 16
    layers = [quantize(rng.normal(size=(k, n)).astype(np.float32), t) for t in ("q4_k", "q6_k", "q4_k", "q8_0")]
    mixed = GGUFMixed.from_layers(layers)
    assert mixed.types == ("q4_k", "q6_k", "q8_0") and mixed.data.shape == (4, n, k // 32 * 34)
    full = np.asarray(jax.jit(lambda m: m.dequantize(jnp.float32))(mixed))
    assert full.shape == (4, k, n)
    for i, w in enumerate(layers):
        ref = np.asarray(w.dequantize(jnp.float32))
        np.testing.assert_array_equal(full[i].view(np.uint32), ref.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(mixed.layer(i).data), np.asarray(w.data))

    x = jnp.asarray(rng.normal(size=(3, k)).astype(np.float32))
    _, ys = jax.jit(lambda x, m: jax.lax.scan(lambda c, w: (c, w.matmul(c)), x, m))(x, mixed)
    for i, w in enumerate(layers):
        np.testing.assert_allclose(ys[i], x @ w.dequantize(jnp.float32), rtol=1e-5, atol=1e-5)
