"""Images -> the vision tower's flat patches and grid, as transformers' Qwen2-VL image processor makes them.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 / 3.6 all use `Qwen2VLImageProcessor` (transformers 5.17's
`image_processing_auto`: `qwen3_vl`, `qwen3_5`, `qwen3_5_moe` -> Qwen2VLImageProcessor / Qwen2VLImageProcessorPil).
This module is the PIL backend's arithmetic (`image_processing_pil_qwen2_vl.py`), step for step:

1. convert to RGB (`Image.convert("RGB")`: an alpha channel is dropped, not composited; modes other than RGB
   are converted the same way);
2. `smart_resize`: both sides rounded to a multiple of factor = patch_size * merge_size, then scaled (keeping the
   aspect ratio) into [min_pixels, max_pixels]; the image resized with PIL (bicubic by default) in uint8;
3. rescale (x float64 * 1/255, cast to float32), normalise ((x - mean) / std in float32, per channel);
4. patchify: the image cut into patch_size squares, ordered by merge block (the merge_size x merge_size patches
   that the merger joins into one token are consecutive), each patch repeated temporal_patch_size times (a still
   image is a clip of identical frames), flattened as (channel, time, row, col).

Result per image: `[grid_h * grid_w, C * T * P * P]` float32 rows and its grid (t=1, grid_h, grid_w); several
images concatenate along rows, their grids stack into `image_grid_thw` [n, 3] int64. The language model sees
grid_h * grid_w / merge_size**2 image tokens per image.

transformers' torchvision backend (`Qwen2VLImageProcessor`, chosen when torchvision is installed) resizes with
torch's antialiased bicubic instead of PIL's, which differs in the last bits of some pixels; this module equals
the PIL backend (tests/data/test_image_patches.py against a fixture of its output).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200

# preprocessor_config.json keys that describe the file, not the arithmetic.
_METADATA_KEYS = frozenset({"image_processor_type", "processor_class", "auto_map", "_processor_class",
                            "default_to_square", "return_tensors", "data_format", "input_data_format",
                            "device", "disable_grouping", "image_seq_length"})


class ImagePreprocessError(ValueError):
    """An image or a preprocessor config the processor cannot handle; the message names which and why."""


@dataclass(frozen=True)
class ImageProcessing:
    """The processor's settings (transformers' defaults for Qwen2VLImageProcessor; Qwen3-VL / Qwen3.5 checkpoints
    ship patch_size 16, mean = std = 0.5 and their own pixel bounds in preprocessor_config.json)."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ImagePreprocessError(f"image processor: {name} must be a positive integer, "
                                           f"got {getattr(self, name)!r}")
        if self.min_pixels > self.max_pixels:
            raise ImagePreprocessError(f"image processor: min_pixels {self.min_pixels} > max_pixels "
                                       f"{self.max_pixels}")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ImagePreprocessError(f"image processor: {name} needs 3 values (RGB), got "
                                           f"{getattr(self, name)!r}")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(cls, config: Mapping, source: str = "preprocessor_config.json") -> "ImageProcessing":
        """From a preprocessor_config.json dict, as Qwen2VLImageProcessor(Pil).__init__ reads it: `size`
        {shortest_edge, longest_edge} are the pixel bounds, and `min_pixels` / `max_pixels` override them.
        An unknown key is refused (naming it and `source`)."""
        known = {"size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                 "image_mean", "image_std", "rescale_factor", "resample", "do_resize", "do_rescale",
                 "do_normalize", "do_convert_rgb"}
        unknown = sorted(set(config) - known - _METADATA_KEYS)
        if unknown:
            raise ImagePreprocessError(f"{source}: keys {unknown} are not understood by the Qwen2-VL image "
                                       f"processor (known: {sorted(known)})")
        kwargs = {k: config[k] for k in known - {"size", "min_pixels", "max_pixels", "image_mean", "image_std"}
                  if k in config}
        size = dict(config.get("size") or {})
        unknown_size = sorted(set(size) - {"shortest_edge", "longest_edge", "min_pixels", "max_pixels"})
        if unknown_size:
            raise ImagePreprocessError(f"{source}: size keys {unknown_size} are not understood (expected "
                                       "shortest_edge / longest_edge: the min / max pixel count)")
        min_pixels = config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        max_pixels = config.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        if min_pixels is not None:
            kwargs["min_pixels"] = min_pixels
        if max_pixels is not None:
            kwargs["max_pixels"] = max_pixels
        for name in ("image_mean", "image_std"):
            if name in config:
                value = config[name]
                kwargs[name] = tuple(float(v) for v in (value if isinstance(value, Sequence) else [value] * 3))
        if "resample" in kwargs:
            kwargs["resample"] = int(kwargs["resample"])
        return cls(**kwargs)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with h * w within [min_pixels, max_pixels], aspect ratio
    kept as closely as that allows (transformers' `smart_resize`, same rounding: Python's round, half to even)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImagePreprocessError(f"image {width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f}"
                                   f" is over {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalised_chw(image: Image.Image, proc: ImageProcessing) -> np.ndarray:
    """The RGB, resized, rescaled, normalised image as [C, H, W] (float32 unless every step is off)."""
    if proc.do_convert_rgb and image.mode != "RGB":
        image = image.convert("RGB")
    if proc.do_resize:
        height, width = smart_resize(image.height, image.width, proc.factor, proc.min_pixels, proc.max_pixels)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=proc.resample)
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    pixels = np.transpose(pixels, (2, 0, 1))
    if proc.do_rescale:
        pixels = (pixels.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    if proc.do_normalize:
        if not np.issubdtype(pixels.dtype, np.floating):
            pixels = pixels.astype(np.float32)
        mean = np.asarray(proc.image_mean, pixels.dtype)[:, None, None]
        std = np.asarray(proc.image_std, pixels.dtype)[:, None, None]
        pixels = (pixels - mean) / std
    return pixels


def patchify(pixels: np.ndarray, proc: ImageProcessing) -> tuple[np.ndarray, int, int]:
    """[C, H, W] -> ([grid_h * grid_w, C * T * P * P] float32 in merge-block order, grid_h, grid_w)."""
    channels, height, width = pixels.shape
    p, m, t = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ImagePreprocessError(f"image {width}x{height}: sides must be multiples of patch_size * merge_size "
                                   f"= {p * m} (resizing is off)")
    grid_h, grid_w = height // p, width // p
    patches = np.asarray(pixels, np.float32).reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)            # (bh, bw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return patches.reshape(grid_h * grid_w, channels * t * p * p), grid_h, grid_w


def preprocess_image(image: Image.Image, proc: ImageProcessing) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (its patch rows [grid_h * grid_w, C * T * P * P] float32, its grid (1, grid_h, grid_w))."""
    patches, grid_h, grid_w = patchify(_normalised_chw(image, proc), proc)
    return patches, (1, grid_h, grid_w)


def preprocess_images(images: Sequence[Image.Image], proc: ImageProcessing) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (pixel_values [sum of patches, C * T * P * P] float32, image_grid_thw [n, 3] int64), the two
    arrays transformers' processor returns."""
    if not images:
        raise ImagePreprocessError("preprocess_images: no images")
    rows, grids = zip(*(preprocess_image(image, proc) for image in images))
    return np.concatenate(rows, axis=0), np.asarray(grids, np.int64)


def image_token_count(grid_thw: Sequence[int], merge_size: int) -> int:
    """How many placeholder tokens the language model gets for one image / video of grid (t, h, w)."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)
