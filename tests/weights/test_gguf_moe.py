"""GGUF MoE files (llama.cpp's names: blk.N.ffn_gate_inp router, merged 3-D experts ffn_gate_exps / ffn_up_exps /
ffn_down_exps, {arch}.expert_count / expert_used_count / expert_feed_forward_length; qwen3moe, and Mixtral as the
llama architecture with experts): our writer's tensors against the published per-expert HF weights, and the
written file read back gives the HF-loaded model's logits (f32 exactly; q8_0 and q4_k_m close)."""
from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from surojax.models.config import ModelConfig  # noqa: E402
from surojax.models.decoder import Decoder  # noqa: E402
from surojax.weights.gguf_checkpoint import load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.gguf_reader import read_gguf  # noqa: E402
from surojax.weights.hf_checkpoint import hf_tensors, load_model, save_model  # noqa: E402
from surojax.weights.safetensors_file import write_safetensors  # noqa: E402
from tests.weights.gguf_tiny import PROMPT_IDS, TOKENIZER_DIR  # noqa: E402

# rows of 256 values (hidden and expert F): whole K-quant super-blocks
BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=128)
HF = {
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      norm_topk_prob=True),
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family, hf in HF.items():
        model = Decoder(ModelConfig.from_hf(hf), rngs=nnx.Rngs(5))
        out[family] = save_model(model, root / family)
    return out


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def logits(model):
    """Logits of PROMPT_IDS through one jitted forward: models of one structure (the HF-loaded and the f32 GGUF ones
    of a family) share one compilation, where an eager call compiles the layer scan again for each model."""
    return np.asarray(_forward(model, jnp.asarray([PROMPT_IDS])))[0]


def test_qwen3moe_tensors_follow_llama_cpp(hf_dirs, tmp_path):
    hf = {k: np.asarray(v) for k, v in hf_tensors(load_model(hf_dirs["qwen3_moe"])).items()}  # per-expert names
    f = read_gguf(save_gguf(hf_dirs["qwen3_moe"], tmp_path / "m.gguf", "q8_0", tokenizer_dir=TOKENIZER_DIR))
    fields, t = f.fields, {x.name: x for x in f.tensors}
    assert fields["general.architecture"] == "qwen3moe"
    assert (fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"],
            fields["qwen3moe.expert_feed_forward_length"]) == (4, 2, 256)
    router = t["blk.1.ffn_gate_inp.weight"]
    assert router.tensor_type.name == "F32" and router.shape == (256, 4)  # ne [D, E]
    np.testing.assert_array_equal(router.data, hf["model.layers.1.mlp.gate.weight"])
    for gname, proj in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
        x = t[f"blk.1.{gname}.weight"]
        assert x.tensor_type.name == "Q8_0" and x.shape == (256, 256, 4)  # ne [in, out, E]
        want = np.stack([hf[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] for e in range(4)])  # [E, out, in]
        got = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
        np.testing.assert_allclose(got, want, atol=np.abs(want).max() / 127)  # one 8-bit step
    assert not any(name.startswith("blk.0.ffn_gate.") for name in t)  # no dense MLP tensors


@pytest.mark.parametrize("family", list(HF))
def test_f32_round_trip_gives_the_hf_logits(hf_dirs, tmp_path, family):
    path = save_gguf(hf_dirs[family], tmp_path / "m.gguf", "f32", tokenizer_dir=TOKENIZER_DIR)
    cfg, model, _ = load_gguf_model(path)
    assert cfg.model_type == family and cfg.moe == load_model(hf_dirs[family]).cfg.moe
    np.testing.assert_array_equal(logits(model), logits(load_model(hf_dirs[family])))


def test_q8_0_equals_the_weights_rounded_by_gguf_py(hf_dirs, tmp_path):
    """Independent reference: the HF model whose 2-D weights (all but the F32 router) went through gguf-py's own
    Q8_0 quantise + dequantise. Our q8_0 file read back gives its logits (up to float summation order)."""
    hf_dir = hf_dirs["qwen3_moe"]
    path = save_gguf(hf_dir, tmp_path / "m.gguf", "q8_0", tokenizer_dir=TOKENIZER_DIR)
    q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = {n: (gguf.quants.dequantize(gguf.quants.quantize(v, q8), q8) if v.ndim == 2 and ".mlp.gate." not in n
                   else v) for n, v in ((n, np.asarray(v, np.float32)) for n, v in hf_tensors(load_model(hf_dir)).items())}
    ref_dir = tmp_path / "rounded"
    ref_dir.mkdir()
    shutil.copy(hf_dir / "config.json", ref_dir / "config.json")
    write_safetensors(ref_dir / "model.safetensors", rounded)
    _, model, _ = load_gguf_model(path)
    np.testing.assert_allclose(logits(model), logits(load_model(ref_dir)), rtol=1e-4, atol=1e-5)


def test_k_quant_experts_read_back_as_gguf_py_decodes_them(hf_dirs, tmp_path):
    """q4_k_m: the experts in K-quants; read back, each layer's gate_up [E, D, 2F] and down [E, F, D] equal gguf-py's dequantisation of the file's
    tensors, and the logits stay near the unquantised model's."""
    path = save_gguf(hf_dirs["qwen3_moe"], tmp_path / "m.gguf", "q4_k_m", tokenizer_dir=TOKENIZER_DIR)
    t = {x.name: x for x in read_gguf(path).tensors}
    assert t["blk.0.ffn_gate_exps.weight"].tensor_type.name == "Q4_K"
    _, model, _ = load_gguf_model(path)

    def dense(w):  # a plain array, or a kept-quantised weight
        w = w.dequantize(jnp.float32) if hasattr(w, "dequantize") else w
        return np.asarray(w)

    gate_up = dense(model.layers.mlp.experts.gate_up_proj.kernel.get_value())
    down = dense(model.layers.mlp.experts.down_proj.kernel.get_value())
    for i in range(2):
        dq = {g: gguf.quants.dequantize(np.asarray(t[f"blk.{i}.{g}.weight"].data), t[f"blk.{i}.{g}.weight"].tensor_type)
              for g in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        want = np.concatenate([dq["ffn_gate_exps"], dq["ffn_up_exps"]], axis=1).swapaxes(1, 2)  # [E, D, 2F]
        np.testing.assert_array_equal(gate_up[i], want)
        np.testing.assert_array_equal(down[i], dq["ffn_down_exps"].swapaxes(1, 2))
    ref = logits(load_model(hf_dirs["qwen3_moe"]))
    err = np.sqrt(np.mean((logits(model) - ref) ** 2)) / np.sqrt(np.mean(ref ** 2))
    assert err < 0.5, err  # 4-bit weights on a tiny random model (q8_0 gives ~0.08): a layout error gives ~1.4
