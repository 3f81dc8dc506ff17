"""Training a vision-language model on image rows.

- PEFT's LoRA on the tiny Qwen3-VL (scripts/make_vlm_lora_fixtures.py: transformers 5.17 + peft 0.21) loads into our
  model with PEFT's logits on an image row, and plain SGD through our train step (image batches made on the host by
  train/image_inputs.py, two micro-batches of one row each) follows PEFT's loss curve; our adapter saves under
  PEFT's names on Qwen3VLForConditionalGeneration (`base_model.model.model.language_model.layers.N...`).
- `surojax sft` in process on the tiny Qwen3-VL with the example image dataset's rows: 2 steps, a PEFT adapter saved.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from surojax.config import config_from_dict
from surojax.config.errors import ConfigError
from surojax.data.batch import FIELDS
from surojax.data.image_batch import collate_image_rows
from surojax.data.preference import build_preference_data
from surojax.data.prompts import load_prompts
from surojax.data.sources import DataError
from surojax.data.tokenizer import Tokenizer
from surojax.losses.lm import lm_loss
from surojax.models.decoder import vision_filter
from surojax.models.vision.inputs import VisionTokens
from surojax.peft.lora import TRAINABLE, apply_lora, lora_modules, vision_lora_modules
from surojax.peft.vision_lora import apply_vision_lora
from surojax.models.registry import weight_rows
from surojax.peft.peft_io import WEIGHTS_FILE, AdapterError, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.quant.model import is_quantized
from surojax.train.distill import text_rows_only
from surojax.train.image_inputs import step_image_batch
from surojax.train.model_setup import build_model, trainable_filter
from surojax.train.run_spec import TrainSetupError, run_spec
from surojax.train.step import make_train_step
from surojax.train.trainer import Trainer
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3_vl"
FIXTURE = ROOT / "tests" / "fixtures" / "peft" / "qwen3_vl"
TOWER = ROOT / "tests" / "fixtures" / "peft" / "qwen3_vl_tower"  # the same with the tower's adapters (--tower)
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


def test_tower_lora_follows_peft_loss_curve_and_resaves_as_peft(tmp_path):
    """PEFT's adapter on the language model AND the tower's / mergers' Linears (make_vlm_lora_fixtures.py --tower):
    our loader gives PEFT's logits (continued, or folded into the base); re-saved it is PEFT's folder again (the
    same tensor names, values and target_modules: what peft loads); with gradients flowing through the tower
    (train_vision) plain SGD follows PEFT's loss curve and moves the tower's adapters."""
    expected = np.load(TOWER / "expected.npz")
    model = load_adapter_into(load_model(BASE, dtype=jnp.float32, attention="xla"), TOWER / "adapter", trainable=True)
    assert len(vision_lora_modules(model)) == 4 * 3 + 2 * 3  # 3 blocks; the merger and 2 deepstack mergers
    tokens = VisionTokens.from_config(model.cfg)
    batch = collate_image_rows([_row("a", 20), _row("b", 20)], tokens.vision.spatial_merge_size)
    a = step_image_batch(batch, tokens, 1)
    images = type(a["images"])(*(x[0] for x in a["images"]))
    forward = nnx.jit(lambda m, b, i: m(b["tokens"][0], images=i, rope_positions=b["rope_positions"][0]))
    np.testing.assert_allclose(np.asarray(forward(model, a, images))[0, :12], expected["logits_a"], rtol=0, atol=1e-4)
    folded = load_adapter_into(load_model(BASE, dtype=jnp.float32, attention="xla"), TOWER / "adapter",
                               trainable=False)
    np.testing.assert_allclose(np.asarray(forward(folded, a, images))[0, :12], expected["logits_a"], rtol=0,
                               atol=1e-4)

    again = save_peft_adapter(model, tmp_path / "again", str(BASE))
    ours, theirs = SafetensorsFile(again / WEIGHTS_FILE), SafetensorsFile(TOWER / "adapter" / WEIGHTS_FILE)
    assert sorted(ours.names()) == sorted(theirs.names())
    assert all(np.array_equal(ours.get(n), theirs.get(n)) for n in theirs.names())
    assert sorted(json.loads((again / "adapter_config.json").read_text())["target_modules"]) == sorted(
        json.loads((TOWER / "adapter" / "adapter_config.json").read_text())["target_modules"])

    with pytest.raises(AdapterError, match="holds adapters on a vision tower .* runtime adapter slots"):
        load_peft_adapter(TOWER / "adapter", rows=tuple(weight_rows(model.cfg)), num_layers=model.cfg.num_layers)

    model.train_vision = True  # what set_vision_training does for a run with train_vision
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    tower_before = jax.tree.map(np.asarray, nnx.state(trainable, vision_filter))
    sgd = optax.sgd(float(expected["lr"]))
    step, opt_state = make_train_step(graphdef, lm_loss, sgd, donate=False), sgd.init(trainable)
    micro = step_image_batch(batch, tokens, 2)
    losses = []
    for _ in range(len(expected["losses"])):
        trainable, opt_state, m = step(trainable, frozen, opt_state, micro, None)
        losses.append(float(m["loss"]))
    assert np.all(np.diff(expected["losses"]) < -0.2)
    np.testing.assert_allclose(losses, expected["losses"], rtol=1e-4, atol=0)
    moved = jax.tree.map(lambda x, y: not np.array_equal(x, np.asarray(y)), tower_before,
                         nnx.state(trainable, vision_filter))
    assert all(jax.tree.leaves(moved))  # every tower adapter got a gradient


def _tiny_vlm_folder(tmp_path: Path) -> Path:
    """The tiny Qwen3-VL with the vision_chat fixture's tokenizer (516 tokens, its image / video / vision-start
    tokens 514 / 515 / 512): the embedding and head grown to 516 rows (new rows N(0, 0.2)), and a processor for
    the tower's patch 4 at most 32x32 pixels an image."""
    folder = tmp_path / "tiny_vlm"
    folder.mkdir()
    chat = ROOT / "tests" / "fixtures" / "vision_chat"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat / name, folder / name)
    cfg = json.loads((BASE / "config.json").read_text())
    cfg.update(image_token_id=514, video_token_id=515, vision_start_token_id=512, vision_end_token_id=513)
    cfg["text_config"]["vocab_size"] = 516
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = SafetensorsFile(BASE / "model.safetensors")
    rng = np.random.default_rng(0)
    tensors = {n: weights.get(n) for n in weights.names()}
    for name in ("lm_head.weight", "model.language_model.embed_tokens.weight"):
        w = tensors[name]
        tensors[name] = np.concatenate([w, 0.2 * rng.standard_normal((516 - len(w), w.shape[1]), w.dtype)])
    write_safetensors(folder / "model.safetensors", tensors)
    proc = json.loads((chat / "preprocessor_config.json").read_text())
    proc.update(patch_size=4, size={"shortest_edge": 64, "longest_edge": 32 * 32})
    (folder / "preprocessor_config.json").write_text(json.dumps(proc))
    return folder


def test_sft_on_the_example_image_dataset_saves_an_adapter(tmp_path):
    """`surojax sft` (in process) with the example image rows: LoRA on the language model, 2 steps of 2 micro-batches
    each, eval on the image test rows, the PEFT adapter written; the tower frozen (no optimizer state)."""
    data = ROOT / "examples" / "data" / "images"
    cfg = config_from_dict(dict(
        model=str(_tiny_vlm_folder(tmp_path)), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none",
        lora=True, lora_rank=4, lora_alpha=8, lora_target_modules="all-linear",
        datasets=[{"path": str(data / "train.jsonl"), "type": "conversation"}],
        validation_datasets=[{"path": str(data / "test.jsonl"), "type": "conversation"}],
        sequence_len=128, sample_packing=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-2, lr_scheduler_type="constant", max_steps=2, seed=0))
    trainer = Trainer(cfg)
    assert trainer.data.stats.images > 0
    assert not nnx.filter_state(trainer.trainable, vision_filter)  # the tower: frozen, no optimizer state
    last = trainer.train()
    assert np.isfinite(last["loss"]) and np.isfinite(last["eval_loss"])
    adapter = tmp_path / "out" / "adapter"
    names = SafetensorsFile(adapter / WEIGHTS_FILE).names()
    assert names and all(n.startswith("base_model.model.model.language_model.layers.") for n in names)


@pytest.mark.parametrize("train_vision", [False, True])
def test_full_fine_tuning_leaves_the_tower_frozen_unless_train_vision(tmp_path, train_vision):
    """Full fine-tuning trains the language model; the tower (stored in the compute dtype) only with train_vision."""
    cfg = config_from_dict(dict(model=str(BASE), output_dir=str(tmp_path / "out"), recipe="bf16",
                                train_vision=train_vision, datasets=[{"path": "unused.jsonl"}]))
    spec = run_spec(cfg, total_steps=1)
    model = build_model(spec)
    trainable = nnx.state(model, trainable_filter(spec))
    assert bool(nnx.state(trainable, vision_filter)) is train_vision
    assert nnx.state(trainable, nnx.Not(vision_filter))  # the language model trains either way
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model.visual, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32 if train_vision else jnp.bfloat16)} and model.train_vision is train_vision


def test_train_vision_and_image_rows_refused_where_not_read(tmp_path):
    with pytest.raises(ConfigError, match="'attn.qkv' is a vision tower module: set train_vision: true"):
        config_from_dict(dict(model=str(BASE), lora=True, lora_target_modules=["q_proj", "attn.qkv"],
                              datasets=[{"path": "x.jsonl"}]))
    with pytest.raises(ConfigError, match="trainer: dpo"):
        config_from_dict(dict(model=str(BASE), trainer="dpo", train_vision=True, datasets=[{"path": "x.jsonl"}]))
    with pytest.raises(TrainSetupError, match="train_vision: qwen3 has no vision tower"):
        run_spec(config_from_dict(dict(model=str(ROOT / "tests" / "fixtures" / "models" / "qwen3"),
                                       train_vision=True, datasets=[{"path": "x.jsonl"}])), total_steps=1)
    image_row = {"images": ["a.png"], "prompt": "<image>Which colour?", "chosen": "Red.", "rejected": "Blue."}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(image_row) + "\n")
    tok = Tokenizer.from_dir(ROOT / "tests" / "fixtures" / "vision_chat")
    with pytest.raises(DataError, match="trainer: dpo trains on text pairs only"):
        build_preference_data([{"path": str(path), "type": "preference"}], tok, sequence_len=64, batch_size=1)
    path.write_text(json.dumps({"images": ["a.png"], "prompt": "<image>Which colour?"}) + "\n")
    with pytest.raises(DataError, match="trainer: grpo generates from text prompts only"):
        load_prompts([{"path": str(path), "type": "prompt"}], tok, max_prompt_len=64)
    closed = []
    data = SimpleNamespace(stats=SimpleNamespace(images=3), train=SimpleNamespace(close=lambda: closed.append(1)))
    with pytest.raises(TrainSetupError, match="trainer: distill trains on text rows only.*3 images"):
        text_rows_only(data)
    assert closed  # the loader's threads stopped before the error


def test_full_fine_tuning_with_train_vision_trains_the_tower_and_saves_it(tmp_path):
    """train_vision: true (full fine-tuning): one step on the example image rows moves the tower's weights
    (gradients flow through it, the optimizer holds it); the saved model folder holds the trained tower."""
    data = ROOT / "examples" / "data" / "images"
    cfg = config_from_dict(dict(
        model=str(_tiny_vlm_folder(tmp_path)), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none",
        train_vision=True, datasets=[{"path": str(data / "train.jsonl"), "type": "conversation"}],
        sequence_len=128, per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant",
        max_steps=1, seed=0))
    trainer = Trainer(cfg)
    def tower():
        return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.filter_state(trainer.trainable,
                                                                                             vision_filter))}

    before = tower()
    assert before
    trainer.train()
    after = tower()
    assert all(not np.array_equal(before[k], after[k]) for k in before if k[-1] == "kernel")
    saved = SafetensorsFile(tmp_path / "out" / "model" / "model.safetensors")
    qkv = saved.get("model.visual.blocks.0.attn.qkv.weight")
    kernel = next(v for k, v in after.items() if "blocks" in k and 0 in k and "qkv" in k and k[-1] == "kernel")
    np.testing.assert_array_equal(qkv, kernel.T)


def _spec(tmp_path, **kw):
    cfg = dict(model=str(BASE), output_dir=str(tmp_path / "out"), recipe="bf16", lora=True, lora_rank=4, lora_alpha=8,
               datasets=[{"path": "unused.jsonl"}])
    return run_spec(config_from_dict({**cfg, **kw}), total_steps=1)


def test_lora_with_train_vision_puts_adapters_on_every_tower_linear(tmp_path):
    """lora + train_vision: an adapter on each Linear of the blocks and mergers (not the patch embedding), trained
    with the language model's; the tower's own weights a frozen base in the compute dtype; the gradients flow
    through the tower (no stop_gradient). An adapter continued as saved must agree with train_vision."""
    spec = _spec(tmp_path, train_vision=True)
    model = build_model(spec)
    trainable = nnx.state(model, trainable_filter(spec))
    tower = nnx.to_flat_state(nnx.state(trainable, vision_filter))
    paths = {".".join(map(str, p[1:-1])) for p, _ in tower}
    depth = model.visual.cfg.depth
    assert paths == {f"blocks.{i}.{m}" for i in range(depth) for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1",
                                                                        "mlp.linear_fc2")} | {
        f"{m}.{fc}" for m in ("merger", "deepstack_merger_list.0", "deepstack_merger_list.1")
        for fc in ("linear_fc1", "linear_fc2")}
    assert all(isinstance(v, nnx.LoRAParam) for _, v in tower) and model.train_vision
    frozen = nnx.state(model.visual, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert not nnx.state(build_model(_spec(tmp_path)), nnx.All(nnx.LoRAParam, vision_filter))  # default: none

    with pytest.raises(TrainSetupError, match="adapter_init_mode: trainable continues .* which has none there"):
        build_model(_spec(tmp_path, train_vision=True, adapter_path=str(FIXTURE / "adapter"),
                          adapter_init_mode="trainable"))


def test_qlora_on_image_rows_trains_the_adapters_over_an_nf4_base(tmp_path):
    """qlora_bnb (NF4) with train_vision: the language model's targets quantised, the tower a frozen bf16 base with
    adapters (never quantised); plain SGD on the two image rows lowers the loss at every step."""
    spec = _spec(tmp_path, qlora_bnb=True, train_vision=True)
    model = build_model(spec)
    assert set(is_quantized(model).values()) == {"nf4"}
    frozen = nnx.state(model.visual, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}  # no quantised (uint8) leaves
    tokens = VisionTokens.from_config(model.cfg)
    micro = step_image_batch(collate_image_rows([_row("a", 20), _row("b", 20)], tokens.vision.spatial_merge_size),
                             tokens, 2)
    graphdef, trainable, frozen = nnx.split(model, trainable_filter(spec), ...)
    assert nnx.state(trainable, vision_filter)  # the tower's adapters train
    sgd = optax.sgd(0.5)
    step, opt_state = make_train_step(graphdef, lm_loss, sgd, donate=False), sgd.init(trainable)
    losses = []
    for _ in range(4):
        trainable, opt_state, m = step(trainable, frozen, opt_state, micro, None)
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0), losses


def test_peft_loads_our_tower_adapter_with_our_logits(tmp_path):
    """Live (where torch, transformers and peft are installed): our LoRA on the language model and the tower, saved,
    loads with PeftModel.from_pretrained on transformers' Qwen3VLForConditionalGeneration and gives our fp32 logits
    on an image row; our own loader reads it back to the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_model = pytest.importorskip("peft.peft_model")
    model = load_model(BASE, dtype=jnp.float32, attention="xla")
    spec = dict(rank=4, alpha=8.0, rngs=nnx.Rngs(0))
    apply_vision_lora(apply_lora(model, targets="all-linear", **spec), **spec)
    key = jax.random.key(5)
    for i, mod in enumerate([*lora_modules(model).values(), *vision_lora_modules(model).values()]):
        b = mod.lora_b.get_value()
        mod.lora_b.set_value(0.2 * jax.random.normal(jax.random.fold_in(key, i), b.shape, b.dtype))
    tokens = VisionTokens.from_config(model.cfg)
    n = len(ROWS["a_ids"])
    a = step_image_batch(collate_image_rows([_row("a", n)], tokens.vision.spatial_merge_size), tokens, 1)
    images = type(a["images"])(*(x[0] for x in a["images"]))
    forward = nnx.jit(lambda m, b, i: m(b["tokens"][0], images=i, rope_positions=b["rope_positions"][0]))
    ours = np.asarray(forward(model, a, images))[0]
    out = save_peft_adapter(model, tmp_path / "adapter", str(BASE))

    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(BASE, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    ids = torch.tensor(ROWS["a_ids"].astype(np.int64))[None]
    inputs = dict(input_ids=ids, pixel_values=torch.tensor(ROWS["a_pixels"]),
                  image_grid_thw=torch.tensor(ROWS["a_grid"]), mm_token_type_ids=(ids == model.cfg.hf_extra[
                      "image_token_id"]).long())
    with torch.no_grad():
        base_logits = hf(**inputs).logits[0].numpy()
        peft = peft_model.PeftModel.from_pretrained(hf, out).eval()
        assert sum(".visual." in name and "lora_A" in name for name, _ in peft.named_parameters()) == 18
        theirs = peft(**inputs).logits[0].numpy()
    assert np.abs(theirs - base_logits).max() > 0.05  # the adapter was applied
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    back = load_adapter_into(load_model(BASE, dtype=jnp.float32, attention="xla"), out, trainable=True)
    np.testing.assert_array_equal(np.asarray(forward(back, a, images))[0], ours)
