"""The vision tower in the memory plan and the parameter counts (models/vision/counts.py): its parameter count equals
the loaded tower's, its forward FLOPs XLA's count; frozen it adds its weights in the compute dtype and its activations, no gradients or optimizer
state; trained (train_vision) it adds those too, or with LoRA its adapters'; a text model's plan is unchanged."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.counts import tower_activation_bytes, tower_flops_per_patch, tower_lora_params, tower_params
from surojax.models.vision.grid import vision_grid
from surojax.models.vision.tower import VisionTower
from surojax.offload.memory_plan import plan_memory
from surojax.peft.vision_lora import apply_vision_lora
from surojax.weights.hf_checkpoint import load_model

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def test_tower_params_equal_the_loaded_towers():
    for name in ("qwen3_vl", "qwen3_5"):
        model = load_model(MODELS / name)
        loaded = sum(x.size for x in jax.tree.leaves(nnx.state(model.visual, nnx.Param)))
        assert tower_params(VisionConfig.from_hf(model.cfg.hf_extra["vision_config"], model.cfg.model_type)) == loaded


def test_plan_counts_the_tower_frozen_or_trained():
    hf = json.loads((MODELS / "qwen3_vl" / "config.json").read_text())
    vlm = ModelConfig.from_hf(hf)
    text = ModelConfig.from_hf({**hf["text_config"], "model_type": "qwen3"})  # the same text model, no tower
    v = VisionConfig.from_hf(hf["vision_config"], "qwen3_vl")
    n = tower_params(v)
    common = dict(mode="full", recipe="bf16", batch=2, seq=64, optimizer="adamw")
    base, frozen = plan_memory(text, **common), plan_memory(vlm, **common, vision_patches=256)
    trained = plan_memory(vlm, **common, vision_patches=256, train_vision=True)
    assert frozen.weights - base.weights == 2 * n  # bf16, no master copy
    assert (frozen.gradients, frozen.optimizer) == (base.gradients, base.optimizer)
    assert frozen.activations - base.activations == tower_activation_bytes(v, 256, c=2, trains=False) > 0
    assert trained.weights - base.weights == 4 * n and trained.optimizer - base.optimizer == 8 * n
    assert trained.gradients - base.gradients == 8 * n
    assert trained.activations > frozen.activations > plan_memory(vlm, **common, vision_patches=64).activations
    lora = dict(common, mode="lora")
    assert plan_memory(vlm, **lora, vision_patches=256).weights - plan_memory(text, **lora).weights == 2 * n


def test_tower_flops_per_patch_match_xlas_count():
    """The forward FLOPs of a 1x8x8 image (one frame of 64 patches) against XLA's cost analysis of a random tower
    wide enough (hidden 256) for the matmuls to be the count (XLA counts the norms and activations too: ~1%)."""
    v = VisionConfig(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, patch_size=4, out_hidden_size=128,
                     num_position_embeddings=16, deepstack_visual_indexes=(0,))
    tower = nnx.eval_shape(lambda: VisionTower(v, rngs=nnx.Rngs(0)))
    grid = vision_grid(np.array([[1, 8, 8]]), v.spatial_merge_size, v.position_grid_side)
    run = jax.jit(lambda tower, x: (lambda o: (o.merged, o.deepstack))(tower(x, grid, dtype=jnp.float32)))
    cost = run.lower(tower, jax.ShapeDtypeStruct((64, v.patch_dim), jnp.float32)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    np.testing.assert_allclose(tower_flops_per_patch(v, 64) * 64, cost["flops"], rtol=0.02)


def test_attention_activations_grow_with_patches_times_frame():
    """Frames of at most 256 patches: twice the patches, about twice the bytes (the [R, L] layout); unknown frames
    (one frame of all the patches) grow with the square; the plan passes the frame bound through."""
    v = VisionConfig(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, patch_size=4, out_hidden_size=128,
                     num_position_embeddings=16, deepstack_visual_indexes=())
    framed = [tower_activation_bytes(v, n, c=2, trains=False, frame_patches=256) for n in (4096, 8192)]
    one_frame = [tower_activation_bytes(v, n, c=2, trains=False) for n in (4096, 8192)]
    assert framed[1] / framed[0] < 2.2 and one_frame[1] / one_frame[0] > 3.5
    cfg = ModelConfig.from_hf(json.loads((MODELS / "qwen3_vl" / "config.json").read_text()))
    common = dict(mode="lora", recipe="bf16", batch=2, seq=64, vision_patches=4096)
    assert (plan_memory(cfg, **common, vision_frame_patches=256).activations
            < plan_memory(cfg, **common).activations)


def test_plan_counts_the_towers_adapters_with_lora_and_train_vision():
    """lora + train_vision: the tower a frozen bf16 base, its adapters (tower_lora_params: the LoRAParams
    apply_vision_lora makes) with their gradients and optimizer state, and the activations kept for the backward."""
    model = load_model(MODELS / "qwen3_vl")
    v = VisionConfig.from_hf(model.cfg.hf_extra["vision_config"], "qwen3_vl")
    apply_vision_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(0))
    assert tower_lora_params(v, 4) == sum(x.size for x in jax.tree.leaves(nnx.state(model.visual, nnx.LoRAParam)))
    lora = dict(mode="lora", recipe="bf16", rank=4, batch=2, seq=64, optimizer="adamw", lora_dtype="fp32",
                vision_patches=256)
    frozen, adapted = plan_memory(model.cfg, **lora), plan_memory(model.cfg, **lora, train_vision=True)
    t = tower_lora_params(v, 4)
    assert adapted.weights == frozen.weights  # the tower's own weights: bf16 either way
    assert (adapted.adapters - frozen.adapters, adapted.optimizer - frozen.optimizer) == (4 * t, 8 * t)
    assert adapted.gradients - frozen.gradients == 8 * t
    assert adapted.activations - frozen.activations == (tower_activation_bytes(v, 256, c=2, trains=True)
                                                        - tower_activation_bytes(v, 256, c=2, trains=False))
