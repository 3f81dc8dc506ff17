"""M-RoPE positions and cos/sin against transformers 5.17 (tests/fixtures/mrope/expected.npz, made by
scripts/make_mrope_fixtures.py from Qwen3VLModel / Qwen3_5Model.get_rope_index and the text rotary embeddings)."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from surojax.models.vision.mrope import mrope_cos_sin, mrope_decode_positions, mrope_inv_freq, mrope_positions

FIX = np.load(Path(__file__).parent / "fixtures" / "mrope" / "expected.npz")
IDS = dict(image_token_id=514, video_token_id=515, vision_start_token_id=512, spatial_merge_size=2)


def _positions(case, **over):
    args = dict(input_ids=FIX[f"{case}_input_ids"], image_grid_thw=FIX[f"{case}_image_grid_thw"],
                video_grid_thw=FIX[f"{case}_video_grid_thw"],
                attention_mask=FIX[f"{case}_attention_mask"] if FIX[f"{case}_has_mask"] else None)
    args.update(over)
    return mrope_positions(args.pop("input_ids"), args.pop("image_grid_thw"), args.pop("video_grid_thw"),
                           **IDS, **args)


@pytest.mark.parametrize("case", ["image", "image_nomask", "text", "video"])
def test_positions_equal_transformers(case):
    pos, deltas = _positions(case)
    assert pos.dtype == np.int32 and pos.shape == FIX[f"{case}_positions"].shape
    np.testing.assert_array_equal(pos, FIX[f"{case}_positions"])
    np.testing.assert_array_equal(deltas, FIX[f"{case}_rope_deltas"])


def test_decode_positions_continue_after_the_prompt():
    pos, deltas = _positions("image")
    real = FIX["image_attention_mask"].sum(1)  # the next token's index among each row's real tokens
    nxt = mrope_decode_positions(real[:, None], deltas)
    np.testing.assert_array_equal(nxt[:, :, 0], np.broadcast_to(pos.max(axis=(0, 2)) + 1, (3, 3)))


@pytest.mark.parametrize("key,rotary_dim,theta,section,interleaved", [
    ("qwen3_vl", 128, 5_000_000.0, [24, 20, 20], True),
    ("qwen3_5", 64, 10_000_000.0, [11, 11, 10], True),   # head_dim 256 x partial_rotary_factor 0.25
    ("chunked", 128, 1_000_000.0, [16, 24, 24], False),  # Qwen2-VL / Qwen2.5-VL layout
])
def test_cos_sin_equal_transformers(key, rotary_dim, theta, section, interleaved):
    # torch's fp32 pow is not correctly rounded: our inv_freq is equal or 1 ulp off
    np.testing.assert_array_max_ulp(mrope_inv_freq(rotary_dim, theta), FIX[f"{key}_inv_freq"], maxulp=1)
    cases = [("big", FIX["rot_big_positions"], FIX[f"{key}_inv_freq"])]  # long-context angles: same inv_freq
    if key != "chunked":
        cases.append(("image", FIX["image_positions"], None))  # our own inv_freq on the image batch
    for pname, src, inv in cases:
        cos, sin = mrope_cos_sin(jnp.asarray(src), rotary_dim, theta, section, interleaved, inv_freq=inv)
        np.testing.assert_allclose(np.asarray(cos), FIX[f"{key}_{pname}_cos"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sin), FIX[f"{key}_{pname}_sin"], rtol=0, atol=1e-6)


def test_layout_matters():
    # the interleaved and chunked layouts differ on the image batch (the fixture would catch a swapped layout)
    p = jnp.asarray(FIX["image_positions"])
    a, _ = mrope_cos_sin(p, 128, 5_000_000.0, [24, 20, 20], True)
    b, _ = mrope_cos_sin(p, 128, 5_000_000.0, [24, 20, 20], False)
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_bad_inputs_are_named():
    ids = FIX["image_input_ids"]
    with pytest.raises(ValueError, match="image_grid_thw: 3 images but input_ids hold 2"):
        _positions("image", input_ids=ids[:2], attention_mask=None)
    with pytest.raises(ValueError, match=r"row 0, token 4: 6 image tokens but image 0 has grid \[1, 2, 4\]"):
        _positions("image", image_grid_thw=FIX["image_image_grid_thw"][[1, 0, 2]])
    bad = ids.copy()
    bad[0, 3] = 10  # the vision start before the first image
    with pytest.raises(ValueError, match="row 0, token 4: image tokens not preceded by the vision start"):
        _positions("image", input_ids=bad)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        _positions("image", image_grid_thw=[[1, 3, 4]] * 3)
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_cos_sin(jnp.zeros((3, 1, 2), jnp.int32), 128, 1e6, [24, 20, 10], True)
