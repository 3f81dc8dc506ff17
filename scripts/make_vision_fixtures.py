"""Golden fixtures for the vision side of Qwen3-VL / Qwen3.5: transformers' image processor output on generated
images, and a tiny random Qwen3-VL vision tower with its outputs.

Run with the reference environment (torch + transformers, no torchvision: AutoImageProcessor then gives the PIL
backend, Qwen2VLImageProcessorPil), never from the surojax venv:

    /work/refenv/bin/python scripts/make_vision_fixtures.py

tests/fixtures/vision/preprocess.npz — for each processor setting S in SETTINGS and image I in IMAGES:
    image_I          the generated input (uint8 [H, W] or [H, W, C]; mode in the key list below)
    palette_I        a palette image's palette (flat RGB uint8)
    S_pixel_values   AutoImageProcessor-equivalent Qwen2VLImageProcessorPil(**S)(images=[all images]) output
    S_image_grid_thw
  and `settings` (JSON string: S -> its kwargs), `modes` (JSON: I -> PIL mode).

tests/fixtures/vision/qwen3_vl_tower/ — `Qwen3VLVisionModel` of a tiny random config (config.json = the vision
config), saved under the names the full model uses (model.safetensors, `model.visual.*`); every LayerNorm weight
1 + 0.3 N(0, 1) and bias 0.2 N(0, 1) (transformers initialises them to ones / zeros). expected.npz:
    pixel_values [sum t*h*w, 3*2*4*4] (N(0, 1) fp32), grid_thw [[1, 4, 6], [2, 2, 4]] (an image and a 2-frame
    clip, so attention segments per frame and per image are both exercised), merged [sum/4, out_hidden],
    deepstack0/1 [sum/4, out_hidden], last_hidden [sum t*h*w, hidden]; computed in float64, stored fp32.

tests/fixtures/vision/qwen3_5_tower_expected.npz — the same keys (no deepstack) for the vision tower of the
committed tests/fixtures/models/qwen3_5 checkpoint (Qwen3_5VisionModel).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import Qwen3VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "vision"

# Qwen3-VL's published settings (patch 16, mean = std = 0.5) with small pixel bounds; and the class defaults
# (patch 14, CLIP mean / std) with small bounds.
SETTINGS = {
    "qwen3_vl": dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                     image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 32 * 32 * 2, "longest_edge": 64 * 64 * 2}),
    "qwen2_vl_default": dict(size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56 * 2}),
}
# name -> (width, height, mode): odd sizes; one upscaled past min_pixels, one downscaled to max_pixels,
# an alpha channel (dropped), grey and palette images (converted to RGB).
IMAGES = {
    "rgb_53x37": (53, 37, "RGB"),
    "rgba_29x100": (29, 100, "RGBA"),
    "grey_13x20": (13, 20, "L"),
    "rgb_211x300": (211, 300, "RGB"),
    "palette_70x45": (70, 45, "P"),
}


def _image(seed: int, width: int, height: int, mode: str) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1),
                       (x + y) * 127 / max(width + height - 2, 1)], axis=-1)
    pixels = np.clip(smooth + rng.normal(0, 40, smooth.shape), 0, 255).astype(np.uint8)
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (height, width, 1), dtype=np.uint8)
        return Image.fromarray(np.concatenate([pixels, alpha], axis=-1), "RGBA")
    if mode == "L":
        return Image.fromarray(pixels[..., 0], "L")
    if mode == "P":
        return Image.fromarray(pixels, "RGB").quantize(16)
    return Image.fromarray(pixels, "RGB")


def make_preprocess() -> None:
    images = {name: _image(i, *spec) for i, (name, spec) in enumerate(IMAGES.items())}
    arrays: dict[str, np.ndarray] = {}
    for name, image in images.items():
        arrays[f"image_{name}"] = np.asarray(image)
        if image.mode == "P":
            arrays[f"palette_{name}"] = np.asarray(image.getpalette(), np.uint8)
    for setting, kwargs in SETTINGS.items():
        processor = Qwen2VLImageProcessorPil(**kwargs)
        out = processor(images=list(images.values()), return_tensors="np")
        arrays[f"{setting}_pixel_values"] = np.asarray(out["pixel_values"], np.float32)
        arrays[f"{setting}_image_grid_thw"] = np.asarray(out["image_grid_thw"], np.int64)
        print(setting, arrays[f"{setting}_image_grid_thw"].tolist())
    arrays["settings"] = np.asarray(json.dumps(SETTINGS))
    arrays["modes"] = np.asarray(json.dumps({name: spec[2] for name, spec in IMAGES.items()}))
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "preprocess.npz", **arrays)


VISION = dict(depth=3, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
              in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48,
              num_position_embeddings=16, deepstack_visual_indexes=[0, 2], initializer_range=0.2)
GRIDS = [[1, 4, 6], [2, 2, 4]]


def make_tower() -> None:
    torch.manual_seed(0)
    config = Qwen3VLConfig(vision_config=VISION, text_config=dict(vocab_size=64, hidden_size=48,
                                                                 num_hidden_layers=1, num_attention_heads=2,
                                                                 num_key_value_heads=1, head_dim=24,
                                                                 intermediate_size=64))
    vision_config = config.vision_config
    vision_config._attn_implementation = "eager"
    model = Qwen3VLVisionModel._from_config(vision_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 + 0.3 * torch.randn_like(p)) if name.endswith("weight") else 0.2 * torch.randn_like(p))
    folder = OUT / "qwen3_vl_tower"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    from safetensors.torch import save_file
    save_file({f"model.visual.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(vision_config.to_dict(), indent=2, sort_keys=True) + "\n")

    grid = torch.tensor(GRIDS, dtype=torch.int64)
    rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    dim = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    pixel_values = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    model64 = model.double()
    with torch.no_grad():
        out = model64(pixel_values.double(), grid_thw=grid)
    expected = dict(pixel_values=pixel_values.numpy(), grid_thw=grid.numpy(),
                    merged=out.pooler_output.float().numpy(), last_hidden=out.last_hidden_state.float().numpy())
    for i, feature in enumerate(out.deepstack_features):
        expected[f"deepstack{i}"] = feature.float().numpy()
    np.savez_compressed(folder / "expected.npz", **expected)
    print("tower", {k: v.shape for k, v in expected.items()})


def make_qwen3_5_tower() -> None:
    """Qwen3_5VisionModel (no deepstack) of the committed tests/fixtures/models/qwen3_5 checkpoint (1 block, hidden
    16, made by scripts/make_qwen3_5_fixtures.py): its outputs on random rows for grids [[1, 2, 4], [1, 4, 2]]."""
    from transformers import Qwen3_5ForConditionalGeneration
    model = Qwen3_5ForConditionalGeneration.from_pretrained(ROOT / "tests" / "fixtures" / "models" / "qwen3_5",
                                                            dtype=torch.float64, attn_implementation="eager")
    visual = model.model.visual.eval()
    grid = torch.tensor([[1, 2, 4], [1, 4, 2]], dtype=torch.int64)
    rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    pixel_values = torch.randn(rows, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = visual(pixel_values.double(), grid_thw=grid)
    np.savez_compressed(OUT / "qwen3_5_tower_expected.npz", pixel_values=pixel_values.numpy(), grid_thw=grid.numpy(),
                        merged=out.pooler_output.float().numpy(), last_hidden=out.last_hidden_state.float().numpy())


if __name__ == "__main__":
    make_preprocess()
    make_tower()
    make_qwen3_5_tower()
