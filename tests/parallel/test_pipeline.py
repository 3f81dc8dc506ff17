"""Pipeline parallelism over `stage`: the schedule's arithmetic, the config's refusals, and (4 virtual CPU devices,
one child process for every multi-device check, as in test_sharding.py) the pipelined layers equal the plain scan
and the Trainer's pipelined losses equal one device's.

Tolerances: the pipelined layers run the same ops on the same rows as the scan (fp32), only the microbatch split
and the stage exchange differ, so rel 1e-5 holds (rounding of batched matmuls of other row counts). A gradient that
sums over rows (the embedding's scatter-add, the weights' contractions over the batch) adds the data shards' and
microbatches' parts in another order: it is compared at 1e-5 of its largest entry. The Trainer
compares with one device computing the whole batch (fp32, rel 1e-4, as issue 17 asks): the data-parallel gradient
sums are taken in another order.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the child runs this file as a script
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tests.parallel.virtual_devices import MARKER, check_passed, child_env, print_results  # noqa: E402
from surojax.parallel.pipeline import (PipelineError, bubble_fraction, check_pipeline,  # noqa: E402
                                       default_microbatches, schedule_length)

DEVICES = 4
TRAIN_STEPS = 2

# ---- in-process: the schedule's arithmetic and the refusals -------------------------------------------------------


def test_schedule_length_and_bubble():
    # M >= S: M R + S - 1 iterations, bubble (S-1) / (M R + S - 1) (the published circular-pipeline formula)
    assert schedule_length(4, 8, 1) == 11 and bubble_fraction(4, 8, 1) == pytest.approx(3 / 11)
    assert schedule_length(4, 8, 2) == 19 and bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    # M < S: a microbatch comes back to stage 0 after S iterations, so a repeat takes S iterations
    assert schedule_length(4, 2, 2) == 4 + 2 + 3 and bubble_fraction(4, 2, 2) == pytest.approx(1 - 4 / 9)
    assert bubble_fraction(1, 3, 1) == 0.0
    assert default_microbatches(2, 2) == 2 and default_microbatches(4, 16) == 8 and default_microbatches(4, 6) == 6
    assert default_microbatches(4, 7) == 7 and default_microbatches(3, 7) == 1


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_layers=6, rows=8, data_parallel=2, stages=4, microbatches=2, repeats=1), ["6 layers", "4 stages"]),
    (dict(num_layers=8, rows=8, data_parallel=2, stages=2, microbatches=3, repeats=1), ["3", "4 rows per data"]),
    (dict(num_layers=8, rows=8, data_parallel=2, stages=2, microbatches=2, repeats=3), ["3 repeats", "6"]),
])
def test_check_pipeline_refuses_bad_shapes(kwargs, words):
    with pytest.raises(PipelineError) as err:
        check_pipeline(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def _base_config(tmp) -> dict:
    """A tiny fp32 from-scratch run (tests/train/conftest.py's model and data), without output_dir / batch size."""
    from tests.tiny import QWEN3, hf
    from tests.train.conftest import TOKENIZER, write_text_data

    return {"from_scratch": True, "tokenizer": str(TOKENIZER), "model_config": hf(QWEN3),
            "recipe": "fp32", "datasets": [{"path": str(write_text_data(tmp / "text.jsonl")), "type": "text"}],
            "sequence_len": 64, "learning_rate": 3e-3, "lr_scheduler_type": "constant", "seed": 0,
            "max_steps": TRAIN_STEPS, "gradient_accumulation_steps": 2, "recompute": "full",
            "output_dir": str(tmp / "out")}


def test_config_reads_or_refuses_the_pipeline_keys(tmp_path):
    from surojax.config import ConfigError, config_from_dict

    base = _base_config(tmp_path)
    with pytest.raises(ConfigError, match="pipeline_microbatches"):
        config_from_dict({**base, "parallel": {"pipeline_microbatches": 2}})
    with pytest.raises(ConfigError, match="offload_base_weights"):
        config_from_dict({**base, "parallel": {"stage": 2}, "lora": True, "offload_base_weights": True})
    cfg = config_from_dict({**base, "parallel": {"stage": 2, "pipeline_microbatches": 2, "pipeline_repeats": 1}})
    assert cfg.parallel.stage == 2 and cfg.parallel.pipeline_microbatches == 2


# ---- 4 devices, in a child process ---------------------------------------------------------------------------------

CHILD_CHECKS: dict = {}


def child_check(fn):
    CHILD_CHECKS[fn.__name__] = fn
    return fn


def _tiny_decoder(lora: bool):
    from flax import nnx

    from surojax.models.config import ModelConfig
    from surojax.models.decoder import Decoder
    from surojax.peft.lora import apply_lora, lora_modules

    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True)
    model = Decoder(cfg, attention="xla", rngs=nnx.Rngs(0))
    if lora:
        apply_lora(model, targets=("q_proj", "down_proj"), rank=2, alpha=4.0, rngs=nnx.Rngs(1))
        for i, mod in enumerate(lora_modules(model).values()):  # B is zero at init: make the adapter matter
            b = mod.lora_b.get_value()
            mod.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(10 + i), b.shape, b.dtype))
    return model


def _loss_and_grads(model, batch, mesh, runner):
    """A probe of every hidden state (not only the LM loss) and its gradients w.r.t. the trainable Params."""
    from flax import nnx

    from surojax.parallel.rules import batch_sharding, param_shardings, shard_model

    shard_model(model, mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    probe = jax.random.normal(jax.random.key(5), batch[0].shape + (model.cfg.hidden_size,))

    def loss(params, tokens, positions, segment_ids):
        h = nnx.merge(graphdef, params, rest).hidden_states(tokens, positions, segment_ids, runner=runner).hidden
        return (h * probe).sum(), h

    bs = batch_sharding(mesh)
    run = jax.jit(jax.value_and_grad(loss, has_aux=True), in_shardings=(param_shardings(params, mesh), bs, bs, bs))
    (_, h), g = run(params, *[jax.device_put(x, bs) for x in batch])
    return np.asarray(h), {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(g)}


@child_check
def check_pipelined_layers_match_the_scan():
    """Decoder.hidden_states through the pipeline layer loop == the plain scan: hidden states and every gradient
    (base weights and LoRA adapters), for microbatches 1, 2, 4 (4 > stages: stage 0 holds returning microbatches)
    and repeats 1, 2 (circular), on stage 2 x data 2 and stage 4. Every case has LoRA adapters (so one reference
    program serves them all): the LoRA-free pipelined layers train in check_trainer_on_stage_2_x_data_2, whose
    losses meet one device's."""
    from surojax.parallel.mesh import make_mesh
    from surojax.parallel.pipeline import PipelinedLayers
    from surojax.models.layer_runner import Recompute
    from tests.parallel.test_sharding import _packed_batch

    batch = _packed_batch(8, 8, 64)
    cases = [({"stage": 2, "data": 2}, 1, 1), ({"stage": 2, "data": 2}, 4, 2), ({"stage": 4}, 2, 1)]
    h_ref, grads_ref = _loss_and_grads(_tiny_decoder(True), batch,
                                       make_mesh({"data": 1, "stage": 1}, jax.devices()[:1]), None)
    for parallel, m, r in cases:
        mesh = make_mesh(parallel)
        loop = PipelinedLayers(mesh, microbatches=m, repeats=r, recompute=Recompute.FULL if r > 1 else Recompute.NONE)
        h, grads = _loss_and_grads(_tiny_decoder(True), batch, mesh, loop)
        where = f"{parallel} M={m} R={r}"
        np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-6, err_msg=where)
        assert grads.keys() == grads_ref.keys() and any("lora_a" in str(k) for k in grads)
        for k in grads_ref:
            if k[0] == "layers":  # every layer gradient is exercised (the probe reads h before the LM head)
                assert np.abs(grads_ref[k]).max() > 0, (where, k)
            np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-5, atol=1e-5 * np.abs(grads_ref[k]).max(),
                                       err_msg=f"{where} {k}")


@child_check
def check_pipeline_in_bf16_matches_the_scan():
    """bf16 activations and weights through the pipeline (the bf16 recipe's dtypes): value and gradients equal the
    plain scan's. XLA CPU aborted compiling this when the stage collectives carried bf16 (pipeline.py)."""
    import jax.numpy as jnp

    from surojax.parallel.mesh import make_mesh
    from surojax.parallel.pipeline import pipeline_layers

    def layer(w, h, consts):
        (scale,) = consts
        return jnp.tanh(h @ w) * scale[:, None, None] + h

    kh, kw = jax.random.split(jax.random.key(3))
    h = jax.random.normal(kh, (8, 4, 16), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (4, 16, 16), jnp.float32) / 4).astype(jnp.bfloat16)
    scale = jnp.linspace(0.5, 1.5, 8).astype(jnp.bfloat16)

    def scan(w, h):
        return jax.lax.scan(lambda x, wl: (layer(wl, x, (scale,)), None), h, w)[0]

    def loss(run):
        return lambda w, h: jnp.sum(run(w, h).astype(jnp.float32) ** 2)

    mesh = make_mesh({"stage": 2, "data": 2})
    piped = lambda w, h: pipeline_layers(layer, w, h, (scale,), mesh=mesh, microbatches=2)  # noqa: E731
    want = jax.jit(jax.value_and_grad(loss(scan), argnums=(0, 1)))(w, h)
    got = jax.jit(jax.value_and_grad(loss(piped), argnums=(0, 1)))(w, h)
    assert got[0].dtype == jnp.float32 and got[1][1].dtype == jnp.bfloat16
    # bf16 rounding: the weight gradient is summed over microbatches in bf16 (the scan's in one matmul), so
    # values agree to a few bf16 ulps of the array's scale, not elementwise; a wrong schedule is off by O(1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=3e-2 * np.abs(b).max())


def _trainer_losses(config: dict) -> tuple[list[float], object]:
    from surojax.config import config_from_dict
    from surojax.train.trainer import Trainer

    t = Trainer(config_from_dict(config))
    try:
        return [float(t.step()["loss"]) for _ in range(TRAIN_STEPS)], t
    finally:
        t.close()


@child_check
def check_trainer_on_stage_2_x_data_2():
    """The Trainer with parallel {stage: 2, data: 2}: layer weights, LoRA-free full fine-tune, optimizer state split
    over `stage`; the per-step losses are written for the parent to compare with one device."""
    config = json.loads(os.environ["PIPELINE_TRAIN_CONFIG"])
    losses, t = _trainer_losses(config)
    specs = {".".join(map(str, k)): v.get_value().sharding.spec
             for k, v in __import__("flax").nnx.to_flat_state(t.trainable)}
    assert specs["layers.attn.q_proj.kernel"][0] == "stage", specs
    assert "stage" not in str(specs["embed.embedding"]), specs  # only the stacked layers split over stage
    moments = [x for x in jax.tree.leaves(t.opt_state) if getattr(x, "ndim", 0) == 3]
    assert moments and all(x.sharding.spec[0] == "stage" for x in moments)
    assert "bubble" in t.run.layer_loop_reason, t.run.layer_loop_reason
    print("TRAIN_LOSSES " + json.dumps(losses), flush=True)


@pytest.fixture(scope="module")
def child_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    base = _base_config(tmp)
    pipelined = {**base, "output_dir": str(tmp / "pp"), "per_device_train_batch_size": 2,
                 "parallel": {"stage": 2, "data": 2}}
    env = child_env(DEVICES, {"PIPELINE_TRAIN_CONFIG": json.dumps(pipelined)})
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    # the one-device reference trains here while the child runs: the same global batch (2 rows x data 2)
    single = {**base, "output_dir": str(tmp / "one"), "per_device_train_batch_size": 4, "parallel": {"data": 1}}
    reference, _ = _trainer_losses(single)
    out, err = proc.communicate(timeout=600)
    results = [ln for ln in out.splitlines() if ln.startswith(MARKER)]
    if proc.returncode or not results:
        pytest.fail(f"pipeline child failed (rc {proc.returncode}):\n{out[-4000:]}\n{err[-4000:]}")
    losses = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("TRAIN_LOSSES ")]
    return json.loads(results[-1][len(MARKER):]), (losses[-1] if losses else None), reference


@pytest.mark.parametrize("name", list(CHILD_CHECKS))
def test_on_4_devices(child_run, name):
    check_passed(child_run[0], name, f"{DEVICES} devices")


def test_pipelined_trainer_losses_equal_one_device(child_run):
    _, pipelined, reference = child_run
    assert pipelined is not None, "the pipelined Trainer check did not report its losses"
    assert len(pipelined) == len(reference) == TRAIN_STEPS
    np.testing.assert_allclose(pipelined, reference, rtol=1e-4)
    assert reference[1] < reference[0]


if __name__ == "__main__":
    print_results(CHILD_CHECKS, devices=DEVICES)
