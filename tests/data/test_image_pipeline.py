"""Image rows through build_data for a vision-language model folder: routing, M-RoPE rope_positions per packed
segment, the collation of ragged images into buckets (and back), the refusal for a text-only model, the config's
max_pixels, and `tokenize --debug` of image rows. The model folder is the vision_chat fixture's tokenizer and
preprocessor_config.json with a Qwen3-VL config.json."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from surojax.data.debug import debug_print
from surojax.data.image_batch import collate_image_rows, patch_bucket, split_image_batch, stack_rows, unpad_images
from surojax.data.image_rows import ImageExample, ImagePackedRows
from surojax.data.pipeline import build_data
from surojax.data.sources import DataError
from surojax.data.tokenizer import Tokenizer
from surojax.data.vision_data import TextOnly, VisionData, model_vision
from surojax.models.vision.mrope import mrope_positions

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vision_chat"


def _model(tmp_path: Path, *, vision: bool = True) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(FIXTURE / name, folder / name)
    tok = Tokenizer.from_dir(folder)
    config = {"model_type": "qwen3_vl", "image_token_id": tok.token_to_id("<|image_pad|>"),
              "video_token_id": tok.token_to_id("<|video_pad|>"),
              "vision_start_token_id": tok.token_to_id("<|vision_start|>"), "text_config": {}}
    if vision:
        config["vision_config"] = {"spatial_merge_size": 2, "patch_size": 16, "temporal_patch_size": 2}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _dataset(tmp_path: Path) -> Path:
    shutil.copy(FIXTURE / "img_a.png", tmp_path / "a.png")
    shutil.copy(FIXTURE / "img_b.png", tmp_path / "b.png")

    def row(images: list[str], answer: str) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
                             {"role": "assistant", "content": answer}]}
    rows = [row(["a.png"], "A red square."), {"messages": [{"role": "user", "content": "Hi"},
                                                          {"role": "assistant", "content": "Hello."}]},
            row(["b.png", "a.png"], "Two pictures."), {"images": ["b.png"], "messages": [
                {"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Blue."}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _build(tmp_path, folder, **kw):
    tok = Tokenizer.from_dir(folder)
    kw = {"sequence_len": 2048, "batch_size": 2, "process_index": 0, "process_count": 1, "num_epochs": 1,
          "vision": model_vision(folder), **kw}
    return build_data([str(_dataset(tmp_path))], tok, **kw), tok


def test_image_rows_pack_with_their_pixels_and_mrope_positions_per_segment(tmp_path):
    data, tok = _build(tmp_path, _model(tmp_path), sample_packing=True, num_epochs=None)
    rows, vision = data.train_rows, model_vision(tmp_path / "model")
    assert isinstance(rows, ImagePackedRows) and data.stats.images == 4
    examples = [rows.example_at(e) for e in range(len(rows.offsets) - 1)]
    assert [type(e) is ImageExample for e in examples] == [True, False, True, True]
    for r in range(len(rows)):
        row = rows[r]
        at = 0
        for e in rows.bins[r]:
            ids, ex = examples[e].ids, examples[e]
            grids = ex.image_grid_thw if isinstance(ex, ImageExample) else np.zeros((0, 3), np.int64)
            want, _ = mrope_positions(ids[None], grids, image_token_id=vision.image_token_id,
                                      video_token_id=vision.video_token_id,
                                      vision_start_token_id=vision.vision_start_token_id, spatial_merge_size=2)
            np.testing.assert_array_equal(row["rope_positions"][:, at:at + len(ids)], want[:, 0])
            if not isinstance(ex, ImageExample):  # a text segment: its 1-D positions on the three axes
                np.testing.assert_array_equal(want[:, 0], np.broadcast_to(np.arange(len(ids)), (3, len(ids))))
            at += len(ids)
        assert not row["rope_positions"][:, at:].any() and not row["segment_ids"][at:].any()
        image_exs = [examples[e] for e in rows.bins[r] if isinstance(examples[e], ImageExample)]
        np.testing.assert_array_equal(row["pixel_values"], np.concatenate(
            [e.pixel_values for e in image_exs]) if image_exs else np.zeros((0, 3 * 2 * 16 * 16)))
    assert len(rows) == 1  # every example fits one row: a batch of 2 is that row twice
    batch = next(iter(data.train))
    assert batch["rope_positions"].shape == (3, 2, 2048) and batch["rope_positions"].dtype == np.int32
    np.testing.assert_array_equal(batch["rope_positions"][:, 1], rows[0]["rope_positions"])
    assert batch["tokens"].shape == (2, 2048) and batch["pixel_values"].dtype == np.float32
    pixels, grids = unpad_images(batch)
    np.testing.assert_array_equal(grids, np.concatenate([rows[0]["image_grid_thw"]] * 2))
    np.testing.assert_array_equal(pixels, np.concatenate([rows[0]["pixel_values"]] * 2))
    assert batch["image_grid_thw"].dtype == np.int64 and len(batch["pixel_values"]) == patch_bucket(len(pixels), 2)


def _image_row(seq_len: int, grids: list[tuple[int, int, int]], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    patches = sum(t * h * w for t, h, w in grids)
    return {"tokens": rng.integers(0, 9, seq_len, dtype=np.int32), "positions": np.arange(seq_len, dtype=np.int32),
            "pixel_values": rng.standard_normal((patches, 12)).astype(np.float32),
            "image_grid_thw": np.asarray(grids, np.int64).reshape(-1, 3),
            "rope_positions": rng.integers(0, 99, (3, seq_len), dtype=np.int32)}


def test_collation_pads_ragged_images_to_buckets_and_round_trips():
    rows = [_image_row(8, [(1, 4, 6), (1, 2, 2)], 0), _image_row(8, [], 1), _image_row(8, [(1, 6, 2)], 2)]
    batch = collate_image_rows(rows, merge_size=2)
    assert batch["pixel_values"].shape == (4 * 16, 12) and patch_bucket(24 + 4 + 12, 2) == 64
    assert batch["image_grid_thw"].shape == (4, 3) and not batch["image_grid_thw"][3].any()
    assert not batch["pixel_values"][40:].any()
    pixels, grids = unpad_images(batch)
    np.testing.assert_array_equal(pixels, np.concatenate([r["pixel_values"] for r in rows]))
    np.testing.assert_array_equal(grids, [[1, 4, 6], [1, 2, 2], [1, 6, 2]])
    np.testing.assert_array_equal(batch["rope_positions"], np.stack([r["rope_positions"] for r in rows], axis=1))
    np.testing.assert_array_equal(batch["tokens"], np.stack([r["tokens"] for r in rows]))
    none = collate_image_rows([_image_row(8, [], 3)], merge_size=2)
    assert none["pixel_values"].shape == (0, 12) and none["image_grid_thw"].shape == (0, 3)
    text = [{k: v for k, v in r.items() if k in ("tokens", "positions")} for r in rows]
    out = collate_image_rows(text, merge_size=2)
    assert out.keys() == {"tokens", "positions"} and all(np.array_equal(out[k], stack_rows(text)[k]) for k in out)


def test_image_rows_refused_for_a_text_only_model_and_text_data_unchanged_for_a_vision_model(tmp_path):
    text_model = _model(tmp_path, vision=False)
    assert isinstance(model_vision(text_model), TextOnly)
    with pytest.raises(DataError, match=r"rows.jsonl: a row has images but .*model is a text model"):
        _build(tmp_path, text_model)
    folder = tmp_path / "text_rows.jsonl"
    folder.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}]}) + "\n")
    tok = Tokenizer.from_dir(text_model)
    data = build_data([str(folder)], tok, sequence_len=64, batch_size=1, process_index=0, process_count=1,
                      vision=lambda: pytest.fail("the model folder is read only for image rows"))
    assert type(data.train_rows).__name__ == "PackedRows" and "pixel_values" not in next(iter(data.train))


def test_preprocessor_config_is_read_and_max_pixels_overrides_it(tmp_path):
    folder = _model(tmp_path)
    vision = model_vision(folder)
    assert isinstance(vision, VisionData) and vision.processing.patch_size == 16
    assert (vision.processing.min_pixels, vision.processing.max_pixels) == (1024, 6144)
    small = model_vision(folder, max_pixels=2048)
    assert small.processing.max_pixels == 2048 and small.processing.min_pixels == 1024
    (tmp_path / "small").mkdir()
    data, _ = _build(tmp_path / "small", folder, vision=small)
    assert all(int(np.prod(g[1:])) * 256 <= 2048 for e in data.examples(4) if isinstance(e, ImageExample)
               for g in e.image_grid_thw)
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "crop_size": 3}))
    with pytest.raises(DataError, match="crop_size"):
        model_vision(folder)
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(DataError, match="no preprocessor_config.json"):
        model_vision(folder)


def test_tokenize_debug_shows_image_spans_and_sources(tmp_path):
    data, tok = _build(tmp_path, _model(tmp_path))
    console = Console(record=True, width=200, color_system=None)
    debug_print(data.examples(3), tok, n=3, console=console)
    text = console.export_text()
    assert "images: a.png" in text and "images: b.png, a.png" in text
    assert "<image 1: " in text and "<image 2: " in text and "<|image_pad|>" not in text


def test_example_dataset_through_the_tokenize_cli(tmp_path, capsys, monkeypatch):
    """configs/examples/lora_qwen3_vl_images.yaml with its shipped dataset (scripts/make_image_dataset.py), the
    model swapped for the fixture folder: every row tokenized with its images; --debug shows spans and files."""
    from surojax.cli.main import main
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    folder = _model(tmp_path)
    assert main(["tokenize", "configs/examples/lora_qwen3_vl_images.yaml", "--override", f"model={folder}",
                 "--debug", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "88 examples" in out and "100 images" in out and "validation 16 examples" in out
    assert re.search(r"<image 1: \d+x\d+ patches -> \d+ tokens>", out) and "images: img/" in out


def test_eval_batches_pad_with_empty_image_rows(tmp_path):
    """The eval loader's last batch is filled with rows of no tokens and no images, collated like the rest."""
    folder = _model(tmp_path)
    path = _dataset(tmp_path)
    data = build_data([str(path)], Tokenizer.from_dir(folder), sequence_len=2048, batch_size=1, process_index=0,
                      process_count=1, validation_datasets=[str(path)], eval_batch_size=3, vision=model_vision(folder))
    (batch,) = list(data.eval)
    row = data.eval_rows[0]
    assert batch["tokens"].shape == (3, 2048) and batch["rope_positions"].shape == (3, 3, 2048)
    assert not batch["rope_positions"][:, 1:].any() and not batch["segment_ids"][1:].any()
    pixels, grids = unpad_images(batch)
    np.testing.assert_array_equal(pixels, row["pixel_values"])
    np.testing.assert_array_equal(grids, row["image_grid_thw"])


def test_split_into_micro_batches_keeps_each_rows_images():
    """Rows [2 images, none, 1 image, 1 image] as 2 micro-batches: each part holds its rows' images, padded to
    one common bucket; the rows' image tokens tell which images are whose."""
    pad = 7
    grids = [[(1, 4, 6), (1, 2, 2)], [], [(1, 6, 2)], [(1, 2, 4)]]
    rows = []
    for k, g in enumerate(grids):
        row = _image_row(16, g, k)
        row["tokens"] = np.zeros(16, np.int32)
        row["tokens"][:sum(t * h * w // 4 for t, h, w in g)] = pad
        row["segment_ids"] = np.ones(16, np.int32)
        rows.append(row)
    batch = collate_image_rows(rows, merge_size=2)
    parts = split_image_batch(batch, 2, image_token_id=pad, merge_size=2)
    assert parts["tokens"].shape == (2, 2, 16) and parts["rope_positions"].shape == (2, 3, 2, 16)
    for j in range(2):
        want = collate_image_rows(rows[2 * j:2 * j + 2], merge_size=2)
        np.testing.assert_array_equal(parts["rope_positions"][j], want["rope_positions"])
        got_pixels, got_grids = unpad_images({k: parts[k][j] for k in ("pixel_values", "image_grid_thw")})
        np.testing.assert_array_equal(got_pixels, unpad_images(want)[0])
        np.testing.assert_array_equal(got_grids, unpad_images(want)[1])
    assert parts["pixel_values"].shape == (2, 32, 12) and parts["image_grid_thw"].shape == (2, 2, 3)


@pytest.mark.parametrize("row,what", [
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "?"}]},
                   {"role": "assistant", "content": "A ball rolls."}]}, r"a video part \('video'\)"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "clip.mp4"}}]},
                   {"role": "assistant", "content": "A ball rolls."}]}, r"a video part \('video_url'\)"),
    ({"videos": ["clip.mp4"], "messages": [{"role": "user", "content": "<video>What happens?"},
                                          {"role": "assistant", "content": "A ball rolls."}]}, "a 'videos' column"),
])
def test_video_rows_refused_by_name(tmp_path, row, what):
    """A video row (no image in it) would otherwise be read as text with its video dropped."""
    path = tmp_path / "videos.jsonl"
    path.write_text(json.dumps(row) + "\n")
    folder = _model(tmp_path)
    with pytest.raises(DataError, match=f"videos.jsonl:1: {what}: videos are not supported in training rows"):
        build_data([str(path)], Tokenizer.from_dir(folder), sequence_len=64, batch_size=1, process_index=0,
                   process_count=1, vision=model_vision(folder))
