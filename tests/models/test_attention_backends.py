"""The cudnn attention backend's packed layout, checked on the CPU.

cuDNN itself cannot run here, so the tests check (1) `packed_segments` on hand-made segment ids, (2) the
canonical-packing predicate, and (3) the whole `cudnn_packed_attention` dispatch (dense / packed / fallback
branches, forward and gradients) with the cuDNN call replaced by a jnp emulation of cuDNN's documented packed
contract (segment j = tokens [offset_j, offset_j + length_j), causal inside it, -1 = unused). If the layout
were wrong, the emulation would attend across segments and differ from the xla reference.
benchmarks/gpu_correctness.py runs the same comparison against the real cuDNN kernel on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.bench.shapes import model_config
from surojax.models.layers import attention as att
from surojax.models.layers.attention_backend import AttentionBackend, AttentionKind, parse_attention_backend

BF16 = jnp.bfloat16


def test_packed_segments_hand_made():
    seg = jnp.asarray([
        [1, 1, 1, 2, 2, 0, 0, 0],  # two sequences + padding: 3 runs
        [1, 1, 1, 1, 1, 1, 1, 1],  # one sequence
        [1, 2, 3, 4, 5, 0, 0, 0],  # 6 runs > M = 4: the tail is merged into the last slot
        [0, 0, 3, 3, 3, 3, 7, 7],  # leading padding
    ], jnp.int32)
    lengths, offsets, runs = jax.jit(att.packed_segments, static_argnums=1)(seg, 4)
    np.testing.assert_array_equal(runs, [3, 1, 6, 3])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, -1],
                                            [0, 2, 6, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 1, 5], [2, 4, 2, -1]])
    assert lengths.dtype == offsets.dtype == runs.dtype == jnp.int32


def test_packed_backend_only_rewrites_auto_on_a_gpu(monkeypatch):
    """auto + a known bound -> cudnn:M:nocheck on a GPU (M >= 2), nothing else changes."""
    auto, parse = AttentionBackend(), parse_attention_backend
    assert str(att.packed_backend(auto, 4)) == ("cudnn:4:nocheck" if jax.default_backend() == "gpu" else "auto")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert att.packed_backend(auto, 4) == AttentionBackend(AttentionKind.CUDNN, 4, check=False)
    assert str(att.packed_backend(auto, 1)) == "cudnn:2:nocheck"
    packed = att.packed_backend(auto, 7)
    assert (packed.segments, packed.check) == (7, False)
    assert att.packed_backend(auto, None) == auto
    assert att.packed_backend(parse("xla"), 4) == parse("xla")
    assert att.packed_backend(parse("cudnn:16"), 4) == parse("cudnn:16")


def test_packed_segments_exactly_m_runs_fills_every_slot():
    seg = jnp.asarray([[1, 1, 2, 3, 3, 3]], jnp.int32)
    lengths, offsets, runs = att.packed_segments(seg, 3)
    np.testing.assert_array_equal(offsets, [[0, 2, 3, -1]])
    np.testing.assert_array_equal(lengths, [[2, 1, 3]])
    assert int(runs[0]) == 3


@pytest.mark.parametrize("seg,pos,ok", [
    ([[1, 1, 1, 2, 2, 0, 0]], [[0, 1, 2, 0, 1, 0, 0]], True),
    ([[1, 1, 1, 2, 2, 0, 0]], [[0, 1, 2, 0, 1, 5, 9]], True),  # padding positions do not matter
    ([[1, 1, 1, 2, 2, 0, 0]], [[0, 1, 2, 3, 4, 0, 0]], False),  # positions continue across segments
    ([[1, 1, 2, 2, 1, 1, 0]], [[0, 1, 0, 1, 2, 3, 0]], False),  # id 1 comes back after id 2
    ([[0, 0, 1, 1, 0, 2, 2]], [[0, 0, 0, 1, 0, 0, 1]], True),  # padding runs between sequences
    ([[1, 1, 1, 1, 1, 1, 1]], [[1, 2, 3, 4, 5, 6, 7]], False),  # does not start at 0
])
def test_packing_is_canonical(seg, pos, ok):
    assert bool(att.packing_is_canonical(jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32))) is ok


def test_backend_names():
    """Every spelling the config / CLI takes parses to its typed value and back to the same spelling."""
    parse = parse_attention_backend
    assert (parse("cudnn").segments, parse("cudnn").check) == (att.DEFAULT_MAX_SEGMENTS, True)
    assert parse("cudnn:8") == AttentionBackend(AttentionKind.CUDNN, 8, True)
    assert parse("cudnn:8:nocheck") == AttentionBackend(AttentionKind.CUDNN, 8, False)
    assert parse("auto").kind is AttentionKind.AUTO and parse("xla").kind is AttentionKind.XLA
    for text in ("auto", "xla", "cudnn", "cudnn:32", "cudnn:32:nocheck"):
        assert str(parse(text)) == text
    assert parse("auto").resolved("gpu") == parse("cudnn") and parse("auto").resolved("cpu") == parse("xla")


@pytest.mark.parametrize("bad", ["cudnn:1", "cudnn:x", "cudnn:8:fast", "flash", "xla:8", "cudnn:8:nocheck:1", ""])
def test_backend_parse_errors_name_the_key_and_the_forms(bad):
    with pytest.raises(ValueError, match=r"^--attention: .* expected auto, xla, cudnn, cudnn:M or cudnn:M:nocheck"):
        parse_attention_backend(bad, key="--attention")


# ---- the dispatch, with cuDNN emulated ----------------------------------------------------------------------

CALLS: list[str] = []


def emulated_cudnn(q, k, v, lengths, offsets, *, scale, causal_only, sliding_window):
    """cuDNN's contract in jnp: causal inside each [offset, offset + length); tokens in no segment get 0."""
    B, T = q.shape[:2]
    t = jnp.arange(T)
    if causal_only:
        CALLS.append("dense")
        slot = jnp.zeros((B, T), jnp.int32)
        covered = jnp.ones((B, T), bool)
    else:
        CALLS.append("packed")
        # jax's packed-layout contract: offsets [B, M+1] list segment starts only, -1 elsewhere
        assert offsets.shape[1] == lengths.shape[1] + 1
        start, length = offsets[:, :-1], lengths  # [B, M]
        inside = (t[None, :, None] >= start[:, None, :]) & (t[None, :, None] < (start + length)[:, None, :]) \
            & (length[:, None, :] >= 0)  # [B, T, M]
        covered = inside.any(-1)
        slot = jnp.where(covered, jnp.argmax(inside, -1), -1)
    mask = (slot[:, :, None] == slot[:, None, :]) & covered[:, :, None] & (t[None, None, :] <= t[None, :, None])
    if sliding_window is not None:
        mask &= (t[None, :, None] - t[None, None, :]) < sliding_window
    out = att.xla_attention(q, k, v, mask, scale)
    return jnp.where(covered[:, :, None, None], out, 0).astype(q.dtype)


def random_packing(rng, B, T, max_runs, pad=True):
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        n = int(rng.integers(1, max_runs + 1))
        end = T - (int(rng.integers(1, T // 4)) if pad and n > 1 else 0)
        cuts = np.sort(rng.choice(np.arange(1, end), size=n - 1, replace=False)) if n > 1 else []
        bounds = [0, *cuts, end]
        for i in range(n):
            seg[b, bounds[i]:bounds[i + 1]] = i + 1
            pos[b, bounds[i]:bounds[i + 1]] = np.arange(bounds[i + 1] - bounds[i])
    return jnp.asarray(seg), jnp.asarray(pos)


def qkv(seed, B, T, N=4, K=2, H=16, dtype=BF16):
    """numpy draws (cast by ml_dtypes): no eager compilation per shape and dtype."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    return (jnp.asarray(draw(B, T, N, H).astype(dtype)), jnp.asarray(draw(B, T, K, H).astype(dtype)),
            jnp.asarray(draw(B, T, K, H).astype(dtype)), jnp.asarray(draw(B, T, N, H)))


def fwd_and_grads(fn, q, k, v, cot, real):
    """Output and d(q, k, v) of sum(out * cot) over real (non-padding) tokens."""
    def f(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cot * real[:, :, None, None]), out
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@functools.partial(jax.jit, static_argnames="window")
def _reference(q, k, v, cot, seg, pos, *, window):
    mask = att.attention_mask(seg, seg, pos, pos, window)
    real = (seg > 0).astype(jnp.float32)
    return fwd_and_grads(lambda q, k, v: att.xla_attention(q, k, v, mask, 16 ** -0.5), q, k, v, cot, real)


@functools.partial(jax.jit, static_argnames=("window", "max_segments", "check"))
def _dispatch(q, k, v, cot, seg, pos, *, window, max_segments, check):
    """The segment ids and positions are arguments (as in training), not constants: one compilation per static
    configuration, shared by every test with the same shapes."""
    real = (seg > 0).astype(jnp.float32)
    return fwd_and_grads(lambda q, k, v: att.cudnn_packed_attention(
        q, k, v, seg, pos, 16 ** -0.5, sliding_window=window, max_segments=max_segments, check=check,
        fused=emulated_cudnn), q, k, v, cot, real)


def compare(seg, pos, *, max_segments=8, window=None, check=True, key=0):
    """(out_err, grad_err) of the dispatch against the xla reference; `check` a tuple: one pair per value, all
    against one reference computation."""
    B, T = seg.shape
    q, k, v, cot = qkv(key, B, T)
    real = (seg > 0).astype(jnp.float32)
    ref = _reference(q, k, v, cot, seg, pos, window=window)
    errs = []
    for chk in (check if isinstance(check, tuple) else (check,)):
        got = _dispatch(q, k, v, cot, seg, pos, window=window, max_segments=max_segments, check=chk)
        out_err = float(jnp.max(jnp.abs((got[0].astype(jnp.float32) - ref[0].astype(jnp.float32))
                                        * real[:, :, None, None])))
        grad_err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for a, b in zip(got[1], ref[1]))
        errs.append((out_err, grad_err))
    return tuple(errs) if isinstance(check, tuple) else errs[0]


@pytest.mark.parametrize("window", [None, 5])
def test_packed_rows_equal_the_xla_reference(window):
    seg, pos = random_packing(np.random.default_rng(0), 4, 64, max_runs=4)
    assert int(jnp.max(att.packed_segments(seg, 8)[2])) == 5  # 4 sequences + a padding run
    CALLS.clear()
    assert branch_taken(seg, pos, 8) == 1
    out_err, grad_err = compare(seg, pos, window=window, max_segments=8)
    assert "packed" in CALLS and "dense" in CALLS  # traced: both cuDNN branches exist in the switch
    assert out_err == 0.0 and grad_err == 0.0


def test_one_segment_per_row_takes_the_dense_branch():
    B, T = 4, 64  # the shapes and M of test_packed_rows_equal_the_xla_reference: its compilations are reused
    seg = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    assert branch_taken(seg, pos, 8) == 0
    out_err, grad_err = compare(seg, pos)
    assert out_err == 0.0 and grad_err == 0.0


def branch_taken(seg, pos, max_segments):
    return int(att.cudnn_branch(seg, pos, max_segments))  # 0 dense, 1 packed, 2 reference


def test_more_segments_than_m_falls_back_and_stays_exact():
    seg, pos = random_packing(np.random.default_rng(1), 4, 64, max_runs=9)
    # row 0: 16 segments of 4 > M = 8 (M of the tests above: their checked compilation is reused)
    seg, pos = np.array(seg), np.array(pos)
    seg[0], pos[0] = np.repeat(np.arange(1, 17, dtype=np.int32), 4), np.tile(np.arange(4, dtype=np.int32), 16)
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    assert branch_taken(seg, pos, 8) == 2
    (checked, unchecked) = compare(seg, pos, max_segments=8, check=(True, False))
    assert checked == (0.0, 0.0)
    # Without the check the merged tail attends across segments: the check is what keeps it exact.
    assert unchecked[0] > 0.1


def test_non_canonical_positions_fall_back():
    seg = jnp.asarray([[1] * 32 + [2] * 32] * 4, jnp.int32)
    pos = jnp.tile(jnp.arange(64, dtype=jnp.int32), (4, 1))  # positions continue into segment 2
    assert branch_taken(seg, pos, 8) == 2
    assert compare(seg, pos) == (0.0, 0.0)


def test_fp32_inputs_use_xla_statically():
    seg, pos = random_packing(np.random.default_rng(2), 2, 32, max_runs=3)
    q, k, v, _ = qkv(3, 2, 32, dtype=np.float32)

    def boom(*a, **kw):
        raise AssertionError("cuDNN must not be called for fp32")
    out = att.cudnn_packed_attention(q, k, v, seg, pos, 0.25, fused=boom)
    ref = att.xla_attention(q, k, v, att.attention_mask(seg, seg, pos, pos), 0.25)
    np.testing.assert_array_equal(out, ref)


# ---- the whole model: cudnn backend (emulated) == xla backend, under scan, remat and grad --------------------

@pytest.fixture(scope="module")
def decoder_setup():
    """The debug decoder, a packed batch, and the xla backend's loss and gradients without remat: the one
    reference for every recompute policy of the cudnn backend (remat does not change what is computed; one
    compilation instead of one per policy)."""

    from surojax.bench.shapes import model_config
    from surojax.bench.train_bench import synthetic_batch

    cfg = model_config("debug")
    batch, _ = synthetic_batch(np.random.default_rng(0), 1, 2, 64, cfg.vocab_size, 3, 8)
    batch = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    return cfg, batch, decoder_loss_and_grads(cfg, batch, "xla", None)


def decoder_loss_and_grads(cfg, batch, backend, loop):
    """loop: the decoder's layer runner (None: the default plain scan)."""
    from flax import nnx

    from surojax.losses.lm import lm_loss
    from surojax.models.decoder import Decoder

    model = Decoder(cfg, dtype=BF16, param_dtype=jnp.float32, attention=backend, rngs=nnx.Rngs(params=0))
    if loop is not None:
        model.runner = loop
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def loss_and_grads(params):
        return jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p), batch)[0])(params)

    return loss_and_grads(params)


@pytest.mark.parametrize("recompute", ["none", "dots", "full"])
def test_decoder_loss_and_grads_match_xla_backend(monkeypatch, decoder_setup, recompute):
    from surojax.models.layer_runner import LayerScan, Recompute

    monkeypatch.setattr(att, "_cudnn_fused", emulated_cudnn)
    CALLS.clear()
    cfg, batch, (l_x, g_x) = decoder_setup
    l_c, g_c = decoder_loss_and_grads(cfg, batch, "cudnn:8", LayerScan(Recompute(recompute)))
    assert "packed" in CALLS  # the emulated cuDNN call is what the cudnn backend traced
    assert abs(float(l_x) - float(l_c)) <= 1e-3 * abs(float(l_x))
    # bf16 compute with bf16 backward GEMMs: two backends differ by bf16 rounding, ~0.5% of a gradient's
    # norm (single elements up to ~2% of the largest); a wrong mask moves gradients by O(100%).
    assert jax.tree.structure(g_x) == jax.tree.structure(g_c)
    for a, b in zip(jax.tree.leaves(g_x), jax.tree.leaves(g_c)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(a)


def test_reduce_decode_attention_equals_xla():
    """The multiply + reduce form of one-token attention (the paged path's "reduce" kernel) == xla_attention."""
    from surojax.models.kv import reduce_decode_attention
    from surojax.models.layers.attention import xla_attention

    rng = np.random.default_rng(0)
    B, S, N, K, H = 3, 12, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, S)) < 0.7).at[:, :, 0].set(True)
    np.testing.assert_allclose(np.asarray(reduce_decode_attention(q, k, v, mask, H ** -0.5)),
                               np.asarray(xla_attention(q, k, v, mask, H ** -0.5)), atol=1e-5, rtol=1e-5)


def test_a_cudnn_layers_self_attention_for_a_fresh_prefill_takes_the_packed_kernel():
    """`Attention.attend_spec` of a cuDNN layer carries its packed causal kernel (`AttendSpec.packed`, bounded to
    2 runs a row), which a fresh paged prefill calls (`AttendSpec.attend_self`): rows as the serving runner builds
    them (one sequence from position 0, then padding; a full row; an all-padding row) take cuDNN's packed branch
    (not the xla fallback) and give the masked reference's outputs on every real token (cuDNN emulated)."""
    layer = att.Attention(model_config("debug"), backend=parse_attention_backend("cudnn"), param_dtype=BF16,
                          rngs=nnx.Rngs(0))
    spec = layer.attend_spec()
    assert spec.packed is not None and spec.packed.keywords["max_segments"] == att.PACKED_CALL_SEGMENTS
    B, T = 3, 16
    n = np.array([T, 5, 0])
    seg = jnp.asarray((np.arange(T)[None, :] < n[:, None]).astype(np.int32))
    pos = jnp.asarray(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)))
    assert int(att.cudnn_branch(seg, pos, att.PACKED_CALL_SEGMENTS)) == 1
    q, k, v, _ = qkv(3, B, T, N=layer.num_heads, K=layer.num_kv_heads, H=layer.head_dim)
    emulated = functools.partial(spec.packed, fused=emulated_cudnn)
    out = type(spec)(spec.dense, spec.scale, spec.sliding_window, spec.sinks, emulated).attend_self(q, k, v, seg, pos)
    want = att.xla_attention(q, k, v, att.attention_mask(seg, seg, pos, pos), spec.scale)
    real = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(out, np.float32)[real], np.asarray(want, np.float32)[real], atol=2e-2)
