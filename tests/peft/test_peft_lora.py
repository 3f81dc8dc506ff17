"""LoRA as a transform: exact no-op at init, gradients only to the adapter, merge, dropout, scan/remat/jit."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from peft_support import TINY, TOKENS, forward, randomize_adapter, tiny_model
from surojax.models.layer_runner import LayerScan, Recompute
from surojax.models.layers.linear import Linear
from surojax.models.layers.params import logical_axes
from surojax.peft.lora import (FROZEN, LORA_TARGETS, TRAINABLE, LoRADropoutKey, LoRALinear, apply_lora, lora_modules,
                               merge_lora, set_dropout_key)
from surojax.weights.hf_checkpoint import hf_tensors


def _lora(model, **kw):
    kw = {"rank": 4, "alpha": 8.0, "rngs": nnx.Rngs(7), **kw}
    return apply_lora(model, **kw)


def _flat(state) -> dict[str, jax.Array]:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def _loss(model):
    logits = model(TOKENS)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3] ** 2)


@pytest.mark.parametrize("family", sorted(TINY))
def test_fresh_adapter_gives_exactly_the_base_logits(family):
    model = tiny_model(family)
    base = forward(model, TOKENS)  # the shared jitted forward: the plain structure's compilation is reused
    _lora(model)
    assert jnp.array_equal(forward(model, TOKENS), base)  # B = 0: base(x) + 0, bit for bit
    assert jnp.array_equal(forward(model, TOKENS), forward(tiny_model(family), TOKENS))  # a fresh base too


def test_init_follows_peft_and_carries_axes(llama):
    _lora(llama, rank=8, alpha=16.0)
    mods = lora_modules(llama)
    assert tuple(mods) == LORA_TARGETS
    L = TINY["llama"].num_layers
    for name, mod in mods.items():
        base = mod.base
        assert isinstance(base, Linear) and type(base.kernel) is nnx.Param
        a, b = mod.lora_a.get_value(), mod.lora_b.get_value()
        assert a.shape == (L, base.in_features, 8) and b.shape == (L, 8, base.out_features)
        assert a.dtype == b.dtype == jnp.float32
        assert not jnp.any(b)
        bound = 1 / math.sqrt(base.in_features)  # kaiming_uniform(a=sqrt(5)) of torch's [R, in]
        assert float(jnp.max(jnp.abs(a))) <= bound and float(jnp.max(jnp.abs(a))) > 0.8 * bound
        _, in_axis, out_axis = logical_axes(base.kernel)
        assert logical_axes(mod.lora_a) == ("layers", in_axis, None)
        assert logical_axes(mod.lora_b) == ("layers", None, out_axis)
        assert mod.scaling == 2.0 and mod.dropout_key is None


def test_forward_formula_and_rslora_scaling():
    """Standalone on one [in, out] Linear: y = x W + b + (x A) B * scaling, scaling alpha/r or alpha/sqrt(r)."""
    rngs, rs = nnx.Rngs(0), np.random.RandomState(1)  # numpy draws: no eager compilation per shape
    x = jnp.asarray(rs.randn(3, 5, 16), jnp.float32)
    for use_rslora, scaling in ((False, 6.0 / 4), (True, 6.0 / 2)):
        base = Linear(16, 24, ("embed", "mlp"), use_bias=True, rngs=rngs)
        base.bias.set_value(jnp.asarray(rs.randn(24), jnp.float32))
        a = jnp.asarray(rs.randn(16, 4), jnp.float32)
        b = jnp.asarray(rs.randn(4, 24), jnp.float32)
        mod = LoRALinear(base, nnx.LoRAParam(a), nnx.LoRAParam(b), rank=4, alpha=6.0, use_rslora=use_rslora)
        assert mod.scaling == scaling
        want = np.asarray(x) @ np.asarray(base.kernel[...]) + np.asarray(base.bias[...]) \
            + (np.asarray(x) @ np.asarray(a) @ np.asarray(b)) * scaling
        np.testing.assert_allclose(mod(x), want, rtol=1e-5, atol=1e-5)


def test_state_filters_select_exactly_the_adapter(llama):
    n_params = len(_flat(nnx.state(llama, nnx.Param)))
    _lora(llama, targets=("q_proj", "down_proj"))
    lora = _flat(nnx.state(llama, TRAINABLE))
    assert sorted(lora) == ["layers.attn.q_proj.lora_a", "layers.attn.q_proj.lora_b",
                            "layers.mlp.down_proj.lora_a", "layers.mlp.down_proj.lora_b"]
    frozen = _flat(nnx.state(llama, FROZEN))
    assert len(frozen) == n_params and not any("lora" in k for k in frozen)
    assert "layers.attn.q_proj.base.kernel" in frozen and "layers.attn.k_proj.kernel" in frozen
    assert len(_flat(nnx.state(llama, nnx.Param))) == n_params + 4  # LoRAParam is a Param


def test_gradient_reaches_only_the_adapter(llama):
    _lora(llama)
    graphdef, _, _ = nnx.split(llama, TRAINABLE, ...)

    @jax.jit
    def grad_fn(trainable, rest):
        """One compilation for every gradient below (fresh and randomised adapter): nnx.grad with the TRAINABLE
        DiffState, and the trainer's form, d/d(trainable) and d/d(rest) of the split state."""
        g = nnx.grad(_loss, argnums=nnx.DiffState(0, TRAINABLE))(nnx.merge(graphdef, trainable, rest))
        return g, *jax.grad(lambda tr, r: _loss(nnx.merge(graphdef, tr, r)), argnums=(0, 1))(trainable, rest)

    # Fresh adapter (B = 0): dL/dA = 0 (B blocks it) while dL/dB != 0 -- the classic LoRA start.
    g0 = _flat(grad_fn(*nnx.split(llama, TRAINABLE, ...)[1:])[0])
    assert all(not jnp.any(v) for k, v in g0.items() if k.endswith("lora_a"))
    assert all(jnp.any(v) for k, v in g0.items() if k.endswith("lora_b"))
    randomize_adapter(llama)
    _, trainable, rest = nnx.split(llama, TRAINABLE, ...)
    g_diff, g_tr, g_rest = grad_fn(trainable, rest)
    grads = _flat(g_diff)
    assert sorted(grads) == sorted(_flat(nnx.state(llama, TRAINABLE)))  # nothing else is differentiated
    for k, g in grads.items():  # every target, every layer of the scan gets a gradient
        assert all(jnp.any(g[i]) for i in range(g.shape[0])), k

    # The trainer's form: split (trainable, rest); the gradient w.r.t. the base is structurally absent, and an
    # explicit gradient w.r.t. the base would be non-zero, so the filter (not the math) is what freezes it.
    assert jax.tree.structure(g_tr) == jax.tree.structure(trainable)
    for k, g in _flat(g_tr).items():  # the same gradient as the DiffState form
        np.testing.assert_allclose(g, grads[k], rtol=1e-4, atol=1e-5)  # two traces: rounding only
    assert jnp.any(_flat(g_rest)["layers.attn.q_proj.base.kernel"])


def test_lora_training_leaves_the_base_bit_identical(llama):
    _lora(llama)
    before = jax.tree.map(np.array, _flat(nnx.state(llama, FROZEN)))
    opt = nnx.Optimizer(llama, optax.adam(1e-2), wrt=TRAINABLE)

    @nnx.jit
    def step(model, opt):
        loss, g = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, TRAINABLE))(model)
        opt.update(model, g)
        return loss

    losses = [float(step(llama, opt)) for _ in range(5)]
    assert losses[-1] < losses[0]
    after = _flat(nnx.state(llama, FROZEN))
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert all(jnp.any(v) for k, v in _flat(nnx.state(llama, TRAINABLE)).items() if k.endswith("lora_b"))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_merge_matches_the_unmerged_adapter(family):
    plain = tiny_model(family)
    model = _lora(tiny_model(family), use_rslora=True)
    randomize_adapter(model)
    want = forward(model, TOKENS)
    assert float(jnp.max(jnp.abs(want - forward(plain, TOKENS)))) > 1e-2  # the adapter matters
    merge_lora(model)
    # Not bit-exact: x (W + s A B) rounds differently from x W + s (x A) B; fp32 leaves ~1e-7 relative error.
    np.testing.assert_allclose(forward(model, TOKENS), want, rtol=0, atol=1e-5)  # plain's compilation
    assert nnx.graphdef(model) == nnx.graphdef(plain)  # structure of a plain (loaded) base again
    assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(nnx.state(plain))
    assert not lora_modules(model) and set(hf_tensors(model)) == set(hf_tensors(plain))


def test_scan_with_remat_and_jit(llama):
    _lora(llama)
    randomize_adapter(llama)
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    seg = jnp.ones_like(TOKENS)
    graphdef, trainable, rest = nnx.split(llama, TRAINABLE, ...)

    @jax.jit
    def scan_and_remat(trainable, rest):
        """One compilation: the layer scan without and with remat, and the adapter's gradient through the remat."""
        def h(tr, runner=None):
            return nnx.merge(graphdef, tr, rest).hidden_states(TOKENS, pos, seg, runner=runner).hidden
        g = jax.grad(lambda tr: jnp.sum(h(tr, LayerScan(Recompute.FULL)) ** 2))(trainable)
        return h(trainable), h(trainable, LayerScan(Recompute.FULL)), g

    h, h_remat, g = scan_and_remat(trainable, rest)
    assert jnp.array_equal(h, h_remat)
    jitted = forward(llama, TOKENS)  # the shared jitted forward (the LoRA llama's compilation is reused)
    np.testing.assert_allclose(jitted, llama(TOKENS), rtol=0, atol=1e-6)  # == the eager forward
    assert jax.tree.structure(g) == jax.tree.structure(trainable)
    assert all(jnp.any(v) for v in _flat(g).values())


def test_dropout_only_in_training_mode_with_a_fresh_key_per_step(llama):
    _lora(llama, dropout=0.5)
    randomize_adapter(llama)
    keys = [mod.dropout_key for mod in lora_modules(llama).values()]
    assert all(isinstance(k, LoRADropoutKey) for k in keys)
    assert not _flat(nnx.state(llama, LoRADropoutKey)).keys() & _flat(nnx.state(llama, nnx.Param)).keys()
    eval_logits = forward(llama, TOKENS)
    llama.train()
    fwd = nnx.jit(lambda m, k: (set_dropout_key(m, k), m(TOKENS))[1])
    a1, a2, b = fwd(llama, jax.random.key(1)), fwd(llama, jax.random.key(1)), fwd(llama, jax.random.key(2))
    assert jnp.array_equal(a1, a2)  # same key, same masks
    assert not jnp.array_equal(a1, b) and not jnp.array_equal(a1, eval_logits)
    data = [np.asarray(k.get_value()) for k in keys]  # distinct per module and per layer
    rows = {tuple(d[i].ravel()) for d in data for i in range(d.shape[0])}
    assert len(rows) == len(data) * data[0].shape[0]
    llama.eval()
    assert jnp.array_equal(forward(llama, TOKENS), eval_logits)


def test_dropout_mask_statistics():
    """With A = identity on 4 input features and B = identity, the update shows the dropped, rescaled input."""
    base = Linear(64, 8, ("embed", "mlp"), rngs=nnx.Rngs(0))
    key = LoRADropoutKey(jax.random.key_data(jax.random.key(3)))
    mod = LoRALinear(base, nnx.LoRAParam(jnp.eye(64)[:, :4]), nnx.LoRAParam(jnp.eye(4, 8)), rank=4, alpha=4.0,
                     dropout=0.25, dropout_key=key)  # scaling 1
    x = jnp.ones((4096, 64))
    assert jnp.array_equal(mod(x), base(x) + jnp.eye(64, 8)[:4].sum(0))  # eval mode: no dropout
    mod.deterministic = False
    vals = np.asarray(mod(x) - base(x))[:, :4].ravel()
    dropped = np.isclose(vals, 0.0, atol=1e-5)
    assert np.all(dropped | np.isclose(vals, 1 / 0.75, atol=1e-5))  # kept inputs are scaled by 1/(1-p)
    assert abs(dropped.mean() - 0.25) < 0.02 and abs(vals.mean() - 1.0) < 0.03


def test_errors(llama):
    with pytest.raises(ValueError, match="qkv_proj"):
        _lora(llama, targets=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="rank"):
        _lora(llama, rank=0)
    _lora(llama, targets="all-linear")
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        _lora(llama)
    with pytest.raises(ValueError, match="dropout"):
        _lora(tiny_model(), dropout=1.0)
