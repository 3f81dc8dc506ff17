"""The FP8 KV cache's number format: float8_e4m3fn codes with one scale per layer for k and one for v.

    stored = saturate(x / scale) as float8_e4m3fn        x = stored * scale (read back in fp32)

E4M3 (1 sign, 4 exponent, 3 mantissa bits, bias 7, no inf) holds |x| <= FP8_MAX = 448; normals from 2^-6 keep
a relative rounding error <= 2^-4 (half an ulp of a 3-bit mantissa), subnormals down to 2^-9 an absolute one of
2^-10 (in units of the scale). A plain cast of a value past 448 gives NaN, so `quantize` saturates first.

The scale rule (`kv_scales`): per layer, the scale maps a BOUND on that layer's |k| (|v|) that the weights imply
to FP8_MAX, so no value the model can produce is clipped and no calibration pass is needed:

    x_n = RMSNorm(h) * g          ||x_n||_2 <= sqrt(D) * max|g|                          (any hidden state h)
    k head (no q/k norm)          ||k||_2 <= ||x_n||_2 * sigma_max(W_k[:, head]) + ||b_k[head]||_2
    k head (q/k norm, scale g_k)  ||k||_2 <= sqrt(H) * max|g_k|        (the smaller of the two bounds)
    rope rotates pairs of a head: every element of the rotated k is <= the head's L2 norm
    v element j                   |v_j| <= ||x_n||_2 * ||W_v[:, j]||_2 + |b_v[j]|
    v head (Gemma 4's v norm: RMS-normalised, no weight)   |v_j| <= ||v||_2 <= sqrt(H)   (that bound alone: the
                                  projection's bound says nothing about a normalised head)

times BOUND_MARGIN (the compute dtype's roundings inside those steps), floored away from 0. The bound is loose
(the hidden state is rarely aligned with a weight column), which costs little: a loose factor c puts the real
largest value at 448 / c, and values c x 2^-9 / 448 of the bound down sit in subnormals whose absolute error
(2^-10 x scale) stays far below the 2^-4 relative error of the largest entries for any c up to ~10^3.
Several KV pools (Gemma 4's full layers of their own shape: `kv_pools`): one scale set per pool, a scale per pool
row, each bounded from the norms and projections of the stack owning those rows (`global_layers`' own head size,
kv heads and, with attention_k_eq_v, its key projection as the values'); KV-shared layers read their source's rows
and scales. A loaded LoRA changes W_k / W_v after the scales are fixed: the engine refuses FP8 with LoRA slots.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from surojax.serve.kv_pools import kv_pools

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
FP8_REL_ERROR = 2.0 ** -4  # half an ulp of E4M3's 3-bit mantissa, relative, for |x| / scale >= 2^-6
BOUND_MARGIN = 1.0 + 2.0 ** -4  # headroom for the bf16 roundings of norm, projection, bias, qk-norm and rope
MIN_SCALE = 2.0 ** -100  # an all-zero layer: any positive scale stores its zeros exactly


def is_fp8(dtype) -> bool:
    """True for the FP8 pool dtype (float8_e4m3fn); other 8-bit floats are refused by `check_pool_dtype`."""
    return dtype is not None and jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def check_pool_dtype(dtype) -> None:
    """A KV pool dtype is a float of 16 / 32 bits or float8_e4m3fn (the only 8-bit format with a scale rule)."""
    d = jnp.dtype(dtype)
    if not jnp.issubdtype(d, jnp.floating) or (d.itemsize == 1 and not is_fp8(d)):
        raise ValueError(f"KV pool dtype {d} is not supported: use the model's dtype or float8_e4m3fn "
                         "(--kv-cache-dtype fp8)")


@dataclasses.dataclass(frozen=True)
class KVScales:
    """Per-layer scales of an FP8 pool (static, hashable: a jit static value). k, v: L floats."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self):
        if len(self.k) != len(self.v) or not all(s > 0 and np.isfinite(s) for s in self.k + self.v):
            raise ValueError(f"KVScales: k and v need one finite positive scale per layer, got {self}")

    def at(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """layer [] int32 (traced) -> (k scale, v scale) [] fp32."""
        return jnp.asarray(self.k, jnp.float32)[layer], jnp.asarray(self.v, jnp.float32)[layer]

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """-> k, v scales [L, 1, 1, 1, 1] fp32, to broadcast over an [L, R, S, K, H] view."""
        shape = (len(self.k), 1, 1, 1, 1)
        return jnp.asarray(self.k, jnp.float32).reshape(shape), jnp.asarray(self.v, jnp.float32).reshape(shape)

    # the cast rule, for the model's paged cache (models/ does not import serve/): `quantize`, `dequantize`
    @staticmethod
    def quantize(x: jax.Array, scale) -> jax.Array:
        return quantize(x, scale)

    @staticmethod
    def dequantize(x: jax.Array, scale, dtype) -> jax.Array:
        return dequantize(x, scale, dtype)


def quantize(x: jax.Array, scale) -> jax.Array:
    """x (any float dtype) / scale, saturated to +-FP8_MAX, rounded to nearest-even float8_e4m3fn (an inf becomes
    +-448, never NaN; a NaN stays NaN)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def dequantize(x: jax.Array, scale, dtype) -> jax.Array:
    """float8_e4m3fn codes -> codes x scale in `dtype` (the product in fp32)."""
    return (x.astype(jnp.float32) * scale).astype(dtype)


def _spectral_norms(w: jax.Array) -> jax.Array:
    """w [..., D, H] -> the largest singular value of each [D, H] matrix [...] (fp32)."""
    gram = jnp.einsum("...dh,...de->...he", w, w, precision=jax.lax.Precision.HIGHEST)
    return jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(gram)[..., -1], 0.0))


def _dense(w) -> jax.Array:
    """One layer's kernel [D, O] (a quantised weight dequantised) in fp32."""
    return w.dequantize(jnp.float32) if hasattr(w, "dequantize") else w.astype(jnp.float32)


def layer_bounds(model, stack: str = "layers") -> tuple[np.ndarray, np.ndarray]:
    """-> (k bound [L], v bound [L]): the largest |k| / |v| element each layer of the layer stack `stack` can
    produce (module docstring) from that stack's own norms and projections in its own shape
    (`ModelConfig.stack_config`: Gemma 4's `global_layers` their head size and kv heads; `attention_k_eq_v`: no
    v_proj, the values are the key projection's output, v-normed), one layer at a time on the device (a quantised
    W_k / W_v is dequantised one layer at a time; q / k / v joined for serving: their columns of the joined one)."""
    cfg = model.cfg.stack_config(stack)
    if stack not in model.stacks:
        raise ValueError(f"{cfg.model_type}: no layer stack {stack!r} (stacks: {', '.join(model.stacks)})")
    block = model.stacks[stack]
    attn, norm = block.attn, block.attn_norm
    K, H, D = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    kv = K * H
    if attn.qkv_proj is not None:  # q / k / v joined for serving (fused_projections): k, v are the columns after q
        k_lin = v_lin = attn.qkv_proj
        k_at = attn.qkv_proj.out_features - 2 * kv
        v_at = k_at + kv
    elif attn.k_proj is not None:  # attention_k_eq_v: no v_proj, the values are the key projection's output
        k_lin, v_lin, k_at, v_at = attn.k_proj, attn.k_proj if attn.v_proj is None else attn.v_proj, 0, 0
    else:
        raise ValueError(f"{cfg.model_type}: the FP8 KV scale bounds read the k / v projections of the stack owning "
                         f"the pool rows; {stack}.attn has none")
    L = norm.scale.shape[0]  # the stack's layers
    has_qk_norm = attn.k_norm is not None
    shift = 1.0 if cfg.norm_zero_centered else 0.0  # (1 + w) RMSNorms (Qwen3.5, Gemma) scale by 1 + w

    @jax.jit
    def one(layer):
        g, wk, bk, wv, bv, gk = layer
        g = g.astype(jnp.float32) + shift
        gk = None if gk is None else gk.astype(jnp.float32) + shift
        x_norm = jnp.sqrt(jnp.float32(D)) * jnp.max(jnp.abs(g))  # ||x_n||_2 bound
        wk, wv = _dense(wk)[:, k_at:k_at + kv], _dense(wv)[:, v_at:v_at + kv]  # [D, K * H]
        bk, bv = bk[k_at:k_at + kv], bv[v_at:v_at + kv]
        heads = x_norm * _spectral_norms(wk.reshape(D, K, H).transpose(1, 0, 2)) \
            + jnp.linalg.norm(bk.reshape(K, H), axis=-1)  # [K]
        k_bound = jnp.max(heads)
        if gk is not None:
            k_bound = jnp.minimum(k_bound, jnp.sqrt(jnp.float32(H)) * jnp.max(jnp.abs(gk)))
        v_bound = jnp.max(x_norm * jnp.linalg.norm(wv, axis=0) + jnp.abs(bv))
        if cfg.v_norm:  # each value head RMS-normalised: sum v_j^2 <= H
            v_bound = jnp.sqrt(jnp.float32(H))
        return k_bound, v_bound

    per_layer = (norm.scale[...], k_lin.kernel[...], _stacked_bias(k_lin, L), v_lin.kernel[...],
                 _stacked_bias(v_lin, L), attn.k_norm.scale[...] if has_qk_norm else None)
    ks, vs = [], []
    for l in range(L):
        k_b, v_b = one(jax.tree.map(lambda x: x[l], per_layer))
        ks.append(float(k_b))
        vs.append(float(v_b))
    return np.asarray(ks), np.asarray(vs)


def pool_bounds(model) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per KV pool (`kv_pools.kv_pools`, in its order): (k bound, v bound), one per pool row. A pool's rows are
    its cache part's layers that compute keys / values, in layer order: the rows of the layer stack of that name
    (`layers`; Gemma 4's `global_layers`), whose own projections bound them (`layer_bounds`). KV-shared layers
    own no rows: they read (and so are bounded by) their source's."""
    out = []
    for pool in kv_pools(model.cfg):
        k, v = layer_bounds(model, pool.part)
        if len(k) != pool.num_layers:
            raise ValueError(f"{model.cfg.model_type}: KV pool {pool.part!r} has {pool.num_layers} rows but its "
                             f"stack {len(k)} layers: the FP8 scale bounds cannot be matched to the pool's rows")
        out.append((k, v))
    return tuple(out)


def _stacked_bias(linear, num_layers: int) -> jax.Array:
    """The stacked bias [L, out_features] fp32 (zeros without one)."""
    if linear.bias is None:
        return jnp.zeros((num_layers, linear.out_features), jnp.float32)
    return linear.bias[...].astype(jnp.float32)


def kv_scales(model) -> KVScales | tuple[KVScales, ...]:
    """The scale rule (module docstring): per pool row BOUND_MARGIN x bound / FP8_MAX, at least MIN_SCALE. In the
    form of the runner's pools (`kv_pools.paged_cache`): one `KVScales` for one pool, a tuple of one per pool
    (rows as the pool's rows) with several."""

    def scale(b):
        return tuple(max(float(x) * BOUND_MARGIN / FP8_MAX, MIN_SCALE) for x in b)

    scales = tuple(KVScales(scale(k), scale(v)) for k, v in pool_bounds(model))
    return scales[0] if len(scales) == 1 else scales


__all__ = ["BOUND_MARGIN", "FP8_DTYPE", "FP8_MAX", "FP8_REL_ERROR", "KVScales", "check_pool_dtype", "dequantize",
           "is_fp8", "kv_scales", "layer_bounds", "pool_bounds", "quantize"]
