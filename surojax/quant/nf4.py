"""NF4, bitsandbytes layout (QLoRA `bnb_4bit_quant_type="nf4"`, blocksize 64), as a pytree.

The torch weight [N, K] (out, in) is flattened row-major and cut into blocks of 64 consecutive values (so
blocks run along K when K % 64 == 0). Each value is the index of the nearest of the 16 NF4 levels (NF4_CODE,
bitsandbytes' table, QLoRA appendix) after dividing by the block's absmax; two indices per byte, the FIRST
value in the HIGH nibble (bitsandbytes `packed = q[0::2] << 4 | q[1::2]`).

  data    uint8   [..., N*K/2]        packed indices (bnb's Params4bit data, flattened)
  absmax  float32 [..., N*K/64]       per-block absmax                         (double_quant=False)
  -- or, double quantisation (bnb `compress_statistics=True`, `bnb_4bit_use_double_quant`):
  absmax_q      uint8   [..., nb]     8-bit codes of (absmax - offset), blocks of 256
  absmax_scale  float32 [..., ceil(nb/256)]   absmax of each 256-block of (absmax - offset)   (bnb state2.absmax)
  absmax_offset float32 [...]         offset = mean(absmax)                                 (bnb offset)
  absmax_code   float32 [256]         the 8-bit code book (bnb state2.code: the signed dynamic map)
  decode: absmax = absmax_code[absmax_q] * absmax_scale[i // 256] + absmax_offset;  x = NF4_CODE[q] * absmax.

Quantisation follows bitsandbytes' reference (backends/default/ops.py): scaled = clip(x * (1/absmax), -1, 1),
nearest code (argmin of the distance). Bytes per weight: 0.5 + 4/64 (= 0.5625), or 0.5 + ~1.016/64 with double
quantisation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul.layout import LayoutSpec, Table16
from surojax.quant.base import QuantFormat, as_kn, register_format, static, to_kn

BLOCK = 64
DQ_BLOCK = 256
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)


def dynamic_map(max_exponent_bits: int = 7) -> np.ndarray:
    """bitsandbytes `create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)`: 256 sorted fp32 values
    in [-1, 1]: for each decade 10^(i-6), i < 7, the midpoints of linspace(0.1, 1, 2^i + 1), both signs; 0; 1."""
    data = []
    for i in range(max_exponent_bits):
        b = np.linspace(0.1, 1.0, 2 ** i + 1, dtype=np.float32)
        means = (b[:-1] + b[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += (scale * means).tolist() + (-scale * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.sort(np.asarray(data, dtype=np.float32))


def _nearest(scaled: np.ndarray, code: np.ndarray) -> np.ndarray:
    return np.argmin(np.abs(scaled[..., None] - code), axis=-1).astype(np.uint8)


def _blockwise(x: np.ndarray, code: np.ndarray, block: int):
    """bnb blockwise quantisation of a flat array: (codes uint8 [n], absmax fp32 [n/block])."""
    n = x.size
    pad = (-n) % block
    xb = np.pad(x, (0, pad)).reshape(-1, block)
    amax = np.abs(xb).max(-1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.clip(xb * (np.float32(1) / amax)[:, None], -1, 1)
    scaled = np.where(amax[:, None] > 0, scaled, 0).astype(np.float32)
    return _nearest(scaled, code).reshape(-1)[:n], amax


@register_format("nf4")
class NF4(QuantFormat):
    data: jax.Array
    absmax: jax.Array | None = None
    absmax_q: jax.Array | None = None
    absmax_scale: jax.Array | None = None
    absmax_offset: jax.Array | None = None
    absmax_code: jax.Array | None = None
    shape: tuple[int, int] = static(default=(0, 0))
    double_quant: bool = static(default=False)

    packed_ndim = 1  # data is the flat [N*K/2]
    kernel_spec = LayoutSpec("nf4", nibble=True, group=BLOCK, has_offset=False, decode=Table16.of(NF4_CODE))

    @classmethod
    def bytes_per_value(cls) -> float:
        return 0.5 + 4 / BLOCK  # a 4-bit code, and an fp32 absmax per 64 values (double quantisation: a little less)

    @classmethod
    def quantize(cls, w, double_quant: bool = False) -> "NF4":
        w = as_kn(w)
        k, n = w.shape
        if (k * n) % BLOCK:
            raise ValueError(f"nf4: K*N = {k * n} must be a multiple of the block size {BLOCK}")
        q, absmax = _blockwise(np.ascontiguousarray(w.T).reshape(-1), NF4_CODE, BLOCK)
        data = (q[0::2] << 4) | q[1::2]
        if not double_quant:
            return cls(data=jnp.asarray(data), absmax=jnp.asarray(absmax), shape=(k, n))
        offset = absmax.mean(dtype=np.float32)
        code = dynamic_map()
        aq, ascale = _blockwise((absmax - offset).astype(np.float32), code, DQ_BLOCK)
        return cls(data=jnp.asarray(data), absmax_q=jnp.asarray(aq), absmax_scale=jnp.asarray(ascale),
                   absmax_offset=jnp.asarray(offset, jnp.float32), absmax_code=jnp.asarray(code), shape=(k, n),
                   double_quant=True)

    def block_absmax(self) -> jax.Array:
        """float32 [..., N*K/64]: the per-block absmax (decoded when double-quantised)."""
        if not self.double_quant:
            return jnp.asarray(self.absmax, jnp.float32)
        aq = jnp.asarray(self.absmax_q)
        nb = aq.shape[-1]
        pad = (-nb) % DQ_BLOCK
        idx = jnp.pad(aq, [(0, 0)] * (aq.ndim - 1) + [(0, pad)]).astype(jnp.int32)
        code = jnp.asarray(self.absmax_code)  # [256], or [..., 256] when stacked with the rest of the leaves
        vals = jnp.take_along_axis(jnp.broadcast_to(code, (*aq.shape[:-1], code.shape[-1])), idx, axis=-1)
        vals = vals.reshape(*aq.shape[:-1], -1, DQ_BLOCK) * jnp.asarray(self.absmax_scale)[..., None]
        offset = jnp.asarray(self.absmax_offset)[..., None]
        return vals.reshape(*aq.shape[:-1], -1)[..., :nb] + offset

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        k, n = self.shape
        data = jnp.asarray(self.data)
        lead = data.shape[:-1]
        idx = jnp.stack([data >> 4, data & 0x0F], axis=-1).reshape(*lead, -1, BLOCK)
        vals = jnp.asarray(NF4_CODE)[idx.astype(jnp.int32)] * self.block_absmax()[..., None]
        return to_kn(vals.reshape(*lead, n, k), dtype)

    def kernel_values(self):
        """codes 0..15 (the first value of a byte is its HIGH nibble), scale = the block absmax."""
        k, n = self.shape
        data = jnp.asarray(self.data)
        codes = jnp.stack([data >> 4, data & 0x0F], axis=-1).reshape(n, k)
        return codes, self.block_absmax().reshape(n, k // BLOCK), None
