"""pallas_kernels/adam8bit: the kernel (interpret mode off the GPU) equals its pure-jnp reference (reference.py),
and the reference is the XLA form of surojax/train/optim_8bit.py (`adam_leaf`, the chain the fused update replaces):
two layers of 4 blocks, the clip active, weight decay on. Params and absmaxes within a few ulps of their magnitude
(the same operations; where XLA contracts a multiply-add into an FMA depends on fusion boundaries); the 8-bit codes
equal but for the rare value an ulp moves across a code boundary (one code off). A wrong term (a missing bias
correction, decay, clip or a wrong layer's scalars) moves values by >= 1e-3 relative."""
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.adam8bit import BLOCK, Adam8bitHyper, Adam8bitTiles, adam8bit_reference, adam8bit_update
from surojax.train.optim_8bit import SIGNED_MAP, UNSIGNED_MAP, Blockwise8bit, _bucket_table, adam_leaf, quantize_blockwise

L, ROWS = 2, 2  # layers, 256-value blocks per layer
HYPER = Adam8bitHyper(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1, max_norm=0.5)


def _tables():
    s_first, s_bounds = _bucket_table(np.asarray(SIGNED_MAP, np.float32).tobytes())
    u_first, u_bounds = _bucket_table(np.asarray(UNSIGNED_MAP, np.float32).tobytes())
    return tuple(jnp.asarray(t) for t in (SIGNED_MAP, UNSIGNED_MAP, s_first, s_bounds, u_first, u_bounds))


def _operands():
    ks = jax.random.split(jax.random.key(0), 4)
    shape = (L * ROWS, BLOCK)
    g = jax.random.normal(ks[0], shape) * 3.0
    p = jax.random.normal(ks[1], shape) * 0.05
    m = quantize_blockwise(jax.random.normal(ks[2], shape) * 0.1, SIGNED_MAP)
    v = quantize_blockwise(jax.random.uniform(ks[3], shape) * 0.01, UNSIGNED_MAP)
    glob = jnp.array([2.0, 7.5], jnp.float32)  # denom; the global norm, above max_norm: the clip acts
    n = jnp.array([3.0, 5.0])  # each layer its own count and learning rate
    scalars = jnp.stack([1 - 0.9 ** n, 1 - 0.999 ** n, jnp.array([-1e-2, -3e-3]), jnp.zeros(L)], 1).astype(jnp.float32)
    return glob, scalars, g, p, m.codes, m.absmax, v.codes, v.absmax, _tables()


def _close(want, got):
    for a, b in zip(want, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == np.uint8:
            off = np.abs(a.astype(int) - b.astype(int))
            assert off.max() <= 1 and (off > 0).mean() < 1e-2, (off.max(), (off > 0).mean())
        else:
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max())


def test_kernel_equals_reference():
    ops = _operands()
    want = jax.jit(lambda *o: adam8bit_reference(*o, hyper=HYPER, decay=True, rows_per_layer=ROWS))(*ops)
    got = adam8bit_update(*ops, hyper=HYPER, decay=True, rows_per_layer=ROWS, tiles=Adam8bitTiles(rows=ROWS),
                          use_kernel=True)
    _close(want, got)
    assert not np.array_equal(np.asarray(got[0]), np.asarray(ops[3]))  # the parameter moved


def test_reference_is_optim_8bit_xla_form():
    """Per layer: g / denom, clipped; adam_leaf's direction and moments; + wd * p; p + step * d."""
    ops = _operands()
    got = jax.jit(lambda *o: adam8bit_reference(*o, hyper=HYPER, decay=True, rows_per_layer=ROWS))(*ops)
    _close(jax.jit(_xla_form)(*ops), got)


def _xla_form(glob, scalars, g, p, mc, ma, vc, va, tables):
    out = []
    for layer in range(L):
        rows = slice(layer * ROWS, (layer + 1) * ROWS)
        g_l = g[rows] / glob[0]
        g_l = g_l / glob[1] * HYPER.max_norm
        m_s, v_s = Blockwise8bit(mc[rows], ma[rows]), Blockwise8bit(vc[rows], va[rows])
        c1, c2, step = scalars[layer, 0], scalars[layer, 1], scalars[layer, 2]
        d, m, v = adam_leaf(g_l, m_s, v_s, c1=c1, c2=c2, b1=HYPER.b1, b2=HYPER.b2, eps=HYPER.eps)
        d = d + HYPER.weight_decay * p[rows]
        out.append((p[rows] + step * d, m.codes, m.absmax, v.codes, v.absmax))
    return [jnp.concatenate([o[i] for o in out]) for i in range(5)]
