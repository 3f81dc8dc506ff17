"""The gated delta rule's forms (pallas_kernels/gated_delta): the chunked jnp form, the Pallas kernels (interpret
mode on CPU) and "pallas_v2" (the three-kernel forward, the four-kernel backward; backward_v2.py's jnp the
backward kernels' reference) against the
token-by-token reference, and the reference against transformers' torch_recurrent_gated_delta_rule
(tests/fixtures/gated_delta, scripts/make_gated_delta_fixture.py). Shapes are small but cover a whole chunk of 64
plus a partial one, segments that start inside a chunk, one that crosses a chunk boundary, one that starts exactly
at a chunk boundary, and padding (id 0)."""
import functools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import backward_v2, kernel_v2_bwd
from pallas_kernels.gated_delta.api import chunk_gated_delta_rule, pallas_forward, v2_operands
from pallas_kernels.gated_delta.chunked import CHUNK, segment_numbers
from pallas_kernels.gated_delta.kernel import gated_delta_pallas, gated_delta_pallas_bwd
from pallas_kernels.gated_delta.kernel_v2 import V2Knobs, chunk_forward, operand_shapes
from pallas_kernels.gated_delta.reference import gated_delta_rule_reference, recurrent_gated_delta_step

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gated_delta" / "recurrent.npz"
IMPLS = ["reference", "chunked", "pallas", "pallas_v2"]
# packed rows of T = 100: row 0 starts segments at 20 and 70 (the second crosses the chunk boundary at 64),
# row 1 at 64 (the boundary itself) and ends in 6 padding tokens
SEGMENTS = [[1] * 20 + [2] * 50 + [3] * 30, [5] * 64 + [6] * 30 + [0] * 6]


@pytest.fixture(autouse=True)
def fp32_matmuls():
    """fp32 dots computed in fp32 on every backend: on a GPU the default precision lowers them to TF32 (XLA's and
    Pallas' Triton dots alike, ~1e-3 off) where these tests compare at 1e-5; on a CPU this changes nothing.
    (test_gated_delta_gpu.py checks the kernels at the default precision too.)"""
    with jax.default_matmul_precision("highest"):
        yield


def operands(B=2, T=100, H=2, Dk=16, Dv=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)

    def unit(key, shape):
        x = jax.random.normal(key, shape)
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit(ks[0], (B, T, H, Dk)), unit(ks[1], (B, T, H, Dk))
    v = jax.random.normal(ks[2], (B, T, H, Dv))
    # per head a slow decay (~0.006 a token: the state survives a chunk) and a faster one (~0.3)
    offsets = jnp.asarray([-5.0, -1.0] * H)[:H]
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)) + offsets)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    state = 0.5 * jax.random.normal(ks[5], (B, H, Dk, Dv))
    return (q, k, v, g, beta), state


def close(got, want, tol=2e-5, name=""):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_recurrent(impl):
    """transformers' torch_recurrent_gated_delta_rule (scale Dk^-0.5, an initial state): outputs and final state."""
    f = np.load(FIXTURE)
    xs = [jnp.asarray(f[n].astype(np.float32)) for n in ("q", "k", "v", "g", "beta")]
    o, state = chunk_gated_delta_rule(*xs, scale=xs[0].shape[-1] ** -0.5,
                                      initial_state=jnp.asarray(f["initial_state"].astype(np.float32)),
                                      output_final_state=True, impl=impl)
    close(o, f["o"])
    close(state, f["final_state"])


@pytest.mark.parametrize("impl", ["chunked", "pallas", "pallas_v2"])
def test_values_match_reference_from_a_zero_state(impl):
    """No initial state, no final state asked for (None); o keeps v's dtype. (The initial and final states: the
    transformers fixture above and the gradient tests below.)"""
    xs, _ = operands()
    o, none = chunk_gated_delta_rule(*xs, scale=0.25, impl=impl)
    assert none is None and o.dtype == jnp.float32
    close(o, reference_outputs())


def test_decode_step_keeps_v_dtype():
    """Decode's one-token step on bf16 operands returns o in bf16 (the model's residual stream and the layer
    scan's carry stay bf16; an fp32 o broke bf16 serving) and the state in fp32, equal to the fp32 step."""
    (q, k, v, g, beta), state = operands(T=1)
    args = [x[:, 0] for x in (q, k, v)] + [g[:, 0], beta[:, 0]]
    o, new = recurrent_gated_delta_step(*[x.astype(jnp.bfloat16) for x in args], state, scale=0.25)
    assert o.dtype == jnp.bfloat16 and new.dtype == jnp.float32
    o32, new32 = recurrent_gated_delta_step(*[x.astype(jnp.bfloat16).astype(jnp.float32) for x in args], state,
                                            scale=0.25)
    close(o, o32.astype(jnp.bfloat16))
    close(new, new32)


@functools.cache
def reference_outputs():
    return gated_delta_rule_reference(*operands()[0], scale=0.25)[0]


def test_kernel_column_blocks_and_padded_head_dims():
    """The kernels with several programs per head (Dv 32 in blocks of 16: dq, dk, dg, dbeta summed over them), Dk
    24 padded to 32, 3 heads, two chunks and a partial one, packed rows: values, final state and gradients (w.r.t.
    q, k, v, g, beta, initial state) = the chunked form's; bfloat16 operands keep their dtype."""
    xs, s0 = operands(T=130, H=3, Dk=24, Dv=32, seed=1)
    seg = jnp.asarray([[1] * 100 + [2] * 30, [1] * 10 + [2] * 120])
    w = jax.random.normal(jax.random.key(7), xs[2].shape)
    ws = jax.random.normal(jax.random.key(8), s0.shape)

    def loss(fn, q, k, v, g, beta, s0):
        o, state = fn(q, k, v, g, beta, s0)
        return jnp.sum(o * w) + jnp.sum(state * ws), (o, state)

    kernel = functools.partial(pallas_forward, segment_ids=seg, scale=0.2, interpret=True, block_v=16)
    chunked = functools.partial(chunk_gated_delta_rule, scale=0.2, segment_ids=seg, output_final_state=True,
                                impl="chunked")
    (_, got), dgot = jax.jit(jax.value_and_grad(functools.partial(loss, lambda *a: kernel(*a[:5], state=a[5])),
                                                argnums=range(6), has_aux=True))(*xs, s0)
    (_, want), dwant = jax.jit(jax.value_and_grad(functools.partial(loss, lambda *a: chunked(*a[:5],
                                                                                             initial_state=a[5])),
                                                  argnums=range(6), has_aux=True))(*xs, s0)
    close(got[0], want[0])
    close(got[1], want[1])
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), dgot, dwant):
        close(a, b, tol=1e-4, name=name)
    q, k, v = (x.astype(jnp.bfloat16) for x in xs[:3])
    o, _ = kernel(q, k, v, *xs[3:], state=s0)
    assert o.dtype == jnp.bfloat16
    close(o.astype(jnp.float32), want[0], tol=5e-2)  # inputs and output rounded to bfloat16


def test_v2_at_qwen_head_dims_packed_and_padded():
    """pallas_v2 at Qwen3.5's head dims (Dk = Dv = 128), T = 200 (three full chunks and a partial one), packed rows
    (a segment crossing a chunk boundary, one starting at a boundary, padding id 0 at a row's end), an initial
    state: o and the final state = the token-by-token reference in fp32. Then bf16 operands with the default bf16
    storage of W, U, h, v_new: within 1e-2 (||x - ref|| / ||ref||) of the fp32 reference of the same bf16 values
    (measured 3.7e-3 for o, 3.6e-3 for the state at T = 512; fp32 storage: 1.7e-3, the rounding of o alone)."""
    B, T, H, D = 2, 200, 2, 128
    xs, s0 = operands(B=B, T=T, H=H, Dk=D, Dv=D, seed=2)
    seg = jnp.asarray([[1] * 50 + [2] * 100 + [3] * 50, [4] * 64 + [5] * 120 + [0] * 16])
    kwargs = dict(scale=D ** -0.5, segment_ids=seg, initial_state=s0, output_final_state=True)
    want = chunk_gated_delta_rule(*xs, impl="reference", **kwargs)
    got = chunk_gated_delta_rule(*xs, impl="pallas_v2", **kwargs)
    close(got[0], want[0])
    close(got[1], want[1])
    bf16 = [x.astype(jnp.bfloat16) for x in xs[:3]] + [xs[3], xs[4].astype(jnp.bfloat16)]
    want = chunk_gated_delta_rule(*(x.astype(jnp.float32) for x in bf16), impl="reference", **kwargs)
    o, state = chunk_gated_delta_rule(*bf16, impl="pallas_v2", **kwargs)
    assert o.dtype == jnp.bfloat16
    for a, b in ((o, want[0]), (state, want[1])):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


def test_v2_saves_what_a_backward_reads():
    """chunk_forward(save_states=True): h = the state entering each chunk (the token-by-token reference's state
    after the chunk before, reset where a segment starts at the boundary) and v_new = U - W h (the chunk's
    corrections u of chunked.py's docstring: beta (v - k's prediction), checked at a chunk's first token, where
    u = beta (v - S^T k) exactly); Dk 24 padded to 32 (zero columns), Dv 32 in value blocks of 16 for K2 and K3."""
    B, T, H, Dk, Dv = 1, 128, 2, 24, 32
    xs, s0 = operands(B=B, T=T, H=H, Dk=Dk, Dv=Dv, seed=4)
    seg = jnp.asarray([[1] * 100 + [2] * 28])
    q, k, v, g, beta = xs
    prepared = v2_operands(q, k, v, g, beta, segment_numbers(seg, (B, T)), s0)
    knobs = V2Knobs(scale=0.25, interpret=True, block_v=16, block_o=16)
    o, final, h, v_new = chunk_forward(*prepared, knobs=knobs, chunk=CHUNK, save_states=True)
    assert h.shape == (B, H, T // CHUNK, 32, Dv)
    h, final = h[..., :Dk, :], final[:, :, :Dk]
    _, state64 = chunk_gated_delta_rule(q[:, :CHUNK], k[:, :CHUNK], v[:, :CHUNK], g[:, :CHUNK], beta[:, :CHUNK],
                                        scale=0.25, initial_state=s0, output_final_state=True, impl="reference")
    close(h[:, :, 0], s0)
    close(h[:, :, 1], state64)
    for c, state in ((0, s0), (1, state64)):
        t = c * CHUNK  # a chunk's first token: the state decays by exp(g_t), then predicts v_t from k_t
        decayed = state * jnp.exp(g[:, t])[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - jnp.einsum("bhk,bhkv->bhv", k[:, t], decayed))
        close(v_new[:, t], u)
    want = chunk_gated_delta_rule(*xs, scale=0.25, segment_ids=seg, initial_state=s0, output_final_state=True,
                                  impl="reference")
    close(o, want[0])
    close(final, want[1])


def test_v2_backward_kernels_match_jnp():
    """kernel_v2_bwd's four kernels, one at a time, = backward_v2.py's jnp (their specification), fp32, packed rows
    (one row: a segment crossing a chunk boundary, one starting at one, padding), three chunks, random saved h and
    v_new:
    the sequential kernel's dS_{n+1} of each chunk, dv_new and initial-state cotangent, then dq, dk, dv, dg, dbeta;
    Dk = Dv = 32 in blocks of 16 (two value blocks for the sequential kernel, two key blocks summed for dq / dk /
    dW). (The whole gradient against the token reference: the tests below.)"""
    B, T, H, D = 1, 136, 1, 32
    xs, s0 = operands(B=B, T=T, H=H, Dk=D, Dv=D, seed=3)
    seg = jnp.asarray([[1] * 40 + [2] * 40 + [3] * 48 + [4] * 4 + [0] * 4])
    q, k, v, gamma, beta, seg, first, last, _ = v2_operands(*xs, segment_numbers(seg, (B, T)), s0)
    Tp = q.shape[1]
    ks = jax.random.split(jax.random.key(5), 4)
    h = jax.random.normal(ks[0], (B, H, Tp // CHUNK, D, D))
    v_new, do = jax.random.normal(ks[1], (B, Tp, H, D)), jax.random.normal(ks[2], (B, Tp, H, D))
    ds = jax.random.normal(ks[3], (B, H, D, D))
    kw = dict(knobs=V2Knobs(scale=0.3, interpret=True), bwd=kernel_v2_bwd.BwdKnobs(block_dv=16, block_dk=16),
              chunk=CHUNK)
    want = jax.jit(functools.partial(backward_v2.chunk_backward, scale=0.3, chunk=CHUNK, intermediates=True))(
        q, k, v, gamma, beta, seg, first, last, h, v_new, do, ds)
    w, t = kernel_v2_bwd.wy_t(k, gamma, beta, seg, first, dtype=jnp.float32, **kw)
    dh, dv_new, ds0 = kernel_v2_bwd.dstates(q, k, w, do, gamma, seg, first, last, ds, **kw)
    close(dh, want[6], name="dh")
    close(dv_new, want[7], name="dv_new")
    close(ds0, want[5], name="ds0")
    dq, dk_part, dw, dgam = kernel_v2_bwd.dqkw(q, k, v_new, do, dv_new, h, dh, gamma, seg, first, last, **kw)
    dk, dv, dbeta, dg = kernel_v2_bwd.wy_bwd(t, k, v, dv_new, dw, dk_part, dgam, gamma, beta, seg, first, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), (dq, dk, dv, dg, dbeta), want):
        close(a, b, name=name)


def loss_and_grads(impl, xs, w, s0, seg, ws=None):
    """((sum(o * w) (+ sum(final state * ws)), o), d/d(q, k, v, g, beta, initial state)), one compile."""
    def loss(q, k, v, g, beta, s0):
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.25, segment_ids=seg, initial_state=s0,
                                          output_final_state=ws is not None, impl=impl)
        return jnp.sum(o * w) + (0.0 if ws is None else jnp.sum(state * ws)), o

    return jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*xs, s0)


@functools.cache
def reference_gradients():
    """The reference's loss and gradients for test_gradients_match_reference (computed once)."""
    xs, s0 = operands()
    w, ws = gradient_weights(xs, s0)
    return loss_and_grads("reference", xs, w, s0, jnp.asarray(SEGMENTS), ws)


def gradient_weights(xs, s0):
    return jax.random.normal(jax.random.key(7), xs[2].shape), jax.random.normal(jax.random.key(8), s0.shape)


@pytest.mark.parametrize("impl", ["chunked", "pallas", "pallas_v2"])
def test_gradients_match_reference(impl):
    """Gradients w.r.t. q, k, v, g, beta and the initial state, through the outputs and the final state, of
    packed rows."""
    xs, s0 = operands()
    w, ws = gradient_weights(xs, s0)
    (got_loss, _), got = loss_and_grads(impl, xs, w, s0, jnp.asarray(SEGMENTS), ws)
    (want_loss, _), want = reference_gradients()
    close(got_loss, want_loss, tol=1e-4)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        close(a, b, tol=1e-4, name=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_rows_equal_each_segment_alone(impl):
    """Each segment of a packed row run as a row of its own (the row's first segment continuing the row's initial
    state, the others from zero): the same outputs, and the same gradients w.r.t. q, k, v, g, beta and the
    initial state; padding tokens (id 0) get zero gradients."""
    xs, s0 = operands()
    w = jax.random.normal(jax.random.key(7), xs[2].shape)
    seg = np.asarray(SEGMENTS)
    w = w * jnp.asarray(seg != 0)[..., None, None]  # padding outputs are don't-care
    pieces = []  # (row, start, length) of each real segment
    for b, row in enumerate(seg):
        starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]] + [len(row)]
        pieces += [(b, s, e - s) for s, e in zip(starts, starts[1:]) if row[s] != 0]
    width = max(n for _, _, n in pieces)

    def alone(x):  # [B, T, ...] -> [segments, width, ...], each segment at the start of its own row
        return jnp.stack([jnp.pad(x[b, s:s + n], [(0, width - n)] + [(0, 0)] * (x.ndim - 2)) for b, s, n in pieces])

    firsts = [pieces.index(p) for p in pieces if p[1] == 0]  # the alone row of each packed row's first segment
    s0_alone = jnp.zeros((len(pieces),) + s0.shape[1:]).at[jnp.asarray(firsts)].set(s0)
    (_, o_packed), packed = loss_and_grads(impl, xs, w, s0, jnp.asarray(seg))
    (_, o_single), single = loss_and_grads(impl, [alone(x) for x in xs], alone(w), s0_alone, None)
    close(alone(o_packed), o_single, tol=1e-5)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), packed[:5], single[:5]):
        expected = jnp.zeros_like(a)
        for i, (r, s, n) in enumerate(pieces):
            expected = expected.at[r, s:s + n].set(b[i, :n])
        close(a, expected, tol=1e-4, name=name)
    close(packed[5], single[5][jnp.asarray(firsts)], tol=1e-4)


def test_bad_operands_are_named():
    xs, s0 = operands()
    with pytest.raises(ValueError, match="impl 'cuda' is unknown"):
        chunk_gated_delta_rule(*xs, scale=0.25, impl="cuda")
    with pytest.raises(ValueError, match=r"beta has shape \(2, 100\), expected \(2, 100, 2\)"):
        chunk_gated_delta_rule(*xs[:4], xs[4][..., 0], scale=0.25)
    with pytest.raises(ValueError, match="initial_state has shape"):
        chunk_gated_delta_rule(*xs, scale=0.25, initial_state=s0[..., :4])
    with pytest.raises(ValueError, match="segment_ids has shape"):
        chunk_gated_delta_rule(*xs, scale=0.25, segment_ids=jnp.zeros((2, 99), jnp.int32))


def test_kernels_lower_to_triton_for_an_h200():
    """Qwen3.5's head dims (Dk = Dv = 128), bfloat16, two chunks, in value-column blocks of 64: every primitive of
    the forward kernel (saving the states) and of the backward kernel has a Triton lowering (jax.export for cuda
    under an abstract H200, as test_triton_lowering.py). Triton's own compilation (registers, shared memory) is
    only checked by a GPU run. At the default precision (TF32 dots), the training path's."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    triton = "__gpu$xla.gpu.triton"
    B, Tp, H, D, N = 1, 128, 2, 128, 2
    bf16 = jax.ShapeDtypeStruct((B, Tp, H, D), jnp.bfloat16)
    per_head = jax.ShapeDtypeStruct((B, Tp, H), jnp.float32)
    state = jax.ShapeDtypeStruct((B, H, D, D), jnp.float32)
    ints = jax.ShapeDtypeStruct((B, Tp), jnp.int32), jax.ShapeDtypeStruct((B, N), jnp.int32)
    knobs = dict(scale=D ** -0.5, chunk=64, block_v=64, num_warps=4, num_stages=1, interpret=False)
    forward = functools.partial(gated_delta_pallas, save_states=True, **knobs)
    backward = functools.partial(gated_delta_pallas_bwd, **knobs)
    states = jax.ShapeDtypeStruct((B, H, N, D, D), jnp.float32)
    for fn, args in ((forward, (bf16, bf16, bf16, per_head, per_head, *ints, state)),
                     (backward, (bf16, bf16, bf16, per_head, per_head, *ints, states, bf16, state))):
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh), jax.default_matmul_precision("default"):
            warnings.simplefilter("ignore")  # the Pallas Triton backend's deprecation notice
            exp = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
        assert triton in exp.mlir_module()


def test_v2_kernels_lower_to_triton_for_an_h200():
    """pallas_v2's three forward and four backward kernels at Qwen3.5's head dims, bfloat16, two chunks, the default
    knobs: every primitive has a Triton lowering (as above; benchmarks/triton_offline_check.py `dump-gdn` compiles
    them for sm_90). The abstract mesh's axis is Auto: under an Explicit one the avals carry a mesh sharding that
    the Triton lowering of a row sum ([C, C] -> [C]) mis-shapes (a jax quirk of lowering without a device; a GPU
    lowers with no mesh)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200",
                                                                                 num_cores=132, platform="gpu"))
    triton = "__gpu$xla.gpu.triton"
    B, Tp, H, D = 1, 128, 2, 128
    args = operand_shapes(B, Tp, H, D, D, jnp.bfloat16)
    knobs = V2Knobs(scale=D ** -0.5, interpret=False)
    tokens = jax.ShapeDtypeStruct((B, Tp, H, D), jnp.bfloat16)
    saved = (jax.ShapeDtypeStruct((B, H, Tp // 64, D, D), jnp.bfloat16), tokens, tokens, args[-1])  # h, v_new, do, ds
    for fn, fn_args, calls in ((functools.partial(chunk_forward, knobs=knobs, chunk=64), args, 3),
                               (functools.partial(kernel_v2_bwd.chunk_backward, knobs=knobs, chunk=64),
                                args[:-1] + saved, 4)):
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore")
            exp = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*fn_args)
        assert exp.mlir_module().count(triton) >= calls
