"""MoE training through the Trainer, in process, on a tiny random qwen3_moe: the router losses join the loss with
the HF config's coefficient (or the config's override), metrics.jsonl carries the router keys, and train_router
trains the router weights with a LoRA adapter (exported as PEFT modules_to_save) while without it they stay
bit-identical."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from surojax.config import config_from_dict
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layers.moe import RouterStats
from surojax.train.router_monitor import RouterMonitor, progress_text
from surojax.train.run_spec import TrainSetupError, run_spec
from surojax.train.trainer import Trainer
from surojax.weights.safetensors_file import SafetensorsFile

from tests import tiny

QWEN3_MOE = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3_moe"
TINY_MOE = tiny.hf(tiny.QWEN3_MOE, router_aux_loss_coef=0.02)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_moe_trains_with_the_router_losses_and_logs_router_metrics(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(model_config=dict(TINY_MOE), max_steps=6, router_z_loss_coef=1e-3))
    trainer = Trainer(cfg)
    assert trainer.spec.moe.router_loss.aux_coef == 0.02  # read from the model's config.json
    trainer.train()
    rows = [r for r in _rows(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]
    for key in ("router_aux_loss", "router_z_loss", "router_entropy", "router_load_max", "router_load_min",
                "router_load_max_l1", "router_load_min_l0"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert "router_dropped" not in rows[0]  # dropless
    r = rows[0]
    assert r["router_aux_loss"] >= 2 * 0.99  # k = 2 for an even router, more when uneven (Cauchy-Schwarz bound)
    assert 0 < r["router_entropy"] <= np.log(4) + 1e-6 and r["router_load_min"] <= 1 <= r["router_load_max"]


def test_aux_coefficient_override_capacity_and_refusals(tiny_config, tmp_path):
    def spec_of(**kw):
        cfg = config_from_dict(tiny_config(model_config=dict(TINY_MOE), **kw))
        return run_spec(cfg, total_steps=1)

    moe = spec_of(router_aux_loss_coef=0.5, capacity_factor=1.25).moe
    assert moe.router_loss.aux_coef == 0.5 and moe.capacity_factor == 1.25 and not moe.train_router
    assert spec_of(router_aux_loss_coef=0.0).moe.router_loss.aux_coef == 0.0
    # LoRA with a frozen router: transformers' rule (the term only with output_router_logits); a trained router: on
    def lora_aux(model_dir, **kw):
        d = tiny_config(from_scratch=False, model=str(model_dir), lora=True, **kw)
        d.pop("model_config")
        return run_spec(config_from_dict(d), total_steps=1).moe.router_loss.aux_coef

    assert lora_aux(QWEN3_MOE) == 0.0  # its config.json: router_aux_loss_coef 0.001, output_router_logits false
    assert lora_aux(QWEN3_MOE, train_router=True) == 0.001
    logits_on = tmp_path / "logits_on"
    logits_on.mkdir()
    hf = json.loads((QWEN3_MOE / "config.json").read_text()) | {"output_router_logits": True}
    (logits_on / "config.json").write_text(json.dumps(hf))
    assert lora_aux(logits_on) == 0.001
    dense = config_from_dict(tiny_config(model_config=tiny.hf(tiny.QWEN3), router_z_loss_coef=0.1))
    with pytest.raises(TrainSetupError, match="router_z_loss_coef: applies to mixture-of-experts models only"):
        run_spec(dense, total_steps=1)
    with pytest.raises(Exception, match="train_router"):  # a LoRA option
        config_from_dict(tiny_config(model_config=dict(TINY_MOE), train_router=True))


def test_train_router_trains_only_the_router_and_exports_it_as_modules_to_save(tmp_path):
    """The LoRA trainable filter (TRAINABLE) with a RouterParam router, through the real train step: the router
    moves, every other weight stays bit-identical (with no RouterParam the router is FROZEN like the base).
    (LoRA adapters on a MoE base come with issue 15 item 5; this checks the router half of the trainable state.)"""
    import jax
    import jax.numpy as jnp
    import optax

    from surojax.losses.lm import lm_loss
    from surojax.losses.router import RouterLossWeights
    from surojax.peft.lora import FROZEN, TRAINABLE
    from surojax.peft.trained_router import add_router_to_adapter, make_router_trainable
    from surojax.train.step import make_train_step

    model = Decoder(ModelConfig.from_hf(TINY_MOE), rngs=nnx.Rngs(3))
    base = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert not jax.tree.leaves(nnx.state(model, TRAINABLE))  # without train_router nothing of the base trains
    assert make_router_trainable(model, jnp.float32) == 2 * 32 * 4
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    assert [k for k, _ in nnx.to_flat_state(trainable)] == [("layers", "mlp", "router", "kernel")]
    loss = lambda m, b: lm_loss(m, b, router=RouterLossWeights(aux_coef=0.02))  # noqa: E731
    opt = optax.adam(1e-2)
    step = make_train_step(graphdef, loss, opt, donate=False)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 512, (2, 1, 16)))  # A=2 micro-batches of 1 row
    batch = {"tokens": tokens, "positions": jnp.tile(jnp.arange(16), (2, 1, 1)),
             "segment_ids": jnp.ones((2, 1, 16), jnp.int32), "targets": jnp.roll(tokens, -1, -1),
             "loss_mask": jnp.ones((2, 1, 16), bool)}
    opt_state = opt.init(trainable)
    for i in range(2):
        trainable, opt_state, m = step(trainable, frozen, opt_state, batch, jax.random.key(i))
    assert m["router"].tokens.shape == (2,) and float(m["router"].tokens[0]) == 32  # summed over the micro-batches
    trained = nnx.merge(graphdef, trainable, frozen)
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(trained, nnx.Param))}
    router = ("layers", "mlp", "router", "kernel")
    assert np.abs(after[router] - base[router]).max() > 1e-4
    for k in base:
        if k != router:
            np.testing.assert_array_equal(after[k], base[k])
    assert router not in dict(nnx.to_flat_state(nnx.state(trained, FROZEN)))

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "modules_to_save": None}))
    from surojax.weights.safetensors_file import write_safetensors
    write_safetensors(adapter / "adapter_model.safetensors", {"x.lora_A.weight": np.zeros((4, 32), np.float32)})
    add_router_to_adapter(trained, adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["gate"]
    f = SafetensorsFile(adapter / "adapter_model.safetensors")
    assert "x.lora_A.weight" in f.names()
    for i in range(2):  # torch layout [E, D]
        np.testing.assert_array_equal(np.asarray(f.get(f"base_model.model.model.layers.{i}.mlp.gate.weight")),
                                      after[router][i].T)


def test_train_router_is_refused_on_a_dense_model():
    from surojax.peft.trained_router import make_router_trainable
    with pytest.raises(ValueError, match="dense model; it has no router"):
        make_router_trainable(Decoder(tiny.model_config(tiny.QWEN3), rngs=nnx.Rngs(0)), np.float32)


def test_starving_expert_is_warned_once_per_window(caplog):
    def stats(counts):
        c = np.asarray(counts, np.float32)  # [L, E]
        L = c.shape[0]
        return RouterStats(expert_counts=c, prob_sums=c / 2, z_sum=np.ones(L), entropy_sum=np.ones(L),
                           dropped=np.zeros(L), tokens=c.sum(-1) / 2)

    monitor = RouterMonitor(capacity=True, window=2)
    even = [[10, 10, 10, 10], [10, 10, 10, 10]]
    starving = [[10, 10, 10, 10], [41, 38, 1, 0]]  # layer 1: expert 2 gets 0.05x its fair share, expert 3 none
    with caplog.at_level(logging.WARNING):
        m = monitor.observe(1, stats(starving))
        assert not caplog.records  # mid-window: no warning yet
        monitor.observe(2, stats(starving))
        assert len(caplog.records) == 1
        msg = caplog.records[0].getMessage()
        assert "layer 1 expert 2" in msg and "layer 1 expert 3" in msg and "layer 0" not in msg
        monitor.observe(3, stats(even))
        monitor.observe(4, stats(even))
        assert len(caplog.records) == 1  # an even window: nothing
    assert m["router_load_max_l1"] == 41 * 4 / 80 and m["router_load_min_l1"] == 0.0 and m["router_dropped"] == 0.0
    assert progress_text(m).startswith("aux ") and "load max/min inf" in progress_text(m)
