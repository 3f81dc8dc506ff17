"""quantize_model (surojax.quant.model over quant.transform): the targeted kernels of a built Decoder become quantised pytrees (leading layers axis) that
run through nnx.split / merge, lax.scan, jit and LoRA; the logits and LoRA gradients equal those of the same model
over the dequantised kernels.

Tolerance. The quantised matmul is x @ dequantize(x.dtype): the same math, and bit-exact against a GEMM over the
dequantised weight in the format's [N, K] storage layout (test_matmul_is_exactly_x_at_dequantize). The reference
model stores the dequantised weight as a plain [K, N] kernel, and XLA:CPU picks a different GEMM micro-kernel (a
different summation order) for that operand layout on some shapes (here the k/v projections, N = 32), so the model
level comparison is at fp32 rounding: rtol 1e-5 / atol 1e-6, orders of magnitude below the quantisation error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.peft.lora import LORA_TARGETS, apply_lora, base_linear, merge_lora
from surojax.quant import FP8Block, NF4, NVFP4, Q4_0, Q8_0
from surojax.quant.base import QuantFormat
from surojax.quant.model import dequantize_model, is_quantized, quantize_model
from surojax.quant.transform import QuantParam, quantize_stacked

HF = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TOKENS = jnp.asarray([[3, 17, 99, 250, 7, 42, 1, 200], [5, 6, 7, 8, 9, 10, 11, 12]])
FORMATS = [("nf4", {}, NF4), ("nf4", {"double_quant": True}, NF4), ("fp8", {}, FP8Block), ("nvfp4", {}, NVFP4),
           ("q8_0", {}, Q8_0), ("q4_0", {}, Q4_0)]
IDS = ["nf4", "nf4-dq", "fp8", "nvfp4", "q8_0", "q4_0"]
RTOL, ATOL = 1e-5, 1e-6


@nnx.jit
def _init():
    """One compilation for the model's random init (eagerly, each parameter shape compiles its own draw)."""
    return Decoder(ModelConfig.from_hf(dict(HF)), rngs=nnx.Rngs(params=0))


def _model():
    return _init()


def _clone(model):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


def _loss(trainable, graphdef, frozen):
    logits = nnx.merge(graphdef, trainable, frozen)(TOKENS)
    return jnp.mean(jax.nn.log_softmax(logits, -1)[..., 0] ** 2), logits


# One compilation per model structure, the logits and the LoRA gradients together: the quantised model compiles
# once for both tests below, the plain / dequantised reference shares one compilation.
_lora_grad = jax.jit(jax.grad(_loss, has_aux=True), static_argnums=1)


def _grads(model):
    graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
    grads, logits = _lora_grad(trainable, graphdef, frozen)
    return grads, np.asarray(logits)


def _with_adapter(model, adapter=None):
    """Rank-4 LoRA on every target; B != 0 (a detached adapter would give A zero gradient), or `adapter`'s
    values (the same adapter on another base)."""
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(1))
    if adapter is not None:
        nnx.update(model, adapter)
        return model
    rs = np.random.RandomState(7)  # numpy draws: no eager compilation per shape
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1] == "lora_b":
            var.set_value(jnp.asarray(0.1 * rs.randn(*var.get_value().shape), jnp.float32))
    return model


# One quantised model for every format: each format quantises its own target(s) (quantize_model(targets=[...]), as
# quantize_model_mix does for a llama.cpp file type), so a single compilation of the quantised model's logits and
# LoRA gradients runs every format through nnx.split / merge, lax.scan, jit and LoRA, and the dequantised clone and
# the plain model share one more. (One model per format compiled the same model six times.) The 4-bit formats sit
# on the k / v projections (N = 32) and on the MLP (K = 128); nf4 (the QLoRA default) takes two targets.
MIX = {"q_proj": "q8_0", "k_proj": "nf4", "v_proj": "nvfp4", "o_proj": "fp8", "gate_proj": "nf4-dq",
       "up_proj": "q4_0", "down_proj": "nf4"}
assert set(MIX) == set(LORA_TARGETS) and set(MIX.values()) == set(IDS)
_RUN: dict = {}


def _targets(fid):
    return [t for t in LORA_TARGETS if MIX[t] == fid]


def _run():
    """Once for the file: the mixed quantised model with an adapter, one report per format, and the logits and LoRA
    gradients of it, of its dequantised clone, and of the unquantised model with the same adapter."""
    if not _RUN:
        model = _model()
        reports = {fid: quantize_model(model, fmt, targets=_targets(fid), **options)
                   for fid, (fmt, options, _) in zip(IDS, FORMATS)}
        _with_adapter(model)
        reference = _clone(model)
        dequantize_model(reference, jnp.float32)
        plain = _with_adapter(_model(), nnx.state(model, nnx.LoRAParam))
        _RUN.update(model=model, reports=reports, reference=reference, plain_model=plain, quant=_grads(model),
                    deq=_grads(reference), plain=_grads(plain)[1])
    return _RUN


@pytest.mark.parametrize("fmt,options,cls", FORMATS, ids=IDS)
def test_logits_equal_the_dequantised_model(fmt, options, cls):
    run = _run()
    fid = IDS[FORMATS.index((fmt, options, cls))]
    model, report = run["model"], run["reports"][fid]
    L = model.cfg.num_layers
    for name in _targets(fid):
        var = base_linear(model, name).kernel
        assert isinstance(var, QuantParam) and isinstance(var, nnx.Param)
        value = var.get_value()
        assert type(value) is cls and value.name == fmt
        if cls is NF4:  # nf4 and nf4-dq are told apart by their double-quantised absmax
            assert (value.absmax_q is not None) == bool(options.get("double_quant"))
        assert all(leaf.shape[0] == L for leaf in jax.tree.leaves(value))  # the scan slices axis 0
        assert var.get_metadata()["axes"][0] == "layers"
        # the quantisation did change this kernel ... but not wildly
        deq = np.asarray(base_linear(run["reference"], name).kernel.get_value())
        orig = np.asarray(base_linear(run["plain_model"], name).kernel.get_value())
        assert not np.array_equal(deq, orig) and np.abs(deq - orig).max() < 0.5 * np.abs(orig).max()
    assert is_quantized(model) == {t: MIX[t].removesuffix("-dq") for t in LORA_TARGETS}
    assert model.embed.embedding.get_value().dtype == jnp.float32  # embeddings / head untouched
    assert not isinstance(model.lm_head.kernel.get_value(), QuantFormat)

    # the whole model's logits: every format's matmul (this one among them) == x @ its dequantised kernel
    assert is_quantized(run["reference"]) == {}
    quant, deq, plain = run["quant"][1], run["deq"][1], run["plain"]
    np.testing.assert_allclose(quant, deq, rtol=RTOL, atol=ATOL)
    assert not np.array_equal(quant, plain)  # the quantisation did change the weights ...
    assert np.abs(quant - plain).max() < 0.5 * np.abs(plain).max()  # ... but not wildly

    # (d) the memory report: every kernel is smaller
    assert set(report.before) == set(_targets(fid))
    assert report.bytes_after < report.bytes_before
    assert all(report.after[t] < report.before[t] for t in report.before)
    assert f"to {fmt}" in str(report)


def test_nf4_report_ratios():
    for options, expected in (({}, 0.5625 / 4), ({"double_quant": True}, None)):
        report = quantize_model(_model(), "nf4", **options)
        assert set(report.before) == set(LORA_TARGETS)  # the default targets: every linear kernel
        if expected is not None:
            assert report.ratio == pytest.approx(expected)
        else:  # double quant: 0.5 + ~1/64 bytes per value, plus a 1 KiB code book per layer (large here)
            assert report.ratio < 0.25


@pytest.mark.parametrize("fmt,options,cls", FORMATS, ids=IDS)
def test_lora_gradients_equal_those_over_the_dequantised_base(fmt, options, cls):
    """Each format's targets: their adapter's gradients flow back through the quantised kernel (x's gradient of
    x @ W goes through dequantize), and those of the targets before them through theirs."""
    run = _run()
    fid = IDS[FORMATS.index((fmt, options, cls))]
    assert all(isinstance(base_linear(run["model"], t).kernel.get_value(), cls) for t in _targets(fid))
    flat_q = dict(nnx.to_flat_state(run["quant"][0]))
    flat_r = dict(nnx.to_flat_state(run["deq"][0]))
    assert flat_q.keys() == flat_r.keys()
    assert {p[-1] for p in flat_q} == {"lora_a", "lora_b"}  # only the adapter is differentiated, never the base
    assert len(flat_q) == 2 * len(LORA_TARGETS)
    checked = 0
    for path in flat_q:
        if not set(path) & set(_targets(fid)):
            continue
        gq, gr = np.asarray(flat_q[path].get_value()), np.asarray(flat_r[path].get_value())
        assert np.abs(gq).max() > 0, path
        np.testing.assert_allclose(gq, gr, rtol=RTOL, atol=ATOL * np.abs(gr).max(), err_msg=str(path))
        checked += 1
    assert checked == 2 * len(_targets(fid))


@pytest.mark.parametrize("fmt,options,cls", FORMATS, ids=IDS)
def test_matmul_is_exactly_x_at_dequantize(fmt, options, cls):
    """The same math, bit for bit: x @ W equals the GEMM over dequantize() in the storage layout [N, K]."""
    w = np.random.RandomState(0).randn(2, 64, 32).astype(np.float32)
    x = jnp.asarray(np.random.RandomState(1).randn(2, 8, 64).astype(np.float32))
    q = quantize_stacked(w, fmt, **options)
    layer = jax.tree.map(lambda a: a[1], q)
    got = jax.jit(lambda x, q: q.matmul(x))(x, layer)
    w_nk = jnp.asarray(np.ascontiguousarray(np.swapaxes(np.asarray(layer.dequantize(jnp.float32)), -1, -2)))
    want = jax.jit(lambda x, w: jnp.einsum("...k,nk->...n", x, w))(x, w_nk)
    if options.get("double_quant"):  # the absmax decode (code * scale + offset) may round differently in a fusion
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    else:
        assert np.abs(np.asarray(got) - np.asarray(want)).max() == 0.0


def test_jit_split_merge_and_scan_keep_the_format():
    run = _run()
    model = run["model"]  # quantised, with an adapter
    graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
    frozen = jax.device_put(frozen)
    merged = nnx.merge(graphdef, trainable, frozen)
    for t in LORA_TARGETS:
        assert type(base_linear(merged, t).kernel.get_value()) is type(base_linear(model, t).kernel.get_value())
    assert isinstance(base_linear(merged, "q_proj").kernel.get_value(), Q8_0)
    g_merged, logits_merged = _grads(merged)
    np.testing.assert_array_equal(logits_merged, run["quant"][1])
    # one layer's slice is a one-layer weight
    layer0 = jax.tree.map(lambda x: x[0], base_linear(merged, "q_proj").kernel.get_value())
    assert layer0.dequantize(jnp.float32).shape == (64, 64)


def test_merging_into_a_quantised_base_raises_and_quantising_twice_raises():
    model = _model()
    quantize_model(model, "nf4")
    apply_lora(model, rank=2, alpha=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cannot fold a LoRA adapter into a quantized base"):
        merge_lora(model)
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(model, "q8_0")
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize_model(_model(), "q9_9")


def test_targets_subset_and_shape_errors():
    model = _model()
    report = quantize_model(model, "fp8", targets=["q_proj", "down_proj"])
    assert set(report.before) == {"q_proj", "down_proj"}
    assert is_quantized(model) == {"q_proj": "fp8", "down_proj": "fp8"}
    odd = Decoder(ModelConfig.from_hf({**HF, "intermediate_size": 72}), rngs=nnx.Rngs(params=0))
    with pytest.raises(ValueError, match="down_proj.*multiple of 32"):
        quantize_model(odd, "q4_0", targets=["down_proj"])
