"""Weights laid out once for the decode kernel (surojax.quant.laid_out): the layout decodes to the source format's
own values, a model converted by `lay_out_model` computes what it computed before on the XLA path and through
the kernel's decode form, and a served model decodes the same greedy tokens through the kernels as without them.

Tolerance. The laid-out weights are the same values; only the order of the fp32 sums differs (the kernel adds K
in tiles and its split-K partials after): tests/tolerances.py's reorder bound for the longest sum (the MLP's F = 512)
at the logits' scale. A layout that put a value in the wrong place would be off by O(the logits)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.quant_matmul import api
from pallas_kernels.quant_matmul.api import decode_layouts
from surojax.kernel_settings import QuantMatmul, kernel_settings, use_kernel_settings
from surojax.generation.sampling import SamplingParams
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.quant.model import quantize_model
from surojax.quant import FP8Block, quantize
from surojax.quant.gguf_mixed import GGUFMixed
from surojax.quant.laid_out import LaidOut, LaidOutMixed, decode_weights, lay_out, lay_out_model
from surojax.quant.transform import QuantParam
from surojax.serve.engine import Engine
from tests.pallas_kernels.kernel_weights import make_weight
from tests.serve.configs import BUCKETS, engine_config
from tests.tolerances import reorder_atol

HF = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 256, "intermediate_size": 512,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
LONGEST_SUM = HF["intermediate_size"]  # the down projection's K
TOKENS = jnp.asarray([[3, 17, 99, 120, 7, 42, 1, 100]])


def _forward(model, tokens):
    return jax.jit(lambda m, t: m(t))(model, tokens)


@pytest.fixture(scope="module")
def models():
    """(quantised model, the same model laid out): q4_k v/down projections, the other Linears fp32."""
    model = Decoder(ModelConfig.from_hf(dict(HF)), rngs=nnx.Rngs(params=0))
    quantize_model(model, "q4_k", targets=("v_proj", "down_proj"))
    graphdef, state = nnx.split(model)
    laid = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    probe = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    assert lay_out_model(probe, frozenset({"q4_k"}), min_values=256 * 512) == {"q4_k": 1}  # down [512, 256] only
    assert lay_out_model(laid, frozenset({"*", "float32"})) == {"q4_k": 2, "float32": 5}
    return model, laid


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "nf4", "fp8", "nvfp4", "bfloat16"])
def test_the_layout_decodes_to_the_source_values(name):
    """Stacked [L, ...] weights: LaidOut.dequantize equals the source format's dequantize bit for bit."""
    if name == "bfloat16":
        w = jnp.asarray(np.random.default_rng(0).standard_normal((3, 256, 64)), jnp.bfloat16)
        want = w.astype(jnp.float32)
    else:
        w = jax.tree.map(lambda *a: jnp.stack(a), *(make_weight(name, 256, 64, seed=s) for s in range(3)))
        want = w.dequantize(jnp.float32)
    laid = lay_out(w)
    assert isinstance(laid, LaidOut) and laid.source == name and laid.data.shape[0] == 3
    np.testing.assert_array_equal(np.asarray(laid.dequantize(jnp.float32)), np.asarray(want))
    assert lay_out(laid) is laid
    one = lambda w: jax.tree.map(lambda a: a[None], w)  # noqa: E731  a stack of one layer
    assert lay_out(one(make_weight("q8_0", 64, 64))) is None  # K off the 128 tile: stays in its format
    assert lay_out(make_weight("q8_0", 128, 64)) is None  # no layers axis: not a layer stack's weight


def test_a_weight_its_format_keeps_from_the_kernels_stays_in_its_format():
    """FP8 with scale blocks 64 wide along K (a checkpoint's groups of 64, surojax.weights.prequant): the shapes
    suit the kernel, the format's own kernel_layout_error does not, so serving keeps it as it is (it raised)."""
    codes = jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 256)), jnp.float8_e4m3fn)
    w = FP8Block(data=codes, scale=jnp.ones((2, 64, 4), jnp.float32), shape=(256, 64), block=(1, 64))
    assert lay_out(w) is None
    assert isinstance(lay_out(dataclasses.replace(w, scale=jnp.ones((2, 64, 2)), block=(1, 128))), LaidOut)


def test_a_laid_out_model_computes_the_same_logits(models, monkeypatch):
    model, laid = models
    with use_kernel_settings(quant_matmul="xla"):
        ref = np.asarray(_forward(model, TOKENS))
        tol = reorder_atol(LONGEST_SUM, np.float32, np.abs(ref).max())
        np.testing.assert_allclose(np.asarray(_forward(laid, TOKENS)), ref, rtol=0, atol=tol)
    calls = []
    real = api.fused_matmul
    monkeypatch.setattr(api, "fused_matmul", lambda *a: calls.append((a[2].splits, a[1].layer.shape)) or real(*a))
    with use_kernel_settings(quant_matmul="pallas"):  # the decode form (M = 1 row, K split), the tiled form (M = 8)
        np.testing.assert_allclose(np.asarray(_forward(laid, TOKENS[:, :1])), ref[:, :1], rtol=0, atol=tol)
    # every Linear of the layer through the kernel, K split, reading its layer of the whole stack in place
    assert len(calls) == 7 and max(c[0] for c in calls) > 1 and {c[1] for c in calls} == {()}


def test_auto_takes_the_decode_kernel_below_the_measured_crossover(monkeypatch):
    native = make_weight("q4_k", 256, 64)
    laid = lay_out(jax.tree.map(lambda a: a[None], native)).at_layer(0)  # what the layer scan hands a Linear
    assert kernel_settings().quant_matmul is QuantMatmul.AUTO  # the default: a clean environment
    monkeypatch.setattr(api, "on_gpu", lambda: False)
    assert decode_layouts() == (frozenset(), 0) and api.choose(laid, m=1) == "xla"  # auto off GPU: never
    monkeypatch.setattr(api, "on_gpu", lambda: True)
    monkeypatch.setattr(api, "DECODE_MAX_M", {})
    assert api.choose(laid, m=1) == "xla"  # no measured crossover for q4_k: XLA
    monkeypatch.setattr(api, "DECODE_MAX_M", {"q4_k": 16})
    monkeypatch.setattr(api, "DECODE_MIN_VALUES", 256 * 64)
    assert decode_layouts() == (frozenset({"q4_k"}), 256 * 64)
    assert [api.choose(laid, m=m) for m in (1, 16, 17)] == ["pallas", "pallas", "xla"]
    assert api.choose(native, m=1) == "xla"  # not laid out: the per-call re-layout would cost a pass
    monkeypatch.setattr(api, "DECODE_MIN_VALUES", 256 * 64 + 1)
    assert api.choose(laid, m=1) == "xla"  # below the size where the kernel pays
    assert decode_layouts("xla") == (frozenset(), 0) and api.choose(laid, "xla", m=1) == "xla"
    layouts, min_values = decode_layouts("pallas")
    assert {"*", "bfloat16"} <= layouts and min_values == 0
    model = Decoder(ModelConfig.from_hf(dict(HF)), rngs=nnx.Rngs(params=0))  # what build_server does at load
    quantize_model(model, "q8_0", targets=("down_proj",))
    with use_kernel_settings(quant_matmul="pallas"):  # decode_weights reads the setting
        assert decode_weights(model) == {"q8_0": 1, "float32": 6}
        assert model.layers.attn.qkv_proj is not None and model.layers.mlp.gate_up_proj is not None  # joined
        assert decode_weights(model) == {"q8_0": 1, "float32": 3}  # idempotent: qkv, o, gate_up (down is q8_0)


def test_served_greedy_tokens_through_the_kernels_equal_xla(models, monkeypatch):
    """The engine's prefill and its multi-step paged decode (the layer scan slicing LaidOut leaves) through the
    kernels (interpret mode) give the greedy tokens of the XLA path on the unconverted model."""
    model, laid = models
    cfg = dict(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48,
               buckets=BUCKETS, decode_steps=4)
    prompts = [[5, 9, 33, 2, 71, 8], [40, 41, 42]]

    def run(m):
        eng = Engine(m, engine_config(**cfg))
        rids = [eng.add_request(p, SamplingParams(max_tokens=6)) for p in prompts]
        out = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        return [out[r] for r in rids]

    with use_kernel_settings(quant_matmul="xla"):
        want = run(model)
    with use_kernel_settings(quant_matmul="pallas"):
        assert run(laid) == want


def test_mixed_stacks_lay_out_per_format(monkeypatch):
    """A GGUF Q4_K_M-style mixed stack (Q4_K and Q6_K layers, GGUFMixed) lays out as one LaidOut stack per type:
    each layer decodes to its own format's values bit for bit, and a model with mixed v / down projections gives
    the unconverted model's logits through the kernels' decode form (interpret mode; lax.switch per layer)."""
    rng = np.random.default_rng(5)
    model = Decoder(ModelConfig.from_hf(dict(HF, num_hidden_layers=3)), rngs=nnx.Rngs(params=0))
    for path, types in (("attn.v_proj", ("q6_k", "q4_k", "q6_k")), ("mlp.down_proj", ("q4_k", "q4_k", "q6_k"))):
        holder, leaf = path.split(".")
        lin = getattr(getattr(model.layers, holder), leaf)
        k, n = lin.kernel.get_value().shape[1:]
        layers = [quantize(rng.normal(size=(k, n)).astype(np.float32) * 0.05, t) for t in types]
        lin.kernel = QuantParam(GGUFMixed.from_layers(layers), **lin.kernel.get_metadata())
    with use_kernel_settings(quant_matmul="xla"):
        want = np.asarray(_forward(model, TOKENS))
    graphdef, state = nnx.split(model)
    laid = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    assert lay_out_model(laid, frozenset({"q4_k", "q6_k"})) == {"q4_k+q6_k": 2}
    v = laid.layers.attn.v_proj.kernel.get_value()
    assert isinstance(v, LaidOutMixed) and [p.data.shape[0] for p in v.parts] == [1, 2]  # q4_k, q6_k layers
    np.testing.assert_array_equal(np.asarray(v.dequantize(jnp.float32)),
                                  np.asarray(model.layers.attn.v_proj.kernel.get_value().dequantize(jnp.float32)))
    tol = reorder_atol(LONGEST_SUM, np.float32, np.abs(want).max())
    with use_kernel_settings(quant_matmul="xla"):
        np.testing.assert_allclose(np.asarray(_forward(laid, TOKENS)), want, rtol=0, atol=tol)
    calls = []
    real = api.fused_matmul
    monkeypatch.setattr(api, "fused_matmul", lambda *a: calls.append(a[1].spec.name) or real(*a))
    with use_kernel_settings(quant_matmul="pallas"):
        np.testing.assert_allclose(np.asarray(_forward(laid, TOKENS[:, :1])), want[:, :1], rtol=0, atol=tol)
    assert sorted(calls) == ["q4_k", "q4_k", "q6_k", "q6_k"]  # v and down: each format's branch is the kernel
