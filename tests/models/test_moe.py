"""The MoE feed-forward (surojax/models/layers/moe.py) against a dense one-hot formulation: every expert run on
every token, combined with a [X, E] weight matrix. Forward and gradients (input, router, experts) must agree. The
few-rows gathered form against the grouped GEMMs, and the static rule that picks it."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.kernel_settings import MoeDecode, use_kernel_settings
from surojax.models.config import MoEConfig
from surojax.models.layers.moe import GATHER_CROSSOVER, GATHER_CROSSOVER_QUANTISED, MoE, dispatch, expert_path
from surojax.peft.lora import LoRAExpertLinear
from tests.tolerances import reorder_atol

D, E, F, K = 16, 6, 8, 2


def make(moe_cfg: MoEConfig, seed=0):
    m = MoE(D, moe_cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(seed))
    # larger router weights than the init so that routing is decisive and differs per token
    m.router.kernel.set_value(jax.random.normal(jax.random.key(seed + 1), (D, E)))
    if m.router.bias is not None:
        m.router.bias.set_value(0.5 * jax.random.normal(jax.random.key(seed + 2), (E,)))
    for lin in (m.experts.gate_up_proj, m.experts.down_proj):
        lin.kernel.set_value(0.3 * jax.random.normal(jax.random.key(seed + 3), lin.kernel.get_value().shape))
        if lin.bias is not None:
            lin.bias.set_value(0.2 * jax.random.normal(jax.random.key(seed + 4), lin.bias.get_value().shape))
    return m


def dense_reference(params, x, moe_cfg: MoEConfig, keep=None):
    """Every expert on every token, combined by a one-hot [X, E] matrix of the routing weights."""
    xs = x.reshape(-1, D)
    logits = xs @ params["router"]["kernel"]
    if "bias" in params["router"]:
        logits = logits + params["router"]["bias"]
    probs = jax.nn.softmax(logits, -1)
    if moe_cfg.router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, K)
        w = jax.nn.softmax(top, -1)
    else:
        w, ids = jax.lax.top_k(probs, K)
        if moe_cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(ids, E)  # [X, k, E]
    if keep is not None:
        onehot = onehot * keep[..., None]
    combine = jnp.einsum("xk,xke->xe", w, onehot)
    gu = jnp.einsum("xd,edf->xef", xs, params["experts"]["gate_up_proj"]["kernel"])
    if "bias" in params["experts"]["gate_up_proj"]:
        gu = gu + params["experts"]["gate_up_proj"]["bias"]
    if moe_cfg.activation == "swiglu_clamped":
        g, u = gu[..., ::2], gu[..., 1::2]
        g = jnp.minimum(g, moe_cfg.swiglu_limit)
        u = jnp.clip(u, -moe_cfg.swiglu_limit, moe_cfg.swiglu_limit)
        a = (u + 1) * g * jax.nn.sigmoid(moe_cfg.swiglu_alpha * g)
    else:
        g, u = jnp.split(gu, 2, -1)
        a = jax.nn.silu(g) * u
    out = jnp.einsum("xef,efd->xed", a, params["experts"]["down_proj"]["kernel"])
    if "bias" in params["experts"]["down_proj"]:
        out = out + params["experts"]["down_proj"]["bias"]
    return jnp.einsum("xe,xed->xd", combine, out).reshape(x.shape)


CONFIGS = {
    "qwen3_moe": MoEConfig(E, K, F, norm_topk_prob=True),
    "no_renorm": MoEConfig(E, K, F, norm_topk_prob=False),
    "gpt_oss": MoEConfig(E, K, F, router="topk_softmax", router_bias=True, expert_bias=True,
                         activation="swiglu_clamped", swiglu_limit=0.8),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_and_gradients_equal_dense_one_hot(name):
    cfg = CONFIGS[name]
    m = make(cfg)
    x = jax.random.normal(jax.random.key(7), (2, 5, D))
    seg = jnp.ones((2, 5), jnp.int32)
    graphdef, params = nnx.split(m)

    def ours(p, x):
        y = nnx.merge(graphdef, p)(x, seg)[0]
        return jnp.sum(jnp.sin(y)), y

    def ref(p, x):
        y = dense_reference(nnx.to_pure_dict(p), x, cfg)
        return jnp.sum(jnp.sin(y)), y

    # one compilation each for the output and the gradients (eagerly, every op compiles on its own)
    g_ours, y_ours = jax.jit(jax.grad(ours, argnums=(0, 1), has_aux=True))(params, x)
    g_ref, y_ref = jax.jit(jax.grad(ref, argnums=(0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(y_ours, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(g_ours[0]["router"]["kernel"][...]).max()) > 0  # the router does get a gradient


def test_capacity_drops_the_overflow_in_token_order():
    cfg = CONFIGS["qwen3_moe"]
    m = make(cfg)
    m.capacity_factor = 0.5  # at most ceil(0.5 * 20 / 6) = 2 assignments per expert
    x = jax.random.normal(jax.random.key(3), (2, 5, D))
    seg = jnp.ones((2, 5), jnp.int32)
    y, stats = m(x, seg)
    ids = jax.lax.top_k(jax.nn.softmax(x.reshape(-1, D) @ m.router.kernel[...], -1), K)[1]
    flat = np.asarray(ids).reshape(-1)
    seen, keep = {}, np.zeros(flat.shape, bool)
    for a, e in enumerate(flat):  # in assignment (token) order, the first `capacity` of each expert are kept
        seen[e] = seen.get(e, 0) + 1
        keep[a] = seen[e] <= 2
    assert (~keep).sum() > 0 and float(stats.dropped) == (~keep).sum()
    ref = dense_reference(nnx.to_pure_dict(nnx.state(m)), x, cfg, keep=jnp.asarray(keep.reshape(-1, K), jnp.float32))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_stats_count_real_tokens_only():
    m = make(CONFIGS["no_renorm"])
    x = jax.random.normal(jax.random.key(5), (2, 4, D))
    seg = jnp.asarray([[1, 1, 2, 2], [1, 1, 0, 0]], jnp.int32)
    _, st = nnx.jit(lambda m, x, seg: m(x, seg))(m, x, seg)  # one compilation (eagerly, one per op)
    # the reference in numpy (float64)
    xs = np.asarray(x, np.float64).reshape(-1, D)[np.asarray(seg).reshape(-1) != 0]
    logits = xs @ np.asarray(m.router.kernel[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, -1, kind="stable")[:, :K].reshape(-1)
    np.testing.assert_array_equal(st.expert_counts, np.bincount(ids, minlength=E))
    np.testing.assert_allclose(st.prob_sums, probs.sum(0), rtol=1e-5)
    assert float(st.tokens) == 6 and float(st.dropped) == 0
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(st.z_sum, np.sum(lse ** 2), rtol=1e-5)


def test_dispatch_groups_are_contiguous_and_stable():
    ids = jnp.asarray([[2, 0], [0, 1], [2, 1], [0, 2]], jnp.int32)
    d = dispatch(ids, 4)
    np.testing.assert_array_equal(d.group_sizes, [3, 2, 3, 0])
    np.testing.assert_array_equal(d.row_expert, [0, 0, 0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(d.order, [1, 2, 6, 3, 5, 0, 4, 7])  # token order inside each expert


def test_moe_config_refuses_bad_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        dataclasses.replace(CONFIGS["qwen3_moe"], experts_per_token=E + 1)


def _with_expert_lora(m: MoE) -> MoE:
    """Both expert projections wrapped in LoRAExpertLinear with B != 0 (an adapter that changes the output)."""
    for name in ("gate_up_proj", "down_proj"):
        base = getattr(m.experts, name)
        e, i, o = base.kernel.get_value().shape
        a = nnx.LoRAParam(0.3 * jax.random.normal(jax.random.key(11), (e, i, 2)))
        b = nnx.LoRAParam(0.3 * jax.random.normal(jax.random.key(12), (e, 2, o)))
        setattr(m.experts, name, LoRAExpertLinear(base, a, b, rank=2, alpha=4))
    return m


def _run(m: MoE, x, seg, path: str):
    """(y, stats, gradients of sum(sin(y)) w.r.t. the parameters and x) with `moe_decode` = path; a fresh jit per
    call (the setting is read at trace time)."""
    graphdef, params = nnx.split(m)

    def f(p, x):
        y, stats = nnx.merge(graphdef, p)(x, seg)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, stats)

    with use_kernel_settings(moe_decode=path):
        grads, (y, stats) = jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))(params, x)
    return y, stats, grads


@pytest.mark.parametrize("name,dtype", [("qwen3_moe", jnp.float32), ("gpt_oss", jnp.float32),
                                        ("qwen3_moe", jnp.bfloat16), ("lora", jnp.float32)])
def test_gather_path_equals_grouped_path(name, dtype):
    """The few-rows form (each assignment's expert gathered) against the grouped GEMMs on the same call: top-2 over
    10 tokens of 6 experts (experts repeat across tokens), fp32 and bf16 parameters and inputs, gpt_oss's expert
    biases and clamped activation, a LoRA adapter on both expert projections: outputs and gradients within the
    fp32 reorder tolerance (bf16: its rounding of the projections' outputs), router stats identical."""
    m = _with_expert_lora(make(CONFIGS["qwen3_moe"])) if name == "lora" else make(CONFIGS[name])
    if dtype == jnp.bfloat16:
        nnx.update(m, jax.tree.map(lambda a: a.astype(dtype), nnx.state(m)))
    x = jax.random.normal(jax.random.key(7), (2, 5, D), dtype)
    seg = jnp.asarray([[1, 1, 1, 2, 2], [1, 1, 1, 0, 0]], jnp.int32)
    y_g, st_g, g_g = _run(m, x, seg, "grouped")
    y_a, st_a, g_a = _run(m, x, seg, "gather")
    assert float(st_a.expert_counts.max()) >= 2  # an expert routed by several tokens
    for a, b in zip(jax.tree.leaves(st_a), jax.tree.leaves(st_g), strict=True):
        np.testing.assert_array_equal(a, b)
    scale = float(jnp.abs(y_g.astype(jnp.float32)).max())
    # fp32: sums of up to F terms in another order (their |terms| summed run a few times the output: 8 x scale);
    # bf16: each projection's output is rounded to bf16, which the reorder may flip by one ulp: 2 ulps of the scale
    atol = reorder_atol(F, jnp.float32, 8 * scale) if dtype == jnp.float32 else 2 * float(jnp.finfo(dtype).eps) * scale
    np.testing.assert_allclose(np.asarray(y_a, np.float32), np.asarray(y_g, np.float32), rtol=0, atol=atol)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_a), jax.tree.leaves(g_g), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        tol = 1e-5 if dtype == jnp.float32 else 0.02
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(float(np.abs(b).max()), 1e-6),
                                   err_msg=jax.tree_util.keystr(path))


def test_expert_path_by_assignments_setting_and_capacity():
    """auto: the gather while X * k <= E * GATHER_CROSSOVER, the grouped GEMM above; the settings force either;
    a capacity that could drop rows keeps the grouped path (forcing the gather there is refused)."""
    E = 128
    limit = int(E * GATHER_CROSSOVER)
    assert expert_path(8, E, None) is MoeDecode.GATHER  # one Qwen3-30B-A3B decode row
    assert expert_path(limit, E, None) is MoeDecode.GATHER
    assert expert_path(limit + 1, E, None) is MoeDecode.GROUPED
    q_limit = int(E * GATHER_CROSSOVER_QUANTISED)  # quantised experts: the grouped GEMM dequantises all E first
    assert expert_path(limit + 1, E, None, quantised=True) is MoeDecode.GATHER
    assert expert_path(q_limit, E, None, quantised=True) is MoeDecode.GATHER
    assert expert_path(q_limit + 1, E, None, quantised=True) is MoeDecode.GROUPED
    assert expert_path(8, E, capacity=8) is MoeDecode.GATHER  # no expert can overflow: nothing is dropped
    assert expert_path(8, E, capacity=1) is MoeDecode.GROUPED
    with use_kernel_settings(moe_decode="grouped"):
        assert expert_path(8, E, None) is MoeDecode.GROUPED
    with use_kernel_settings(moe_decode="gather"):
        assert expert_path(4096, E, None) is MoeDecode.GATHER
        with pytest.raises(ValueError, match="capacity"):
            expert_path(8, E, capacity=1)


def test_sigmoid_and_gemma4_routing_follow_transformers_formulas():
    """route() against the routers of transformers' modeling_lfm2_moe / modeling_gemma4 written out in numpy:
    lfm2_moe picks by sigmoid + expert bias, weighs by the unbiased sigmoid, renormalises (+ 1e-6) or not, scales;
    Gemma 4 renormalises the top-k softmax and multiplies each weight by its expert's scale."""
    from surojax.models.layers.moe import route
    rng = np.random.default_rng(0)
    logits, bias, scale = rng.normal(size=(7, 6)), rng.normal(size=6), rng.uniform(0.5, 2, size=6)
    sig = 1 / (1 + np.exp(-logits))
    for norm in (True, False):
        moe = MoEConfig(6, 2, 4, router="sigmoid_topk", norm_topk_prob=norm, norm_topk_eps=1e-6,
                        selection_bias=True, routed_scaling_factor=2.5)
        w, ids, _ = route(jnp.asarray(logits, jnp.float32), moe, selection_bias=jnp.asarray(bias, jnp.float32))
        want_ids = np.argsort(-(sig + bias), axis=-1)[:, :2]
        want = np.take_along_axis(sig, want_ids, -1)
        want = (want / (want.sum(-1, keepdims=True) + 1e-6) if norm else want) * 2.5
        assert np.array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5)
    moe = MoEConfig(6, 2, 4, norm_topk_prob=True, per_expert_scale=True)
    w, ids, _ = route(jnp.asarray(logits, jnp.float32), moe, per_expert_scale=jnp.asarray(scale, jnp.float32))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want_ids = np.argsort(-p, axis=-1)[:, :2]
    want = np.take_along_axis(p, want_ids, -1)
    np.testing.assert_allclose(np.asarray(w), want / want.sum(-1, keepdims=True) * scale[want_ids], rtol=1e-5)


def test_gather_kernel_setting_takes_the_kernel_with_the_gather_paths_values(monkeypatch):
    """SUROJAX_MOE_GATHER_KERNEL=pallas: read from the environment; off a GPU it is ignored (the XLA gather, bit for
    bit); with the choice forced as on a GPU the layer's gathered products run the kernel (interpret mode, counted)
    and give the XLA gather's outputs and gradients within the reorder tolerance (its backward is the XLA one)."""
    import pallas_kernels.gathered_gemv.api as gemv_api
    import pallas_kernels.grouped_matmul.gathered as gathered
    from surojax.kernel_settings import KernelSettings, MoeGatherKernel

    assert KernelSettings.from_environ({"SUROJAX_MOE_GATHER_KERNEL": "pallas"}).moe_gather_kernel \
        is MoeGatherKernel.PALLAS
    m = make(CONFIGS["qwen3_moe"])
    x = jax.random.normal(jax.random.key(7), (2, 3, D), jnp.float32)
    seg = jnp.ones((2, 3), jnp.int32)

    def run():
        with use_kernel_settings(moe_gather_kernel=kernel):
            return _run(m, x, seg, "gather")

    kernel = "xla"
    y_x, _, g_x = run()
    kernel = "pallas"
    y_cpu, _, _ = run()
    np.testing.assert_array_equal(np.asarray(y_cpu), np.asarray(y_x))  # ignored off a GPU
    calls = []
    monkeypatch.setattr(gemv_api, "on_gpu", lambda: True)
    monkeypatch.setattr(gathered, "gathered_gemv",
                        lambda *a, **kw: calls.append(1) or gemv_api.gathered_gemv(*a, interpret=True, **kw))
    y_k, _, g_k = run()
    assert len(calls) == 2  # gate_up and down
    scale = float(jnp.abs(y_x).max())
    np.testing.assert_allclose(np.asarray(y_k), np.asarray(y_x), rtol=0, atol=reorder_atol(D, jnp.float32, 8 * scale))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_k), jax.tree.leaves(g_x), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * max(float(np.abs(b).max()), 1e-6),
                                   err_msg=jax.tree_util.keystr(path))
