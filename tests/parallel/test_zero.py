"""ZeRO stages (surojax/config/zero.py, surojax/parallel/zero.py): the config spelling and refusals, the memory
plan's divisors, and on 4 data devices the shardings of parameters, gradients and optimizer state (AdamW and
8-bit AdamW) per stage, the collectives each stage compiles to, and the losses of 2 steps equal to one device.

The device checks run once in a child process started with XLA_FLAGS=--xla_force_host_platform_device_count=8
(the harness of tests/parallel/test_sharding.py: JAX reads the flag when its backend starts).
"""
from __future__ import annotations

import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the child runs this file as a script
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from tests.parallel.virtual_devices import check_passed, print_results, shared_child_results  # noqa: E402
from surojax.config.errors import ConfigError  # noqa: E402
from surojax.config.load import config_from_dict  # noqa: E402
from surojax.models.config import ModelConfig  # noqa: E402
from surojax.models.layer_runner import Recompute  # noqa: E402
from surojax.offload.memory_plan import plan_memory  # noqa: E402

BASE = {"model": "some/model", "datasets": [{"path": "d.jsonl", "type": "text"}], "max_steps": 1}
TINY = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


# ---- in-process: the config ---------------------------------------------------------------------------------


def test_zero_stage_defaults_to_the_mesh_and_stage_3_is_the_fsdp_mesh():
    assert config_from_dict(BASE).resolved_zero_stage == 0
    fsdp = config_from_dict({**BASE, "parallel": {"fsdp": 2}})
    assert fsdp.resolved_zero_stage == 3 and fsdp.mesh_sizes()["fsdp"] == 2 and fsdp.mesh_sizes()["data"] == -1
    three = config_from_dict({**BASE, "zero_stage": 3, "parallel": {"data": -1, "tensor": 2}})
    assert three.mesh_sizes() == {"data": 1, "fsdp": -1, "tensor": 2, "expert": 1, "stage": 1}
    two = config_from_dict({**BASE, "zero_stage": 2, "parallel": {"data": 4}})
    assert two.resolved_zero_stage == 2 and two.mesh_sizes()["data"] == 4 and two.mesh_sizes()["fsdp"] == 1


@pytest.mark.parametrize("extra, words", [
    ({"zero_stage": 1, "parallel": {"fsdp": 2}}, ["zero_stage", "parallel.fsdp = 2", "zero_stage: 3"]),
    ({"zero_stage": 2, "offload_optimizer": True}, ["zero_stage", "offload_optimizer", "drop one"]),
    ({"zero_stage": 4}, ["zero_stage"]),
])
def test_contradicting_zero_stage_is_refused_naming_both_keys(extra, words):
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, **extra})
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_memory_plan_divides_what_the_stage_splits():
    """Independent arithmetic: AdamW holds 8 bytes per trainable param, the accumulator 4, fp32 weights 4."""
    kw = dict(mode="full", recipe="fp32", batch=1, seq=16, recompute=Recompute.FULL)
    one = plan_memory(TINY, **kw)
    n = TINY.num_params()
    assert one.optimizer == 8 * n and one.gradients == 8 * n and one.weights == 4 * n
    s1 = plan_memory(TINY, **kw, optimizer_shards=4)
    s2 = plan_memory(TINY, **kw, optimizer_shards=4, gradient_shards=4)
    s3 = plan_memory(TINY, **kw, optimizer_shards=4, gradient_shards=4, weight_shards=4)
    assert (s1.optimizer, s1.gradients, s1.weights) == (2 * n, 8 * n, 4 * n)
    assert (s2.optimizer, s2.gradients, s2.weights) == (2 * n, n + 4 * n, 4 * n)
    assert (s3.optimizer, s3.gradients, s3.weights) == (2 * n, 2 * n, n)
    assert s1.activations == one.activations


# ---- 4 data devices, in a child process ---------------------------------------------------------------------

CHILD_CHECKS: dict = {}


def child_check(fn):
    CHILD_CHECKS[fn.__name__] = fn
    return fn


def _spec(stage: int | None, optimizer: str = "adamw", rows: int = 2):
    import jax.numpy as jnp

    from surojax.train.run_spec import BatchSpec, MemorySpec, ModelSpec, OptimSpec, PrecisionSpec, RunSpec

    return RunSpec(model=ModelSpec(config=TINY, source=None, seed=0, attention="xla"),
                   precision=PrecisionSpec("fp32", jnp.float32, jnp.float32, jnp.float32), lora=None, quant=None,
                   memory=MemorySpec(recompute=Recompute.NONE, unroll=1),
                   optim=OptimSpec(name=optimizer, learning_rate=1e-2, schedule="constant", total_steps=2,
                                   weight_decay=0.1),
                   batch=BatchSpec(rows=rows, accumulation=2, sequence_len=16), zero_stage=stage)


def _batch():
    from surojax.bench.train_bench import synthetic_batch

    return synthetic_batch(np.random.default_rng(0), accum=2, batch=8, seq=16, vocab=TINY.vocab_size,
                           segments=2, min_segment=4)[0]  # [A=2, B=8, T=16]: 2 rows per device on 4


def _mesh(sizes: dict):
    import jax

    from surojax.parallel.mesh import make_mesh

    return make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])


def _two_steps(run):
    """Losses of 2 steps, the step's compiled HLO text, and the run's state after them."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from surojax.parallel.rules import batch_sharding

    sharding = NamedSharding(run.mesh, P(None, *batch_sharding(run.mesh).spec))
    batch = {k: jax.device_put(v, sharding) for k, v in _batch().items()}
    key = jax.random.key(0)
    step = run.train_step.lower(run.trainable, run.frozen, run.opt_state, batch, key).compile()  # compiled once
    losses = []
    tr, st = run.trainable, run.opt_state
    for _ in range(2):
        tr, st, m = step(tr, run.frozen, st, batch, key)
        losses.append(float(m["loss"]))
    return losses, step.as_text(), tr, st


def _specs(tree) -> dict:
    """{path: PartitionSpec} of the arrays (or shardings) of a tree (jax keys as the path)."""
    import jax

    return {jax.tree_util.keystr(p): getattr(x, "sharding", x).spec
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _norm(spec) -> tuple:
    """A PartitionSpec without trailing Nones (P(None, 'data') and P(None, 'data', None) are the same split)."""
    t = tuple(spec)
    while t and t[-1] is None:
        t = t[:-1]
    return t


def _assert_same_layout(got, want, what: str):
    """The step's outputs are split as its inputs were (so the next call neither reshards nor recompiles)."""
    g = {k: _norm(v) for k, v in _specs(got).items()}
    w = {k: _norm(v) for k, v in _specs(want).items()}
    assert g == w, (what, {k: (g.get(k), w.get(k)) for k in g.keys() | w.keys() if g.get(k) != w.get(k)})


# q_proj.kernel [L=2, D=32, N*H=32], the final norm [D], q_norm [L, H=8]: where each stage puts them (by hand)
WANT = {  # stage: (params, gradients, adam moments) of q_proj kernel
    0: ((), (), ()),
    1: ((), (), (None, "data")),
    2: ((), (None, "data"), (None, "data")),
    3: ((None, "fsdp"), (None, "fsdp"), (None, "fsdp")),
}


def _one(specs: dict, fragment: str):
    hits = [v for k, v in specs.items() if fragment in k]
    assert len(hits) == 1, (fragment, list(specs))
    return _norm(hits[0])


# Stage 2 trains with 8-bit AdamW: one compiled step serves both checks below (stage 2 splits the gradients whatever
# the optimizer; its small leaves, q_proj's included, keep fp32 moments split as AdamW's). Plain AdamW's stage-2-style
# state split is stage 1's (the same moments, same specs).
STAGE_OPTIMIZER = {0: "adamw", 1: "adamw", 2: "adamw_8bit", 3: "adamw"}
_MEMO: dict = {}


def _reference_losses(optimizer: str) -> list[float]:
    """2 steps' losses on one device (all 8 rows of each micro-batch on it), once per optimizer."""
    from surojax.train.build import build_run

    if optimizer not in _MEMO:
        _MEMO[optimizer] = _two_steps(build_run(_spec(None, optimizer, rows=8), _mesh({"data": 1})))[0]
    return _MEMO[optimizer]


def _stage(stage: int):
    """(run, its 2 steps' losses, HLO text, params and optimizer state after them) at `stage`, once per stage."""
    from surojax.train.build import build_run

    if stage not in _MEMO:
        mesh = _mesh({"data": 1, "fsdp": 4} if stage == 3 else {"data": 4})  # stage 3: config mesh_sizes()
        run = build_run(_spec(stage, STAGE_OPTIMIZER[stage]), mesh)
        _MEMO[stage] = (run, *_two_steps(run))
    return _MEMO[stage]


@child_check
def check_stages_place_state_as_they_say_and_train_like_one_device():
    for stage in (0, 1, 2, 3):
        run, losses, hlo, tr, st = _stage(stage)
        assert run.zero.stage == stage and f"ZeRO stage {stage}" in run.zero_summary
        params, grads = _specs(run.trainable), _specs(run.zero.gradients)
        mu = _specs(run.opt_state[1][0].mu)  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
        want_p, want_g, want_m = WANT[stage]
        q = "q_proj"
        assert _one(params, q) == want_p and _one(grads, q) == want_g and _one(mu, q) == want_m, (
            stage, _one(params, q), _one(grads, q), _one(mu, q))
        # 1-D final norm [32] splits on its only dimension; q_norm [2, 8] on its largest divisible one (8)
        if stage in (1, 2):
            assert _one(mu, "final_norm") == ("data",) and _one(mu, "q_norm") == (None, "data")
            assert all(_norm(s) == () for s in params.values()), params  # parameters stay replicated
        np.testing.assert_allclose(losses, _reference_losses(STAGE_OPTIMIZER[stage]), rtol=1e-5,
                                   err_msg=f"zero_stage {stage}")
        _assert_same_layout(tr, run.trainable, f"params after the step, stage {stage}")
        _assert_same_layout(st, run.opt_state, f"optimizer state after the step, stage {stage}")
        # The compiled step: the updated parameters are all-gathered at stages 1-2 (each device updated its
        # shard), never at 0; the gradients are all-reduced at 0-1. (XLA's CPU backend writes a reduce-scatter
        # as all-reduce + slice, so stage 2's gradient split is checked by its layout and the losses above.)
        if stage < 3:
            assert ("all-gather" in hlo) == (stage in (1, 2)), stage
        assert "all-reduce" in hlo


@child_check
def check_8bit_adamw_state_splits_its_blocks():
    from surojax.train.optim_8bit import Blockwise8bit

    assert STAGE_OPTIMIZER[2] == "adamw_8bit"
    run, losses, _, _, st = _stage(2)
    mu = run.opt_state[1][0].mu
    q = mu["layers"]["attn"]["q_proj"]["kernel"]  # [2, 32, 32] = 2048 values < 4096: fp32 moments
    gate = mu["layers"]["mlp"]["gate_proj"]["kernel"]  # [2, 32, 128]: 8192 values, 32 blocks of 256
    q, gate = getattr(q, "value", q), getattr(gate, "value", gate)
    assert isinstance(gate, Blockwise8bit) and not isinstance(q, Blockwise8bit)
    assert _norm(gate.codes.sharding.spec) == ("data",) and _norm(gate.absmax.sharding.spec) == ("data",)
    assert _norm(q.sharding.spec) == (None, "data")
    np.testing.assert_allclose(losses, _reference_losses("adamw_8bit"), rtol=1e-5)
    _assert_same_layout(st, run.opt_state, "8-bit state after the step")


@child_check
def check_bench_over_a_mesh_times_the_same_step():
    """`surojax bench train --parallel data=-1 --zero-stage 1`: the Trainer's mesh over every device, --batch rows
    per data shard, the record's counts over the mesh; its first step's loss is the one-device bench's on the same
    global rows."""
    import jax

    from surojax.bench.train_bench import BenchConfig, run

    keys = dict(shape="debug", mode="full", seq=64, segments=2, min_segment=16, steps=1, repeats=1, warmup=0,
                recipe="fp32")
    quiet = lambda msg: None  # noqa: E731
    meshed = run(BenchConfig(batch=1, parallel={"data": -1}, zero_stage=1, **keys), log=quiet)
    n = jax.device_count()
    assert (meshed["devices"], meshed["mesh"], meshed["rows"]) == (n, {"data": n}, n), meshed
    one = run(BenchConfig(batch=n, **keys), log=quiet)
    assert (one["devices"], one["rows"]) == (1, n)
    np.testing.assert_allclose(meshed["loss_first"], one["loss_first"], rtol=1e-5)


@pytest.fixture(scope="module")
def child_results(tmp_path_factory) -> dict[str, str]:
    return shared_child_results(tmp_path_factory, __file__, devices=8)  # one 8-device child for the modules of SHARED


@pytest.mark.parametrize("name", list(CHILD_CHECKS))
def test_on_4_data_devices(child_results, name):
    check_passed(child_results, name, "4 data devices")


if __name__ == "__main__":
    print_results(CHILD_CHECKS, devices=8)
