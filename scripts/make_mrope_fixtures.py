"""Make tests/fixtures/mrope/expected.npz: transformers 5.17's multimodal rotary positions and cos/sin.

Run in the reference environment:  /work/refenv/bin/python scripts/make_mrope_fixtures.py

Positions: `Qwen3VLModel.get_rope_index` and `Qwen3_5Model.get_rope_index` (called unbound; they read only
`config.vision_config.spatial_merge_size` and `get_vision_position_ids`), with `mm_token_type_ids` made as the
processor makes them (image token -> 1, video token -> 2). Cos/sin: `Qwen3VLTextRotaryEmbedding` (head_dim 128,
mrope_section [24, 20, 20]), `Qwen3_5TextRotaryEmbedding` (head_dim 256, partial_rotary_factor 0.25, section
[11, 11, 10]), both interleaved; and the chunked layout of Qwen2-VL / Qwen2.5-VL (`Qwen2VLRotaryEmbedding`, head_dim
128, section [16, 24, 24]).
"""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import torch
from transformers.models.qwen2_vl import modeling_qwen2_vl as q2vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_vl import modeling_qwen3_vl as q3vl
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "mrope" / "expected.npz"
PAD, V_START, V_END, IMAGE, VIDEO = 0, 512, 513, 514, 515
MERGE = 2


def text(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def vision(token: int, n: int) -> list[int]:
    return [V_START] + [token] * n + [V_END]


def rope_index(model_cls, ids, image_grid, video_grid, mask):
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=MERGE)),
        get_vision_position_ids=lambda *a, **k: model_cls.get_vision_position_ids(None, *a, **k))
    ids_t = torch.tensor(ids)
    types_t = (ids_t == IMAGE).int() + 2 * (ids_t == VIDEO).int()
    pos, deltas = model_cls.get_rope_index(
        fake, ids_t, types_t,
        image_grid_thw=None if image_grid is None else torch.tensor(image_grid),
        video_grid_thw=None if video_grid is None else torch.tensor(video_grid),
        attention_mask=None if mask is None else torch.tensor(mask))
    return pos.numpy(), deltas.numpy()


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, np.ndarray] = {}
    # images: row 0 text + 2 images of different grids; row 1 text only; row 2 left-padded with one tall image
    rows = [text(3) + vision(IMAGE, 6) + text(2) + vision(IMAGE, 2) + text(1),
            text(18),
            [PAD] * 4 + text(2) + vision(IMAGE, 6) + text(4)]
    image_grid = [[1, 4, 6], [1, 2, 4], [1, 6, 4]]
    mask = [[1] * 18, [1] * 18, [0] * 4 + [1] * 14]
    # video: row 0 a 2-frame clip (timestamp text between frames) then an image; row 1 left-padded 3-frame clip
    vrows = [text(2) + vision(VIDEO, 4) + text(2, 40) + vision(VIDEO, 4) + text(1) + vision(IMAGE, 1) + text(2),
             [PAD] * 3 + text(1) + vision(VIDEO, 2) + text(1, 40) + vision(VIDEO, 2) + text(1, 41)
             + vision(VIDEO, 2) + text(4)]
    assert len(vrows[0]) == len(vrows[1]) == 22, [len(r) for r in vrows]
    vimage_grid, video_grid = [[1, 2, 2]], [[2, 4, 4], [3, 2, 4]]
    vmask = [[1] * 22, [0] * 3 + [1] * 19]
    cases = {"image": (rows, image_grid, None, mask),
             "image_nomask": (rows[:2], image_grid[:2], None, None),
             "text": ([text(5), text(5, 30)], None, None, [[0, 0, 1, 1, 1], [1] * 5]),
             "video": (vrows, vimage_grid, video_grid, vmask)}
    for name, (ids, ig, vg, m) in cases.items():
        pos, deltas = rope_index(q3vl.Qwen3VLModel, ids, ig, vg, m)
        pos35, deltas35 = rope_index(q35.Qwen3_5Model, ids, ig, vg, m)
        assert np.array_equal(pos, pos35) and np.array_equal(deltas, deltas35), name
        out[f"{name}_input_ids"] = np.asarray(ids, np.int64)
        out[f"{name}_image_grid_thw"] = np.asarray(ig if ig is not None else np.zeros((0, 3)), np.int64)
        out[f"{name}_video_grid_thw"] = np.asarray(vg if vg is not None else np.zeros((0, 3)), np.int64)
        out[f"{name}_attention_mask"] = np.asarray(m if m is not None else np.ones_like(ids), np.int64)
        out[f"{name}_has_mask"] = np.asarray(m is not None)
        out[f"{name}_positions"] = pos
        out[f"{name}_rope_deltas"] = deltas.reshape(-1)

    # cos/sin on the image batch's positions and on large random positions (fp32 precision at long context)
    big = torch.randint(0, 40000, (3, 2, 7))
    out["rot_big_positions"] = big.numpy()
    x = torch.zeros(1)
    vl_cfg = Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                               rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    q35_cfg = Qwen3_5TextConfig(hidden_size=256, num_attention_heads=2, head_dim=256,
                                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                 "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                 "mrope_interleaved": True})
    for key, emb in (("qwen3_vl", q3vl.Qwen3VLTextRotaryEmbedding(vl_cfg)),
                     ("qwen3_5", q35.Qwen3_5TextRotaryEmbedding(q35_cfg))):
        out[f"{key}_inv_freq"] = emb.inv_freq.numpy()
        for pname, p in (("image", torch.from_numpy(out["image_positions"])), ("big", big)):
            cos, sin = emb(x, p)
            out[f"{key}_{pname}_cos"], out[f"{key}_{pname}_sin"] = cos.numpy(), sin.numpy()

    # chunked (non-interleaved) layout: Qwen2-VL's text rotary (head_dim 128, section [16, 24, 24], theta 1e6)
    q2_cfg = Qwen2VLTextConfig(hidden_size=256, num_attention_heads=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                "mrope_section": [16, 24, 24]})
    emb = q2vl.Qwen2VLRotaryEmbedding(q2_cfg)
    out["chunked_inv_freq"] = emb.inv_freq.numpy()
    cos, sin = emb(x, big)
    out["chunked_big_cos"], out["chunked_big_sin"] = cos.numpy(), sin.numpy()

    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    for name in cases:
        print(name, out[f"{name}_positions"].tolist(), out[f"{name}_rope_deltas"].tolist())


if __name__ == "__main__":
    main()
