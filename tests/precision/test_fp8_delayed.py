"""fp8_scaling: delayed and blockwise. The history rule against a hand computation, the block quantiser against
NumPy, every FP8 GEMM (forward, dgrad, wgrad) within its rounding bound (surojax/precision/fp8_bounds.py), the
training step carrying the histories, exact resume, and the config rules."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from surojax.bench.train_bench import BenchConfig, build, place_batch, synthetic_batch
from surojax.config import ConfigError, config_from_dict
from surojax.precision.fp8_blockwise import (BLOCK, COL_TILE, ROW_TILE, dequantize_blockwise, fp8_dot_blockwise,
                                             quantize_blockwise)
from surojax.precision.fp8_bounds import element_error, gemm_error_bound
from surojax.precision.fp8_delayed import Fp8AmaxHistory, Fp8Scale, fp8_dot_delayed
from surojax.precision.fp8_matmul import fp8_dot
from surojax.precision.fp8_scaling import Fp8Settings, roll_amax_history
from surojax.train.checkpoints import Checkpointer
from surojax.train.run_spec import precision_spec

BASE = {"model": "m", "datasets": [{"path": "d.jsonl"}]}


# ---- the history rule ---------------------------------------------------------------------------------------

def test_history_update_rule_by_hand():
    h, s = jnp.zeros((3,)), jnp.zeros(())
    by_algo = {}
    for algo in ("max", "most_recent"):
        hist, scale, scales = h, s, []
        for amax in (4.0, 8.0, 2.0, 1.0, 0.0):
            hist, scale = roll_amax_history(hist, scale, amax, 448.0, algo)
            scales.append(float(scale))
        by_algo[algo] = (np.asarray(hist), scales)
    # newest first, H = 3: after 4, 8, 2, 1, 0 the history is [0, 1, 2]
    np.testing.assert_array_equal(by_algo["max"][0], [0.0, 1.0, 2.0])
    # max: 448 / max(window) rounded down to a power of two: 448/4, 448/8, 448/8, 448/8 (4 dropped, 8 still in),
    # 448/2 (8 dropped)
    assert by_algo["max"][1] == [64.0, 32.0, 32.0, 32.0, 128.0]
    # most_recent: 448 / newest; the newest 0 keeps the previous scale
    assert by_algo["most_recent"][1] == [64.0, 32.0, 128.0, 256.0, 256.0]
    # per-role format max broadcast over [L, 3] (x, W: E4M3; dy: E5M2); a nan keeps the scale
    hist, scale = roll_amax_history(jnp.zeros((2, 3, 4)), jnp.full((2, 3), 7.0),
                                    jnp.array([[1.0, 2.0, 4.0], [jnp.nan, 1.0, 1.0]]),
                                    jnp.array([448.0, 448.0, 57344.0]))
    np.testing.assert_array_equal(np.asarray(scale), [[256.0, 128.0, 8192.0], [7.0, 256.0, 32768.0]])


# ---- block-wise quantiser -----------------------------------------------------------------------------------

def _numpy_blockwise(t, block, fmt_max, np_dtype):
    """Independent reference: pad, block amax, d = 2^ceil(log2(amax / max)), q = fp8(clip(t / d))."""
    r, c = t.shape
    br, bc = block
    pad = np.zeros((-(-r // br) * br, -(-c // bc) * bc), np.float32)
    pad[:r, :c] = t
    blocks = np.abs(pad.reshape(pad.shape[0] // br, br, pad.shape[1] // bc, bc)).max(axis=(1, 3))
    with np.errstate(divide="ignore"):
        d = np.where(blocks > 0, 2.0 ** np.ceil(np.log2(blocks / np.float32(fmt_max))), 1.0).astype(np.float32)
    full = np.repeat(np.repeat(d, br, 0), bc, 1)[:r, :c]
    return np.clip(t / full, -fmt_max, fmt_max).astype(np_dtype), d


@pytest.mark.parametrize("block,dtype,np_dtype,fmax", [
    (ROW_TILE, jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
    (BLOCK, jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
    (COL_TILE, jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)])
def test_blockwise_quantiser_matches_numpy(block, dtype, np_dtype, fmax):
    rng = np.random.default_rng(1)
    t = (rng.standard_normal((130, 260)) * np.exp(rng.uniform(-6, 6, (130, 1)))).astype(np.float32)
    t[:, 5] = 0.0
    t[3, :] = 0.0  # an all-zero 1x128 tile keeps d = 1
    q, d = quantize_blockwise(jnp.asarray(t), block, dtype)
    q_ref, d_ref = _numpy_blockwise(t, block, fmax, np_dtype)
    np.testing.assert_array_equal(np.asarray(d), d_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    deq = dequantize_blockwise(q, d, block, jnp.float32)  # exact: FP8 value x power of two
    full = np.repeat(np.repeat(d_ref, block[0], 0), block[1], 1)[:130, :260]
    np.testing.assert_array_equal(np.asarray(deq), q_ref.astype(np.float32) * full)


# ---- every GEMM within its bound ----------------------------------------------------------------------------

def _group_amax(t, block):
    """Per element, the amax of its scaling group (None: the whole tensor)."""
    t = np.abs(t)
    if block is None:
        return np.full_like(t, t.max())
    r, c = t.shape
    out = np.empty_like(t)
    for i in range(0, r, block[0]):
        for j in range(0, c, block[1]):
            out[i:i + block[0], j:j + block[1]] = t[i:i + block[0], j:j + block[1]].max()
    return out


def _pow2_scale(fmax, amax):
    """The largest power of two s with amax * s <= fmax (float64; independent of the exponent-bit arithmetic)."""
    amax = np.asarray(amax, np.float64)
    s = 2.0 ** np.floor(np.log2(fmax / amax))
    s = np.where(amax * s > fmax, s / 2, s)
    return np.where(amax * 2 * s <= fmax, 2 * s, s)


def _delayed_after_warmup(x, w):
    """Step 1 (scale 0: its own amax) observes the amaxes; step 2 runs on the scales they give."""
    probe = jnp.zeros((3,))
    seen = jax.grad(lambda p: jnp.sum(fp8_dot_delayed(x, w, jnp.zeros((3,)), p) * G))(probe)
    scale = jnp.asarray(_pow2_scale(np.array([448.0, 448.0, 57344.0]), np.asarray(seen)), jnp.float32)
    return lambda a, b: fp8_dot_delayed(a, b, scale, probe)


RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((64, 256)) * 3, jnp.bfloat16)
W = jnp.asarray(RNG.standard_normal((256, 192)) * 0.05, jnp.float32)
G = jnp.asarray(RNG.standard_normal((64, 192)) * 1e-4, jnp.bfloat16)


@pytest.mark.parametrize("scaling", ["current", "delayed", "blockwise"])
def test_each_gemm_within_its_rounding_bound(scaling):
    fn = {"current": fp8_dot, "blockwise": fp8_dot_blockwise}.get(scaling) or _delayed_after_warmup(X, W)
    # one compiled program (as in training) instead of op-by-op dispatch of the quantisers (4x slower on CPU)
    y, dx, dw = jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(fn, x, w)))(X, W, G)
    x, w, g = (np.asarray(t, np.float32) for t in (X, W, G))
    blk = scaling == "blockwise"
    err = lambda t, fmt, block: element_error(t, fmt, _group_amax(t, block if blk else None))  # noqa: E731
    cases = {  # GEMM: (got, a, b, err a, err b)
        "forward": (y, x, w, err(x, "e4m3", ROW_TILE), err(w, "e4m3", BLOCK)),
        "dgrad": (dx, g, w.T, err(g, "e5m2", ROW_TILE), err(w, "e4m3", BLOCK).T),
        "wgrad": (dw, x.T, g, err(x, "e4m3", COL_TILE).T, err(g, "e5m2", COL_TILE)),
    }
    for name, (got, a, b, ea, eb) in cases.items():
        exact = a.astype(np.float64) @ b.astype(np.float64)
        off = np.abs(np.asarray(got, np.float64) - exact)
        bound = gemm_error_bound(a, b, ea, eb)
        assert np.all(off <= bound), f"{scaling} {name}: {np.max(off / bound):.3f} x its bound"
        # and the FP8 rounding happened (a dropped quantiser would leave only bf16's error, ~30x smaller)
        assert np.max(off) > 2.0 ** -9 * np.max(np.abs(exact)), f"{scaling} {name}: no FP8 rounding seen"


# ---- the training step carries the histories ----------------------------------------------------------------

@pytest.fixture(scope="module")
def delayed_run():
    bc = BenchConfig(shape="debug", mode="full", batch=1, seq=32, accum=2, recipe="fp8_hybrid",
                     fp8_scaling="delayed", learning_rate=1e-2, segments=1, min_segment=16)
    run = build(bc)
    host, _ = synthetic_batch(np.random.default_rng(0), 2, 1, 32, run.model_config.vocab_size, 1, 16)
    return run, place_batch(run, host)


def _delayed_vars(run, trainable):
    lin = nnx.merge(run.graphdef, trainable, run.frozen).layers.mlp.down_proj
    return np.asarray(lin.fp8_scale.get_value()), np.asarray(lin.fp8_history.get_value())


def _steps(run, batch, trainable, opt_state, n):
    trainable, opt_state = jax.tree.map(jnp.copy, (trainable, opt_state))  # the step donates its inputs
    losses = []
    for _ in range(n):
        trainable, opt_state, m = run.train_step(trainable, run.frozen, opt_state, batch, jax.random.key(0))
        losses.append(float(m["loss"]))
    return trainable, opt_state, losses


def test_step_rolls_the_histories(delayed_run):
    run, batch = delayed_run
    # the optimizer never sees the delayed-scaling state
    assert not any(x.shape[-1:] == (1024,) for x in jax.tree.leaves(run.opt_state))
    s0, h0 = _delayed_vars(run, run.trainable)
    assert not s0.any() and not h0.any()  # scale 0: no amax seen yet (the first step scales by its own amax)
    states, tr, opt = [], run.trainable, run.opt_state
    for _ in range(3):
        tr, opt, _ = _steps(run, batch, tr, opt, 1)
        states.append(_delayed_vars(run, tr))
    (s1, h1), (s2, h2), (s3, h3) = states
    assert (h1[..., 0] > 0).all() and not h1[..., 1:].any()  # one amax per layer and tensor recorded
    np.testing.assert_array_equal(h2[..., 1], h1[..., 0])  # rolled, newest first
    np.testing.assert_array_equal(h3[..., 1:3], h2[..., 0:2])
    # the scale for step t+1 = format max / max over the history of steps <= t (algo max), as a power of two
    fmax = np.array([448.0, 448.0, 57344.0])
    np.testing.assert_array_equal(s3, _pow2_scale(fmax, h3.max(-1)))
    assert not np.array_equal(h3[..., 0], h2[..., 0])  # the weights moved: new amaxes


def test_step_runs_two_programs_without_conditionals_equal_to_the_conditional_form(delayed_run, monkeypatch):
    """The delayed step is compiled twice (the first step: own amaxes; later: the histories' scales) and picked on the
    host, because XLA GPU runs each lax.cond by reading its predicate back and waiting for the stream. Neither
    program holds a conditional, and three steps give the bits of the one-program form with a lax.cond per tensor."""
    run, batch = delayed_run
    step = run.train_step
    args = (run.trainable, run.frozen, run.opt_state, batch, jax.random.key(0))
    conds = lambda text: text.count("stablehlo.case") + text.count("stablehlo.if")  # noqa: E731
    assert conds(jax.jit(step.step).lower(*args).as_text()) > 0  # the reference form does hold them
    assert step.program(run.trainable) is step.first
    assert conds(step.first.lower(*args).as_text()) == 0 and conds(step.later.lower(*args).as_text()) == 0
    reference = jax.jit(step.step)
    tr_a, opt_a = jax.tree.map(jnp.copy, (run.trainable, run.opt_state))
    tr_b, opt_b = jax.tree.map(jnp.copy, (run.trainable, run.opt_state))
    for i in range(3):
        tr_a, opt_a, m_a = step(tr_a, run.frozen, opt_a, batch, jax.random.key(0))
        tr_b, opt_b, m_b = reference(tr_b, run.frozen, opt_b, batch, jax.random.key(0))
        assert float(m_a["loss"]) == float(m_b["loss"]), i
    # the steady state reads nothing back: its input is what the history program returned
    monkeypatch.setattr(type(step._fp8), "fresh", classmethod(lambda cls, tr: pytest.fail("read back")))
    assert step.program(tr_a) is step.later
    for a, b in zip(jax.tree.leaves(tr_a), jax.tree.leaves(tr_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_is_exact_with_the_histories(delayed_run, tmp_path):
    run, batch = delayed_run
    tr, opt, _ = _steps(run, batch, run.trainable, run.opt_state, 2)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(2, {"trainable": tr, "opt_state": opt}, {"step": 2})
    _, _, straight = _steps(run, batch, tr, opt, 2)
    # restore into a like whose histories and scales are zero: they must come from the checkpoint
    blank = jax.tree.map(jnp.zeros_like, nnx.filter_state(tr, nnx.Any(Fp8AmaxHistory, Fp8Scale)))
    like = {"trainable": nnx.merge_state(tr, blank), "opt_state": opt}
    state, meta = ckpt.restore(2, like)
    ckpt.close()
    np.testing.assert_array_equal(_delayed_vars(run, state["trainable"])[1], _delayed_vars(run, tr)[1])
    _, _, resumed = _steps(run, batch, state["trainable"], state["opt_state"], 2)
    assert resumed == straight


# ---- config ------------------------------------------------------------------------------------------------

def test_config_keys():
    cfg = config_from_dict({**BASE, "recipe": "fp8_hybrid", "fp8_scaling": "delayed", "fp8_amax_history": 16,
                            "fp8_amax_compute_algo": "most_recent"})
    assert (cfg.fp8_scaling, cfg.fp8_amax_history, cfg.fp8_amax_compute_algo) == ("delayed", 16, "most_recent")
    for extra in ({"recipe": "fp8_hybrid", "fp8_scaling": "current", "fp8_amax_compute_algo": "most_recent"},
                  {"recipe": "fp8_hybrid", "fp8_scaling": "blockwise", "fp8_amax_history": 8},
                  {"recipe": "fp8_hybrid", "offload_optimizer": True, "fp8_amax_history": 8}):
        with pytest.raises(ConfigError) as e:
            config_from_dict({**BASE, **extra})
        key = next(k for k in extra if k.startswith("fp8_amax"))
        assert key in {p.key for p in e.value.problems} and "delayed" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, "fp8_scaling": "delayed"})
    assert "fp8_scaling" in {p.key for p in e.value.problems}
    # unset: delayed, except where delayed does not run (offload_optimizer's in-place update), read by the run spec
    unset = config_from_dict({**BASE, "recipe": "fp8_hybrid", "fp8_amax_history": 8})
    offload = config_from_dict({**BASE, "recipe": "fp8_hybrid", "offload_optimizer": True})
    assert (unset.resolved_fp8_scaling, offload.resolved_fp8_scaling) == ("delayed", "current")
    assert precision_spec(unset).fp8 == Fp8Settings("delayed", 8, "max")
    assert precision_spec(offload).fp8.scaling == "current"
