"""The step computes the plain computation: accumulation equals the large batch, packing equals unpacked."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from surojax.data.batch import example_to_row
from surojax.losses.lm import lm_loss
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layer_runner import LayerScan, with_runner
from surojax.train.step import make_train_step

from tests.train.conftest import TINY_QWEN3

CFG = ModelConfig.from_hf(dict(TINY_QWEN3, vocab_size=64))


def _rows(n, seq_len, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(4, seq_len))
        out.append(example_to_row(rng.integers(1, 64, size=k).tolist(), (rng.random(k) > 0.3).tolist(), seq_len))
    return out


def _stack(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


SGD = optax.sgd(1.0)  # the update is minus the gradient itself: compares the gradients directly
_STEP = {}


def _grads_and_update(batch_accum):
    """One step of SGD(1.0) from the seed-0 model. One jitted step for the module: each batch shape (accumulation
    count x micro-batch) compiles once, whichever test uses it first."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    graphdef, trainable, frozen = nnx.split(model, nnx.Param, ...)
    if "step" not in _STEP:
        _STEP["step"] = make_train_step(graphdef, lm_loss, SGD, donate=False)
    new, _, metrics = _STEP["step"](trainable, frozen, SGD.init(trainable), batch_accum, jax.random.key(0))
    return trainable, new, metrics


def test_accumulation_4x2_equals_batch_8():
    batch = _stack(_rows(8, 16))
    results = [_grads_and_update({k: v.reshape(a, 8 // a, 16) for k, v in batch.items()}) for a in (1, 4)]
    (p0, big, m_big), (_, acc, m_acc) = results
    assert float(m_big["tokens"]) == float(m_acc["tokens"]) > 0
    np.testing.assert_allclose(float(m_big["loss"]), float(m_acc["loss"]), rtol=1e-6)
    # fp32 sums taken in another order agree to rounding, not bit for bit; the update is read back as
    # new - old where |old| ~ 1 (norm scales), so atol covers two fp32 ulps at 1.0 (2.4e-7)
    for a, b, p in zip(jax.tree.leaves(big), jax.tree.leaves(acc), jax.tree.leaves(p0)):
        np.testing.assert_allclose(np.asarray(a - p), np.asarray(b - p), rtol=1e-5, atol=2.5e-7)
    assert any(float(jnp.abs(a - p).max()) > 1e-4 for a, p in zip(jax.tree.leaves(big), jax.tree.leaves(p0)))


def test_accumulation_is_a_token_mean_not_a_mean_of_micro_batch_means():
    """Micro-batches with very different supervised-token counts: the loss is sum / total count. (4 micro-batches
    of 2 rows: the shapes of the test above, so its compiled step is reused.)"""
    rows = _rows(8, 16, seed=3)
    for r in rows[:2]:
        r["loss_mask"][:] = 0
    rows[0]["loss_mask"][0] = 1  # one supervised token in micro-batch 0
    batch = _stack(rows)
    _, _, m = _grads_and_update({k: v.reshape(4, 2, 16) for k, v in batch.items()})
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    # the whole batch's summed loss in one jitted call (not eager op-by-op), divided by its token count here
    total = nnx.jit(lambda m, b: lm_loss(m, b)[0])(model, {k: jnp.asarray(v) for k, v in batch.items()})
    count = batch["loss_mask"].sum()
    np.testing.assert_allclose(float(m["loss"]), float(total) / count, rtol=1e-6)


def test_packed_row_loss_and_grads_equal_unpacked_rows():
    rng = np.random.default_rng(7)
    seqs = [rng.integers(1, 64, size=k).tolist() for k in (5, 9, 7)]
    masks = [(rng.random(len(s)) > 0.2).tolist() for s in seqs]
    unpacked = _stack([example_to_row(s, m, 24) for s, m in zip(seqs, masks)])
    # pack the three into one row of 24 by hand (segment ids 1..3, per-segment positions), then two all-padding
    # rows: the same [3, 24] shape as the unpacked batch, so one compiled program computes both
    packed = {k: np.zeros((3, 24), v.dtype) for k, v in unpacked.items()}
    at = 0
    for i, (s, m) in enumerate(zip(seqs, masks)):
        r = example_to_row(s, m, len(s))
        for k in packed:
            packed[k][0, at:at + len(s)] = r[k] * (i + 1 if k == "segment_ids" else 1)
        at += len(s)
    model = Decoder(CFG, rngs=nnx.Rngs(0))

    def loss(m, b):
        s, aux = lm_loss(m, b)
        return s, aux["tokens"]

    # one jitted loss-and-gradient program for both batches (eager op-by-op dispatch compiled every op alone)
    loss_and_grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (s_u, n_u), g_u = loss_and_grad(model, {k: jnp.asarray(v) for k, v in unpacked.items()})
    (s_p, n_p), g_p = loss_and_grad(model, {k: jnp.asarray(v) for k, v in packed.items()})
    assert float(n_u) == float(n_p)
    np.testing.assert_allclose(float(s_p), float(s_u), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_u), jax.tree.leaves(g_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_u)) > 1e-3


def test_unrolled_layer_loop_equals_the_rolled_scan():
    """`unroll_layers` changes how the layer loop is compiled, not what it computes: loss and every gradient
    of the inlined loop (True) and of 2 layers per iteration equal the rolled scan's (fp32 rounding only)."""
    batch = {k: v[None] for k, v in _stack(_rows(4, 16, seed=5)).items()}
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    graphdef, trainable, frozen = nnx.split(model, nnx.Param, ...)

    def loss_and_grads(unroll):
        def loss(tr):
            model = with_runner(nnx.merge(graphdef, tr, frozen), LayerScan(unroll=unroll))
            total, aux = lm_loss(model, {k: v[0] for k, v in batch.items()})
            return total / aux["tokens"]
        return jax.jit(jax.value_and_grad(loss))(trainable)

    ref_loss, ref_grads = loss_and_grads(1)
    assert CFG.num_layers >= 2
    for unroll in (True, 2):
        l, g = loss_and_grads(unroll)
        np.testing.assert_allclose(float(l), float(ref_loss), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(ref_grads)) > 1e-3
