"""A collated image batch (data/image_batch.py) -> what the train / eval steps give the decoder, on the host.

    host batch {tokens.. [A*B, T], pixel_values [P_pad, D], image_grid_thw [I_pad, 3], rope_positions [3, A*B, T]}
      -- split_image_batch (A micro-batches, each part's images re-padded to one bucket) --
      -- prepare_images per micro-batch (models/vision/inputs.py) -->
    {tokens.. [A, B, T], rope_positions [A, 3, B, T], images: ImageInputs with a leading [A] axis}

The ImageInputs' shapes depend only on the patch bucket (P_pad of the split: merge_size^2 x a power of two) and the
attention layout's [R, L] (grid.py's layout_bucket; the micro-batches' layouts padded to the largest), so the jitted step
compiles once per bucket and layout shape; a micro-batch without images gets an all-padding ImageInputs of the same
shapes (its merged rows are dropped by the scatter: token_index B * T; its layout all empty). A batch with no image at all has no
`images` key (the rope positions alone: one more compile, the text rows' M-RoPE positions). The collated
rope_positions are recomputed by prepare_images (the model's own function; the data's are the same values).

Data parallelism: the [.., B, T] arrays are split over the batch axes as text batches are; the flat pixel rows
cannot be split by row, so `images` is replicated on every device (each runs the tower on the whole micro-batch's
images; the scatter keeps its rows' tokens). Multi-process runs refuse image batches (each process holds other
images: `ImageBatchError`), and so do pipeline stages (the tower and its deepstack features run outside the staged
layers).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from surojax.data.image_batch import IMAGE_KEYS, ROPE_KEY, patch_bucket, split_image_batch
from surojax.models.vision.grid import pad_layout
from surojax.models.vision.inputs import ImageInputs, VisionTokens, prepare_images

IMAGES_KEY = "images"


class ImageBatchError(ValueError):
    """An image batch the run cannot take; the message says which setting (a user error: the CLI prints it)."""

    is_user_error = True


def is_image_batch(batch: Mapping) -> bool:
    """Whether a host batch carries the collated image keys (a data set with image rows)."""
    return all(k in batch for k in IMAGE_KEYS)


def _padding_images(bucket: int, rows: int, seq: int, like: ImageInputs) -> ImageInputs:
    """An ImageInputs of `bucket` padding patches (no image): every merged row dropped by the scatter."""
    group = like.pixel_values.shape[0] // like.token_index.shape[0]
    return ImageInputs(*(np.zeros((bucket, *x.shape[1:]), x.dtype) for x in like[:5]),
                       token_index=np.full((bucket // group,), rows * seq, like.token_index.dtype),
                       attention_layout=np.full_like(like.attention_layout, -1))


def step_image_batch(batch: Mapping[str, np.ndarray], tokens: VisionTokens, parts: int) -> dict:
    """A collated host batch of `parts` x B rows -> micro-batches with a leading [parts] axis (module docstring)."""
    split = split_image_batch(dict(batch), parts, image_token_id=tokens.image_token_id,
                              merge_size=tokens.vision.spatial_merge_size)
    out = {k: v for k, v in split.items() if k not in (*IMAGE_KEYS, ROPE_KEY)}
    bucket = split["pixel_values"].shape[1]
    seg = split.get("segment_ids")
    prepared = [prepare_images(tokens, split["tokens"][a], split["pixel_values"][a], split["image_grid_thw"][a],
                               segment_ids=None if seg is None else seg[a], patch_bucket=bucket or None)
                for a in range(parts)]
    out[ROPE_KEY] = np.stack([p.rope_positions for p in prepared])
    real = [p.images for p in prepared if p.images is not None]
    if not real:
        return out
    rows, seq = split["tokens"].shape[1:]
    shape = tuple(max(im.attention_layout.shape[i] for im in real) for i in (0, 1))
    real = [im._replace(attention_layout=pad_layout(im.attention_layout, *shape)) for im in real]
    parts_images = [p.images._replace(attention_layout=pad_layout(p.images.attention_layout, *shape))
                    if p.images is not None else _padding_images(bucket, rows, seq, real[0]) for p in prepared]
    out[IMAGES_KEY] = ImageInputs(*(np.stack(xs) for xs in zip(*parts_images)))
    return out


def eval_image_batch(batch: Mapping[str, np.ndarray], tokens: VisionTokens) -> dict:
    """A collated eval batch [B, T] -> the same keys without the leading axis."""
    out = step_image_batch(batch, tokens, 1)
    return {k: (ImageInputs(*(x[0] for x in v)) if k == IMAGES_KEY else v[0]) for k, v in out.items()}


def planned_patches(row_sets, micro_rows: int, merge_size: int) -> int:
    """The most patches a micro-batch of `micro_rows` rows can hold (the memory plan's vision term): the bucket of
    the `micro_rows` rows with the most patches, over the packed row sets given (ImagePackedRows; others hold none)."""
    most = 0
    for rows in row_sets:
        examples = getattr(rows, "image_examples", None)
        if examples is None:
            continue
        per_row = sorted((sum(len(examples[e].pixel_values) for e in b if examples[e] is not None)
                          for b in rows.bins), reverse=True)
        most = max(most, sum(per_row[:micro_rows]))
    return patch_bucket(most, merge_size)


def planned_frame_patches(row_sets) -> int:
    """The most patches of one image frame (h x w of a grid) in the packed row sets given: the memory plan's bound
    on the tower's attention rows (models/vision/counts.py)."""
    most = 0
    for rows in row_sets:
        for example in getattr(rows, "image_examples", None) or ():
            if example is not None and len(example.image_grid_thw):
                most = max(most, int(np.max(np.prod(np.asarray(example.image_grid_thw)[:, 1:], axis=1))))
    return most
