"""Expert parallelism (surojax/parallel/expert.py): a tiny MoE decoder on 8 virtual CPU devices, expert-parallel
and composed with data, fsdp and tensor, gives the single-device logits, router statistics and gradients (qwen3_moe,
gpt_oss's biased form, and the Qwen3.5 MoE hybrid, whose two layer stacks both hold MoE layers).

The reference is the same model with no runner on one device (the MoE layer's local sort + ragged_dot, itself
checked against a dense one-hot formulation in tests/models/test_moe.py). Not bit-equal: a token's k expert
outputs are summed per device and then across devices (psum_scatter), fsdp / tensor contractions are summed across
devices, and gradients of replicated parameters are all-reduced, all in another fp32 order. Hence rel 1e-4.

The 8-device checks run in one child process started with XLA_FLAGS=--xla_force_host_platform_device_count=8
(as tests/parallel/test_sharding.py explains); the refusals and the rules run in this process.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the child runs this file as a script
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AbstractMesh, PartitionSpec as P  # noqa: E402

from tests.parallel.virtual_devices import check_passed, print_results, shared_child_results  # noqa: E402
from surojax.models.config import ModelConfig, MoEConfig  # noqa: E402
from surojax.models.decoder import Decoder  # noqa: E402
from surojax.models.layers.moe import MoE  # noqa: E402
from surojax.parallel.expert import ExpertParallelError, apply_expert_parallel  # noqa: E402
from surojax.parallel.mesh import make_mesh  # noqa: E402
from surojax.parallel.rules import (  # noqa: E402
    ACTIVATION_RULES,
    PARAM_RULES,
    batch_parallel_size,
    batch_sharding,
    param_shardings,
    partition_spec,
    shard_model,
)

BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, tie_word_embeddings=False)
QWEN3_MOE = dict(BASE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                 norm_topk_prob=True)


def qwen3_moe() -> ModelConfig:
    return ModelConfig.from_hf(QWEN3_MOE)


def qwen3_5_moe() -> ModelConfig:
    hf = json.loads((Path(ROOT) / "tests/fixtures/models/qwen3_5_moe_text/config.json").read_text())
    return ModelConfig.from_hf({**hf, "num_experts": 8, "num_hidden_layers": 2,
                                "layer_types": ["linear_attention", "full_attention"]})


def biased_moe() -> ModelConfig:
    """gpt_oss's expert form (top-k-then-softmax router with a bias, biased clamped-SwiGLU experts) on the qwen3
    attention: the bias path of a device's non-local rows (key E_l) is exercised."""
    return dataclasses.replace(qwen3_moe(), moe=MoEConfig(8, 3, 8, router="topk_softmax", router_bias=True,
                                                          expert_bias=True, activation="swiglu_clamped"))


# ---- in-process ---------------------------------------------------------------------------------------------------

MESH_2141 = AbstractMesh((1, 2, 1, 4, 1), ("stage", "data", "fsdp", "expert", "tensor"))


def test_expert_weights_split_over_the_expert_axis_and_the_batch_over_it_too():
    # gate_up_proj [L, E, D, 2F] and down_proj [L, E, F, D]
    assert partition_spec(("layers", "experts", "embed", "mlp"), PARAM_RULES, MESH_2141, (2, 8, 16, 16)) == \
        P(None, "expert", None, None)
    assert partition_spec(("embed", None), PARAM_RULES, MESH_2141, (16, 8)) == P(None, None)  # router: replicated
    assert partition_spec(("batch", "seq"), ACTIVATION_RULES, MESH_2141) == P(("data", "expert"), None)
    assert batch_parallel_size(MESH_2141) == 8


def test_experts_the_expert_axis_does_not_divide_are_refused():
    model = nnx.eval_shape(lambda: Decoder(qwen3_moe(), rngs=nnx.Rngs(0)))
    with pytest.raises(ExpertParallelError, match=r"parallel.expert = 3 does not divide the model's 8 experts"):
        apply_expert_parallel(model, AbstractMesh((1, 1, 1, 3, 1), ("stage", "data", "fsdp", "expert", "tensor")))
    apply_expert_parallel(model, AbstractMesh((1, 2, 1, 1, 1), ("stage", "data", "fsdp", "expert", "tensor")))
    assert all(m.runner is None for _, m in nnx.iter_graph(model) if isinstance(m, MoE))  # expert=1: local


# ---- 8 devices, in a child process --------------------------------------------------------------------------------

CHILD_CHECKS: dict = {}


def child_check(fn):
    CHILD_CHECKS[fn.__name__] = fn
    return fn


def _batch(B: int, T: int, V: int):
    """[B, T] rows of two packed segments and trailing padding (segment 0: routed, left out of the stats)."""
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V, dtype=jnp.int32)
    t = jnp.arange(T)
    segment_ids = jnp.broadcast_to(jnp.where(t < 5, 1, jnp.where(t < T - 2, 2, 0)), (B, T)).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.where(t < 5, t, t - 5), (B, T)).astype(jnp.int32)
    return tokens, positions, segment_ids


def _forward_and_grads(model, mesh=None):
    """(logits, router stats, grads of a loss of both) of `model`, sharded by the rules on `mesh` when given."""
    batch = _batch(8, 8, model.cfg.vocab_size)
    probe = jax.random.normal(jax.random.key(2), (8, 8, model.cfg.vocab_size))

    def f(params, rest, tokens, positions, segment_ids):
        m = nnx.merge(graphdef, params, rest)
        h, _, stats = m.hidden_states(tokens, positions, segment_ids)
        logits = m.logits(h)
        # the router statistics take part, as a load-balancing loss does (sum over experts of counts x probs)
        aux = jnp.sum(stats.expert_counts * stats.prob_sums) + jnp.sum(stats.z_sum)
        return jnp.sum(logits * probe) + 1e-2 * aux, (logits, stats)

    if mesh is None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        grad = jax.jit(jax.grad(f, has_aux=True))
        return _numpy(grad(params, rest, *batch))
    shard_model(model, mesh)
    apply_expert_parallel(model, mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    bs = batch_sharding(mesh)
    grad = jax.jit(jax.grad(f, has_aux=True), in_shardings=(param_shardings(params, mesh),
                                                            param_shardings(rest, mesh), bs, bs, bs))
    return _numpy(grad(params, rest, *(jax.device_put(x, bs) for x in batch)))


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_close(got, want, what):
    flat_w = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = flat_w[path]
        scale = max(np.abs(w).max(), 1e-30)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale, err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _check_mesh(parallel: dict, name: str, cfg: ModelConfig):
    mesh = make_mesh(parallel)
    ref_grads, (ref_logits, ref_stats) = _forward_and_grads(Decoder(cfg, attention="xla", rngs=nnx.Rngs(0)))
    model = Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))
    grads, (logits, stats) = _forward_and_grads(model, mesh)
    assert np.abs(ref_logits).max() > 1e-2
    _assert_close(logits, ref_logits, f"{name} logits")
    _assert_close(stats, ref_stats, f"{name} router stats")
    _assert_close(grads, ref_grads, f"{name} grads")
    # the experts of every layer stack really are split: E / expert of them on each device
    for stack_name, stack in model.stacks.items():
        kernel = stack.mlp.experts.gate_up_proj.kernel.get_value()
        assert kernel.sharding.spec[1] == "expert", kernel.sharding.spec
        assert {s.data.shape[1] for s in kernel.addressable_shards} == {cfg.moe.num_experts // parallel["expert"]}
        assert np.abs(ref_grads[stack_name]["mlp"]["experts"]["gate_up_proj"]["kernel"]).max() > 0


# One model per mesh (each mesh compiles its own sharded program per model): the Qwen3.5 MoE hybrid (softmax top-k
# router, as qwen3_moe's) on data x expert, and the biased form, whose router and expert biases are split over expert
# and tensor too, on the composed expert x fsdp x tensor mesh. The plain qwen3_moe decoder on data x expert has no
# check of its own: its MoE layer is the hybrid's (same router, experts and exchange: this check), and it trains on
# that mesh with the one device's losses in tests/train/test_expert_parallel_training.py (and drops per group in
# check_capacity_is_per_expert_group below).
@child_check
def check_qwen3_5_moe_data_2_expert_4_matches_one_device():
    """The Qwen3.5 MoE hybrid (the qwen3_5_moe_text fixture's widths, 8 experts, a Gated DeltaNet layer then a gated
    attention layer): the MoE layers of both stacks run expert-parallel; logits, router stats and every gradient
    (the DeltaNet's and the experts' included) are the one device's."""
    _check_mesh({"data": 2, "expert": 4}, "qwen3_5_moe_text", qwen3_5_moe())


@child_check
def check_expert_2_fsdp_2_tensor_2_matches_one_device():
    _check_mesh({"expert": 2, "fsdp": 2, "tensor": 2}, "biased", biased_moe())


@child_check
def check_expert_parallel_trains_in_bf16():
    """The bf16 recipe's LoRA step (recompute full) with expert=2 over the 8 devices: it compiles (XLA CPU aborted
    on the bf16 reduce-scatter of the token gradients and the bf16 sums of the parameter gradients, which now add in
    fp32) and its first loss is the one-device step's on the same rows, within bf16 rounding."""
    from surojax.bench.train_bench import BenchConfig, run

    keys = dict(shape="debug-moe", mode="lora", seq=64, segments=2, min_segment=16, steps=1, repeats=1, warmup=0,
                recompute="full")
    quiet = lambda msg: None  # noqa: E731
    ep = run(BenchConfig(batch=1, parallel={"expert": 2, "data": -1}, **keys), log=quiet)
    assert ep["mesh"] == {"data": 4, "expert": 2}, ep["mesh"]
    one = run(BenchConfig(batch=8, **keys), log=quiet)
    np.testing.assert_allclose(ep["loss_first"], one["loss_first"], rtol=1e-2)


@child_check
def check_capacity_is_per_expert_group():
    """With a capacity, each expert group (the 4 devices of one data index: batch rows 0-3, then 4-7) drops as one
    device does on that group's rows alone: the capacity counts the group's assignments, in its token order."""
    cfg = qwen3_moe().moe
    moe = MoE(16, cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    moe.capacity_factor = 0.5  # ceil(0.5 * 4*8*2 / 8) = 4 of the 64 assignments per expert and group: drops
    x = jax.random.normal(jax.random.key(3), (8, 8, 16))
    seg = _batch(8, 8, 64)[2]
    apply = jax.jit(lambda m, a, b: m(a, b))  # one program for both halves (same shapes)
    halves = [apply(moe, x[i:i + 4], seg[i:i + 4]) for i in (0, 4)]
    want_y = np.concatenate([np.asarray(h[0]) for h in halves])
    want_stats = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), halves[0][1], halves[1][1])
    assert want_stats.dropped > 0

    mesh = make_mesh({"data": 2, "expert": 4})
    apply_expert_parallel(shard_model(moe, mesh), mesh)
    assert moe.runner is not None
    bs = batch_sharding(mesh)
    y, stats = jax.jit(lambda m, a, b: m(a, b))(moe, jax.device_put(x, bs), jax.device_put(seg, bs))
    _assert_close(np.asarray(y), want_y, "capacity y")
    _assert_close(_numpy(stats), want_stats, "capacity stats")


@pytest.fixture(scope="module")
def child_results(tmp_path_factory) -> dict[str, str]:
    return shared_child_results(tmp_path_factory, __file__, devices=8)  # one 8-device child for the modules of SHARED


@pytest.mark.parametrize("name", list(CHILD_CHECKS))
def test_on_8_devices(child_results, name):
    check_passed(child_results, name, "8 devices")


if __name__ == "__main__":
    print_results(CHILD_CHECKS, devices=8)
