"""Schedules, the weight-decay mask and the metric sinks."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.decoder import Decoder
from surojax.train.metrics import Metrics, MetricsSinkError, plot_loss
from surojax.train.optim import decay_mask, lr_schedule

from tests.tiny import QWEN3, model_config


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine", "wsd"])
def test_schedules_warm_up_then_follow_their_shape(kind):
    s = lr_schedule(kind, 1.0, total_steps=100, warmup_steps=10, final_lr_fraction=0.1, cooldown_steps=20)
    lrs = np.array([float(s(i)) for i in range(100)])
    np.testing.assert_allclose(lrs[:10], np.arange(1, 11) / 10, rtol=1e-6)  # linear warmup to the peak
    assert lrs.max() == pytest.approx(1.0)
    if kind == "constant":
        assert np.all(lrs[10:] == 1.0)
    else:
        assert np.all(np.diff(lrs[10:]) <= 1e-7)  # never increases after warmup
        # the last step runs one decay step before the end value, final_lr_fraction * lr
        last_decay = 20 if kind == "wsd" else 90
        assert lrs[-1] == pytest.approx(0.1 + 0.9 / last_decay, abs=0.01)
    if kind == "wsd":
        assert np.all(lrs[10:80] == 1.0) and lrs[90] < 1.0  # stable, then the cooldown


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine", "wsd"])
def test_host_schedule_equals_the_optimizers(kind):
    """The trainer logs the numpy schedule (no device work after the step's dispatch): the optimizer's values."""
    args = (kind, 3e-4, 100, 10, 0.1, 20)
    on_device, on_host = lr_schedule(*args), lr_schedule(*args, xp=np)
    steps = np.arange(100)
    host = np.array([on_host(i) for i in steps])
    assert not isinstance(on_host(50), jax.Array)
    np.testing.assert_allclose(host, np.asarray(jnp.stack([on_device(i) for i in steps])), rtol=1e-6, atol=0)


def test_weight_decay_applies_to_matrices_only():
    model = Decoder(model_config(QWEN3, model_type="qwen2", vocab_size=64), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(decay_mask(params))}
    assert flat["layers.attn.q_proj.kernel"] is True and flat["embed.embedding"] is True
    assert flat["layers.attn.q_proj.bias"] is False  # qwen2 biases
    assert flat["layers.attn_norm.scale"] is False and flat["final_norm.scale"] is False
    qwen3 = Decoder(model_config(QWEN3, vocab_size=64), rngs=nnx.Rngs(0))
    flat3 = {".".join(map(str, p)): v.get_value()
             for p, v in nnx.to_flat_state(decay_mask(nnx.state(qwen3, nnx.Param)))}
    assert flat3["layers.attn.q_norm.scale"] is False and flat3["layers.mlp.down_proj.kernel"] is True


def test_metrics_jsonl_and_chart(tmp_path, monkeypatch):
    """... and the chart leaves matplotlib's backend alone (a notebook's inline one: plots after training show)."""
    import matplotlib

    monkeypatch.setitem(matplotlib.rcParams, "backend", "svg")  # as if the user's
    m = Metrics(tmp_path, report_to=["jsonl"])
    for step in range(1, 6):
        m.write(step, {"loss": 3.0 / step, "lr": jnp.asarray(1e-3)})
    m.write(5, {"eval_loss": 0.9})
    m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": 3.0, "lr": pytest.approx(1e-3)} and rows[-1]["eval_loss"] == 0.9
    png = plot_loss(m.history, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.rcParams["backend"] == "svg"


def test_unknown_or_missing_sink_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(MetricsSinkError, match="unknown"):
        Metrics(tmp_path, report_to=["mlflow"])
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(MetricsSinkError, match="pip install wandb"):
        Metrics(tmp_path, report_to=["wandb"])
