"""quant_matmul's api (its mode; surojax's SUROJAX_QUANT_MATMUL setting) and the custom_vjp over the fused kernels: forward and input
gradient equal the XLA path's, the frozen weight gets no gradient, and LoRA gradients over a quantised base
through the kernels (interpret mode on CPU) equal those over its dequantised copy.

Tolerance. Both paths multiply by the same decoded weights; they differ in the order of the fp32 sums only (the
kernel adds K in tiles). In float32 that is rtol 1e-5 / atol 1e-5 x max|grad| at these sizes (K <= 256), far
below the quantisation error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from kernel_weights import make_weight
from pallas_kernels.quant_matmul import api
from pallas_kernels.quant_matmul.api import KernelOptions, choose, fused_matmul, xla_matmul
from pallas_kernels.quant_matmul.kernel import Tiles
from surojax.kernel_settings import KernelSettings, QuantMatmul, kernel_settings, use_kernel_settings
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.peft.lora import apply_lora
from surojax.quant.model import dequantize_model, quantize_model

OPTS = KernelOptions(Tiles(bm=16, bn=32, kt=128), Tiles(bm=16, bn=32, kt=128), interpret=True)


def test_mode_selection(monkeypatch):
    w = make_weight("q8_0", 128, 32)
    assert choose(w) == "xla"  # auto (the default) is xla off GPU
    assert choose(w, "pallas") == "pallas"
    with pytest.raises(ValueError, match="stacked"):
        choose(jax.tree.map(lambda a: jnp.stack([a, a]), w), "pallas")
    with pytest.raises(ValueError, match="K=64"):
        choose(make_weight("q8_0", 64, 32), "pallas")
    assert choose(w, "xla") == "xla"
    with pytest.raises(ValueError, match="mode 'cuda'"):
        choose(w, "cuda")
    with pytest.raises(ValueError, match="SUROJAX_QUANT_MATMUL='cuda'"):  # surojax's setting names its variable
        KernelSettings.from_environ({"SUROJAX_QUANT_MATMUL": "cuda"})
    assert kernel_settings().quant_matmul is QuantMatmul.AUTO  # what surojax's formats pass (quant/base.py)
    monkeypatch.setattr(api, "on_gpu", lambda: True)  # auto on GPU: only the formats of AUTO_PALLAS
    monkeypatch.setattr(api, "AUTO_PALLAS", frozenset({"q8_0"}))
    assert choose(w, "auto") == "pallas" and choose(make_weight("fp8", 128, 32), "auto") == "xla"
    assert choose(make_weight("q8_0", 64, 32), "auto") == "xla"  # off the tiles: auto falls back


@pytest.mark.parametrize("name", ["q4_k", "nvfp4"])
def test_custom_vjp_matches_the_xla_path(name):
    w = make_weight(name, 256, 64, seed=5)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 256)), jnp.float32)   # [B, T, K]: leading dims flattened
    c = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)

    @jax.jit
    def kernel_vjp(x, w, c):
        y, vjp = jax.vjp(lambda x, w: fused_matmul(x, w, OPTS), x, w)
        return (y, *vjp(c))

    @jax.jit
    def xla_vjp(x, w, c):
        y, vjp = jax.vjp(lambda x: xla_matmul(x, w), x)
        return (y, *vjp(c))

    y, dx, dw = kernel_vjp(x, w, c)
    y_ref, dx_ref = xla_vjp(x, w, c)
    assert y.shape == (2, 5, 64) and dx.shape == x.shape
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max())
    assert type(dw) is type(w)  # the frozen base: zero cotangents (float0 for the integer leaves)
    for a in jax.tree.leaves(dw):
        assert a.dtype == jax.dtypes.float0 or not np.any(np.asarray(a))


HF = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 256,
      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
TARGETS = ("v_proj", "down_proj")  # [128, 64], [256, 128]: the other targets stay bf16 (interpret mode is slow)
TOKENS = jnp.asarray([[3, 17, 99, 120, 7, 42, 1, 100], [5, 6, 7, 8, 9, 10, 11, 12]])


def _grads(model):
    graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)

    def loss(tr):
        logits = nnx.merge(graphdef, tr, frozen)(TOKENS)
        return jnp.mean(jax.nn.log_softmax(logits, -1)[..., 0] ** 2)

    return dict(nnx.to_flat_state(jax.jit(jax.grad(loss))(trainable)))


def test_lora_gradients_through_the_kernels_equal_the_dequantised_base(monkeypatch):
    model = Decoder(ModelConfig.from_hf(dict(HF)), rngs=nnx.Rngs(params=0))
    quantize_model(model, "nf4", targets=TARGETS)
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(1))
    key = jax.random.key(7)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        key, sub = jax.random.split(key)  # B != 0 too, so that A has a gradient
        var.set_value(0.1 * jax.random.normal(sub, var.get_value().shape, jnp.float32))
    graphdef, state = nnx.split(model)
    reference = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    dequantize_model(reference, jnp.float32)

    calls = []
    real = api.fused_matmul
    monkeypatch.setattr(api, "fused_matmul", lambda *a: calls.append(a[1].name) or real(*a))
    with use_kernel_settings(quant_matmul="pallas"):
        g_kernel = _grads(model)
    assert sorted(calls) == ["nf4"] * 2  # each quantised linear went through the kernels (traced once: the scan)
    with use_kernel_settings(quant_matmul="xla"):
        g_ref = _grads(reference)
    assert g_kernel.keys() == g_ref.keys() and len(g_kernel) == 14
    for path in g_kernel:
        gk, gr = np.asarray(g_kernel[path].get_value()), np.asarray(g_ref[path].get_value())
        assert np.abs(gr).max() > 0, path
        np.testing.assert_allclose(gk, gr, rtol=1e-5, atol=1e-5 * np.abs(gr).max(), err_msg=str(path))


@pytest.mark.parametrize("path", ["xla", "pallas"])
def test_scan_saves_the_packed_weight_not_a_bf16_copy(path, capsys):
    """Under a scan without remat, plain autodiff of x @ dequantize(w) saves every layer's bf16 weight for the
    backward (the whole base in bf16); both custom_vjps keep only the packed bytes (the scanned argument itself)."""
    w = make_weight("q4_k", 256, 128)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a, a]), w)

    def loss(matmul):
        def f(x, ws):
            def body(c, wl):
                return jnp.tanh(matmul(c, wl)).repeat(2, axis=1), None
            return jnp.sum(jax.lax.scan(body, x, ws)[0])
        return f

    x = jnp.ones((8, 256), jnp.bfloat16)
    print_saved_residuals(loss(lambda c, wl: jnp.einsum("mk,kn->mn", c, wl.dequantize(c.dtype))), x, stacked)
    plain = capsys.readouterr().out
    assert "bf16[3,256,128]" in plain  # what the custom_vjps avoid
    matmul = xla_matmul if path == "xla" else (lambda c, wl: fused_matmul(c, wl, OPTS))
    print_saved_residuals(loss(matmul), x, stacked)
    saved = capsys.readouterr().out
    assert "bf16[3,256,128]" not in saved and "u8[3,128,144] from the argument" in saved, saved
