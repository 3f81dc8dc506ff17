"""Random quantised weights: random codes in a format's own layout with sane scales (no NaN / inf), built with
jax.random (jit-able, one layer's arrays at a time in XLA). Speed does not depend on the weight values, so
benchmarks use these as bases: `bench/quant_base.randomize_base` (inside the init jit on the device) and
`offload/host_init.py` (one layer on the CPU backend, repeated over L). The one builder of random quantised
weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes

from surojax.quant import FORMATS

# every format random_weight builds: the fused-kernel formats and the GGUF legacy block types
RANDOM_FORMATS = ("q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nvfp4", "fp8", "q4_0", "q5_0")
# byte offsets of the fp16 scales in each GGUF block (gguf_legacy.py, gguf_kquants.py)
_F16_FIELDS = {"q4_0": [0], "q5_0": [0], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
# the fp16 (super-)block scale d, about 0.02 / (typical sub-scale x typical code): weights of a trained model's size
_D = {"q4_0": 5e-3, "q5_0": 2.5e-3, "q8_0": 3e-4, "q4_k": 1e-4, "q5_k": 5e-5, "q6_k": 1e-5}


def random_weight(name: str, k: int, n: int, key, lead: tuple[int, ...] = ()):
    """A random [K, N] weight in format `name` (leaves with the leading dims `lead`, e.g. (L,))."""
    if name not in RANDOM_FORMATS:
        raise ValueError(f"no random builder for format {name!r}; choose from {', '.join(RANDOM_FORMATS)}")
    cls = FORMATS[name]
    kc, ks = jax.random.split(key)

    def codes(shape):
        return jax.random.bits(kc, (*lead, *shape), jnp.uint8)

    if name in _F16_FIELDS:
        if k % cls.block_size:
            raise ValueError(f"{name}: K={k} must be a multiple of {cls.block_size}")
        nb = k // cls.block_size
        raw = codes((n, nb, cls.type_size))
        d = jax.random.uniform(ks, (*lead, n, nb), jnp.float32, 0.5 * _D[name], 1.5 * _D[name])
        d = d.astype(jnp.float16)
        bits = jax.lax.bitcast_convert_type(d, jnp.uint16)
        lo, hi = (bits & 0xFF).astype(jnp.uint8), (bits >> 8).astype(jnp.uint8)
        for off in _F16_FIELDS[name]:
            raw = raw.at[..., off].set(lo).at[..., off + 1].set(hi)
        return cls(data=raw.reshape(*lead, n, -1), shape=(k, n))
    if name == "nf4":
        absmax = jax.random.uniform(ks, (*lead, n * k // 64), jnp.float32, 0.01, 0.1)
        return cls(data=codes((n * k // 2,)), absmax=absmax, shape=(k, n))
    if name == "nvfp4":
        scale = jax.random.uniform(ks, (*lead, n, k // 16), jnp.float32, 1, 448).astype(ml_dtypes.float8_e4m3fn)
        g = jnp.full(lead, 2e-5, jnp.float32)
        return cls(data=codes((n, k // 2)), scale=scale, global_scale=g, shape=(k, n))
    data = (64 * jax.random.normal(kc, (*lead, n, k), jnp.float32)).astype(ml_dtypes.float8_e4m3fn)
    scale = jax.random.uniform(ks, (*lead, -(-n // 128), -(-k // 128)), jnp.float32, 1e-4, 1e-3)
    return cls(data=data, scale=scale, shape=(k, n))


__all__ = ["RANDOM_FORMATS", "random_weight"]
