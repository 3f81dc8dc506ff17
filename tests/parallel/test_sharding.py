"""Sharding by the rules table: mesh sizes, partition specs, and sharded == unsharded numerics.

The mesh arithmetic and spec resolution run in this process (pure functions; an AbstractMesh needs no
devices). Everything that needs 8 devices runs once in a child process (one for the modules of
virtual_devices.SHARED: virtual_devices.shared_child_results) started with
XLA_FLAGS=--xla_force_host_platform_device_count=8: JAX reads that flag when its backend starts, so setting it here could not work once any other test has touched JAX, and would leak into other tests.
The child runs every `@child_check` and reports each result; one pytest case per check reads it.
"""
from __future__ import annotations

import logging
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the child runs this file as a script
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AbstractMesh, PartitionSpec as P  # noqa: E402

from tests.parallel.virtual_devices import check_passed, print_results, shared_child_results  # noqa: E402
from surojax.parallel.mesh import MeshError, make_mesh, mesh_shape  # noqa: E402
from surojax.parallel.rules import ACTIVATION_RULES, PARAM_RULES, partition_spec  # noqa: E402


# ---- in-process: mesh arithmetic ----------------------------------------------------------------------------


def test_mesh_shape_resolves_minus_one():
    s1 = {"stage": 1}
    assert mesh_shape({"data": 2, "fsdp": 2, "tensor": 2}, 8) == {**s1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert mesh_shape({"data": -1, "tensor": 2}, 8) == {**s1, "data": 4, "fsdp": 1, "expert": 1, "tensor": 2}
    assert mesh_shape({"fsdp": -1}, 8) == {**s1, "data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert mesh_shape({"data": 1, "fsdp": -1, "tensor": 4}, 8) == {**s1, "data": 1, "fsdp": 2, "expert": 1, "tensor": 4}
    assert mesh_shape(None, 1) == {**s1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert mesh_shape({"data": -1, "expert": 4}, 8) == {**s1, "data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert mesh_shape({"data": -1, "fsdp": 2, "tensor": 1, "expert": 1, "stage": 1}, 8)["data"] == 4
    assert mesh_shape({"data": -1, "fsdp": 1, "tensor": 2, "expert": 1, "stage": 2}, 8)["data"] == 2


@pytest.mark.parametrize("parallel, words", [
    ({"data": 3, "fsdp": 2, "tensor": 2}, ["data=3", "fsdp=2", "tensor=2", "12", "8 devices"]),
    ({"data": 2}, ["data=2", "8 devices"]),
    ({"data": -1, "fsdp": -1}, ["at most one", "data", "fsdp"]),
    ({"data": -1, "fsdp": 3}, ["fsdp=3", "8 devices"]),
    ({"tensor": 0}, ["parallel.tensor", "0"]),
    ({"tensor": 2.0}, ["parallel.tensor"]),
    ({"tensr": 2}, ["'tensr'", "stage, data, fsdp, expert, tensor"]),
    ({"data": 3, "expert": 2}, ["data=3", "expert=2", "8 devices"]),
    ({"data": 3, "stage": 2}, ["data=3", "stage=2", "8 devices"]),
])
def test_mesh_shape_errors_name_values_and_device_count(parallel, words):
    with pytest.raises(MeshError) as err:
        mesh_shape(parallel, 8)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_make_mesh_checks_against_the_given_devices():
    one = jax.devices()[:1]
    mesh = make_mesh({"fsdp": -1}, devices=one)
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(MeshError, match="1 devices"):
        make_mesh({"data": 2}, devices=one)


# ---- in-process: partition specs ------------------------------------------------------------------------------

MESH_222 = AbstractMesh((1, 2, 2, 1, 2), ("stage", "data", "fsdp", "expert", "tensor"))


def test_partition_spec_follows_rules():
    assert partition_spec(("layers", "embed", "heads"), PARAM_RULES, MESH_222, (2, 32, 64)) == P(None, "fsdp", "tensor")
    assert partition_spec(("layers", "mlp", "embed"), PARAM_RULES, MESH_222, (2, 64, 32)) == P(None, "tensor", "fsdp")
    assert partition_spec(("layers", "head_dim"), PARAM_RULES, MESH_222, (2, 8)) == P(None, None)
    assert partition_spec((None, "embed"), PARAM_RULES, MESH_222, (3, 32)) == P(None, "fsdp")
    assert partition_spec(("batch", "seq"), ACTIVATION_RULES, MESH_222, (8, 16)) == P(("data", "fsdp"), None)
    assert partition_spec(("batch", "seq"), ACTIVATION_RULES, MESH_222) == P(("data", "fsdp"), None)


def test_partition_spec_drops_indivisible_axes_with_a_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger="surojax.parallel.rules"):
        assert partition_spec(("vocab", "embed"), PARAM_RULES, MESH_222, (127, 32)) == P(None, "fsdp")
    assert "not divisible" in caplog.text and "127" in caplog.text
    # a tuple rule keeps the axes that still divide: 6 rows split over data (2), not over data*fsdp (4)
    assert partition_spec(("batch", "seq"), ACTIVATION_RULES, MESH_222, (6, 16)) == P("data", None)
    assert partition_spec(("batch", "seq"), ACTIVATION_RULES, MESH_222, (3, 16)) == P(None, None)


def test_partition_spec_never_repeats_a_mesh_axis(caplog):
    with caplog.at_level(logging.DEBUG, logger="surojax.parallel.rules"):
        assert partition_spec(("embed", "embed"), PARAM_RULES, MESH_222, (32, 32)) == P("fsdp", None)
    assert "already shards" in caplog.text
    rules = dict(ACTIVATION_RULES, embed="fsdp")
    assert partition_spec(("batch", "seq", "embed"), rules, MESH_222, (8, 4, 32)) == P(("data", "fsdp"), None, None)
    assert partition_spec(("batch", "seq", "embed"), rules, MESH_222, (2, 4, 32)) == P("data", None, "fsdp")


def test_partition_spec_rejects_unknown_names():
    with pytest.raises(KeyError, match="lora_rank"):
        partition_spec(("embed", "lora_rank"), PARAM_RULES, MESH_222, (32, 8))
    with pytest.raises(KeyError, match="pipe"):
        partition_spec(("embed",), {"embed": "pipe"}, MESH_222, (32,))
    with pytest.raises(ValueError, match="do not match"):
        partition_spec(("embed",), PARAM_RULES, MESH_222, (32, 8))


# ---- 8 devices, in a child process ------------------------------------------------------------------------------

CHILD_CHECKS: dict = {}


def child_check(fn):
    CHILD_CHECKS[fn.__name__] = fn
    return fn


# Written out by hand (not computed from the rules) so that a wrong rule or a wrong resolution shows up.
# On a data=2, fsdp=2, tensor=2 mesh; V = 128 splits over tensor, 127 (tied config) does not.
EXPECTED_SPECS = {
    "embed.embedding": P("tensor", "fsdp"),  # [V, D]
    "layers.attn_norm.scale": P(None, "fsdp"),  # [L, D]
    "layers.attn.q_proj.kernel": P(None, "fsdp", "tensor"),  # [L, D, N*H]
    "layers.attn.k_proj.kernel": P(None, "fsdp", "tensor"),  # [L, D, K*H]
    "layers.attn.v_proj.kernel": P(None, "fsdp", "tensor"),  # [L, D, K*H]
    "layers.attn.o_proj.kernel": P(None, "tensor", "fsdp"),  # [L, N*H, D]
    "layers.attn.q_norm.scale": P(None, None),  # [L, H]
    "layers.attn.k_norm.scale": P(None, None),  # [L, H]
    "layers.mlp_norm.scale": P(None, "fsdp"),  # [L, D]
    "layers.mlp.gate_proj.kernel": P(None, "fsdp", "tensor"),  # [L, D, F]
    "layers.mlp.up_proj.kernel": P(None, "fsdp", "tensor"),  # [L, D, F]
    "layers.mlp.down_proj.kernel": P(None, "tensor", "fsdp"),  # [L, F, D]
    "final_norm.scale": P("fsdp"),  # [D]
    "lm_head.kernel": P("fsdp", "tensor"),  # [D, V]
}
EXPECTED_SPECS_TIED_BIAS = {
    **{k: v for k, v in EXPECTED_SPECS.items()  # no lm_head (tied), no q/k norms (qwen2)
       if k not in ("lm_head.kernel", "layers.attn.q_norm.scale", "layers.attn.k_norm.scale")},
    "embed.embedding": P(None, "fsdp"),  # [V=127, D]: 127 does not split over tensor=2
    "layers.attn.q_proj.bias": P(None, "tensor"),  # [L, N*H]
    "layers.attn.k_proj.bias": P(None, "tensor"),  # [L, K*H]
    "layers.attn.v_proj.bias": P(None, "tensor"),  # [L, K*H]
}


def _configs():
    from surojax.models.config import ModelConfig

    qwen3 = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)  # GQA: G = 2
    qwen2_tied = ModelConfig(model_type="qwen2", vocab_size=127, hidden_size=32, intermediate_size=64,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
                             tie_word_embeddings=True)
    return {"qwen3": (qwen3, EXPECTED_SPECS), "qwen2_tied": (qwen2_tied, EXPECTED_SPECS_TIED_BIAS)}


def _specs(model) -> dict:
    from flax import nnx

    return {".".join(map(str, path)): var.get_value().sharding.spec
            for path, var in nnx.to_flat_state(nnx.state(model))}


def _packed_batch(B: int, T: int, V: int):
    """[B, T] tokens with two packed segments per row (positions restart at the boundary)."""
    import jax.numpy as jnp

    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V, dtype=jnp.int32)
    cut = T * 5 // 8
    t = jnp.arange(T)
    segment_ids = jnp.broadcast_to(jnp.where(t < cut, 1, 2), (B, T)).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.where(t < cut, t, t - cut), (B, T)).astype(jnp.int32)
    return tokens, positions, segment_ids


@child_check
def check_make_mesh_on_8_devices():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1, "tensor": 2} and mesh.devices.size == 8
    assert mesh.axis_names == ("stage", "data", "fsdp", "expert", "tensor")
    assert dict(make_mesh({"data": -1, "fsdp": 2, "tensor": 2}).shape) == {"stage": 1, "data": 2, "fsdp": 2,
                                                                            "expert": 1, "tensor": 2}
    assert dict(make_mesh({"data": 1, "fsdp": -1, "tensor": 2}).shape) == {"stage": 1, "data": 1, "fsdp": 4,
                                                                            "expert": 1, "tensor": 2}
    assert len({d.id for d in make_mesh({"fsdp": -1}).devices.flat}) == 8
    for bad in ({"data": 3, "fsdp": 2, "tensor": 2}, {"data": 4, "fsdp": 4}, {"data": -1, "fsdp": 3}):
        try:
            make_mesh(bad)
        except MeshError as e:
            assert "8 devices" in str(e), str(e)
        else:
            raise AssertionError(f"{bad} made a mesh on 8 devices")


@child_check
def check_param_specs_and_values_after_shard_model():
    from flax import nnx

    from surojax.models.decoder import Decoder
    from surojax.parallel.rules import shard_model

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    for name, (cfg, expected) in _configs().items():
        model = Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))
        before = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}
        assert shard_model(model, mesh) is model
        specs = _specs(model)
        assert specs == expected, (name, {k: (specs.get(k), expected.get(k))
                                          for k in specs.keys() | expected.keys() if specs.get(k) != expected.get(k)})
        for k, v in nnx.to_flat_state(nnx.state(model)):
            np.testing.assert_array_equal(np.asarray(v.get_value()), before[k])  # placement moves, never changes
    # the arrays really are split: q_proj [L=2, D=32, N*H=32] holds [2, 16, 16] per device
    q = model.layers.attn.q_proj.kernel.get_value()
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 16)} and len(q.addressable_shards) == 8


@child_check
def check_sharded_forward_matches_single_device():
    """fp32 logits of the 2x2x2-sharded model vs the same model on one device.

    Not bit-equal: with `embed` over fsdp and heads / mlp over tensor, the contractions of o_proj, down_proj,
    the lm_head (and the norms' statistics) sum partial products on different devices and all-reduce them,
    so fp32 additions happen in another order. Rounding only: max |diff| ~ 1e-7 at logits ~ 0.1.
    """
    from flax import nnx

    from surojax.models.decoder import Decoder
    from surojax.parallel.rules import batch_sharding, param_shardings, shard_model

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    for name, (cfg, _) in _configs().items():
        model = Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))
        batch = _packed_batch(4, 16, cfg.vocab_size)
        ref = np.asarray(nnx.jit(lambda m, *b: m(*b))(model, *batch))  # everything on device 0

        shard_model(model, mesh)
        graphdef, state = nnx.split(model)
        bs = batch_sharding(mesh)
        forward = jax.jit(lambda s, *b: nnx.merge(graphdef, s)(*b),
                          in_shardings=(param_shardings(model, mesh), bs, bs, bs))
        sharded_batch = [jax.device_put(x, bs) for x in batch]
        assert sharded_batch[0].sharding.spec == P(("data", "fsdp"), None)
        out = forward(state, *sharded_batch)
        assert len(out.sharding.device_set) == 8
        assert out.dtype == np.float32 and out.shape == ref.shape
        assert np.abs(ref).max() > 1e-2, "logits too small for the tolerance to mean anything"
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6, err_msg=name)


@child_check
def check_init_sharded():
    """Built directly in shards: the rules' specs, and the same values as the unsharded jitted build
    (partitionable threefry; exact, since both are one XLA computation with the same arithmetic)."""
    from flax import nnx

    from surojax.models.decoder import Decoder
    from surojax.parallel.rules import init_sharded

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg, expected = _configs()["qwen3"]
    make = lambda: Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))  # noqa: E731
    model = init_sharded(make, mesh)
    assert isinstance(model, Decoder)
    assert _specs(model) == expected
    unsharded = jax.jit(lambda: nnx.state(make()))()
    got = dict(nnx.to_flat_state(nnx.state(model)))
    for k, v in nnx.to_flat_state(unsharded):
        np.testing.assert_array_equal(np.asarray(got[k].get_value()), np.asarray(v.get_value()), err_msg=str(k))
    logits = model(*_packed_batch(4, 16, cfg.vocab_size))
    assert logits.shape == (4, 16, cfg.vocab_size)


@pytest.fixture(scope="module")
def child_results(tmp_path_factory) -> dict[str, str]:
    return shared_child_results(tmp_path_factory, __file__, devices=8)  # one 8-device child for the modules of SHARED


@pytest.mark.parametrize("name", list(CHILD_CHECKS))
def test_on_8_devices(child_results, name):
    check_passed(child_results, name, "8 devices")


if __name__ == "__main__":
    print_results(CHILD_CHECKS, devices=8)
