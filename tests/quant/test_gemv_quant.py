"""The quantised decode GEMV (pallas_kernels/decode_gemv/quant_kernel.py, interpret mode on CPU) and its served
weight (surojax.quant.gemv_quant.GemvQuant): the rows decode to the format's own values bit for bit, the kernel
with every fused form equals the plain decode GEMV's reference on those values, and a served Q4_K model laid out
for it under SUROJAX_DECODE_GEMV=pallas decodes the greedy tokens of the same model through XLA, its decode
steps (the FMA body) and short prefills (the tensor-core body) taking the kernel for every linear with the block's
norms, gated product and residual adds fused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.decode_gemv.api import decode_gemv_quant, quant_bk
from pallas_kernels.decode_gemv.quant_kernel import pack_rows, unpack_rows
from pallas_kernels.decode_gemv.reference import decode_gemv_ref
from surojax.kernel_settings import use_kernel_settings
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.quant import gemv_quant
from surojax.quant.gemv_quant import GemvQuant
from surojax.quant.laid_out import decode_weights
from surojax.quant.model import quantize_model
from surojax.quant.random_weights import random_weight
from tests.quant.test_gemv_weight import _greedy

K, N = 512, 64


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "nf4"])  # nibble + offset, bytes, bytes, code book
def test_rows_decode_to_the_formats_values_and_the_kernel_equals_the_reference(fmt):
    w = random_weight(fmt, K, N, jax.random.key(0))
    spec = w.kernel_spec
    rows = pack_rows(spec, *w.kernel_values(), quant_bk(spec, K))
    wt = unpack_rows(rows)  # [N, K]
    np.testing.assert_array_equal(np.asarray(wt), np.asarray(w.dequantize(jnp.float32)).T)
    nw = (1 + 0.1 * jax.random.normal(jax.random.key(2), (K,), jnp.float32)).astype(jnp.bfloat16)
    for m in (3, 9):  # the FMA body; the tensor-core body (9 rows: 16 padded, masked)
        _check_forms(rows, wt, nw, m)


def _check_forms(rows, wt, nw, m):
    x = jax.random.normal(jax.random.key(1), (m, K), jnp.float32).astype(jnp.bfloat16)
    r = jax.random.normal(jax.random.key(3), (m, N // 2), jnp.float32).astype(jnp.bfloat16)
    for kw, ref_kw in ((dict(), dict()),
                       (dict(norm_weight=nw, norm="plain", activation="silu", residual=r),
                        dict(norm=nw, activation="silu", residual=r)),
                       (dict(norm_weight=nw, norm="zero_centered", activation="gelu_tanh"),
                        dict(norm=nw, zero_centered=True, activation="gelu_tanh"))):
        got = decode_gemv_quant(x, rows, n=N, interpret=True, **kw).astype(jnp.float32)
        want = decode_gemv_ref(x, wt, **ref_kw).astype(jnp.float32)
        unit = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(want).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=unit)  # summation order only


def test_bad_operands_are_named():
    w = random_weight("q4_k", K, N, jax.random.key(0))
    rows = pack_rows(w.kernel_spec, *w.kernel_values(), 256)
    with pytest.raises(ValueError, match="1..64"):
        decode_gemv_quant(jnp.zeros((65, K)), rows, n=N, interpret=True)
    with pytest.raises(ValueError, match="K=512"):
        decode_gemv_quant(jnp.zeros((1, 256)), rows, n=N, interpret=True)
    with pytest.raises(ValueError, match="bk=96"):
        pack_rows(w.kernel_spec, *w.kernel_values(), 96)


HF = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 256, "intermediate_size": 512,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def test_served_q4_k_through_the_quantised_decode_gemv_equals_xla(monkeypatch):
    cfg = ModelConfig.from_hf(dict(HF))
    plain = Decoder(cfg, rngs=nnx.Rngs(params=0))
    plain.embed.embedding[...] = plain.embed.embedding[...] * 8  # well separated greedy choices
    quantize_model(plain, "q4_k")
    graphdef, state = nnx.split(plain)
    served = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    q_values = plain.layers.attn.q_proj.kernel.get_value().dequantize(jnp.float32)
    with use_kernel_settings(decode_gemv="pallas"):
        done = decode_weights(served)
    assert done == {"gemv_q:q4_k": 7, "norms_in_place": 4}
    qkv = served.layers.attn.qkv_proj.kernel.get_value()
    assert isinstance(qkv, GemvQuant) and qkv.data.shape == (2, 256 + 2 * 128, 128)  # joined rows, K / 2 bytes
    np.testing.assert_array_equal(qkv.dequantize(jnp.float32)[..., :256], q_values)  # the same values, [K, N]

    calls = []
    real = gemv_quant.decode_gemv_quant
    monkeypatch.setattr(gemv_quant, "decode_gemv_quant", lambda x, w, **kw: calls.append(
        (x.shape, kw["n"], kw.get("norm"), kw.get("activation"), kw.get("residual") is not None)) or real(x, w, **kw))
    prompts = [[5, 9, 33, 2, 71, 8], [40, 41, 42]]
    with use_kernel_settings(decode_gemv="xla"):
        want = _greedy(plain, prompts)
    with use_kernel_settings(decode_gemv="pallas"):
        assert _greedy(served, prompts) == want
    # every linear through the kernel with the block's ops fused: the decode steps (<= 8 rows) by its FMA body, the
    # prefill (9..64 rows) by its tensor-core body
    assert {c[1:] for c in calls} == {(512, "plain", None, False), (256, None, None, True),
                                      (1024, "plain", "silu", False), (256, None, None, True)}
    rows = {int(np.prod(c[0][:-1])) for c in calls}
    assert min(rows) <= 8 < max(rows) <= 64


def test_lowers_to_triton_for_an_h200():
    """The fused forms lower through Pallas' Triton lowering at a Qwen3-0.6B linear (the offline sm_90 compile of
    every shape: benchmarks/triton_offline_check.py dump-gemv-quant)."""
    from tests.pallas_kernels.test_triton_lowering import TRITON, _lower

    w = random_weight("q4_k", 1024, 6144, jax.random.key(0), (2,))
    rows = jax.vmap(lambda v: pack_rows(v.kernel_spec, *v.kernel_values(), 512))(w)
    rows = jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), rows)
    fn = lambda x, rows, nw: decode_gemv_quant(x, rows, n=6144, layer=1, norm_weight=nw, norm="plain",  # noqa: E731
                                               activation="silu", interpret=False)
    assert TRITON in _lower(fn, jnp.zeros((1, 1024), jnp.bfloat16), rows, jnp.zeros((1024,), jnp.bfloat16))


def test_a_mixed_format_stack_reads_each_layer_in_its_own_format():
    """MixedRows (Q4_K_M's per-layer types): a Q4_K stack and a Q6_K stack, layers typed [q4_k, q6_k, q6_k,
    q4_k]; the kernel at each layer (both bodies) equals the reference on that layer's own values."""
    from pallas_kernels.decode_gemv.quant_kernel import MixedRows

    stacks = {}
    for fmt in ("q4_k", "q6_k"):
        w = random_weight(fmt, K, N, jax.random.key(7 if fmt == "q4_k" else 8), (2,))
        rows = jax.vmap(lambda v: pack_rows(v.kernel_spec, *v.kernel_values(), quant_bk(v.kernel_spec, K)))(w)
        stacks[fmt] = (jax.tree.map(lambda a: a.reshape(-1, a.shape[-1]), rows), unpack_rows(rows))  # [2 N, ·], [2, N, K]
    mixed = MixedRows(parts=(stacks["q4_k"][0], stacks["q6_k"][0]), kind=jnp.asarray([0, 1, 1, 0]),
                      pos=jnp.asarray([0, 0, 1, 1]))
    nw = jnp.ones((K,), jnp.bfloat16)
    for layer, (fmt, pos) in enumerate([("q4_k", 0), ("q6_k", 0), ("q6_k", 1), ("q4_k", 1)]):
        for m in (2, 9):
            x = jax.random.normal(jax.random.key(layer), (m, K), jnp.float32).astype(jnp.bfloat16)
            got = decode_gemv_quant(x, mixed, n=N, layer=layer, norm_weight=nw, norm="plain",
                                    interpret=True).astype(jnp.float32)
            want = decode_gemv_ref(x, stacks[fmt][1][pos], norm=nw).astype(jnp.float32)
            unit = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(want).max())
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=unit)


def test_served_q4_k_m_mix_takes_the_kernel_on_its_mixed_stacks():
    """llama.cpp's Q4_K_M types attn_v and ffn_down Q6_K on layer 1 of 2 (GGUFMixed stacks, as a GGUF file loads):
    `decode_weights` under pallas lays those out as GemvQuantMixed, the rest as GemvQuant, and the engine decodes
    the greedy tokens of the same weights through XLA."""
    pytest.importorskip("gguf")
    from surojax.bench.quant_base import randomize_gguf_mix
    from surojax.quant.gemv_quant import GemvQuantMixed

    plain = Decoder(ModelConfig.from_hf(dict(HF)), rngs=nnx.Rngs(params=1))
    plain.embed.embedding[...] = plain.embed.embedding[...] * 8
    types = randomize_gguf_mix(plain, "q4_k_m", jax.random.key(4))
    assert types["v_proj"] == ("q4_k", "q6_k") and types["down_proj"] == ("q4_k", "q6_k")
    graphdef, state = nnx.split(plain)
    served = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    with use_kernel_settings(decode_gemv="pallas"):
        done = decode_weights(served)
    assert done == {"gemv_q:q4_k": 5, "gemv_q:q4_k+q6_k": 2, "norms_in_place": 4}
    assert isinstance(served.layers.mlp.down_proj.kernel.get_value(), GemvQuantMixed)
    prompts = [[5, 9, 33, 2], [40, 41]]
    with use_kernel_settings(decode_gemv="xla"):
        want = _greedy(plain, prompts, max_tokens=4)
    with use_kernel_settings(decode_gemv="pallas"):
        assert _greedy(served, prompts, max_tokens=4) == want
