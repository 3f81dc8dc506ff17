"""Is a decode path correct? A teacher-forced comparison against the fp32 reference, judged by the bf16 noise floor.

Comparing greedy tokens cannot tell: with near-flat logits (random weights) one rounding difference flips an
argmax, and from then on every input differs. Here every path decodes the SAME forced tokens from the SAME pool
(``forced_decode``), and each is measured against the truth, the reference path in fp32 (fp32 copies of the
weights and the pool, matmul precision "highest"):

    err(x) per step i = max |x_i - truth_i| / max |truth_i|          (x: logits [R, V]; the k/v written [L, R, K, H])
    noise floor       = err of the reference path in the model's dtype (bf16 on the GPU), measured the same way
    PASS  iff  for every step: err(path) <= 2 * noise + eps  (logits and the k/v written)
          and  no pool slot other than the K written per row changed (bit for bit)
          and  the argmax equals the truth's wherever the truth's top-2 margin exceeds twice the allowed
               logit error (decisive positions: there no path within tolerance could flip it).

The k/v of layer 0 do not depend on attention: they should equal the reference's bit for bit (reported as
``kv_layer0_max_abs_diff``; a different XLA fusion may round them differently, so it does not decide).
In fp32 (CPU tests) the noise floor is ~0 and ``eps`` decides.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.serve.forced_decode import forced_decode, pool_slots

DEFAULT_EPS = 1e-4  # relative; bf16's unit roundoff is 3.9e-3, fp32's 6e-8


def fp32_twin(graphdef, state):
    """The same model computing in fp32 on fp32 copies of the weights -> (graphdef, state)."""
    f32 = jnp.float32
    state32 = jax.tree.map(lambda x: x.astype(f32) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    model = nnx.merge(graphdef, state32)
    model.dtype = f32  # the decoder's compute dtype (layers compute in their input's dtype)
    return nnx.split(model)


def _run(graphdef, state, k_pool, v_pool, tokens, start, block_table, block_size, path, unroll):
    """-> (logits [R, K, V] fp32, new k / v [L, R, K, KH, H] fp32, any slot other than those changed)."""
    k, v, logits = forced_decode(graphdef, state, k_pool, v_pool, tokens, start, block_table, path=path,
                                 block_size=block_size, unroll=unroll)
    K = tokens.shape[1]
    slots = pool_slots(block_table, start[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :], block_size)
    written = jnp.zeros((k_pool.shape[1],), bool).at[slots].set(True)[None, :, None, None]
    stray = jnp.any(jnp.where(written, False, k != k_pool.astype(k.dtype))) | jnp.any(
        jnp.where(written, False, v != v_pool.astype(v.dtype)))
    new_k, new_v = k[:, slots].astype(jnp.float32), v[:, slots].astype(jnp.float32)
    del k, v
    return logits, new_k, new_v, bool(stray)


def _rel_per_step(x, truth, step_axis):
    """max |x - truth| / max |truth| per step (the K axis) -> [K] numpy."""
    axes = tuple(a for a in range(x.ndim) if a != step_axis)
    return np.asarray(jnp.max(jnp.abs(x - truth), axis=axes) / jnp.maximum(jnp.max(jnp.abs(truth), axis=axes),
                                                                           1e-30))


def teacher_forced_check(graphdef, state, k_pool, v_pool, tokens, start, block_table, *, block_size: int,
                         paths=("gather", "reduce", "pallas"), eps: float = DEFAULT_EPS, unroll: int | bool = 1,
                         on_error=None) -> list[dict]:
    """tokens [R, K] forced, start [R], block_table [R, NB]; pools in the model's KV dtype.

    -> one dict for the reference in the model's dtype (the noise floor; ``check="reference"``) and one per
    path in `paths` (``pass`` True / False). on_error(path, exception): called for a path that raises (it
    is then left out); None re-raises."""
    tokens, start, block_table = (jnp.asarray(a, jnp.int32) for a in (tokens, start, block_table))
    R, K = tokens.shape
    args = (tokens, start, block_table, block_size)
    g32, s32 = fp32_twin(graphdef, state)
    with jax.default_matmul_precision("highest"):
        t_logits, t_k, t_v, _ = _run(g32, s32, k_pool.astype(jnp.float32), v_pool.astype(jnp.float32), *args,
                                     "reference", unroll)
    del s32
    scale = float(jnp.max(jnp.abs(t_logits)))
    top2 = jax.lax.top_k(t_logits, 2)[0]
    margin = top2[..., 0] - top2[..., 1]  # [R, K]
    t_ids = jnp.argmax(t_logits, axis=-1)

    def measure(name, logits, k, v, stray):
        kv_err = np.maximum(_rel_per_step(k, t_k, 2), _rel_per_step(v, t_v, 2))
        return {"check": name, "rows": R, "steps": K, "logits_rel_err": _rel_per_step(logits, t_logits, 1),
                "kv_rel_err": kv_err, "stray_writes": stray}

    r_logits, r_k, r_v, r_stray = _run(graphdef, state, k_pool, v_pool, *args, "reference", unroll)
    ref = measure("reference", r_logits, r_k, r_v, r_stray)
    noise_logits, noise_kv = ref["logits_rel_err"], ref["kv_rel_err"]
    tol_logits, tol_kv = 2 * noise_logits + eps, 2 * noise_kv + eps
    decisive = margin > 2 * jnp.asarray(tol_logits)[None, :] * scale  # [R, K]
    n_decisive = int(jnp.sum(decisive))
    out = []
    for name in ["reference", *paths]:
        if name == "reference":
            logits, k, v, stray = r_logits, r_k, r_v, r_stray
        else:
            try:
                logits, k, v, stray = _run(graphdef, state, k_pool, v_pool, *args, name, unroll)
            except Exception as e:  # noqa: BLE001 - the caller decides
                if on_error is None:
                    raise
                on_error(name, e)
                continue
        r = measure(name, logits, k, v, stray)
        agree = jnp.where(decisive, jnp.argmax(logits, axis=-1) == t_ids, True)
        ratio = max(float(np.max(r["logits_rel_err"] / tol_logits)), float(np.max(r["kv_rel_err"] / tol_kv)))
        r.update(
            logits_rel_err=float(np.max(r["logits_rel_err"])), logits_rel_err_step0=float(r["logits_rel_err"][0]),
            kv_rel_err=float(np.max(r["kv_rel_err"])), kv_rel_err_step0=float(r["kv_rel_err"][0]),
            logits_noise=float(np.max(noise_logits)), kv_noise=float(np.max(noise_kv)), eps=eps,
            kv_layer0_max_abs_diff=float(jnp.maximum(jnp.max(jnp.abs(k[0] - r_k[0])), jnp.max(jnp.abs(v[0] - r_v[0])))),
            logits_rel_diff_vs_reference=float(jnp.max(jnp.abs(logits - r_logits)) / scale),
            decisive=n_decisive, argmax_disagree=int(jnp.sum(~agree)), err_over_tolerance=ratio,
            argmax_equal_all=float(jnp.mean(jnp.argmax(logits, axis=-1) == t_ids)))
        r["pass"] = bool(ratio <= 1.0 and not stray and r["argmax_disagree"] == 0)
        out.append(r)
    return out


def format_check(r: dict) -> str:
    """One human line of a `teacher_forced_check` result."""
    verdict = "noise floor" if r["check"] == "reference" else ("PASS" if r["pass"] else "FAIL")
    return (f"{r['check']:9s} R={r['rows']:<3d} {verdict:11s} logits rel err {r['logits_rel_err']:.2e} "
            f"(bf16 floor {r['logits_noise']:.2e}), k/v rel err {r['kv_rel_err']:.2e} (floor {r['kv_noise']:.2e}), "
            f"err / tolerance {r['err_over_tolerance']:.2f}, argmax {r['decisive'] - r['argmax_disagree']}/"
            f"{r['decisive']} decisive agree, stray writes {r['stray_writes']}")


__all__ = ["DEFAULT_EPS", "format_check", "fp32_twin", "teacher_forced_check"]
