"""The decode GEMV in a served model (SUROJAX_DECODE_GEMV, surojax.quant.gemv_weight): `decode_weights` lays the plain
Linear kernels out transposed only when the setting resolves to the kernel, the joined projections stay the same
values, a forward of a few rows through the kernels gives XLA's logits, and the engine decodes the same greedy tokens through the kernel (interpret mode) as through XLA, its decode
step taking the kernel for every linear with the block's RMSNorms, gated product and residual adds fused."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.generation.sampling import SamplingParams
from surojax.kernel_settings import use_kernel_settings
import surojax.models.decoder as decoder_module
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.quant import gemv_weight
from surojax.quant.gemv_weight import GemvWeight
from surojax.quant.laid_out import decode_weights
from surojax.serve.engine import Engine
from tests.serve.configs import BUCKETS, engine_config

HF = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _greedy(model, prompts, max_tokens=5):
    eng = Engine(model, engine_config(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                                      max_model_len=32, buckets=BUCKETS))
    rids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    out = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    return [out[r] for r in rids]


def test_served_greedy_tokens_through_the_decode_gemv_equal_xla(monkeypatch):
    cfg = ModelConfig.from_hf(dict(HF))
    plain = Decoder(cfg, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(plain)
    served = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    q_kernel = plain.layers.attn.q_proj.kernel.get_value()
    with use_kernel_settings(decode_gemv="auto"):  # auto off a GPU: nothing laid out
        assert decode_weights(plain, join_projections=False) == {}
    with use_kernel_settings(decode_gemv="pallas"):
        # q, k, v, o, gate, up, down, then joined; the attention, q, k and MLP norm scales read in place
        assert decode_weights(served) == {"gemv_t:float32": 7, "norms_in_place": 4}
    qkv = served.layers.attn.qkv_proj.kernel.get_value()
    assert isinstance(qkv, GemvWeight) and qkv.data.shape == (2, 64 + 2 * 32, 64)
    np.testing.assert_array_equal(qkv.dequantize(jnp.float32)[..., :64], q_kernel)  # the same values, [K, N]

    tokens = jnp.asarray([[3, 17, 99, 120, 7, 42]])  # 6 rows: every linear through the kernel
    with use_kernel_settings(decode_gemv="xla"):
        want_logits = np.asarray(jax.jit(lambda m, t: m(t))(plain, tokens))
    with use_kernel_settings(decode_gemv="pallas"):
        got_logits = np.asarray(jax.jit(lambda m, t: m(t))(served, tokens))
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4 * np.max(np.abs(want_logits)))

    calls = []
    real = gemv_weight.decode_gemv
    monkeypatch.setattr(gemv_weight, "decode_gemv", lambda x, w, **kw: calls.append(
        (x.shape, w.shape[-2:], kw.get("norm"), kw.get("activation"), kw.get("residual") is not None,
         None if kw.get("norm_weight") is None else (kw["norm_weight"].shape, kw.get("norm_layer") is not None)))
        or real(x, w, **kw))
    prompts = [[5, 9, 33, 2, 71, 8], [40, 41, 42]]
    with use_kernel_settings(decode_gemv="xla"):
        want = _greedy(plain, prompts)
    with use_kernel_settings(decode_gemv="pallas"):
        assert _greedy(served, prompts) == want
    # every linear took the kernel with the block's ops fused: qkv [128, 64] with the attention norm, o with the
    # residual, gate/up with the MLP norm and silu(gate) * up, down with the residual; the decode steps (<= 8 rows)
    # through its FMA body, the prefill (9..64 rows) through its tensor-core body; each norm weight the whole
    # [L, D] stack of its scale, read by the kernel at the layer
    assert {c[1:] for c in calls} == {((128, 64), "plain", None, False, ((2, 64), True)),
                                      ((64, 64), None, None, True, None),
                                      ((256, 64), "plain", "silu", False, ((2, 64), True)),
                                      ((64, 128), None, None, True, None)}
    rows = {int(np.prod(x[:-1])) for x, *_ in calls}
    assert min(rows) <= 8 < max(rows) <= 64


def test_tied_head_through_the_decode_gemv_gives_the_fp32_logits(monkeypatch):
    """A tied head (the embedding, [V, D]: the kernel's layout as it is) takes the decode GEMV at few rows once
    `decode_weights` marks the model (pallas mode, interpret here: 3 rows through the FMA body, 16 through the dot
    body), the sums left in fp32: the logits equal the einsum's; more rows (a prefill of 80) keep the einsum; an
    untied head is left alone."""
    cfg = ModelConfig.from_hf(dict(HF, tie_word_embeddings=True))
    plain = Decoder(cfg, rngs=nnx.Rngs(params=1))
    hs = [jax.random.normal(jax.random.key(0), (b, 1, 64), jnp.float32) for b in (3, 16)]
    want = [np.asarray(plain.logits(h)) for h in hs]
    with use_kernel_settings(decode_gemv="pallas"):
        decode_weights(plain, join_projections=False)
        assert plain.head_gemv
        calls = []
        real = decoder_module.decode_gemv
        monkeypatch.setattr(decoder_module, "decode_gemv",
                            lambda x, w, **kw: calls.append((x.shape, w.shape, kw)) or real(x, w, **kw))
        got = [np.asarray(plain.logits(h)) for h in hs]
        prefill = np.asarray(plain.logits(jax.random.normal(jax.random.key(1), (2, 40, 64), jnp.float32)))
    assert [c[:2] for c in calls] == [((3, 1, 64), (128, 64)), ((16, 1, 64), (128, 64))]
    assert all(c[2]["out_dtype"] == jnp.float32 for c in calls)
    assert prefill.shape == (2, 40, 128)
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.max(np.abs(w)))
    untied = Decoder(ModelConfig.from_hf(dict(HF, tie_word_embeddings=False)), rngs=nnx.Rngs(params=2))
    with use_kernel_settings(decode_gemv="pallas"):
        decode_weights(untied, join_projections=False)
    assert not untied.head_gemv


def test_matmul_of_16_rows_takes_the_dot_kernel_on_a_layer_of_the_stack(monkeypatch):
    """GemvWeight.matmul at 16 rows (16 users' decode step) under pallas: the kernel (its tensor-core body) on the
    stack read in place at the layer, the einsum's values; 65 rows (past MAX_DOT_ROWS) take XLA's einsum."""
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.standard_normal((2, 64, 128)) * 0.1, jnp.float32)  # [L, K, N]
    gw = GemvWeight.from_kernel(kernel).at_layer(jnp.int32(1))
    calls = []
    real = gemv_weight.decode_gemv
    monkeypatch.setattr(gemv_weight, "decode_gemv",
                        lambda x, w, **kw: calls.append((x.shape, w.shape)) or real(x, w, **kw))
    xs = [jnp.asarray(rng.standard_normal((b, 1, 64)), jnp.float32) for b in (16, 65)]
    with use_kernel_settings(decode_gemv="pallas"):
        got = [gw.matmul(x) for x in xs]
    assert calls == [((16, 1, 64), (2, 128, 64))]  # the whole stack: the layer read in place
    for g, x in zip(got, xs):
        np.testing.assert_allclose(g, x @ kernel[1], rtol=1e-5, atol=1e-5)
