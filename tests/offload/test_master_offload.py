"""offload_master: the layers' fp32 master weights in pinned host memory, the device training their bf16 copy (CPU).

Exactness: with the bf16 recipe the resident run keeps fp32 params and casts them to bf16 at each use; the
offloaded run keeps that bf16 cast as the param and the fp32 master on host. The forward / backward see the same
bf16 values, the gradient of an fp32 param is its bf16 cotangent converted to fp32 (what the accumulator does to
the bf16 param's gradient), and the update reads the fp32 master like the resident update reads the fp32 param:
against the same per-layer update loop with everything on the device the losses and the final fp32 weights are
equal bit for bit. Against the plain whole-tree optax update (the Trainer without offload) the update agrees to
1 ulp (XLA compiles the elementwise AdamW inside the loop body differently, see test_optimizer_offload.py), so
the Trainer's losses are compared with rtol 1e-6 and the weights to a few fp32 ulps.
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.decoder import Decoder
from surojax.models.layer_runner import Recompute
from surojax.offload.optimizer import compute_copy, master_params
from surojax.offload.streaming import HOST_KIND
from surojax.parallel import make_mesh

from tests.offload.layerwise_runs import _run, device_layerwise_run
from tests.tiny import QWEN3, model_config
from tests.train.conftest import tiny_config  # noqa: F401 (fixture)

CFG = model_config(QWEN3, vocab_size=128)


def test_master_on_host_trains_exactly_like_the_resident_fp32_master():
    """Master alone (its AdamW state on the device); with the state on host too: the Trainer test below."""
    l_ref, p_ref, *_ = device_layerwise_run()  # shared with test_optimizer_offload.py
    losses, params, state, *_ = _run(offload_state=False, master=True)
    assert losses == l_ref and losses[-1] < losses[0]
    lw = state[1]
    assert {x.sharding.memory_kind for x in jax.tree.leaves(lw.master)} == {HOST_KIND}  # still, after 3 steps
    assert {x.dtype for x in jax.tree.leaves(lw.master)} == {jnp.dtype(jnp.float32)}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(lw.layers)} == {"device"}
    dev_layers = params.raw_mapping["layers"]
    assert {x.dtype for x in jax.tree.leaves(dev_layers)} == {jnp.dtype(jnp.bfloat16)}  # the compute copy
    assert {x.sharding.memory_kind for x in jax.tree.leaves(dev_layers)} == {"device"}
    full = master_params(params, state)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(p_ref)):
        assert a.dtype == b.dtype == jnp.float32 and bool(jnp.all(a == b))  # bit for bit
    for a, b in zip(jax.tree.leaves(dev_layers), jax.tree.leaves(full["layers"])):
        assert bool(jnp.all(a == b.astype(jnp.bfloat16)))  # the device copy is the cast of the master


def test_trainer_full_finetune_with_offload_optimizer_and_master(tmp_path, tiny_config):  # noqa: F811
    """The Trainer with offload_optimizer, and with offload_master + offload_optimizer, against the plain bf16
    recipe (one resident run for both): the same losses (rtol 1e-6, the loop body's 1-ulp AdamW) and, exported,
    the same fp32 weights; a checkpoint resumes exactly."""
    from surojax.config import config_from_dict
    from surojax.train.trainer import Trainer

    def trainer(name, **keys):
        return Trainer(config_from_dict(tiny_config(recipe="bf16", recompute="full", max_steps=3,
                                                    output_dir=str(tmp_path / name), **keys)))

    def host_kinds(t):
        return HOST_KIND in {x.sharding.memory_kind for x in jax.tree.leaves(t.opt_state)}

    ref = trainer("resident")
    ref_losses = [ref.step()["loss"] for _ in range(3)]
    assert not host_kinds(ref)
    # offload_optimizer alone (the AdamW state in host memory, the fp32 params on the device): the same losses
    state_only = trainer("offload_state", offload_optimizer=True)
    assert host_kinds(state_only)
    np.testing.assert_allclose([state_only.step()["loss"] for _ in range(3)], ref_losses, rtol=1e-6)
    del state_only
    off = trainer("offload", offload_master=True, offload_optimizer=True)
    losses = [off.step()["loss"] for _ in range(2)]
    off.save_checkpoint()  # the bf16 params + the state with the master in host memory
    off.checkpointer.close()
    losses.append(off.step()["loss"])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert ref_losses[-1] < ref_losses[0]
    assert {x.dtype for x in jax.tree.leaves(off.trainable.raw_mapping["layers"])} == {jnp.dtype(jnp.bfloat16)}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(off.opt_state[1].master)} == {HOST_KIND}
    params = nnx.state(off.trained_model(), nnx.Param)  # the export reads the fp32 master
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(nnx.state(ref.trained_model(), nnx.Param))):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    resumed = trainer("offload", offload_master=True, offload_optimizer=True, resume_from_checkpoint=True)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(resumed.opt_state[1].master)} == {HOST_KIND}
    assert resumed.step()["loss"] == losses[2]  # resumes exactly


def test_offload_master_config_rules():
    import pytest

    from surojax.config import config_from_dict
    from surojax.config.errors import ConfigError

    base = {"model": "x", "datasets": [{"path": "d.jsonl", "type": "text"}], "max_steps": 1, "offload_master": True}
    for bad in ({"lora": True}, {"recipe": "fp32"}):
        with pytest.raises(ConfigError, match="offload_master"):
            config_from_dict(dict(base, **bad))


def test_memory_plan_counts_the_master_on_host():
    from surojax.offload.memory_plan import plan_memory
    from surojax.bench.shapes import model_config

    cfg = model_config("qwen3-8b")
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    embed = V * D * (1 if cfg.tie_word_embeddings else 2) + D
    layer = (cfg.num_params() - embed) // L
    kw = dict(mode="full", batch=1, seq=2048, recompute=Recompute.FULL)
    res, off = plan_memory(cfg, **kw), plan_memory(cfg, offload_master=True, **kw)
    # layers: 2 bytes / param (bf16 copy) on the device instead of 4 (fp32 master) + 2 (cast copy of one layer)
    assert off.weights == 4 * embed + 2 * L * layer + 2 * 4 * layer
    assert res.weights == 4 * (embed + L * layer) and res.cast_weights == 2 * (layer + V * D)
    assert off.cast_weights == 2 * V * D and off.host == 4 * L * layer and res.host == 0
    # the in-place per-layer update (offload/optimizer.py in_place): one micro-batch's gradients as they are (the
    # layers' bf16), an fp32 accumulator only with accumulation, plus one fp32 copy of the rest's (whole-tree update)
    assert off.gradients == 4 * embed + 2 * L * layer + 4 * embed
    acc = plan_memory(cfg, offload_master=True, accum=2, **kw)
    assert acc.gradients == res.gradients - 2 * L * layer + 4 * embed
    both = plan_memory(cfg, offload_master=True, offload_optimizer=True, **kw)
    assert both.host == (4 + 8) * L * layer and both.total < 0.4 * res.total  # 57 GiB vs 159 GiB resident


def test_place_master_on_host_puts_only_the_layers_params_there():
    from surojax.offload.master import place_master_on_host

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    model = place_master_on_host(Decoder(CFG, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0)), mesh)
    state = nnx.state(model, nnx.Param).raw_mapping
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state["layers"])} == {HOST_KIND}
    rest = {k: v for k, v in state.items() if k != "layers"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(rest)} == {"device"}
    copy = compute_copy(nnx.state(model, nnx.Param), jnp.bfloat16).raw_mapping["layers"]
    assert {(x.dtype, x.sharding.memory_kind) for x in jax.tree.leaves(copy)} == {(jnp.dtype(jnp.bfloat16), "device")}
