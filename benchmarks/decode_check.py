"""Is a decode path correct? A teacher-forced comparison against the fp32 reference, judged by the bf16 noise floor.

Comparing greedy tokens cannot tell: with near-flat logits (random weights) one rounding difference flips an
argmax, and from then on every input differs. Here every path decodes the SAME forced tokens from the SAME pool
(``forced_decode``), and each is measured against the truth, the reference path in fp32 (fp32 copies of the
weights and the pool, matmul precision "highest"):

    err(x) per row r, step i = max |x_ri - truth_ri| / max |truth_ri|   (x: logits [V]; the k/v written [L, K, H])
    noise floor of step i    = the largest err over the rows of the reference path in the model's dtype
                               (bf16 on the GPU), measured the same way
    PASS  iff  for every row and step: err(path) <= 2 * floor + eps  (logits and the k/v written)
          and  no pool slot other than the K written per row changed (bit for bit)
          and  the argmax equals the truth's wherever the truth's top-2 margin exceeds twice the allowed
               logit error (decisive positions: there no path within tolerance could flip it).

The k/v of layer 0 do not depend on attention: they should equal the reference's bit for bit (reported as
``kv_layer0_max_abs_diff``; a different XLA fusion may round them differently, so it does not decide).
In fp32 (CPU tests) the noise floor is ~0 and ``eps`` decides.

Under the whole network's bf16 rounding a small attention error hides (one token of 577 near-uniformly
attended); ``attention_check`` runs each layer's attention sublayer alone, per row, the same way. Rows of
different lengths (1 token, a partial block, a block boundary, the full context) make an off-by-one visible:
at length 1 it is the whole output.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forced_decode import forced_attention, forced_decode, pool_slots  # benchmarks/ is on sys.path

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


def _rel(x, truth, keep):
    """max |x - truth| / max |truth| over every axis but `keep` (row, step) -> numpy [R, K]."""
    axes = tuple(a for a in range(x.ndim) if a not in keep)
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
    scale = jnp.max(jnp.abs(t_logits), axis=-1)  # [R, K]
    top2 = jax.lax.top_k(t_logits, 2)[0]
    margin = top2[..., 0] - top2[..., 1]  # [R, K]
    t_ids = jnp.argmax(t_logits, axis=-1)

    def measure(name, logits, k, v, stray):
        kv_err = np.maximum(_rel(k, t_k, (1, 2)), _rel(v, t_v, (1, 2)))  # [R, K]
        return {"check": name, "rows": R, "steps": K, "logits_rel_err": _rel(logits, t_logits, (0, 1)),
                "kv_rel_err": kv_err, "stray_writes": stray}

    r_logits, r_k, r_v, r_stray = _run(graphdef, state, k_pool, v_pool, *args, "reference", unroll)
    ref = measure("reference", r_logits, r_k, r_v, r_stray)
    # the floor per step: its worst row (a single row's floor is a max over few values: too noisy to judge by)
    noise_logits, noise_kv = (np.max(ref[k], axis=0, keepdims=True) for k in ("logits_rel_err", "kv_rel_err"))
    tol_logits, tol_kv = 2 * noise_logits + eps, 2 * noise_kv + eps  # [1, K]
    decisive = margin > 2 * jnp.asarray(tol_logits) * scale  # [R, K]
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
            logits_rel_err=float(np.max(r["logits_rel_err"])),
            logits_rel_err_step0=float(np.max(r["logits_rel_err"][:, 0])),
            kv_rel_err=float(np.max(r["kv_rel_err"])), kv_rel_err_step0=float(np.max(r["kv_rel_err"][:, 0])),
            worst_row=int(np.unravel_index(np.argmax(np.maximum(r["logits_rel_err"] / tol_logits,
                                                                r["kv_rel_err"] / tol_kv)), (R, K))[0]),
            logits_noise=float(np.max(noise_logits)), kv_noise=float(np.max(noise_kv)), eps=eps,
            kv_layer0_max_abs_diff=float(jnp.maximum(jnp.max(jnp.abs(k[0] - r_k[0])), jnp.max(jnp.abs(v[0] - r_v[0])))),
            logits_rel_diff_vs_reference=float(jnp.max(jnp.abs(logits - r_logits)) / jnp.max(scale)),
            decisive=n_decisive, argmax_disagree=int(jnp.sum(~agree)), err_over_tolerance=ratio,
            argmax_equal_all=float(jnp.mean(jnp.argmax(logits, axis=-1) == t_ids)))
        r["pass"] = bool(ratio <= 1.0 and not stray and r["argmax_disagree"] == 0)
        out.append(r)
    return out


def attention_check(graphdef, state, k_pool, v_pool, start, block_table, *, block_size: int,
                    paths=("reduce", "pallas"), eps: float = DEFAULT_EPS, seed: int = 0,
                    on_error=None) -> list[dict]:
    """Each layer's attention sublayer alone (``forced_attention``), where a kernel's error is not buried
    under the rest of the network's rounding: x ~ N(0, 1) [R, 1, D] as the new token at position start [R],
    through every layer's attention. Truth: the gather path in fp32 (fp32 twin, fp32 pools, matmul precision
    "highest"); noise floor: the gather path in the model's dtype (the reference path's arithmetic, equal
    to it bit for bit: tests/serve/test_paged_attention.py). Per layer and row err = max |y - truth| /
    max |truth| (y [D] of that row); PASS iff err <= 2 x floor + eps in every layer and row (floor: the
    layer's largest over the rows). -> one dict per path, "attention-gather" first (the
    floor)."""
    start, block_table = jnp.asarray(start, jnp.int32), jnp.asarray(block_table, jnp.int32)
    R = start.shape[0]
    cfg = nnx.merge(graphdef, state).cfg
    x = jax.random.normal(jax.random.key(seed), (R, 1, cfg.hidden_size), jnp.float32)
    g32, s32 = fp32_twin(graphdef, state)
    k32, v32 = k_pool.astype(jnp.float32), v_pool.astype(jnp.float32)
    layers = range(cfg.num_layers)
    with jax.default_matmul_precision("highest"):
        truth = [forced_attention(g32, s32, x, k32, v32, block_table, start, jnp.int32(l), kernel="gather",
                                  block_size=block_size) for l in layers]
    del s32, k32, v32
    xd = x.astype(k_pool.dtype)

    def errors(kernel):  # -> [L, R]
        return np.stack([_rel(forced_attention(graphdef, state, xd, k_pool, v_pool, block_table, start,
                                               jnp.int32(l), kernel=kernel, block_size=block_size), t, (0,))
                         for l, t in zip(layers, truth)])

    floor = errors("gather")
    tol = 2 * np.max(floor, axis=1, keepdims=True) + eps  # per layer: the floor's worst row
    out = []
    for name in ["gather", *[p for p in paths if p != "gather"]]:
        try:
            err = floor if name == "gather" else errors(name)
        except Exception as e:  # noqa: BLE001 - the caller decides
            if on_error is None:
                raise
            on_error(f"attention-{name}", e)
            continue
        ratio = float(np.max(err / tol))
        worst_layer, worst_row = np.unravel_index(np.argmax(err / tol), err.shape)
        out.append({"check": f"attention-{name}", "rows": R, "layers": cfg.num_layers,
                    "attn_rel_err": float(np.max(err)), "attn_noise": float(np.max(floor)), "eps": eps,
                    "worst_layer": int(worst_layer), "worst_row": int(worst_row),
                    "worst_row_length": int(start[worst_row]) + 1, "err_over_tolerance": ratio,
                    "pass": ratio <= 1.0})
    return out


def format_check(r: dict) -> str:
    """One human line of a `teacher_forced_check` / `attention_check` result."""
    if r["check"].startswith("attention-"):
        verdict = "noise floor" if r["check"] == "attention-gather" else ("PASS" if r["pass"] else "FAIL")
        return (f"{r['check']:16s} R={r['rows']:<3d} {verdict:11s} attention output rel err "
                f"{r['attn_rel_err']:.2e} (floor {r['attn_noise']:.2e}), err / tolerance "
                f"{r['err_over_tolerance']:.2f} (worst: layer {r['worst_layer']} of {r['layers']}, row "
                f"{r['worst_row']} attending {r['worst_row_length']} tokens)")
    verdict = "noise floor" if r["check"] == "reference" else ("PASS" if r["pass"] else "FAIL")
    return (f"{r['check']:9s} R={r['rows']:<3d} {verdict:11s} logits rel err {r['logits_rel_err']:.2e} "
            f"(floor {r['logits_noise']:.2e}), k/v rel err {r['kv_rel_err']:.2e} (floor {r['kv_noise']:.2e}), "
            f"err / tolerance {r['err_over_tolerance']:.2f}, argmax {r['decisive'] - r['argmax_disagree']}/"
            f"{r['decisive']} decisive agree, stray writes {r['stray_writes']}")


__all__ = ["DEFAULT_EPS", "attention_check", "format_check", "fp32_twin", "teacher_forced_check"]
