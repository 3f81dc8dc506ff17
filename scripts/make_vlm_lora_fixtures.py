"""PEFT's LoRA on the tiny Qwen3-VL (tests/fixtures/models/qwen3_vl) trained on image rows: the loss curve of plain
SGD on the adapter, made by transformers 5.17 + peft 0.21 (refenv: `/work/refenv/bin/python
scripts/make_vlm_lora_fixtures.py`), for tests/train/test_vlm_training.py.

Rows: cases `a` (one image, grid 1x4x4) and `b` (two images, 1x2x6 and 1x6x4) of tests/fixtures/vlm/qwen3_vl.npz
(ids, pixel_values, image_grid_thw). Each row runs alone (no padding); the loss of a step is transformers' causal-LM
cross-entropy over both rows' next-token predictions together: (sum over a + sum over b) / (len(a) - 1 + len(b) - 1).

Adapter: r 4, alpha 8, on q/k/v/o/gate/up/down_proj (the names only the language model has: the vision tower's
Linears are attn.qkv / attn.proj / mlp.linear_fc1 / linear_fc2, the mergers' linear_fc1 / linear_fc2, so the tower
and mergers take none), init_lora_weights=False (B non-zero) with B scaled by 0.2, dropout 0. Written:
tests/fixtures/peft/qwen3_vl/adapter/ (PEFT's folder: its names `base_model.model.model.language_model.layers.N...`)
and expected.npz: `losses` (before each of SGD_STEPS steps of lr SGD_LR, and after the last), `lr`, and `logits_a`
(row a's logits with the initial adapter).

`--tower`: the same with adapters on the vision tower and mergers too (`train_vision: true` with LoRA:
surojax/peft/vision_lora.py), target_modules + attn.qkv / attn.proj / linear_fc1 / linear_fc2 (every Linear of the
blocks, the merger and the deepstack mergers; the patch embedding, a Conv3d, takes none), written to
tests/fixtures/peft/qwen3_vl_tower/.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3VLForConditionalGeneration

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3_vl"
ROWS = ROOT / "tests" / "fixtures" / "vlm" / "qwen3_vl.npz"
OUT = ROOT / "tests" / "fixtures" / "peft" / "qwen3_vl"
TOWER_OUT = ROOT / "tests" / "fixtures" / "peft" / "qwen3_vl_tower"
IMAGE_TOKEN = 250  # the fixture's image_token_id
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOWER_TARGETS = ["attn.qkv", "attn.proj", "linear_fc1", "linear_fc2"]
SGD_LR, SGD_STEPS = 0.5, 4


def main(tower: bool) -> None:
    out_dir = TOWER_OUT if tower else OUT
    torch.manual_seed(11)
    model = Qwen3VLForConditionalGeneration.from_pretrained(BASE, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS + (TOWER_TARGETS if tower else []), lora_dropout=0.0,
                      init_lora_weights=False)
    pmodel = get_peft_model(model, lora).eval()
    wrapped = [n for n, _ in pmodel.named_parameters() if "lora_A" in n]
    visual = [n for n in wrapped if ".visual." in n]
    assert wrapped and all(".language_model." in n or n in visual for n in wrapped), wrapped[:3]
    if tower:  # every Linear of the blocks and mergers, not the patch embedding
        depth, deepstack = model.config.vision_config.depth, len(model.config.vision_config.deepstack_visual_indexes)
        assert len(visual) == 4 * depth + 2 * (1 + deepstack) and not any("patch_embed" in n for n in visual), visual
    else:
        assert not visual, visual[:3]
    with torch.no_grad():
        for name, p in pmodel.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    data = np.load(ROWS)
    rows = [(torch.tensor(data[f"{c}_ids"])[None], torch.tensor(data[f"{c}_pixels"]),
             torch.tensor(data[f"{c}_grid"])) for c in "ab"]

    def forward(ids, pixels, grid):  # mm_token_type_ids: 1 on image tokens (what the processor returns)
        return pmodel(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                      mm_token_type_ids=(ids == IMAGE_TOKEN).long()).logits

    def loss_of():
        total, count = 0.0, 0
        for ids, pixels, grid in rows:
            logits = forward(ids, pixels, grid)[0, :-1]
            total = total + torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
            count += ids.shape[1] - 1
        return total / count

    with torch.no_grad():
        ids, pixels, grid = rows[0]
        logits_a = forward(ids, pixels, grid)[0].numpy()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    (out_dir / "adapter").mkdir(parents=True)
    pmodel.save_pretrained(out_dir / "adapter")
    (out_dir / "adapter" / "README.md").unlink(missing_ok=True)
    cfg_path = out_dir / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["base_model_name_or_path"] = str(BASE.relative_to(ROOT))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    params = [p for n, p in pmodel.named_parameters() if "lora_" in n]
    losses = []
    for _ in range(SGD_STEPS):
        loss = loss_of()
        losses.append(loss.item())
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= SGD_LR * p.grad
    with torch.no_grad():
        losses.append(loss_of().item())
    np.savez(out_dir / "expected.npz", losses=np.array(losses, np.float64), lr=np.float64(SGD_LR),
             logits_a=logits_a.astype(np.float32))
    print(f"losses {losses}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tower", action="store_true", help="adapters on the vision tower too (qwen3_vl_tower/)")
    main(parser.parse_args().tower)
