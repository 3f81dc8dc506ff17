"""What the data pipeline needs to know about a vision-language model: its image processor and its vision tokens.

    model folder --config.json--> vision_config? model_type? image / video / vision-start token ids
                 --preprocessor_config.json--> ImageProcessing (every key read or refused: image_patches)
                 --the config's max_pixels (Surogate's key), if set--> the processor's max_pixels

`model_vision(folder)` gives a `VisionData` for a model whose images surojax can take (config.json with a
`vision_config` and model_type qwen3_vl, qwen3_vl_moe, qwen3_5 or qwen3_5_moe), else a `TextOnly` saying why (a
text model, or a vision model of another family: Gemma 3 / 4 train their text backbone only). A VisionData with no
preprocessor_config.json in the folder is refused by name (the defaults would be another checkpoint's patch size).

`VisionData.rope_positions(ids, grids)` is one segment's M-RoPE positions [3, n] (vision/mrope.py, transformers'
`get_rope_index`), which the packed rows lay out per segment as they lay out the 1-D positions.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from surojax.data.image_patches import ImagePreprocessError, ImageProcessing
from surojax.data.sources import DataError
from surojax.models.vision.mrope import mrope_positions

VISION_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
PREPROCESSOR_CONFIG = "preprocessor_config.json"


@dataclass(frozen=True)
class TextOnly:
    """A model that takes no images, and why (for the error when image rows meet it)."""
    reason: str


@dataclass(frozen=True)
class VisionData:
    """A vision-language model's image processor settings and vision token ids (config.json's)."""
    processing: ImageProcessing
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    model_type: str
    source: str = ""

    def rope_positions(self, ids: np.ndarray, grids: np.ndarray) -> np.ndarray:
        """[3, len(ids)] int32 M-RoPE positions of one sequence (from 0) holding the images of `grids` [n, 3]."""
        positions, _ = mrope_positions(np.asarray(ids)[None], np.asarray(grids, np.int64).reshape(-1, 3),
                                       image_token_id=self.image_token_id, video_token_id=self.video_token_id,
                                       vision_start_token_id=self.vision_start_token_id,
                                       spatial_merge_size=self.processing.merge_size)
        return positions[:, 0]


def _token_id(config: Mapping, key: str, source: str) -> int:
    value = config.get(key, (config.get("text_config") or {}).get(key))
    if not isinstance(value, int):
        raise DataError(f"{source}: a vision-language config.json needs an integer {key!r}, got {value!r}")
    return value


def vision_data(config: Mapping, preprocessor: Mapping | None, *, source: str = "the model",
                max_pixels: int | None = None) -> VisionData | TextOnly:
    """From config.json and preprocessor_config.json (None: the file is missing) as dicts; `max_pixels` (the
    config's key) overrides the processor's upper pixel bound."""
    model_type = config.get("model_type")
    if not isinstance(config.get("vision_config"), Mapping):
        return TextOnly(f"{source} is a text model (model_type {model_type!r}, no vision_config in config.json)")
    if model_type not in VISION_MODEL_TYPES:
        return TextOnly(f"{source} is a {model_type!r} vision-language model; surojax takes images for "
                        f"{', '.join(VISION_MODEL_TYPES)} only and trains this one's text backbone")
    if preprocessor is None:
        raise DataError(f"{source}: the model has a vision tower but its folder has no {PREPROCESSOR_CONFIG} (the "
                        "image processor's patch size, pixel bounds and normalisation); copy it from the checkpoint")
    where = f"{source}/{PREPROCESSOR_CONFIG}"
    try:
        processing = ImageProcessing.from_config(preprocessor, where)
        if max_pixels is not None:
            processing = replace(processing, max_pixels=max_pixels,
                                 min_pixels=min(processing.min_pixels, max_pixels))
    except (ImagePreprocessError, TypeError) as e:
        raise DataError(str(e) if isinstance(e, ImagePreprocessError) else f"{where}: {e}") from None
    vision = config["vision_config"]
    for key, mine in (("spatial_merge_size", processing.merge_size), ("patch_size", processing.patch_size),
                      ("temporal_patch_size", processing.temporal_patch_size)):
        if key in vision and vision[key] != mine:
            raise DataError(f"{source}: config.json's vision_config.{key} is {vision[key]} but {PREPROCESSOR_CONFIG} "
                            f"gives {mine}: the tower and the processor disagree")
    return VisionData(processing, _token_id(config, "image_token_id", source),
                      _token_id(config, "video_token_id", source),
                      _token_id(config, "vision_start_token_id", source), model_type, source)


def model_vision(folder: str | Path, *, max_pixels: int | None = None) -> VisionData | TextOnly:
    """`vision_data` of a model folder (its config.json and preprocessor_config.json)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        return TextOnly(f"{folder} has no config.json")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    pre = folder / PREPROCESSOR_CONFIG
    preprocessor = json.loads(pre.read_text(encoding="utf-8")) if pre.is_file() else None
    return vision_data(config, preprocessor, source=str(folder), max_pixels=max_pixels)
