"""The layer runner (surojax/models/layer_runner.py) over a mixed layer pattern: two toy layer types with their own
stacked parameters, a pattern with a remainder, a stack shared by two types; checked against a Python loop over
the same layers (outputs, gradients of every parameter, KV-like per-layer state), and the recompute / unroll
variants against the plain scan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.layer_runner import LayerPattern, LayerScan, LayerType, Recompute

D = 8


class Mixer(nnx.Module):
    """A toy 'linear attention' layer: h + tanh(h W) * scale (its option: a static scale)."""

    def __init__(self, rngs):
        self.w = nnx.Param(0.3 * jax.random.normal(rngs.params(), (D, D)))

    def __call__(self, h, bias, *, kv=None, kv_meta=None, scale=1.0):
        return h + scale * jnp.tanh(h @ self.w[...] + bias), kv, None


class Gated(nnx.Module):
    """A toy 'full attention' layer with other parameters: h + sigmoid(h a) * (h b); reports stats [2]."""

    def __init__(self, rngs):
        self.a = nnx.Param(0.3 * jax.random.normal(rngs.params(), (D, D)))
        self.b = nnx.Param(0.3 * jax.random.normal(rngs.params(), (D, D)))

    def __call__(self, h, bias, *, kv=None, kv_meta=None):
        out = h + jax.nn.sigmoid(h @ self.a[...]) * (h @ self.b[...])
        return out, kv, jnp.stack([jnp.sum(out), jnp.max(out)])


def stacked(cls, n, seed):
    return nnx.vmap(lambda k: cls(nnx.Rngs(params=k)), in_axes=0, out_axes=0)(jax.random.split(jax.random.key(seed), n))


# [mixer(scale 1), mixer(scale 0.5), gated] x 2 + [mixer(scale 1), mixer(scale 0.5)]: 8 layers; the two mixer
# types share the stack "mixer" (6 rows: 2 per group + 2 remainder), "gated" holds 2
PATTERN = LayerPattern((LayerType("mixer", (("scale", 1.0),)), LayerType("mixer", (("scale", 0.5),)),
                        LayerType("gated")), num_layers=8)


def python_loop(pattern, stacks, h, consts):
    """The reference: layer i of type types[i % P], its parameters the next row of its stack, in a Python loop."""
    rows = {name: 0 for name in pattern.stacks}
    stats = []
    for i in range(pattern.num_layers):
        t = pattern.types[i % pattern.period]
        graphdef, state = nnx.split(stacks[t.stack])
        layer = nnx.merge(graphdef, jax.tree.map(lambda x, r=rows[t.stack]: x[r], state))
        rows[t.stack] += 1
        h, _, st = layer(h, *consts, **dict(t.options))
        if st is not None:
            stats.append(st)
    assert rows == {name: pattern.rows(name) for name in pattern.stacks}  # every row read once
    return h, jnp.stack(stats)


def _setup():
    stacks = {"mixer": stacked(Mixer, PATTERN.rows("mixer"), 0), "gated": stacked(Gated, PATTERN.rows("gated"), 1)}
    h = jax.random.normal(jax.random.key(2), (2, 3, D))
    bias = 0.1 * jax.random.normal(jax.random.key(3), (2, 3, D))
    return stacks, h, bias


def _loss_and_grads(run, stacks, h, bias):
    graphdefs = {k: nnx.split(m)[0] for k, m in stacks.items()}
    states = {k: nnx.split(m)[1] for k, m in stacks.items()}

    def loss(states, h):
        mods = {k: nnx.merge(graphdefs[k], s) for k, s in states.items()}
        out, stats = run(mods, h)
        return jnp.sum(out ** 2) + jnp.sum(stats), (out, stats)

    (_, (out, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(states, h)
    return out, stats, grads


def test_mixed_pattern_with_remainder_equals_a_python_loop():
    assert (PATTERN.groups, PATTERN.remainder, PATTERN.rows("mixer"), PATTERN.rows("gated")) == (2, 2, 6, 2)
    stacks, h, bias = _setup()
    ref = _loss_and_grads(lambda mods, h: python_loop(PATTERN, mods, h, (bias,)), stacks, h, bias)

    def scan(mods, h):
        out = LayerScan().run(PATTERN, mods, h, (bias,))
        return out.hidden, out.router_stats

    got = _loss_and_grads(scan, stacks, h, bias)
    assert got[1].shape == (2, 2)  # the gated layers' stats, in layer order
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # every parameter row gets a gradient (a row read twice or never would show here as zero or double)
    assert all(float(jnp.min(jnp.max(jnp.abs(g.reshape(g.shape[0], -1)), axis=1))) > 0
               for g in jax.tree.leaves(got[2][0]))
    # the check can fail: swapping the two mixer types' static options changes the result
    swapped = LayerPattern((PATTERN.types[1], PATTERN.types[0], PATTERN.types[2]), PATTERN.num_layers)
    other = LayerScan().run(swapped, stacks, h, (bias,)).hidden
    assert float(jnp.max(jnp.abs(other - got[0]))) > 1e-3


def test_recompute_and_unroll_equal_the_plain_scan():
    stacks, h, bias = _setup()

    def with_runner(r):
        def run(mods, h):
            out = r.run(PATTERN, mods, h, (bias,))
            return out.hidden, out.router_stats
        return run

    ref = _loss_and_grads(with_runner(LayerScan()), stacks, h, bias)
    for runner in (LayerScan(Recompute.FULL), LayerScan(Recompute.DOTS, unroll=True),
                   LayerScan(Recompute.OFFLOAD, unroll=2)):
        got = _loss_and_grads(with_runner(runner), stacks, h, bias)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):  # fp32 reassociation only
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-5, err_msg=str(runner))


def test_pattern_refuses_a_stack_of_the_wrong_depth():
    stacks, h, bias = _setup()
    stacks["gated"] = stacked(Gated, 3, 1)
    with pytest.raises(ValueError, match="'gated' .* of 2"):
        LayerScan().run(PATTERN, stacks, h, (bias,))
