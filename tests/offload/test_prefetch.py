"""`offload_prefetch` (surojax/offload/prefetch.py): the double-buffered streamed layer loop computes exactly what the
resident base computes under `recompute: full`, and fetches layer l+1 independently of layer l's compute.

Same protocol as test_streaming.py: logits, loss and every LoRA gradient equal (max abs diff 0.0) for a bf16 base
and an NF4 base, gradient accumulation through the real train step; vacuity guard (LoRA B randomised, every
gradient non-zero); the streamed base is asserted to be in `pinned_host` memory and the program to fetch it.
"""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from surojax.losses.lm import lm_loss
from surojax.models.decoder import Decoder
from surojax.models.layer_runner import LayerScan, Recompute, with_runner
from surojax.offload.prefetch import PrefetchedLayers
from surojax.offload.streaming import streamed_leaves
from surojax.peft.lora import TRAINABLE, apply_lora
from surojax.quant.model import quantize_model
from surojax.train.step import make_train_step

from tests.offload.test_streaming import CFG, _batch, _device_puts, _max_diff, _split

PREFETCH = PrefetchedLayers()
FULL = LayerScan(Recompute.FULL)


def _graphdef(graphdef, trainable, rest, runner):
    """`graphdef` with `runner` as the decoder's layer runner (the runner is static: part of the graphdef)."""
    return nnx.split(with_runner(nnx.merge(graphdef, trainable, rest), runner), TRAINABLE, ...)[0]


def _ancestors(jaxpr, targets: set) -> set:
    """The variables of `jaxpr` that `targets` are computed from (transitively, themselves included)."""
    needed = {v for v in targets if not isinstance(v, jax.extend.core.Literal)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars if not isinstance(v, jax.extend.core.Literal)):
            needed.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
    return needed


def _scans_with_independent_fetch(jaxpr) -> int:
    """How many scans fetch host weights in their body such that (1) the fetch reads only host arrays and the
    integer loop index (not the activation, its cotangent, or anything computed from them) and (2) nothing in the
    step reads the fetched weights: they only leave the step (the carry for the next layer)."""
    found = 0
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _scans_with_independent_fetch(sub)
        if eqn.primitive.name != "scan":
            continue
        body = eqn.params["jaxpr"].jaxpr
        puts = [e for e in body.eqns if e.primitive.name == "device_put"
                and jax.memory.Space.Device in e.params["devices"]]
        if not puts:
            continue
        sources = _ancestors(body, {v for e in puts for v in e.invars}) & set(body.invars)
        def host_or_index(v):
            return (getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
                    or (v.aval.shape == () and v.aval.dtype == jnp.int32))

        assert all(map(host_or_index, sources)), "the fetch of the next layer reads the step's activations"
        fetched = {v for e in puts for v in e.outvars}
        read = {v for e in body.eqns for v in e.invars if not isinstance(v, jax.extend.core.Literal)}
        assert not fetched & read, "the step computes with the weights it prefetches"
        assert fetched <= set(body.outvars)
        found += 1
    return found


def _model(quant: str | None = None, dtype=jnp.bfloat16):
    model = Decoder(CFG, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    if quant:
        quantize_model(model, quant)
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(1), dtype=dtype)
    keys = iter(jax.random.split(jax.random.key(2), 16))  # vacuity guard: B = 0 would zero every dL/dA
    for path, var in nnx.to_flat_state(nnx.state(model, TRAINABLE)):
        if path[-1] == "lora_b":
            var.set_value(0.1 * jax.random.normal(next(keys), var.get_value().shape, var.get_value().dtype))
    return model


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_prefetched_equals_resident(quant):
    """The prefetching program's fetches (jaxpr: each streamed leaf before and once per step in every layer loop,
    the next layer's fetch independent of this layer's compute) for a bf16 and an NF4 base; and, compiled and run on
    the NF4 base, its logits, loss and every LoRA gradient equal the resident scan's bit for bit. The bf16 base's
    bit-equality through the same loop (leaf-generic): test_train_step_with_accumulation_equal[False] (the real
    train step: loss, gradient norm, every updated adapter), which compiles it once instead of twice."""
    graphdef, trainable, resident, streamed = _split(_model(quant))
    mb = {k: jnp.asarray(v[0]) for k, v in _batch().items()}

    def logits_loss_grads(tr, fr, loop):
        h = nnx.merge(graphdef, tr, fr).hidden_states(mb["tokens"], mb["positions"], mb["segment_ids"],
                                                      runner=loop).hidden
        logits = nnx.merge(graphdef, tr, fr).logits(h)
        loss, grads = jax.value_and_grad(
            lambda t: lm_loss(with_runner(nnx.merge(graphdef, t, fr), loop), mb)[0])(tr)
        return logits, loss, grads

    full = FULL
    if quant is not None:
        runs = jax.jit(lambda tr, s, r: (logits_loss_grads(tr, s, PREFETCH), logits_loss_grads(tr, r, full)))
        (lg_s, l_s, g_s), (lg_r, l_r, g_r) = runs(trainable, streamed, resident)
        assert _max_diff(lg_s, lg_r) == 0.0
        assert float(l_s) == float(l_r)
        assert _max_diff(g_s, g_r) == 0.0
        nonzero = [bool(np.abs(np.asarray(g, np.float32)).max() > 0) for g in jax.tree.leaves(g_s)]
        assert len(nonzero) == 2 * 7 and all(nonzero)
    # the prefetching program fetches each streamed leaf before the forward scan and once per step in it, the same
    # in the backward scan, and the embedding once per forward pass (two forward passes here: logits, loss)
    n = len(streamed_leaves(streamed))
    jaxpr = jax.make_jaxpr(lambda t, f: logits_loss_grads(t, f, PREFETCH))(trainable, streamed).jaxpr
    assert _device_puts(jaxpr) == (2 * n + 1) + (2 * n + 1) + 2 * n
    # overlap by construction: in every layer loop (logits forward, loss forward, backward) the fetch of the next
    # layer neither reads the carried activation nor feeds this step's compute
    assert _scans_with_independent_fetch(jaxpr) == 3
    if quant is None:  # the check can fail: the plain streamed loop computes with the weights it fetches
        plain = jax.make_jaxpr(lambda t, f: logits_loss_grads(t, f, full))(trainable, streamed).jaxpr
        with pytest.raises(AssertionError, match="computes with the weights"):
            _scans_with_independent_fetch(plain)


@pytest.mark.parametrize("per_layer", [False, True])
def test_train_step_with_accumulation_equal(per_layer):
    """The real train step with 2 micro-batches: the prefetching loop over the streamed base (stacked, or as
    per-layer host buffers) equals its resident counterpart (the scan with recompute full / the same per-layer
    loop over the device base) bit for bit."""
    from surojax.offload.streaming import place_base_on_host

    graphdef, trainable, resident, streamed = _split(_model())
    twin = FULL
    if per_layer:
        streamed, twin = place_base_on_host(resident, embedding=True, per_layer=True), PrefetchedLayers(per_layer=True)
    opt = optax.adamw(1e-2)
    step_p = make_train_step(_graphdef(graphdef, trainable, resident, PREFETCH), lm_loss, opt, jit=False)
    step_r = make_train_step(_graphdef(graphdef, trainable, resident, twin), lm_loss, opt, jit=False)
    batch, key, opt_state = _batch(accum=2), jax.random.key(0), opt.init(trainable)
    both = jax.jit(lambda s, r: (step_p(trainable, s, opt_state, batch, key),
                                 step_r(trainable, r, opt_state, batch, key)))
    (p_s, _, m_s), (p_r, _, m_r) = both(streamed, resident)
    assert float(m_s["loss"]) == float(m_r["loss"]) and float(m_s["grad_norm"]) == float(m_r["grad_norm"]) > 0
    assert _max_diff(p_s, p_r) == 0.0
    assert _max_diff(p_s, trainable) > 0


def test_gpu_lowering_fetches_each_streamed_leaf_twice_per_pass():
    """CUDA lowering (no GPU needed): per streamed leaf one transfer before and one inside each layer loop."""
    graphdef, trainable, _, streamed = _split(_model())
    mb = {k: jnp.asarray(v[0]) for k, v in _batch().items()}

    def loss(tr, fr):
        return lm_loss(with_runner(nnx.merge(graphdef, tr, fr), PREFETCH), mb)[0]

    try:
        text = jax.jit(jax.grad(loss)).trace(trainable, streamed).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001 - a jax build without CUDA lowering rules
        pytest.skip(f"no CUDA lowering here: {e}")
    n = len(streamed_leaves(streamed))
    assert text.count("annotate_device_placement") == 4 * n + 1  # forward 2n, backward 2n, the embedding
    assert text.count("stablehlo.while") == 3  # forward layers, backward layers, the chunked loss


def _host_dynamic_slices(jaxpr) -> int:
    """dynamic_slice / slice equations whose operand lives in host memory (the serial copy form)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dynamic_slice", "slice", "gather") and any(
                getattr(v.aval, "memory_space", None) == jax.memory.Space.Host for v in eqn.invars
                if not isinstance(v, jax.extend.core.Literal)):
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _host_dynamic_slices(sub)
    return n


@pytest.mark.parametrize("quant", ["nf4"])
def test_per_layer_host_buffers_equal_resident(quant):
    """offload_prefetch's base as per-layer host buffers (HostLayers): the unrolled prefetching loop computes
    exactly the resident result (logits, loss, every LoRA gradient), moves whole per-layer buffers (one
    device_put per leaf per layer and pass, no slice of a host array), and the plain scan refuses the buffers.
    The NF4 base only (its codes, scales and the bf16 norms are all per-layer buffers; the loop is leaf-generic):
    a bf16 base's per-layer buffers are checked bit for bit through the train step in
    test_train_step_with_accumulation_equal[True] (loss, gradient norm, updated adapters)."""
    from surojax.offload.host_layers import HostLayers
    from surojax.offload.streaming import place_base_on_host

    graphdef, trainable, resident = nnx.split(_model(quant), TRAINABLE, ...)
    streamed = place_base_on_host(resident, embedding=True, per_layer=True)
    layers = [v.get_value() for p, v in nnx.to_flat_state(streamed) if p[0] == "layers"]
    hl = [x for v in layers for x in jax.tree.leaves(v, is_leaf=lambda x: isinstance(x, HostLayers))]
    assert hl and all(isinstance(x, HostLayers) and len(x) == CFG.num_layers for x in hl)
    assert {a.sharding.memory_kind for x in hl for a in x.layers} == {"pinned_host"}
    mb = {k: jnp.asarray(v[0]) for k, v in _batch().items()}

    def loss_grads(tr, fr, loop):
        return jax.value_and_grad(lambda t: lm_loss(with_runner(nnx.merge(graphdef, t, fr), loop), mb)[0])(tr)

    # the resident twin: the same per-layer loop over the base on the device (only the placement differs)
    twin = PrefetchedLayers(per_layer=True)
    (l_s, g_s), (l_r, g_r) = jax.jit(lambda tr, s, r: (loss_grads(tr, s, PREFETCH), loss_grads(tr, r, twin)))(
        trainable, streamed, resident)
    assert float(l_s) == float(l_r)
    assert _max_diff(g_s, g_r) == 0.0
    assert all(np.abs(np.asarray(g, np.float32)).max() > 0 for g in jax.tree.leaves(g_s))
    # and it is the model's computation: the plain (unrolled, recompute full) layer loop agrees up to bf16 rounding
    l_u, g_u = jax.jit(lambda tr, r: loss_grads(tr, r, LayerScan(Recompute.FULL, unroll=True)))(trainable, resident)
    assert abs(float(l_s) - float(l_u)) <= 1e-5 * abs(float(l_u))
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_u)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert float(np.linalg.norm(a - b)) <= 2e-2 * float(np.linalg.norm(b))
    jaxpr = jax.make_jaxpr(lambda t, f: loss_grads(t, f, PREFETCH))(trainable, streamed).jaxpr
    n = sum(len(x) for x in hl)  # every per-layer buffer once forward, once in the backward recompute
    assert _device_puts(jaxpr) == 2 * n + 1  # + the (untied) embedding, fetched whole
    assert _host_dynamic_slices(jaxpr) == 0
    stacked = place_base_on_host(resident, embedding=True)  # the check can fail: the scan form slices the stack
    assert _host_dynamic_slices(jax.make_jaxpr(lambda t, f: loss_grads(t, f, PREFETCH))(trainable, stacked).jaxpr)
    with pytest.raises(ValueError, match="per-layer host buffers"):
        jax.jit(lambda t, f: loss_grads(t, f, FULL))(trainable, streamed)


def _fetch_order(jaxpr, host_vars: list) -> list[tuple[int, object]]:
    """(layer, fetched variable) of every device_put to the device in program order; the layer is the host buffer
    it copies (its operand, or the operand an optimization barrier passes through to it)."""
    through = {}  # a barrier's output -> the same position's input
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            through.update(zip(eqn.outvars, eqn.invars))
        if eqn.primitive.name == "device_put" and jax.memory.Space.Device in eqn.params["devices"]:
            (src,) = eqn.invars
            out.append((host_vars.index(through.get(src, src)), eqn.outvars[0]))
    return out


def _check_look_ahead(jaxpr, host_vars: list, depth: int) -> None:
    """Each fetch of layer j (but the first depth + 1 of a pass) is ordered after every use of the device copy of
    layer j - 1 - depth (forward) / j + 1 + depth (backward) and not after the uses of the next layer's copy (so it
    can overlap that layer's compute); the backward's first fetches are ordered after the whole forward pass."""
    L = len(host_vars)
    fetches = _fetch_order(jaxpr, host_vars)
    assert [l for l, _ in fetches] == list(range(L)) + list(range(L - 1, -1, -1))
    uses = {v: [o for e in jaxpr.eqns if v in e.invars for o in e.outvars] for _, v in fetches}
    fwd, bwd = dict(fetches[:L]), dict(fetches[L:])

    def after(v, copy):  # every equation that reads `copy` is an ancestor of v
        return set(uses[copy]) <= _ancestors(jaxpr, {v})

    for j in range(depth + 1, L):
        assert after(fwd[j], fwd[j - 1 - depth]), f"forward fetch of layer {j} not after layer {j - 1 - depth}"
        assert not after(fwd[j], fwd[j - depth]), f"forward fetch of layer {j} waits for layer {j - depth}"
    for j in range(L - 1 - depth):
        assert after(bwd[j], bwd[j + 1 + depth]), f"backward fetch of layer {j} not after layer {j + 1 + depth}"
        assert not after(bwd[j], bwd[j + depth]), f"backward fetch of layer {j} waits for layer {j + depth}"
    for j in range(max(L - 1 - depth, 0), L):
        assert all(after(bwd[j], fwd[l]) for l in range(L)), f"backward fetch of layer {j} during the forward"


@pytest.mark.parametrize("depth", [1, 2])
def test_look_ahead_is_bounded(depth):
    """The unrolled loop over per-layer host buffers keeps at most 1 + depth layers' copies in flight: in the
    jaxpr of the gradient each fetch is data-dependent on the layer depth + 1 places before it (after it in the
    backward pass), and no more (the copy may still overlap the compute in between)."""
    from surojax.offload.host_layers import HostLayers
    from surojax.offload.prefetch import prefetched_layer_stack

    L, D = 6, 4
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    w = HostLayers(jax.device_put(x, host) for x in jax.random.normal(jax.random.key(0), (L, D, D)))
    a = 0.1 * jax.random.normal(jax.random.key(1), (L, D, D))

    def loss(a, w, h, depth):
        out = prefetched_layer_stack(lambda s, h, _: jnp.tanh(h @ s["w"] + h @ s["a"]), h, {"a": a, "w": w}, (),
                                     depth=depth)
        return jnp.sum(out ** 2)

    def jaxpr(depth):
        closed = jax.make_jaxpr(jax.grad(loss), static_argnums=3)(a, w, jnp.ones((2, D)), depth)
        return closed.jaxpr, list(closed.jaxpr.invars[1:1 + L])

    _check_look_ahead(*jaxpr(depth), depth)
    with pytest.raises(AssertionError):  # the check can fail: a deeper look-ahead breaks the shallower bound
        _check_look_ahead(*jaxpr(depth + 1), depth)


def test_hybrid_prefetched_equals_resident():
    """A Qwen3.5 hybrid (test_streaming's: a Gated DeltaNet layer, then a gated attention layer) over per-layer
    host buffers of both stacks: the unrolled prefetching loop runs the layers in
    model order, each fetching its row of its own stack, and computes the resident layer scan's loss and every
    LoRA gradient of both stacks within fp32 rounding (the unrolled program fuses differently; bit equality with
    its resident twin is the dense tests' protocol, the loop being the same code for one stack or two)."""
    from surojax.offload.host_layers import is_host_layers
    from surojax.offload.streaming import place_base_on_host
    from tests.offload.test_streaming import HYBRID as cfg

    model = Decoder(cfg, rngs=nnx.Rngs(0))
    apply_lora(model, targets="all-linear", rank=4, alpha=8, rngs=nnx.Rngs(1))
    rs = np.random.RandomState(2)  # vacuity guard: B = 0 would zero every dL/dA
    for path, var in nnx.to_flat_state(nnx.state(model, TRAINABLE)):
        if path[-1] == "lora_b":
            var.set_value(jnp.asarray(0.1 * rs.randn(*var.get_value().shape), jnp.float32))
    graphdef, trainable, resident = nnx.split(model, TRAINABLE, ...)
    streamed = place_base_on_host(resident, embedding=True, per_layer=True)
    assert {k.split(".")[0] for k in streamed_leaves(streamed)} == {"layers", "linear_layers"}
    mb = {k: jnp.asarray(v[0]) for k, v in _batch(vocab=cfg.vocab_size).items()}

    def loss_grads(tr, fr, loop):
        return jax.value_and_grad(lambda t: lm_loss(with_runner(nnx.merge(graphdef, t, fr), loop), mb)[0])(tr)

    (l_s, g_s), (l_f, g_f) = jax.jit(lambda tr, s, r: (loss_grads(tr, s, PREFETCH), loss_grads(tr, r, FULL)))(
        trainable, streamed, resident)
    assert len(jax.tree.leaves(g_s)) == 2 * 15 and all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(g_s))
    np.testing.assert_allclose(float(l_s), float(l_f), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_f)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
    # every per-layer buffer of both stacks is fetched once forward and once in the backward recompute
    hl = [x for p, v in nnx.to_flat_state(streamed) if p[0] in ("layers", "linear_layers")
          for x in jax.tree.leaves(v.get_value(), is_leaf=is_host_layers)]
    assert all(map(is_host_layers, hl))
    jaxpr = jax.make_jaxpr(lambda t, f: loss_grads(t, f, PREFETCH))(trainable, streamed).jaxpr
    assert _device_puts(jaxpr) == 2 * sum(map(len, hl)) + 1  # + the (untied) embedding
