"""Conversation rows with images against transformers' Qwen3VLProcessor (tests/fixtures/vision_chat, made by
scripts/make_vision_chat_fixtures.py): token ids, pixel_values and grids for image content parts and for the
`images` + `<image>` layout; the named errors; packing and `tokenize --debug` of image rows."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from surojax.data import chat_images
from surojax.data.chat_images import ImageLimits
from surojax.data.debug import debug_print
from surojax.data.formats import Example
from surojax.data.image_patches import ImageProcessing
from surojax.data.image_rows import (ImagePackedRows, ImageRowTooLongError, fit_image_example,
                                     tokenize_image_conversation)
from surojax.data.tokenizer import Tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vision_chat"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
PIXELS = np.load(FIXTURE / "expected.npz")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIXTURE)


@pytest.fixture(scope="module")
def proc():
    return ImageProcessing.from_config(json.loads((FIXTURE / "preprocessor_config.json").read_text()))


def _two_image_messages(first: str, second: dict) -> list[dict]:
    return [{"role": "system", "content": "You compare pictures."},
            {"role": "user", "content": [{"type": "text", "text": "First "},
                                         {"type": "image_url", "image_url": {"url": first}},
                                         {"type": "text", "text": " then "}, second,
                                         {"type": "text", "text": " differ?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Yes, they differ."}]},
            {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Colours."}]


def _check(ex, case: str, tok):
    exp = EXPECTED[case]
    assert ex.ids.tolist() == exp["input_ids"]
    assert ex.image_grid_thw.tolist() == exp["image_grid_thw"]
    np.testing.assert_array_equal(ex.pixel_values, PIXELS[f"{case}_pixel_values"])
    pad = tok.token_to_id("<|image_pad|>")
    assert [int(ex.ids[s:s + n].sum()) == pad * n for s, n in ex.image_spans] == [True] * len(exp["image_grid_thw"])
    assert not ex.mask[ex.ids == pad].any()


def test_two_images_as_content_parts_equal_transformers_processor(tok, proc):
    data_url = "data:image/png;base64," + base64.b64encode((FIXTURE / "img_b.png").read_bytes()).decode()
    messages = _two_image_messages("img_a.png", {"type": "image", "image": data_url})
    ex = tokenize_image_conversation(messages, tok, proc, base_dir=FIXTURE, row=0)
    _check(ex, "two_images", tok)
    assert tok.decode(ex.ids[ex.mask].tolist()) == "Yes, they differ.<|im_end|>Colours.<|im_end|>"
    same = tokenize_image_conversation(_two_image_messages((FIXTURE / "img_a.png").as_uri(),
                                                           {"type": "image_url", "image_url": "img_b.png"}),
                                       tok, proc, base_dir=FIXTURE)
    assert same.ids.tolist() == ex.ids.tolist() and same.mask.tolist() == ex.mask.tolist()


def test_image_placeholders_take_the_images_column_in_order(tok, proc):
    messages = [{"role": "user", "content": "<image>What is it?<image>"}, {"role": "assistant", "content": "Noise."}]
    ex = tokenize_image_conversation(messages, tok, proc, images=["img_b.png", "img_a.png"], base_dir=FIXTURE)
    _check(ex, "placeholder", tok)
    assert tok.decode(ex.ids[ex.mask].tolist()) == "Noise.<|im_end|>"


def _bad(tmp_path: Path, case: str):
    """(messages, images column, limits, the error class, a text the message must hold)."""
    user = lambda url: [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},  # noqa: E731
                                                     {"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": "ok"}]
    if case == "remote":
        return user("https://example.com/cat.png"), None, ImageLimits(), chat_images.RemoteImageError, "example.com"
    if case == "missing":
        return user("nope.png"), None, ImageLimits(), chat_images.MissingImageError, "nope.png"
    if case == "unreadable":
        (tmp_path / "text.png").write_text("not an image")
        return user("text.png"), None, ImageLimits(), chat_images.UnreadableImageError, "text.png"
    if case == "bad_base64":
        return (user("data:image/png;base64,@@@"), None, ImageLimits(), chat_images.UnreadableImageError,
                "data:image/png")
    if case == "pixels":
        Image.new("RGB", (40, 30)).save(tmp_path / "big.png")
        return user("big.png"), None, ImageLimits(max_pixels=1000), chat_images.ImageTooLargeError, "big.png"
    if case == "bytes":
        Image.new("RGB", (40, 30)).save(tmp_path / "big.png")
        return user("big.png"), None, ImageLimits(max_bytes=10), chat_images.ImageTooLargeError, "big.png"
    if case == "aspect_ratio":
        Image.new("RGB", (300, 1)).save(tmp_path / "thin.png")
        return user("thin.png"), None, ImageLimits(), chat_images.ImageRowError, "thin.png"
    if case == "placeholder_count":
        return ([{"role": "user", "content": "<image> and <image>"}, {"role": "assistant", "content": "ok"}],
                [str(FIXTURE / "img_a.png")], ImageLimits(), chat_images.ImageLayoutError, "1 images")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["remote", "missing", "unreadable", "bad_base64", "pixels", "bytes",
                                  "aspect_ratio", "placeholder_count"])
def test_bad_images_are_named_errors_with_the_row_and_file(tmp_path, tok, proc, case):
    messages, images, limits, error, named = _bad(tmp_path, case)
    with pytest.raises(error) as e:
        tokenize_image_conversation(messages, tok, proc, images=images, base_dir=tmp_path, row=7, limits=limits)
    assert "row 7" in str(e.value) and named in str(e.value)


def test_packing_keeps_each_rows_images_and_refuses_cutting_them(tok, proc):
    messages = [{"role": "user", "content": "<image>What is it?<image>"}, {"role": "assistant", "content": "Noise."}]
    a = tokenize_image_conversation(messages, tok, proc, images=["img_b.png", "img_a.png"], base_dir=FIXTURE)
    b = tokenize_image_conversation(messages, tok, proc, images=["img_a.png", "img_a.png"], base_dir=FIXTURE)
    text = Example.of(tok.encode("plain text row"), [True] * len(tok.encode("plain text row")))
    rows = ImagePackedRows([a, text, b], seq_len=len(a) + len(b) + len(text), packing=True)
    assert len(rows) == 1
    row = rows[0]
    np.testing.assert_array_equal(row["pixel_values"], np.concatenate([a.pixel_values, b.pixel_values]))
    assert row["image_grid_thw"].tolist() == a.image_grid_thw.tolist() + b.image_grid_thw.tolist()
    pad = tok.token_to_id("<|image_pad|>")
    tokens_per_image = row["image_grid_thw"].prod(axis=1) // proc.merge_size ** 2
    assert int((row["tokens"] == pad).sum()) == int(tokens_per_image.sum())
    unpacked = ImagePackedRows([a, text, b], seq_len=max(len(a), len(b)), packing=False)
    assert [len(unpacked[r]["image_grid_thw"]) for r in range(3)] == [2, 0, 2]
    assert fit_image_example(a, len(a) - 1, "drop") is None
    with pytest.raises(ImageRowTooLongError, match="row 3"):
        fit_image_example(a, len(a) - 1, "truncate", row=3)


def test_debug_shows_image_spans_compactly(tok, proc):
    messages = [{"role": "user", "content": "<image>What is it?<image>"}, {"role": "assistant", "content": "Noise."}]
    ex = tokenize_image_conversation(messages, tok, proc, images=["img_b.png", "img_a.png"], base_dir=FIXTURE)
    console = Console(record=True, color_system=None, width=400)
    debug_print([ex], tok, console=console)
    out = console.export_text()
    assert "<image 1: 2x4 patches -> 2 tokens>" in out and "<image 2: 6x4 patches -> 6 tokens>" in out
    assert "<|image_pad|>" not in out and "<|vision_start|>" in out


def test_dataset_rows_sharegpt_placeholders_and_the_text_path_refusing_images(tok, proc):
    from surojax.config.data import DatasetSpec
    from surojax.data.formats import make_formatter
    from surojax.data.image_rows import tokenize_image_row
    from surojax.data.sources import InvalidRowError

    spec = DatasetSpec(path=str(FIXTURE / "rows.jsonl"))
    sharegpt = {"conversations": [{"from": "human", "value": "<image>What is it?<image>"},
                                  {"from": "gpt", "value": "Noise."}], "images": ["img_b.png", "img_a.png"]}
    _check(tokenize_image_row(sharegpt, tok, proc, spec, index=4), "placeholder", tok)
    parts = {"messages": _two_image_messages("img_a.png", {"type": "image", "image": "img_b.png"})}
    _check(tokenize_image_row(parts, tok, proc, spec), "two_images", tok)
    text_only = make_formatter("conversation", tok, spec)
    for row in (sharegpt, parts):
        with pytest.raises(InvalidRowError, match="image_rows.py"):
            text_only(row)


def test_images_column_with_bare_image_parts_bytes_and_pil_images(tok, proc):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"},
                                             {"type": "image"}]},
                {"role": "assistant", "content": "Noise."}]
    images = [{"bytes": (FIXTURE / "img_b.png").read_bytes(), "path": None}, Image.open(FIXTURE / "img_a.png")]
    _check(tokenize_image_conversation(messages, tok, proc, images=images), "placeholder", tok)
    assert chat_images.has_images(messages) and chat_images.has_images([messages[1]], ["a.png"])
    assert not chat_images.has_images([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    video = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}, messages[1]]
    with pytest.raises(chat_images.ImageLayoutError, match="row 1: a video part"):
        tokenize_image_conversation(video, tok, proc, row=1)
    named = [{"role": "user", "content": [{"type": "image", "image": "img_a.png"}]}, messages[1]]
    with pytest.raises(chat_images.ImageLayoutError, match="row 2: the row has an images column"):
        tokenize_image_conversation(named, tok, proc, images=["img_b.png"], row=2)
