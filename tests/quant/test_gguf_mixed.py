"""GGUFMixed: layers of different GGUF types in one stacked pytree decode exactly as their own formats, also when
a scan slices the layers off."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.bench.quant_base import randomize_gguf_mix
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.quant import quantize
from surojax.quant.gguf_mixed import GGUFMixed
from surojax.quant.quantize_mix import use_more_bits


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


def test_a_random_base_typed_as_a_llama_cpp_file():
    """surojax.bench.quant_base.randomize_gguf_mix (serve_load --quant q4_k_m): each layer's type is llama.cpp's
    for that file type, a stack of one type is that format, a mixed one a GGUFMixed; the model runs."""
    hf = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    model = Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(params=0))
    types = randomize_gguf_mix(model, "q4_k_m", jax.random.key(0))
    more = tuple("q6_k" if use_more_bits(i, 8) else "q4_k" for i in range(8))
    assert types["v_proj"] == types["down_proj"] == more and set(types["q_proj"]) == {"q4_k"}
    assert isinstance(model.layers.mlp.down_proj.kernel[...], GGUFMixed)
    assert type(model.layers.attn.q_proj.kernel[...]).__name__ == "Q4_K"
    assert np.isfinite(np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray([[1, 2, 3]])))).all()
