"""adamw_8bit's fused per-parameter update of the stacked layers (surojax/train/optim_8bit_fused.py, the Pallas
kernel in interpret mode on CPU) equals the per-layer in-place loop (surojax/offload/optimizer.py `in_place`):
counts exactly; params and absmaxes within a few ulps of their magnitude (the same operations; where XLA CPU
contracts a multiply-add into an FMA depends on its fusion boundaries, ~1e-7 relative here, where any wrong term
is >= 1e-3); the 8-bit codes equal but for the rare value an ulp moves across a code boundary (one code off),
which moves that parameter's next update by ~0.2%: after the first step every parameter is held to the ulps, after
the third all but those few. The leaves cover the kernel (whole 256-value blocks per layer, with
and without weight decay), an 8-bit leaf whose layer is not whole blocks and an fp32-moment leaf (both the XLA
form per layer), and outside the layers an 8-bit head (the kernel, a stack of one) and an fp32-moment embedding; the clip is active and the schedule moves, over three steps."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from surojax.kernel_settings import KernelSettings, use_kernel_settings
from surojax.train.optim import build_optimizer
from surojax.train.optim_8bit_fused import FusedAdam8bit

L = 3


def _params(key):
    ks = jax.random.split(key, 5)
    return {"layers": {"attn": {"kernel": jax.random.normal(ks[0], (L, 64, 128)) * 0.05},  # 32 blocks per layer
                       "mlp": {"kernel": jax.random.normal(ks[1], (L, 4100)) * 0.05},  # 8-bit, not whole blocks
                       "norm": {"scale": 1.0 + 0.1 * jax.random.normal(ks[2], (L, 4096))},  # 8-bit, no decay
                       "q_norm": {"scale": jnp.ones((L, 16))}},  # fp32 moments
            "embed": {"embedding": jax.random.normal(ks[3], (32, 16))},  # not layers: fp32 moments
            "lm_head": {"kernel": jax.random.normal(ks[4], (64, 128)) * 0.05}}  # not layers: 8-bit, the kernel


def _run(mode, steps=3):
    with use_kernel_settings(adam8bit=mode):  # read when the step is traced (the first call below)
        return _steps(steps)


def _steps(steps):
    schedule = lambda c: 1e-2 / (1.0 + c.astype(jnp.float32))  # noqa: E731 - moves every step
    opt = build_optimizer("adamw_8bit", schedule, weight_decay=0.1, max_grad_norm=0.5, layerwise_update=True)
    params = _params(jax.random.key(0))
    state = opt.init(params)
    step = jax.jit(lambda g, s, p: opt.update_and_apply(g, jnp.float32(2.0), s, p))
    out = []
    for i in range(steps):
        grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(10 + i), p.shape) * (1.0 + i), params)
        params, state, norm = step(grads, state, params)
        assert float(norm) > 0.5  # the clip is active
        out.append((params, state))
    return out


def _close(ref, got, *, first: bool):
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == np.uint8:  # codes
            off = np.abs(a.astype(int) - b.astype(int))
            assert off.max() <= 1 and (off > 0).mean() < 1e-3, (off.max(), (off > 0).mean())
        elif np.issubdtype(a.dtype, np.floating):
            tol = 1e-6 * np.abs(a).max()
            if first:
                np.testing.assert_allclose(b, a, rtol=1e-6, atol=tol)
            else:
                off = np.abs(b - a) > tol + 1e-6 * np.abs(a)
                assert off.mean() < 2e-3, off.mean()
                np.testing.assert_allclose(b, a, rtol=1e-2, atol=tol)
        else:
            np.testing.assert_array_equal(a, b)


def test_fused_update_equals_the_per_layer_loop():
    ref, ker = _run("xla"), _run("kernel")
    _close(ref[0], ker[0], first=True)
    _close(ref[-1], ker[-1], first=False)
    p_ref = ref[-1][0]
    assert not np.array_equal(np.asarray(p_ref["layers"]["attn"]["kernel"]),
                              np.asarray(_params(jax.random.key(0))["layers"]["attn"]["kernel"]))


def test_fused_update_runs_the_kernel_only_where_the_blocks_fit():
    fused = FusedAdam8bit(1e-3)
    assert fused._fits(jnp.zeros((L, 64, 128))) and fused._fits(jnp.zeros((L, 4096)))
    assert not fused._fits(jnp.zeros((L, 4100)))
    opt = build_optimizer("adamw_8bit", optax.constant_schedule(1e-3), layerwise_update=True)
    params = _params(jax.random.key(1))
    with use_kernel_settings(adam8bit="kernel"):
        hlo = jax.jit(lambda g, s, p: opt.update_and_apply(g, jnp.float32(1.0), s, p)).lower(
            params, opt.init(params), params).as_text()
    calls = re.findall(r"= call @adam8bit_kernel\w*\(.*?tensor<(\d+)x256xf32>, tensor<(\d+)x256xf32>", hlo)
    # the norm scale, attn and lm_head (a stack of one), not mlp
    assert sorted(int(a) for a, _ in calls) == sorted([L * 16, 32, L * 32]), calls


def test_mode_is_checked():
    with pytest.raises(ValueError, match="SUROJAX_ADAM8BIT"):
        KernelSettings.from_environ({"SUROJAX_ADAM8BIT": "fast"})
