"""Pre-quantised checkpoints (surojax.weights.prequant) against the formats' own tools.

Each folder of tests/fixtures/prequant was written by the format's tool (scripts/make_prequant_fixtures.py:
transformers' FineGrainedFP8 quantiser, compressed-tensors' compressor, NVIDIA ModelOpt's export, transformers +
bitsandbytes' save_pretrained) with the tool's own dequantisation in reference.npz. Checked here: surojax's
dequantisation of every quantised weight equals the tool's bit for bit; the model loads with its Linear kernels in
surojax's format (the frozen base of LoRA and of serving) and its logits equal transformers' forward over the
tool's dequantised weights; bitsandbytes' quantize_4bit states (with and without double quantisation, bf16
storage) read exactly; and every checkpoint surojax cannot read is refused naming the file and the key or tensor.
"""
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from surojax.model_loader import load_model_ref
from surojax.peft.lora import LORA_TARGETS, base_linear
from surojax.quant.model import is_quantized
from surojax.quant import NF4, NVFP4, FP8Block
from surojax.weights.hf_checkpoint import load_model, open_checkpoint
from surojax.weights.prequant import PrequantError, read_scheme, with_prequant
from surojax.weights.prequant.bnb_nf4 import BitsAndBytesNF4
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "prequant"
FORMATS = {"fp8_block": FP8Block, "ct_fp8": FP8Block, "modelopt_nvfp4": NVFP4, "bnb_nf4": NF4}
HF_TOL = 1e-4  # fp32 logits against transformers' (the fixtures' protocol, as tests/weights/test_hf_checkpoint.py)


def probe(k: int) -> np.ndarray:
    """The fixture script's fingerprint matrix: float64 [K, 2] of +-1 seeded by K."""
    return np.random.default_rng(k).choice([-1.0, 1.0], size=(k, 2))


def assert_same_values(name: str, deq: np.ndarray, ref: np.lib.npyio.NpzFile) -> None:
    """deq (float32 [N, K]) equals the tool's dequantisation: whole where reference.npz keeps it, else through its
    probe fingerprint. Both fingerprints sum the same K float64 terms (float32 values times +-1, exact), each sum
    within K * 2^-53 * sum|terms| of the exact one whatever the summation order, so they agree within twice that;
    one value one float32 ulp away (>= 2^-24 |w| for a normal w) moves the sum by far more (2^-24 |w| vs
    K * 2^-52 * sum|w| with K <= 128)."""
    if f"weight:{name}" in ref.files:
        np.testing.assert_array_equal(deq, ref[f"weight:{name}"], err_msg=name)
    got = deq.astype(np.float64) @ probe(deq.shape[1])
    bound = 2 * deq.shape[1] * 2.0 ** -53 * (np.abs(deq.astype(np.float64)) @ np.ones((deq.shape[1], 2)))
    assert np.all(np.abs(got - ref[f"probe:{name}"]) <= bound), name


@pytest.mark.parametrize("folder", FORMATS)
def test_dequantisation_equals_the_tools_bit_for_bit(folder):
    d = FIXTURES / folder
    ref = np.load(d / "reference.npz")
    where, _ = with_prequant(open_checkpoint(d), read_scheme(d))
    names = [k[len("probe:"):] for k in ref.files if k.startswith("probe:")]
    assert len(names) == 14  # 7 Linears x 2 layers
    for name in names:
        assert_same_values(name, where[name].get(name), ref)


@pytest.mark.parametrize("folder", FORMATS)
def test_loads_quantised_with_transformers_logits(folder):
    """(The ModelOpt export has an FP8 KV cache, as nvidia's do: its k_scale / v_scale are read as not used.)"""
    d = FIXTURES / folder
    ref = np.load(d / "reference.npz")
    model = load_model(d, dtype=jnp.float32, keep_quantized=True)
    for target in LORA_TARGETS:
        assert isinstance(base_linear(model, target).kernel.get_value(), FORMATS[folder]), target
    assert is_quantized(model).keys() == set(LORA_TARGETS)
    out = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"])[None]))[0]
    assert np.abs(out - ref["logits"]).max() <= HF_TOL
    plain = load_model(d, dtype=jnp.float32)  # keep_quantized off: every weight dequantised to float32
    assert not is_quantized(plain)
    np.testing.assert_array_equal(np.asarray(plain.layers.attn.q_proj.kernel.get_value()[0]).T,
                                  ref["weight:model.layers.0.self_attn.q_proj.weight"])


def test_a_served_reference_keeps_the_checkpoint_quantised():
    """The one model loader (serve, generate) keeps the format; with an adapter to fold it would dequantise."""
    loaded = load_model_ref(FIXTURES / "bnb_nf4", dtype=jnp.float32, keep_quantized=True,
                            tokenizer_dir=FIXTURES.parent / "tokenizer")
    assert set(is_quantized(loaded.model).values()) == {"nf4"}
    assert base_linear(loaded.model, "down_proj").kernel.get_value().double_quant


@pytest.mark.parametrize("case,double_quant", [("single", False), ("nested", True), ("storage_bf16", True)])
def test_bitsandbytes_quantize_4bit_states_read_exactly(case, double_quant):
    """bitsandbytes' quantize_4bit outputs as Linear4bit saves them: compress_statistics False (fp32 absmax) and
    True over two nested blocks of 256 (320 blocks), and bf16 quant storage (the packed bytes in bf16 elements)."""
    d = FIXTURES / "bnb_quant_states"
    f = SafetensorsFile(d / "states.safetensors")
    where = {n: f for n in f.names()}
    scheme = BitsAndBytesNF4.from_config({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, f.path)
    stored = scheme.claim(where).weights[f"{case}.weight"]
    q = scheme.read(stored, where)
    assert isinstance(q, NF4) and q.double_quant == double_quant
    deq = np.asarray(jax.jit(lambda w: w.dequantize(jnp.float32))(q)).T
    assert_same_values(f"{case}.weight", deq, np.load(d / "reference.npz"))


def _copy(tmp_path, folder) -> Path:
    dst = tmp_path / folder
    shutil.copytree(FIXTURES / folder, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, drop=(), replace=None) -> None:
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: f.get(n) for n in f.names() if n not in drop}
    tensors.update(replace or {})
    write_safetensors(d / "model.safetensors", tensors)


@pytest.mark.parametrize("folder,changes,match", [
    ("fp8_block", {"quant_method": "awq"}, r"quantization_config\.quant_method: 'awq' is not supported; .*fp8, "
                                           r"compressed-tensors, modelopt, bitsandbytes"),
    ("fp8_block", {"scale_fmt": "ue8m0"}, r"quantization_config\.scale_fmt: expected \"float\""),
    ("fp8_block", {"weight_block_size": [128]}, r"quantization_config\.weight_block_size"),
    ("ct_fp8", {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     r"quantization_config\.config_groups\.g\.format: expected one of float-quantized"),
    ("ct_fp8", {"transform_config": {"config_groups": {"r": {}}}}, r"quantization_config\.transform_config"),
    ("modelopt_nvfp4", {"quant_algo": "W4A16_AWQ"}, r"quantization_config\.quant_algo: expected one of NVFP4, FP8"),
    ("modelopt_nvfp4", {"kv_cache_scheme": "NVFP4"}, r"quantization_config\.kv_cache_scheme: expected null, \"FP8\""),
    ("bnb_nf4", {"bnb_4bit_quant_type": "fp4"}, r"quantization_config\.bnb_4bit_quant_type: expected \"nf4\""),
    ("bnb_nf4", {"load_in_8bit": True, "load_in_4bit": False}, r"quantization_config\.load_in_8bit"),
])
def test_unsupported_quantisation_configs_are_refused(tmp_path, folder, changes, match):
    d = _copy(tmp_path, folder)
    _edit_config(d, **changes)
    with pytest.raises(PrequantError, match=match) as e:
        load_model(d)
    assert str(d / "config.json") in str(e.value)


def test_modelopt_hf_quant_config_alone_is_read(tmp_path):
    """Older ModelOpt exports carry the scheme only in hf_quant_config.json."""
    d = _copy(tmp_path, "modelopt_nvfp4")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_scheme(d).describe() == "modelopt NVFP4 -> surojax nvfp4"
    assert set(is_quantized(load_model(d, keep_quantized=True)).values()) == {"nvfp4"}
    hf_quant = json.loads((d / "hf_quant_config.json").read_text())
    hf_quant["quantization"]["group_size"] = 32
    (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    with pytest.raises(PrequantError, match=r"hf_quant_config\.json: quantization_config\.group_size: expected 16"):
        read_scheme(d)


def test_older_compressed_tensors_exports_are_read(tmp_path):
    """Older llm-compressor exports (nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf, transformers' documented example)
    say format "naive-quantized", quantization_status "frozen", some under the key compression_config (which vLLM
    and compressed-tensors read too): the same FP8 tensors, the same values."""
    d = _copy(tmp_path, "ct_fp8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["compression_config"] = {**cfg.pop("quantization_config"), "format": "naive-quantized",
                                 "quantization_status": "frozen"}
    (d / "config.json").write_text(json.dumps(cfg))
    ref = np.load(d / "reference.npz")
    where, _ = with_prequant(open_checkpoint(d), read_scheme(d))
    for name in [k[len("probe:"):] for k in ref.files if k.startswith("probe:")]:
        assert_same_values(name, where[name].get(name), ref)
    cfg["compression_config"]["quantization_status"] = "initialized"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrequantError, match=r"quantization_status: expected \"compressed\" or \"frozen\""):
        read_scheme(d)


Q = "model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("folder,drop,replace,match", [
    ("fp8_block", [f"{Q}.weight_scale_inv"], None,
     rf"tensor {Q}\.weight is float8_e4m3fn but is not a quantised weight .*<module>\.weight_scale_inv"),
    ("ct_fp8", [f"{Q}.weight_scale"], None,
     rf"tensor {Q}\.weight is float8_e4m3fn but is not a quantised weight .*<module>\.weight_scale\)"),
    ("fp8_block", [], {f"{Q}.weight_scale_inv": np.ones((1, 1), np.float32)},
     rf"tensor {Q}\.weight_scale_inv has shape \[1, 1\], expected \[2, 1\] .*32 x 64 block"),
    ("ct_fp8", [f"{Q}.input_scale"], None, rf"module {Q} has no {Q}\.input_scale .*static input activations"),
    ("modelopt_nvfp4", [f"{Q}.weight_scale"], None, rf"{Q}\.weight_scale_2 has no {Q}\.weight_scale"),
    ("bnb_nf4", [f"{Q}.weight.absmax"], None, rf"has no {Q}\.weight\.absmax"),
    ("bnb_nf4", [f"{Q}.weight.quant_state.bitsandbytes__nf4"], None,
     rf"tensor {Q}\.weight(\.\w+)* is uint8 but is not a quantised weight .*<module>\.weight\.quant_state\."),
    ("bnb_nf4", [], {f"{Q}.weight.quant_map": np.linspace(-1, 1, 16, dtype=np.float32)},
     rf"tensor {Q}\.weight\.quant_map is not bitsandbytes' NF4 code book"),
])
def test_broken_quantised_tensors_are_named(tmp_path, folder, drop, replace, match):
    d = _copy(tmp_path, folder)
    _edit_tensors(d, drop, replace)
    with pytest.raises(PrequantError, match=match) as e:
        load_model(d, keep_quantized=True)
    assert "model.safetensors" in str(e.value)


def _fp8_blocks(w: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (E4M3 codes, fp32 scale per bn x bk block): transformers' rule (block absmax / 448)."""
    n, k = w.shape
    padded = np.pad(w, ((0, -n % bn), (0, -k % bk)))
    amax = np.abs(padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    codes = (w / np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


@pytest.mark.parametrize("block,joined", [((16, 32), True), ((128, 128), False)])
def test_moe_experts_stay_quantised_where_gate_and_up_join(tmp_path, block, joined):
    """A Qwen3-MoE FP8 checkpoint (per-expert weights, as Qwen3-30B-A3B-FP8 publishes them): the experts' kernels
    stack to [L, E, ...]; gate and up fill one gate_up kernel, kept quantised when their scale blocks end at the
    seam (16-row blocks, F = 32) and dequantised otherwise (128-row blocks straddle it). Either way the model
    computes what the dequantised checkpoint does."""
    src, d = FIXTURES.parent / "models" / "qwen3_moe", tmp_path / "moe_fp8"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    (d / "config.json").write_text(json.dumps(cfg))
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {}
    for name in f.names():
        w = f.get(name)
        if w.ndim == 2 and "_proj." in name:
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = _fp8_blocks(w, *block)
        else:
            tensors[name] = w
    write_safetensors(d / "model.safetensors", tensors)
    quant, plain = load_model(d, keep_quantized=True), load_model(d)
    experts = quant.layers.mlp.experts
    assert isinstance(experts.down_proj.kernel.get_value(), FP8Block)
    assert experts.down_proj.kernel.get_value().data.shape == (2, 8, 64, 32)  # [L, E, N, K]
    assert isinstance(experts.gate_up_proj.kernel.get_value(), FP8Block) == joined
    assert isinstance(quant.layers.attn.q_proj.kernel.get_value(), FP8Block) and not is_quantized(plain)
    np.testing.assert_array_equal(np.asarray(experts.gate_up_proj.kernel.get_value().dequantize(jnp.float32)
                                             if joined else experts.gate_up_proj.kernel.get_value()),
                                  np.asarray(plain.layers.mlp.experts.gate_up_proj.kernel.get_value()))
    tokens = jnp.asarray([[507, 12, 300, 45, 7, 99, 250, 509]])
    run = nnx.jit(lambda m, t: m(t))
    np.testing.assert_allclose(np.asarray(run(quant, tokens)), np.asarray(run(plain, tokens)), rtol=0, atol=1e-5)


def test_a_projection_stored_float_in_one_layer_is_dequantised(tmp_path):
    """modules_to_not_convert naming one layer's q_proj: that projection loads as float (the layer scan takes one
    format per projection), every other stays FP8, and the logits are still transformers'."""
    d = _copy(tmp_path, "fp8_block")
    ref = np.load(d / "reference.npz")
    where, _ = with_prequant(open_checkpoint(d), read_scheme(d))
    _edit_tensors(d, drop=[f"{Q}.weight_scale_inv"], replace={f"{Q}.weight": where[f"{Q}.weight"].get(f"{Q}.weight")})
    model = load_model(d, dtype=jnp.float32, keep_quantized=True)
    assert set(is_quantized(model)) == set(LORA_TARGETS) - {"q_proj"}
    out = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ref["tokens"])[None]))[0]
    assert np.abs(out - ref["logits"]).max() <= HF_TOL
