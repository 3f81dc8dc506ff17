"""Training a vision-language model on image rows.

- PEFT's LoRA on the tiny Qwen3-VL (scripts/make_vlm_lora_fixtures.py: transformers 5.17 + peft 0.21) loads into our
  model with PEFT's logits on an image row, and plain SGD through our train step (image batches made on the host by
  train/image_inputs.py, two micro-batches of one row each) follows PEFT's loss curve; our adapter saves under
  PEFT's names on Qwen3VLForConditionalGeneration (`base_model.model.model.language_model.layers.N...`).
- `surojax sft` in process on the tiny Qwen3-VL with the example image dataset's rows: 2 steps, a PEFT adapter saved.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from surojax.data.batch import FIELDS
from surojax.data.image_batch import collate_image_rows
from surojax.losses.lm import lm_loss
from surojax.models.decoder import vision_filter
from surojax.models.vision.inputs import VisionTokens
from surojax.peft.lora import TRAINABLE
from surojax.peft.peft_io import WEIGHTS_FILE, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.train.image_inputs import step_image_batch
from surojax.train.step import make_train_step
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3_vl"
FIXTURE = ROOT / "tests" / "fixtures" / "peft" / "qwen3_vl"
ROWS = np.load(ROOT / "tests" / "fixtures" / "vlm" / "qwen3_vl.npz")
EXPECTED = np.load(FIXTURE / "expected.npz")


def _row(case: str, seq: int) -> dict:
    """Fixture row `case` alone in a row of `seq` tokens (padding: segment 0), every next token supervised."""
    ids = ROWS[f"{case}_ids"].astype(np.int32)
    n = len(ids)
    row = {k: np.zeros(seq, dt) for k, dt in FIELDS.items()}
    row["tokens"][:n] = ids
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    row["targets"][:n - 1] = ids[1:]
    row["loss_mask"][:n - 1] = 1
    row["pixel_values"] = ROWS[f"{case}_pixels"]
    row["image_grid_thw"] = ROWS[f"{case}_grid"]
    return row


def test_lora_on_image_rows_follows_peft_loss_curve_and_exports_as_peft(tmp_path):
    model = load_adapter_into(load_model(BASE, dtype=jnp.float32, attention="xla"), FIXTURE / "adapter",
                              trainable=True)
    tokens = VisionTokens.from_config(model.cfg)
    batch = collate_image_rows([_row("a", 20), _row("b", 20)], tokens.vision.spatial_merge_size)
    micro = step_image_batch(batch, tokens, 2)  # two micro-batches: each its own images, one bucket
    assert micro["images"].pixel_values.shape[:2] == (2, 64) and micro["rope_positions"].shape == (2, 3, 1, 20)

    a = step_image_batch(batch, tokens, 1)  # PEFT's adapter in our model: PEFT's logits of row a
    images = type(a["images"])(*(x[0] for x in a["images"]))
    logits = nnx.jit(lambda m, b, i: m(b["tokens"][0], images=i, rope_positions=b["rope_positions"][0]))(
        model, a, images)
    np.testing.assert_allclose(np.asarray(logits)[0, :12], EXPECTED["logits_a"], rtol=0, atol=1e-4)

    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    assert not nnx.state(model, nnx.All(TRAINABLE, vision_filter))  # no adapter on the tower
    sgd = optax.sgd(float(EXPECTED["lr"]))
    step, opt_state = make_train_step(graphdef, lm_loss, sgd, donate=False), sgd.init(trainable)
    losses = []
    for _ in range(len(EXPECTED["losses"])):
        trainable, opt_state, m = step(trainable, frozen, opt_state, micro, None)
        losses.append(float(m["loss"]))  # the loss before the step's update
    assert np.all(np.diff(EXPECTED["losses"]) < -0.3)  # the curve moves, every step
    np.testing.assert_allclose(losses, EXPECTED["losses"], rtol=1e-4, atol=0)

    out = save_peft_adapter(nnx.merge(graphdef, trainable, frozen), tmp_path / "adapter", str(BASE))
    names = set(SafetensorsFile(out / WEIGHTS_FILE).names())
    assert names == set(SafetensorsFile(FIXTURE / "adapter" / WEIGHTS_FILE).names())
    assert all(n.startswith("base_model.model.model.language_model.layers.") for n in names)
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == sorted(
        json.loads((FIXTURE / "adapter" / "adapter_config.json").read_text())["target_modules"])
