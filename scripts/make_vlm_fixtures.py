"""Golden fixtures for the vision-language decoder (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE with images):
tiny random checkpoints made by transformers 5.17, and the logits it computes on rows with images.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_vlm_fixtures.py

tests/fixtures/models/qwen3_vl/      Qwen3VLForConditionalGeneration: text 3 layers (q/k norm, head_dim 16, M-RoPE
                                     mrope_section [4, 2, 2] interleaved, untied head), tower 3 blocks with
                                     deepstack_visual_indexes [0, 2] (two deepstack features: added after decoder
                                     layers 0 and 1)
tests/fixtures/models/qwen3_vl_moe/  Qwen3VLMoeForConditionalGeneration: the same with every MLP the sparse MoE
                                     (4 experts, top-2, moe_intermediate_size 8); save_pretrained writes the experts
                                     in memory ([E, 2F, D] / [E, D, F]; published checkpoints hold [E, D, 2F] / [E, F, D], which transformers transposes on load)
Both: vocab 256, hidden 32, 4 heads over 2 kv heads, the tower hidden 16, 2 heads, patch 4, temporal 2, merge 2,
out_hidden 32, 16 learned positions; image / video / vision start / end token ids 250 / 251 / 252 / 253;
initializer_range 0.2 (text and tower), every norm weight 1 + 0.3 N(0, 1) ((1 + w) norms: 0.3 N(0, 1)) and LayerNorm
bias 0.2 N(0, 1), so the images, the deepstack features and the M-RoPE sections move the logits well past 1e-4
(checked here: the script fails if zeroing the deepstack features or using 1-D positions changes the logits of
case a by less than 1e-2).

The Qwen3.5 models reuse tests/fixtures/models/qwen3_5 and qwen3_5_moe (their config.json's image token ids are
outside the 256 vocab): transformers loads them with image / video / vision start / end token ids 250..253 set on
the config, and the test does the same to its config.

tests/fixtures/vlm/NAME.npz for NAME in qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe — the cases (computed in
float64, stored fp32; eager attention):
    a_ids [T], a_grid [1, 3], a_pixels [P, 96], a_logits [T, 256]        one image (grid 1 x 4 x 4: 4 tokens)
    b_ids, b_grid [2, 3], b_pixels, b_logits                            two images (1 x 2 x 6 and 1 x 6 x 4)
    c_ids, c_logits                                                     text only (no pixel_values)
    d_ids, d_grid, d_pixels, d_logits                                   a second segment with one image (1 x 2 x 6),
                                                                        alone; the test packs a and d in one row
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "fixtures" / "models"
OUT = ROOT / "tests" / "fixtures" / "vlm"
IMG, VIDEO, VS, VE = 250, 251, 252, 253
TOKENS = dict(image_token_id=IMG, video_token_id=VIDEO, vision_start_token_id=VS, vision_end_token_id=VE)
PATCH_DIM = 3 * 2 * 4 * 4

TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
            initializer_range=0.2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=1, mlp_only_layers=[])
VISION = dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 2], initializer_range=0.2)


def _row(*parts) -> list[int]:
    out = []
    for p in parts:
        out += [VS, *([IMG] * p), VE] if isinstance(p, int) else list(p)
    return out


def cases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Token rows and pixel values (grids in patches; merged tokens = t * h/2 * w/2)."""
    def pixels(grid):
        return rng.normal(size=(int(np.prod(grid, axis=1).sum()), PATCH_DIM)).astype(np.float32)

    a_grid, b_grid, d_grid = np.array([[1, 4, 4]]), np.array([[1, 2, 6], [1, 6, 4]]), np.array([[1, 2, 6]])
    out = {"a_ids": _row((5, 6, 7), 4, (8, 9, 10)), "a_grid": a_grid,
           "b_ids": _row((5,), 3, (11, 12), 6, (13, 14)), "b_grid": b_grid,
           "c_ids": list(range(20, 36)),
           "d_ids": _row((40,), 3, (41, 42)), "d_grid": d_grid}
    for k in ("a", "b", "d"):
        out[f"{k}_pixels"] = pixels(out[f"{k}_grid"])
    return {k: np.asarray(v) for k, v in out.items()}


def _perturb(model, seed: int, zero_centred: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith("norm.weight") or name.endswith("layernorm.weight") or ".norm" in name):
                continue
            noise = 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
            elif zero_centred and "language_model" in name and "linear_attn.norm" not in name:
                p.copy_(noise)
            else:
                p.copy_(1 + noise)


def _logits(model, ids, grid=None, pixels=None, **kw) -> np.ndarray:
    args = dict(input_ids=torch.tensor(np.asarray(ids)[None]))
    if grid is not None:
        args |= dict(pixel_values=torch.tensor(pixels, dtype=torch.float64), image_grid_thw=torch.tensor(grid),
                     mm_token_type_ids=(args["input_ids"] == IMG).long())  # 1: image token (the processor's)
    with torch.no_grad():
        return model(**args, **kw).logits[0].double().numpy()


def expected(model, name: str, seed: int, deepstack: bool) -> None:
    model = model.double().eval()
    data = cases(np.random.default_rng(seed))
    out = dict(data)
    for k in ("a", "b", "d"):
        out[f"{k}_logits"] = _logits(model, data[f"{k}_ids"], data[f"{k}_grid"], data[f"{k}_pixels"])
    out["c_logits"] = _logits(model, data["c_ids"])
    # sensitivity: 1-D positions instead of M-RoPE's, and (Qwen3-VL) the deepstack features zeroed
    flat = torch.arange(len(data["a_ids"]))[None]
    moved = np.abs(_logits(model, data["a_ids"], data["a_grid"], data["a_pixels"], position_ids=flat)
                   - out["a_logits"]).max()
    print(f"{name}: 1-D positions move case a's logits by {moved:.3g}")
    assert moved > 1e-2, moved
    if deepstack:
        lm = model.model.language_model
        original = lm._deepstack_process
        lm._deepstack_process = lambda h, mask, emb: h
        moved = np.abs(_logits(model, data["a_ids"], data["a_grid"], data["a_pixels"]) - out["a_logits"]).max()
        lm._deepstack_process = original
        print(f"{name}: zeroing deepstack moves case a's logits by {moved:.3g}")
        assert moved > 1e-2, moved
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / f"{name}.npz", **{k: (v.astype(np.float32) if v.dtype == np.float64 else v)
                                                for k, v in out.items()})


def make_qwen3_vl(name: str, seed: int) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig, \
        Qwen3VLMoeForConditionalGeneration
    torch.manual_seed(seed)
    moe = name == "qwen3_vl_moe"
    config_cls, model_cls = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                             else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    text = TEXT | (MOE if moe else {})
    config = config_cls(text_config=copy.deepcopy(text), vision_config=dict(VISION), tie_word_embeddings=False,
                        **TOKENS)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = model_cls(config).float().eval()
    _perturb(model, seed, zero_centred=False)
    out = MODELS / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for extra in ("generation_config.json",):
        (out / extra).unlink(missing_ok=True)
    expected(model, name, seed, deepstack=True)


def make_qwen3_5(name: str, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(MODELS / name)
    for k, v in TOKENS.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    model = AutoModelForImageTextToText.from_pretrained(MODELS / name, config=config, dtype=torch.float32,
                                                        experts_implementation="eager")
    expected(model, name, seed, deepstack=False)


if __name__ == "__main__":
    make_qwen3_vl("qwen3_vl", 41)
    make_qwen3_vl("qwen3_vl_moe", 42)
    make_qwen3_5("qwen3_5", 43)
    make_qwen3_5("qwen3_5_moe", 44)
    print(json.dumps({p.name: p.stat().st_size for p in sorted(OUT.glob("*.npz"))}))
