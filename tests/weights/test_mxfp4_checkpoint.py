"""gpt-oss's published MXFP4 experts (`*_blocks` / `*_scales`) load dequantised, equal to an element-by-element
decoding of the format, and the saved model is a plain float checkpoint (no quantization_config)."""
import json

import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.weights.hf_checkpoint import hf_tensors, load_model, save_model
from surojax.weights.mxfp4_checkpoint import dequantize_mxfp4
from surojax.weights.safetensors_file import write_safetensors

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
HF = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
          attention_bias=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
          quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})


def decode_one(blocks, scales, e, o, i):
    """Element [e, o, i] of the [E, out, in] matrix, from the format's definition."""
    byte = int(blocks[e, o, i // 32, (i % 32) // 2])
    code = byte & 0xF if i % 2 == 0 else byte >> 4
    value = E2M1[code & 7] * (-1 if code & 8 else 1)
    return value * 2.0 ** (int(scales[e, o, i // 32]) - 127)


def test_dequantize_matches_the_format_definition():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (2, 3, 2), dtype=np.uint8)
    got = dequantize_mxfp4(blocks, scales)  # [E, in, out]
    assert got.shape == (2, 64, 3)
    for e, o, i in [(0, 0, 0), (0, 0, 1), (1, 2, 33), (1, 1, 62), (0, 2, 63), (1, 0, 31)]:
        assert got[e, i, o] == decode_one(blocks, scales, e, o, i)


def test_published_mxfp4_checkpoint_loads_dequantised(tmp_path):
    cfg = ModelConfig.from_hf(HF)
    tensors = hf_tensors(Decoder(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    expected = {}
    for i in range(2):
        for proj, (out, inn) in {"gate_up_proj": (64, 64), "down_proj": (64, 32)}.items():
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[name]
            blocks = rng.integers(0, 256, (4, out, inn // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 130, (4, out, inn // 32), dtype=np.uint8)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            expected[name] = np.stack([[[decode_one(blocks, scales, e, o, x) for o in range(out)]
                                        for x in range(inn)] for e in range(4)])
    d = tmp_path / "gpt-oss"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF))
    write_safetensors(d / "model.safetensors", tensors)
    model = load_model(d)
    got = hf_tensors(model)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    save_model(model, tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_unpaired_blocks_are_reported(tmp_path):
    tensors = hf_tensors(Decoder(ModelConfig.from_hf(HF), rngs=nnx.Rngs(0)))
    name = "model.layers.0.mlp.experts.down_proj"
    del tensors[name]
    tensors[name + "_blocks"] = np.zeros((4, 64, 1, 16), np.uint8)  # no _scales
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF))
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.layers\.0\.mlp\.experts\.down_proj"):
        load_model(d)
