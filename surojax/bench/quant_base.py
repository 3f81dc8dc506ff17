"""Random quantised bases for throughput benchmarks: the one builder of random quantised weights
(`surojax bench train --quant FMT` and `--base-format FMT`, benchmarks/quant_matmul_h200.py).

Speed does not depend on the weight values, so a benchmark base is random codes in the format's own layout with
sane scales (no NaN / inf), built with jax.random: jit-able, one layer's arrays at a time in XLA.
`randomize_base(model, fmt, key)` replaces every targeted Linear kernel of a built Decoder by such a stacked
[L, ...] pytree (the shape `quantize_model` produces). Called inside the jit that builds the model
(`init_sharded`), the bf16 kernels it replaces are dead code and never materialise: a 70B base needs only its
quantised bytes on the device. Under `nnx.eval_shape` it gives the abstract quantised model that
`offload/host_init.py` fills on the host (one layer from `random_weight` on the CPU backend, repeated over L).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes

from surojax.quant import FORMATS

# `--quant`: the formats with a fused dequantise + matmul kernel (a QuantFormat.kernel_spec), built on the device
KERNEL_FORMATS = ("q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nvfp4", "fp8")
# `--base-format`: GGUF legacy block types (one fp16 scale per 32 values), built on the host (offload/host_init.py)
GGUF_LEGACY_FORMATS = ("q4_0", "q5_0", "q8_0")
RANDOM_FORMATS = KERNEL_FORMATS + ("q4_0", "q5_0")  # every format random_weight builds
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


def randomize_base(model, fmt: str, key, targets: str = "all-linear") -> None:
    """Replace the targeted stacked kernels [L, K, N] of `model.layers` by random `fmt` weights (in place)."""
    from surojax.peft.lora import base_linear, resolve_targets
    from surojax.quant.transform import QuantParam

    for i, name in enumerate(resolve_targets(targets)):
        lin = base_linear(model, name)
        var = lin.kernel
        lead_k_n = tuple(var.get_value().shape)
        *lead, k, n = lead_k_n
        q = random_weight(fmt, k, n, jax.random.fold_in(key, i), tuple(lead))
        lin.kernel = QuantParam(q, **var.get_metadata())


__all__ = ["GGUF_LEGACY_FORMATS", "KERNEL_FORMATS", "RANDOM_FORMATS", "random_weight", "randomize_base"]
