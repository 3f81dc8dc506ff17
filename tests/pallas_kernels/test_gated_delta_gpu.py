"""The gated delta rule's Pallas kernels compiled for the GPU (Triton), against the token-by-token reference: values,
final state and the gradients w.r.t. q, k, v, g, beta and the initial state, of packed rows. Skipped off a GPU,
where test_gated_delta.py runs the same kernels in interpret mode (`pytest tests/pallas_kernels -k gated_delta` on
the GPU machine runs both files, the kernels compiled in each).

Two precisions. fp32 operands with fp32 matmuls (`jax.default_matmul_precision("highest")`: Pallas' Triton dots in
IEEE fp32, XLA's too) at the CPU tests' tolerances: only the order of the sums differs. bf16 operands at the default
precision (the kernels' dots in TF32, the training path) at Qwen3.5's head dims, by ||x - ref|| / ||ref|| <= 1e-2
against the fp32 reference of the same bf16 values (o, dq, dk, dv are rounded to bf16: ~1e-3 alone). Each case is
run by the forward kernel alone (no saved states), and by the forward kernel that saves the states plus the
backward kernel (value_and_grad)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta.api import chunk_gated_delta_rule, pallas_forward
from test_gated_delta import close, operands

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles the Triton kernels: needs a GPU")]


def packed(B, T, seed):
    """[B, T] segment ids: random cuts (one at a chunk boundary, 64), the last row ending in 6 padding tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        cuts = sorted({64, *rng.choice(np.arange(1, T), 3, replace=False).tolist()})
        row = np.zeros(T, np.int32)
        for i, c in enumerate(cuts):
            row[c:] = i + 1
        rows.append(row + 10 * (b + 1))
    rows[-1][-6:] = 0
    return jnp.asarray(np.stack(rows))


def loss_and_grads(fn, xs, s0, w, ws):
    """((sum(o * w) + sum(final state * ws), (o, final state)), d/d(q, k, v, g, beta, initial state))."""
    def loss(q, k, v, g, beta, s0):
        o, final = fn(q, k, v, g, beta, s0)
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(final * ws), (o, final)

    return jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*xs, s0)


def kernel(seg, scale, block_v, num_warps):
    def fn(q, k, v, g, beta, s0):
        return pallas_forward(q, k, v, g, beta, seg, s0, scale=scale, interpret=False, block_v=block_v,
                              num_warps=num_warps)
    return fn


def reference(seg, scale):
    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, segment_ids=seg, initial_state=s0,
                                      output_final_state=True, impl="reference")
    return fn


@pytest.mark.parametrize("B, T, H, Dk, Dv, block_v, num_warps", [
    # Qwen3.5's head dims in 4 column blocks, a partial chunk (block_v 64 / 128: the backward kernel needs more shared
    # memory than a Hopper block has by benchmarks/triton_offline_check.py: 278 / 442 KB > 227 KB)
    (2, 200, 2, 128, 128, 32, 4),
    (2, 200, 2, 128, 128, 16, 8),
    (1, 130, 3, 24, 32, 16, 4),  # Dk padded to 32, Dv in two blocks of 16, T padded to 192 (not a power of two)
])
def test_compiled_kernels_fp32(B, T, H, Dk, Dv, block_v, num_warps):
    xs, s0 = operands(B=B, T=T, H=H, Dk=Dk, Dv=Dv, seed=3)
    seg, scale = packed(B, T, seed=4), Dk ** -0.5
    w = jax.random.normal(jax.random.key(5), xs[2].shape) * (seg != 0)[..., None, None]
    ws = jax.random.normal(jax.random.key(6), s0.shape)
    with jax.default_matmul_precision("highest"):
        (_, (o, final)), grads = loss_and_grads(kernel(seg, scale, block_v, num_warps), xs, s0, w, ws)
        (_, (o_ref, final_ref)), grads_ref = loss_and_grads(reference(seg, scale), xs, s0, w, ws)
        o_fwd, final_fwd = jax.jit(kernel(seg, scale, block_v, num_warps))(*xs, s0)
    real = np.asarray(seg != 0)  # padding outputs are don't-care
    for got in (o, o_fwd):
        close(np.asarray(got)[real], np.asarray(o_ref)[real], tol=1e-4, name="o")
    for got in (final, final_fwd):
        close(got, final_ref, tol=1e-4, name="final state")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_ref):
        close(a, b, tol=1e-4, name=f"d{name}")


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_compiled_kernels_bf16_at_default_precision():
    """chunk_gated_delta_rule(impl="pallas"), the kernels at the API's default knobs: bf16 q, k, v (as the model
    passes them), 4 heads of 128 x 128, 1024 tokens a row, TF32 dots."""
    B, T, H, D = 2, 1024, 4, 128
    (q, k, v, g, beta), s0 = operands(B=B, T=T, H=H, Dk=D, Dv=D, seed=7)
    seg, scale = packed(B, T, seed=8), D ** -0.5
    w = jax.random.normal(jax.random.key(9), v.shape) * (seg != 0)[..., None, None]
    ws = jax.random.normal(jax.random.key(10), s0.shape)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)] + [g, beta]

    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, segment_ids=seg, initial_state=s0,
                                      output_final_state=True, impl="pallas")

    (_, (o, final)), grads = loss_and_grads(fn, bf16, s0, w, ws)
    o_fwd, _ = jax.jit(fn)(*bf16, s0)
    assert o.dtype == o_fwd.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in bf16]  # the same values
    with jax.default_matmul_precision("highest"):
        (_, (o_ref, final_ref)), grads_ref = loss_and_grads(reference(seg, scale), f32, s0, w, ws)
    real = np.asarray(seg != 0)
    errors = {"o": rel_err(np.asarray(o, np.float32)[real], np.asarray(o_ref)[real]),
              "o (forward alone)": rel_err(np.asarray(o_fwd, np.float32)[real], np.asarray(o_ref)[real]),
              "final state": rel_err(final, final_ref)}
    errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads,
                                                              grads_ref)})
    assert all(e <= 1e-2 for e in errors.values()), errors  # NaN fails too


@pytest.mark.parametrize("backward", ["kernels", "jnp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_v2_forward(dtype, backward):
    """impl "pallas_v2" compiled (its three kernels at the default V2Knobs): Qwen3.5's head dims, packed rows with
    padding, an initial state. fp32 operands with fp32 dots: o, the final state and the gradients (its four backward
    kernels, kernel_v2_bwd.py) = the token reference at 1e-4; bf16 operands (bf16 W, U, h, v_new, T, dh, dv_new,
    bf16 tensor-core dots): within 1e-2 of the fp32 reference of the same values, the gradients too."""
    B, T, H, D = 2, 200, 2, 128
    xs, s0 = operands(B=B, T=T, H=H, Dk=D, Dv=D, seed=11)
    seg, scale = packed(B, T, seed=12), D ** -0.5
    w = jax.random.normal(jax.random.key(13), xs[2].shape) * (seg != 0)[..., None, None]
    ws = jax.random.normal(jax.random.key(14), s0.shape)
    if dtype == "bfloat16":
        xs = [x.astype(jnp.bfloat16) for x in xs[:3]] + list(xs[3:])

    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, segment_ids=seg, initial_state=s0,
                                      output_final_state=True, impl="pallas_v2", backward=backward)

    f32 = [x.astype(jnp.float32) for x in xs]
    with jax.default_matmul_precision("highest"):
        (_, (o_ref, final_ref)), grads_ref = loss_and_grads(reference(seg, scale), f32, s0, w, ws)
    real = np.asarray(seg != 0)
    with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
        (_, (o, final)), grads = loss_and_grads(fn, xs, s0, w, ws)
    if dtype == "float32":
        close(np.asarray(o)[real], np.asarray(o_ref)[real], tol=1e-4, name="o")
        close(final, final_ref, tol=1e-4, name="final state")
        for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_ref):
            close(a, b, tol=1e-4, name=f"d{name}")
        return
    errors = {"o": rel_err(np.asarray(o, np.float32)[real], np.asarray(o_ref)[real]),
              "final state": rel_err(final, final_ref)}
    errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads,
                                                              grads_ref)})
    assert all(e <= 1e-2 for e in errors.values()), errors
