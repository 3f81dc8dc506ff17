"""8-bit AdamW (`optimizer: adamw_8bit`): Adam moments stored blockwise-quantised, as bitsandbytes' 8-bit optimizers.

    state of a parameter with >= `min_8bit_size` elements (smaller ones keep fp32 moments, as bitsandbytes):
        m  uint8 codes [n_blocks, block] into the SIGNED dynamic map      + fp32 absmax [n_blocks]
        v  uint8 codes [n_blocks, block] into the UNSIGNED dynamic map    + fp32 absmax [n_blocks]
    one step:  m, v = dequantise(state)            (code[idx] * absmax of the block)
               m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2          (fp32)
               direction = m_hat / (sqrt(v_hat) + eps)                  (from the fp32 values of this step)
               state = quantise(m), quantise(v)   (per block of `block_size` values: absmax, then the index of the
                                                   nearest code to x / absmax)
Memory: 1 byte per moment value plus 4 bytes per block (2.03 bytes per parameter for both moments, block 256)
instead of 8.

The dynamic map (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", and bitsandbytes'
`create_dynamic_map`): 7 decades 10^-6 .. 10^0; within decade i the interval [0.1, 1] is cut into
2^i (signed) or 2^(i+1) (unsigned) equal parts and the part midpoints, times 10^(i-6), are the codes; the
signed map mirrors them to negative values; 0 and 1 are added: 256 sorted values in [-1, 1] (signed) or
[0, 1] (unsigned). Small magnitudes keep relative precision, which is what the second moment needs.

`adamw_8bit(...)` = scale_by_adam_8bit -> add_decayed_weights(mask) -> scale_by_learning_rate, the composition of
optax.adamw with the moments swapped.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

BLOCK_SIZE = 256  # bitsandbytes' block for the 8-bit optimizers
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep 32-bit state
# blocks one pass of the update reads at a time: a larger tensor's moments are dequantised, updated and quantised
# chunk by chunk (lax.map), so its fp32 moments and quantisation indices exist for 2^18 blocks (67M values) at
# a time instead of for the whole tensor (a [V, D] embedding: ~30 bytes per value of temporaries otherwise, issue 19)
CHUNK_BLOCKS = 1 << 18


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted values of the 8-bit dynamic quantisation map (7 exponent decades), float32."""
    values: list[float] = [0.0, 1.0]
    for i in range(7):  # decade 10^(i-6) .. 10^(i-5)
        parts = 2 ** i if signed else 2 ** (i + 1)
        bounds = np.linspace(0.1, 1.0, parts + 1)
        mids = (bounds[:-1] + bounds[1:]) / 2.0 * 10.0 ** (i - 6)
        values += mids.tolist() + ((-mids).tolist() if signed else [])
    assert len(values) == 256, len(values)
    return np.sort(np.asarray(values, np.float32))


SIGNED_MAP = dynamic_map(signed=True)
UNSIGNED_MAP = dynamic_map(signed=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Blockwise8bit:
    """A tensor quantised per block: codes uint8 [n_blocks, block] (padded), absmax fp32 [n_blocks]."""

    codes: jax.Array
    absmax: jax.Array


def _blocks(x: jax.Array, block: int) -> jax.Array:
    flat = x.reshape(-1).astype(jnp.float32)
    pad = (-flat.size) % block
    return jnp.pad(flat, (0, pad)).reshape(-1, block)  # [n_blocks, block]


def quantize_blockwise(x: jax.Array, code: np.ndarray, block: int = BLOCK_SIZE) -> Blockwise8bit:
    """x (any shape) -> per-block absmax and the index of the code nearest to x / absmax (ties: the lower)."""
    return _quantize_blocks(_blocks(x, block), code)


def code_boundaries(code: np.ndarray) -> np.ndarray:
    """The 255 decision boundaries between neighbouring codes, (code[i] + code[i + 1]) / 2 in float32 [255]."""
    code = np.asarray(code, np.float32)
    return (code[1:] + code[:-1]) / np.float32(2.0)


PREFIX_SHIFT = 16  # nearest_code_index's buckets: floats sharing their top 16 bits (sign, exponent, 7 mantissa bits)


def _order_key(bits):
    """int32 bit patterns of floats -> int32 keys in the floats' order (non-NaN; -0 just below +0)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@functools.lru_cache(maxsize=8)
def _bucket_table(code_bytes: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(first, bounds): first[p] (uint8 [2^16]) = the number of boundaries below bucket p (the floats whose order
    key has the top 16 bits p - 2^15); bounds = the 255 boundaries + inf (fp32 [256]). Every bucket holds at most
    one boundary (a bucket spans at most 2^-7 of its values' magnitude; neighbouring boundaries are >= 0.9 / 128
    of their decade's top apart), checked here. Keyed by the map's float32 bytes (cached)."""
    mid = code_boundaries(np.frombuffer(code_bytes, np.float32))
    keys = _order_key(mid.view(np.int32).astype(np.int64))
    n = 1 << (32 - PREFIX_SHIFT)
    starts = (np.arange(n, dtype=np.int64) - n // 2) << PREFIX_SHIFT  # bucket p: keys [starts[p], + 2^16)
    first = np.searchsorted(keys, starts, side="left")
    per_bucket = np.searchsorted(keys, starts + (1 << PREFIX_SHIFT), side="left") - first
    assert per_bucket.max() <= 1 and first.max() <= 255, (per_bucket.max(), first.max())
    return first.astype(np.uint8), np.append(mid, np.float32(np.inf)).astype(np.float32)


def nearest_code_index(normed: jax.Array, code: np.ndarray) -> jax.Array:
    """The index (uint8, normed's shape) of the code nearest to each value of `normed` (ties: the lower code).

    Exactly `jnp.searchsorted(code_boundaries(code), normed, side="left")`: the number of boundaries b with
    NOT (x <= b) (those below x; NaN: all 255). One elementwise pass with two lookups: the top 16 bits of x's
    order key pick a bucket, `first` of the bucket counts the boundaries below it, and the one boundary the
    bucket may hold decides the last +1 (x > bounds[first]; bounds[255] = inf). searchsorted's default ("scan")
    is a while loop of 8 passes over the array, each reading and writing two int32 index arrays."""
    first, bounds = _bucket_table(np.asarray(code, np.float32).tobytes())
    bits = jax.lax.bitcast_convert_type(normed.astype(jnp.float32), jnp.int32)
    bucket = ((_order_key(bits) >> PREFIX_SHIFT) + (1 << (31 - PREFIX_SHIFT))).astype(jnp.uint32)  # [0, 2^16)
    below = jnp.asarray(first)[bucket].astype(jnp.uint32)  # unsigned indices: no negative-index fix-up
    idx = jnp.where(normed <= jnp.asarray(bounds)[below], below, below + jnp.uint32(1))
    return jnp.where(jnp.isnan(normed), jnp.uint32(255), idx).astype(jnp.uint8)


def _quantize_blocks(b: jax.Array, code: np.ndarray) -> Blockwise8bit:
    """Blocks [n_blocks, block] fp32 -> their Blockwise8bit."""
    absmax = jnp.max(jnp.abs(b), axis=1)  # [n_blocks]
    normed = b / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    return Blockwise8bit(nearest_code_index(normed, code), absmax)


def _dequantize_blocks(q: Blockwise8bit, code: np.ndarray) -> jax.Array:
    """Blockwise8bit -> its values [n_blocks, block] fp32 (uint8 codes index the 256-entry map as they are)."""
    return jnp.asarray(code)[q.codes] * q.absmax[:, None]


def dequantize_blockwise(q: Blockwise8bit, code: np.ndarray, shape: tuple[int, ...]) -> jax.Array:
    vals = _dequantize_blocks(q, code)  # [n_blocks, block]
    n = int(np.prod(shape)) if shape else 1
    return vals.reshape(-1)[:n].reshape(shape)


class ScaleByAdam8bitState(NamedTuple):
    count: jax.Array
    mu: object  # per leaf: Blockwise8bit (signed map) or fp32 array
    nu: object  # per leaf: Blockwise8bit (unsigned map) or fp32 array


def adam_leaf(g, m_s, v_s, *, c1, c2, b1: float, b2: float, eps: float, block_size: int = BLOCK_SIZE):
    """One parameter's Adam step with its moments (Blockwise8bit, or fp32 arrays): (direction in g's dtype, new m,
    new v). c1 / c2: this step's bias corrections 1 - b^count (fp32 scalars). The XLA form; the fused GPU pass
    (surojax/train/optim_8bit_fused.py) does the same operations in one kernel."""

    def moments(g32, m, v):
        m = b1 * m + (1.0 - b1) * g32
        v = b2 * v + (1.0 - b2) * g32 * g32
        return (m / c1) / (jnp.sqrt(v / c2) + eps), m, v

    def blocks_update(args):  # blocks [n, block]: the quantised moments' update, per block
        g_b, m_s, v_s = args
        m, v = _dequantize_blocks(m_s, SIGNED_MAP), _dequantize_blocks(v_s, UNSIGNED_MAP)
        d, m, v = moments(g_b, m, v)
        return d, _quantize_blocks(m, SIGNED_MAP), _quantize_blocks(v, UNSIGNED_MAP)

    if not isinstance(m_s, Blockwise8bit):  # fp32 moments
        d, m, v = moments(g.astype(jnp.float32), m_s, v_s)
        return d.astype(g.dtype), m, v
    g_b = _blocks(g, block_size)  # [n_blocks, block]
    n_blocks = g_b.shape[0]
    if n_blocks <= CHUNK_BLOCKS:  # the whole tensor at once
        d, m, v = blocks_update((g_b, m_s, v_s))
    else:
        # chunks of CHUNK_BLOCKS blocks, one at a time: per block, the same values as the whole tensor at
        # once (the padding of the last block, and the zero blocks padding the last chunk, are zeros in g
        # and in the moments: 0 is a code of both maps, so they stay 0 and leave every absmax as it is)
        pad = (-n_blocks) % CHUNK_BLOCKS
        chunked = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(  # noqa: E731
            -1, CHUNK_BLOCKS, *x.shape[1:])  # [n_chunks, CHUNK_BLOCKS, ...]
        d, m, v = jax.lax.map(blocks_update, jax.tree.map(chunked, (g_b, m_s, v_s)))
        d, m, v = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:n_blocks], (d, m, v))
    return d.reshape(-1)[:g.size].reshape(g.shape).astype(g.dtype), m, v


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, block_size: int = BLOCK_SIZE,
                       min_8bit_size: int = MIN_8BIT_SIZE) -> optax.GradientTransformation:
    """optax.scale_by_adam with the moments of every parameter of >= min_8bit_size elements kept in 8 bits."""

    def quantised(p) -> bool:
        return p.size >= min_8bit_size

    def init(params):
        def zeros(p, code):
            if quantised(p):
                return quantize_blockwise(jnp.zeros(p.shape, jnp.float32), code, block_size)
            return jnp.zeros(p.shape, jnp.float32)

        mu = jax.tree.map(lambda p: zeros(p, SIGNED_MAP), params)
        nu = jax.tree.map(lambda p: zeros(p, UNSIGNED_MAP), params)
        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), mu, nu)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1 = 1.0 - b1 ** count.astype(jnp.float32)
        c2 = 1.0 - b2 ** count.astype(jnp.float32)
        is_q = lambda x: isinstance(x, Blockwise8bit)  # noqa: E731
        leaf = functools.partial(adam_leaf, c1=c1, c2=c2, b1=b1, b2=b2, eps=eps, block_size=block_size)
        out = jax.tree.map(leaf, updates, state.mu, state.nu, is_leaf=is_q)
        treedef = jax.tree.structure(updates)
        flat = treedef.flatten_up_to(out)
        direction = treedef.unflatten([o[0] for o in flat])
        mu = treedef.unflatten([o[1] for o in flat])
        nu = treedef.unflatten([o[2] for o in flat])
        return direction, ScaleByAdam8bitState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
               mask=None, *, block_size: int = BLOCK_SIZE,
               min_8bit_size: int = MIN_8BIT_SIZE) -> optax.GradientTransformation:
    """AdamW with 8-bit blockwise moments (decoupled weight decay on `mask`, as optax.adamw)."""
    return optax.chain(
        scale_by_adam_8bit(b1, b2, eps, block_size=block_size, min_8bit_size=min_8bit_size),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
