"""The adaptive-training rules wired into the Trainer and the jitted step (the rules themselves: test_adaptive.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.config import config_from_dict
from surojax.train.trainer import Trainer


def test_a_non_finite_step_changes_nothing_and_halves_the_next_learning_rate(tiny_config):
    """auto_lr_reduction end to end: a step whose loss is NaN leaves every weight and the optimizer state as they
    were, is not fatal, and the next step runs at half the scheduled learning rate (the loss guard's cut)."""
    trainer = Trainer(config_from_dict(tiny_config(max_steps=6, auto_lr_reduction=True, lr_scheduler_type="constant")))
    trainer.prefetch_batches = False  # each step places its own batch: the one below is poisoned as it is placed
    trainer.step()
    before = jax.tree.map(np.asarray, (trainer.trainable, trainer.opt_state))
    poisoned = trainer._device_batch  # a batch whose loss mask is NaN gives a NaN loss and NaN gradients

    def nan_batch(batch):
        out = poisoned(batch)
        return dict(out, loss_mask=out["loss_mask"] * jnp.nan)

    trainer._device_batch = nan_batch
    m = trainer.step()
    trainer._device_batch = poisoned
    assert not np.isfinite(m["loss"]) and m["skipped"] == 1.0
    after = jax.tree.map(np.asarray, (trainer.trainable, trainer.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    assert trainer.lr_scale == 0.5
    m = trainer.step()
    assert m["skipped"] == 0.0 and m["lr"] == pytest.approx(trainer.cfg.learning_rate * 0.5, rel=1e-6)
    assert trainer.adaptive.state_dict()["loss_guard"] is not None  # saved with every checkpoint


def test_epoch_adjustment_sets_the_run_length_from_the_chinchilla_budget(tiny_config):
    from surojax.train.adaptive import epochs_for_budget

    cfg = config_from_dict(tiny_config(max_steps=None, num_epochs=1, epoch_adjustment=True))
    trainer = Trainer(cfg)
    epochs = epochs_for_budget(trainer.num_params, trainer.data.stats.tokens)
    assert epochs > 1  # a tiny data set: the budget asks for more than the one epoch written
    A, B = cfg.gradient_accumulation_steps, cfg.per_device_train_batch_size
    assert trainer.plan.total_steps == trainer.data.train.num_rows * epochs // (A * B)
