"""Conversation rows with images -> token ids, the loss mask, pixel_values and image_grid_thw, as transformers'
Qwen3-VL / Qwen3.5 processor makes them.

    row --chat_images--> messages with {"type": "image"} parts + image sources --load_image--> PIL images
        --image_patches--> pixel_values [sum of patches, C*T*P*P] (made again on access), image_grid_thw [n, 3]
        --chat_masks--> ids + assistant mask of the rendered template (one <|image_pad|> per image)
        --expand--> each <|image_pad|> repeated image_token_count(grid) times (the processor's expansion)

The template sees the image parts as transformers' processors pass them (`{"type": "image"}` at the image's
place), so `<|vision_start|><|image_pad|><|vision_end|>` is whatever the template writes for an image, and the
ids equal `processor(text=apply_chat_template(messages), images=...)["input_ids"]`. The mask is chat_masks'
assistant-only mask (train_on_inputs: every token) with every image pad token unsupervised: the model never
learns to produce image placeholders (an image inside an assistant turn included).

Packing: an `ImageExample` is packed whole like any example (bins hold whole examples), so an image's tokens stay
with its row; `ImagePackedRows` gives each packed row its images' pixel_values / image_grid_thw in segment order.
Fitting: an image row longer than the limit is dropped under truncation "drop" and refused otherwise
(`ImageRowTooLongError`): cutting it would part image tokens from their pixels.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from surojax.config.data import DatasetSpec
from surojax.data.chat_images import ImageLimits, ImageRowError, conversation_images, load_image, where
from surojax.data.chat_masks import chat_ids_and_mask
from surojax.data.formats import Example, conversation_and_tools
from surojax.data.image_batch import collate_image_rows, empty_image_row
from surojax.data.image_patches import ImagePreprocessError, ImageProcessing, image_token_count, preprocess_image
from surojax.data.packing import PackedRows
from surojax.data.tokenizer import Tokenizer, TokenizerError
from surojax.data.vision_data import VisionData

IMAGE_TOKEN = "<|image_pad|>"
IMAGES_FIELD = "images"  # the LLaVA / ShareGPT column of image paths that `<image>` placeholders take in order


class ImageRowTooLongError(ImageRowError):
    """An image row over the sequence length under a truncation mode that would cut it."""


@dataclass(frozen=True)
class ImageExample(Example):
    """A tokenized conversation with images: `ids` / `mask` as Example, the images' grids, where each image's pad
    tokens are (`image_spans[k]` = (first token, token count) of image k), and the images themselves.

    The example keeps the images' sources (paths, bytes or decoded images) and the processor settings, not their
    patches: `pixel_values` preprocesses them again on each access (a dataset's patches would not fit in memory;
    the tokenization already preprocessed each image once, so bad images fail there, not in the loader)."""

    image_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    image_spans: tuple[tuple[int, int], ...] = ()
    images: tuple = ()
    processing: ImageProcessing = ImageProcessing()
    base_dir: str | Path | None = None
    limits: ImageLimits = ImageLimits()

    @property
    def pixel_values(self) -> np.ndarray:
        """[sum of the images' patches, C * T * P * P] float32, as transformers' processor returns them."""
        return image_pixels(self.images, self.processing, base_dir=self.base_dir, limits=self.limits)[0]


def image_pixels(sources: Sequence, processing: ImageProcessing, *, base_dir: str | Path | None = None,
                 limits: ImageLimits = ImageLimits(), row: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum of patches, C * T * P * P] float32, image_grid_thw [n, 3] int64) of images given by
    source (chat_images.load_image), each error naming the row and image."""
    patches, grids = [], []
    for k, source in enumerate(sources):
        image = load_image(source, base_dir=base_dir, limits=limits, row=row, k=k)
        try:
            p, grid = preprocess_image(image, processing)
        except ImagePreprocessError as e:
            shown = f" ({source[:80]})" if isinstance(source, str) else ""
            raise ImageRowError(f"{where(row, k)}{shown}: {e}") from None
        patches.append(p)
        grids.append(grid)
    width = 3 * processing.temporal_patch_size * processing.patch_size ** 2
    return (np.concatenate(patches) if patches else np.zeros((0, width), np.float32),
            np.asarray(grids, np.int64).reshape(-1, 3))


def image_token_id(tokenizer: Tokenizer, token: str = IMAGE_TOKEN) -> int:
    """The id of the image placeholder token; a tokenizer without it cannot take image rows."""
    tid = tokenizer.token_to_id(token)
    if tid is None:
        raise TokenizerError(f"the tokenizer in {tokenizer.source} has no {token} token: it is not a vision-language "
                             "tokenizer (Qwen3-VL / Qwen3.5), so it cannot take rows with images")
    return tid


def expand_image_tokens(ids: Sequence[int], mask: Sequence[bool], counts: Sequence[int], image_id: int, *,
                        row: int | None = None) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...]]:
    """Each image_id token replaced by counts[k] copies (the k-th one), unsupervised; (ids, mask, spans)."""
    ids, mask = np.asarray(ids, np.int64), np.asarray(mask, bool)
    at = np.flatnonzero(ids == image_id)
    if len(at) != len(counts):
        raise ImageRowError(f"{where(row)}: the chat template wrote {len(at)} image placeholder tokens for "
                            f"{len(counts)} images (a template that drops image parts, or image pad tokens in the "
                            "text)")
    reps = np.ones(len(ids), np.int64)
    reps[at] = counts
    out_ids, out_mask = np.repeat(ids, reps), np.repeat(mask, reps)
    extra = np.asarray(counts, np.int64) - 1                     # tokens each image adds before the next one
    starts = at + np.cumsum(extra) - extra
    out_mask[out_ids == image_id] = False
    return out_ids.astype(np.int32), out_mask, tuple((int(s), int(n)) for s, n in zip(starts, counts))


def tokenize_image_conversation(messages: Sequence[Mapping], tokenizer: Tokenizer, processing: ImageProcessing, *,
                                images: Sequence | None = None, row: int | None = None,
                                base_dir: str | Path | None = None, limits: ImageLimits = ImageLimits(),
                                tools=None, chat_template: str | None = None, train_on_inputs: bool = False,
                                image_token: str = IMAGE_TOKEN) -> ImageExample:
    """One conversation with images (content parts, or `images` + `<image>` placeholders) -> ImageExample."""
    image_id = image_token_id(tokenizer, image_token)
    parts, sources = conversation_images(messages, images, row=row)
    _, grids = image_pixels(sources, processing, base_dir=base_dir, limits=limits, row=row)
    ids, mask = chat_ids_and_mask(parts, tokenizer, tools=tools, chat_template=chat_template,
                                  train_on_inputs=train_on_inputs)
    counts = [image_token_count(g, processing.merge_size) for g in grids]
    ids, mask, spans = expand_image_tokens(ids, mask, counts, image_id, row=row)
    return ImageExample(ids, mask, grids, spans, tuple(sources), processing, base_dir, limits)


def dataset_image_dir(path: str | Path) -> Path:
    """Where a dataset's relative image paths resolve: the dataset file's folder, or the dataset folder itself."""
    path = Path(path).expanduser()
    return path if path.is_dir() else path.parent


def tokenize_image_row(row: Mapping, tokenizer: Tokenizer, processing: ImageProcessing, spec: DatasetSpec, *,
                       index: int | None = None, base_dir: str | Path | None = None,
                       limits: ImageLimits = ImageLimits(), chat_template: str | None = None,
                       train_on_inputs: bool = False) -> ImageExample:
    """A dataset row (the `messages` / sharegpt `conversations` layouts formats reads, with image parts, or an
    `images` column and `<image>` placeholders) -> ImageExample; relative image paths resolve against `base_dir`
    (default: dataset_image_dir(spec.path)); `index` is the row's number for error messages."""
    messages, tools = conversation_and_tools(row, spec, train_on_inputs, keep_parts=True)
    images = row.get(IMAGES_FIELD) or None
    return tokenize_image_conversation(messages, tokenizer, processing, images=images, row=index,
                                       base_dir=dataset_image_dir(spec.path) if base_dir is None else base_dir,
                                       limits=limits, tools=tools, chat_template=chat_template,
                                       train_on_inputs=train_on_inputs)


def fit_image_example(ex: ImageExample, max_length: int, mode: str = "truncate", *,
                      row: int | None = None) -> ImageExample | None:
    """`ex` if it fits in `max_length`; None under mode "drop"; otherwise ImageRowTooLongError (a cut would part
    image tokens from their pixels)."""
    if len(ex) <= max_length:
        return ex
    if mode == "drop":
        return None
    raise ImageRowTooLongError(f"{where(row)}: {len(ex)} tokens with {len(ex.image_grid_thw)} images, over the "
                               f"limit of {max_length}; image rows are not truncated or split ({mode!r}): raise "
                               "sequence_len, lower the image processor's max_pixels, or set truncation_strategy: "
                               "delete")


class ImagePackedRows(PackedRows):
    """PackedRows over ImageExamples (and text Examples): row r (a dict of [T] arrays, as PackedRows) plus
    `pixel_values` [P, D] and `image_grid_thw` [n, 3] of its examples' images, in segment order. Whole examples are
    packed, so every image's tokens are in the row that carries its pixels. With `vision` (the model's
    vision_data.VisionData) each row also gets `rope_positions` [3, T] int32: each segment's M-RoPE positions from
    0 (a text segment: its 1-D positions on all three axes), 0 on padding, as `positions` is laid out.
    `collate` batches such rows (image_batch.collate_image_rows) and `empty_row()` is a padding row."""

    def __init__(self, examples: Sequence[Example], seq_len: int, packing: bool = True, *,
                 vision: VisionData | None = None):
        super().__init__(examples, seq_len, packing)
        self.image_examples = [e if isinstance(e, ImageExample) and len(e.images) else None for e in examples]
        settings = {e.processing for e in self.image_examples if e is not None}
        if vision is not None:
            settings.add(vision.processing)
        if len(settings) > 1:
            raise ImageRowError(f"image examples preprocessed with {len(settings)} different image processor "
                                "settings; pack one model's data at a time")
        self.processing = settings.pop() if settings else ImageProcessing()
        self.width = 3 * self.processing.temporal_patch_size * self.processing.patch_size ** 2
        self.vision = vision

    def __getitem__(self, r: int) -> dict[str, np.ndarray]:
        row = super().__getitem__(r)
        examples = [self.image_examples[e] for e in self.bins[r] if self.image_examples[e] is not None]
        pixels = [e.pixel_values for e in examples]
        row["pixel_values"] = np.concatenate(pixels) if pixels else np.zeros((0, self.width), np.float32)
        row["image_grid_thw"] = (np.concatenate([e.image_grid_thw for e in examples]) if examples
                                 else np.zeros((0, 3), np.int64))
        if self.vision is not None:
            row["rope_positions"] = self.rope_positions(r)
        return row

    def rope_positions(self, r: int) -> np.ndarray:
        """[3, T] int32 M-RoPE positions of row r, per segment from 0; 0 on padding."""
        out, at = np.zeros((3, self.seq_len), np.int32), 0
        for e in self.bins[r]:
            ids, _ = self.example(e)
            ex = self.image_examples[e]
            grids = ex.image_grid_thw if ex is not None else np.zeros((0, 3), np.int64)
            try:
                out[:, at:at + len(ids)] = self.vision.rope_positions(ids, grids)
            except ValueError as err:
                raise ImageRowError(f"packed row {r}, example {e}: {err}") from None
            at += len(ids)
        return out

    def example_at(self, e: int) -> Example:
        """Example e as tokenized (its ImageExample when it has images), e.g. for debug.debug_print."""
        ex = self.image_examples[e]
        return ex if ex is not None else Example(*self.example(e))

    def empty_row(self) -> dict[str, np.ndarray]:
        """A padding row (no tokens, no images) with this data's keys."""
        row = super().empty_row()
        row.update(empty_image_row(self.seq_len, self.width, rope=self.vision is not None))
        return row

    def collate(self, rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """A batch of these rows (image_batch.collate_image_rows)."""
        return collate_image_rows(rows, self.processing.merge_size)
