"""The gated delta rule (Gated DeltaNet's linear attention), token by token: the reference every other form of it
(the chunked jnp form, the Pallas kernels) is tested against.

Per head, with a state S [Dk, Dv] (fp32), for each token t of a row:

    S   <- exp(g_t) * S                          decay (g_t <= 0, log space)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T    the delta rule: write the part of v_t the state does not predict
    o_t  = S^T (scale * q_t)

q and k come L2-normalised by the caller; `scale` (Dk^-0.5 in Qwen3.5) multiplies q here. Packed rows: where
`segment_ids` changes between t-1 and t, the state is reset to zero before token t (the first token of a row
continues `initial_state`: chunked prefill resumes a sequence). Padding (id 0) is computed like any segment; its
outputs are the caller's to ignore.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
    """[B, T] bool: where a new segment begins (never at t = 0, which continues the initial state)."""
    if segment_ids is None:
        return jnp.zeros(shape, bool)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((shape[0], 1), bool), change], axis=1)


def recurrent_gated_delta_step(q, k, v, g, beta, state, *, scale: float):
    """One token: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] (fp32) -> (o [B, H, Dv] in
    v's dtype, the new state fp32). Decode's step."""
    f32, out_dtype = jnp.float32, v.dtype
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    state = state.astype(f32) * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("bhk,bhkv->bhv", k, state)
    state = state + k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q * scale, state)
    return o.astype(out_dtype), state


def gated_delta_rule_reference(q, k, v, g, beta, *, scale: float, segment_ids=None, initial_state=None,
                               output_final_state: bool = False):
    """q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta [B, T, H], segment_ids [B, T] or None, initial_state
    [B, H, Dk, Dv] or None -> (o [B, T, H, Dv] in v's dtype, the final state [B, H, Dk, Dv] fp32 or None)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    state = jnp.zeros((B, H, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    resets = segment_starts(segment_ids, (B, T))

    def token(state, xs):
        q_t, k_t, v_t, g_t, b_t, reset = xs
        state = jnp.where(reset[:, None, None, None], 0.0, state)
        o, state = recurrent_gated_delta_step(q_t, k_t, v_t, g_t, b_t, state, scale=scale)
        return state, o

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets)]
    state, o = jax.lax.scan(token, state, time_major)
    return jnp.moveaxis(o, 0, 1), (state if output_final_state else None)


__all__ = ["gated_delta_rule_reference", "recurrent_gated_delta_step", "segment_starts"]
