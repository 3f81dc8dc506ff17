"""surojax.data.image_patches against transformers' Qwen2VLImageProcessorPil (the processor Qwen3-VL / Qwen3.5 use):
tests/fixtures/vision/preprocess.npz, made by scripts/make_vision_fixtures.py on generated images of odd sizes
(RGB, RGBA, grey, palette; upscaled to min_pixels, downscaled to max_pixels) under two settings."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from surojax.data.image_patches import (ImagePreprocessError, ImageProcessing, image_token_count,
                                        preprocess_images, smart_resize)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vision" / "preprocess.npz"


@pytest.fixture(scope="module")
def golden():
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def _images(golden) -> list[Image.Image]:
    modes = json.loads(str(golden["modes"]))
    images = []
    for name, mode in modes.items():
        image = Image.fromarray(golden[f"image_{name}"], mode)
        if mode == "P":
            image.putpalette(golden[f"palette_{name}"].tolist())
        images.append(image)
    return images


@pytest.mark.parametrize("setting", ["qwen3_vl", "qwen2_vl_default"])
def test_equals_transformers_processor(golden, setting):
    proc = ImageProcessing.from_config(json.loads(str(golden["settings"]))[setting])
    pixel_values, grid_thw = preprocess_images(_images(golden), proc)
    np.testing.assert_array_equal(grid_thw, golden[f"{setting}_image_grid_thw"])
    assert pixel_values.dtype == np.float32
    np.testing.assert_allclose(pixel_values, golden[f"{setting}_pixel_values"], rtol=0, atol=1e-6)


def test_smart_resize_bounds_and_refusals():
    assert smart_resize(37, 53, 32, 2048, 8192) == (32, 64)          # rounded to the factor
    h, w = smart_resize(3000, 1000, 28, 784, 28 * 28 * 16)            # over max_pixels: floor-scaled
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 28 * 28 * 16
    with pytest.raises(ImagePreprocessError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 784, 10**6)
    with pytest.raises(ImagePreprocessError, match=r"crop_size"):
        ImageProcessing.from_config({"crop_size": 3})
    assert image_token_count((1, 6, 4), 2) == 6
