"""Pre-quantised checkpoint fixtures, each made by the format's own tool (tests/weights/test_prequant_*.py).

Run with the reference environment (torch, transformers, bitsandbytes, compressed-tensors, nvidia-modelopt), never
from the surojax venv:

    /work/refenv/bin/python scripts/make_prequant_fixtures.py             # all of tests/fixtures/prequant/
    /work/refenv/bin/python scripts/make_prequant_fixtures.py --only fp8_block bnb_nf4

Every folder is a tiny random model (vocab 512 = the fixture tokenizer's, hidden 64, 2 layers, 4 heads, 2 kv heads,
head_dim 16, intermediate 128, tied embeddings, bf16) quantised and saved the way the format's tool writes it:

    fp8_block/         transformers' FineGrainedFP8 quantiser (`Fp8Quantize`, weight_block_size [32, 64]: several
                       non-square blocks per matrix) -> `weight` F8_E4M3 + `weight_scale_inv` [N/32, K/64] fp32;
                       config.json quantization_config quant_method "fp8" (qwen3)
    ct_fp8/            compressed-tensors' FloatQuantizationCompressor ("float-quantized"): q/k/v/o per-tensor
                       scale + static input_scale, gate/up per-channel, down block [128, 128] (partial blocks,
                       padded as compressed-tensors pads); bf16 scales; quant_method "compressed-tensors" (qwen3)
    modelopt_nvfp4/    NVIDIA ModelOpt's own export (mtq.quantize NVFP4_DEFAULT_CFG with the FP8 KV cache config +
                       export_hf_checkpoint): `weight` uint8 E2M1 pairs, `weight_scale` F8_E4M3 per 16,
                       `weight_scale_2` fp32, `input_scale`, the attention's `k_proj.k_scale` / `v_proj.v_scale`;
                       hf_quant_config.json (kv_cache_quant_algo "FP8") and quantization_config quant_method
                       "modelopt" (kv_cache_scheme) (qwen3)
    bnb_nf4/           transformers + bitsandbytes (BitsAndBytesConfig load_in_4bit nf4, double quant) then
                       save_pretrained: `weight` uint8 [N*K/2, 1], `weight.absmax` uint8, `weight.nested_absmax`,
                       `weight.nested_quant_map`, `weight.quant_map`, `weight.quant_state.bitsandbytes__nf4` (llama)
    bnb_quant_states/  bitsandbytes' quantize_4bit of three matrices saved as Linear4bit saves them
                       (states.safetensors): without double quant (compress_statistics=False), with it over two
                       nested blocks, with bf16 quant storage

and reference.npz, from the independent implementation:

    weight:<name>      float32 [N, K]: the tool's own dequantisation (transformers' Fp8Dequantize; compressed-
                       tensors' dequantize; ModelOpt's NVFP4QTensor.dequantize; bitsandbytes' dequantize_4bit),
                       computed in float32, of layer 0's q_proj (of `single` in bnb_quant_states)
    probe:<name>       float64 [N, 2]: that dequantisation of every quantised weight times probe(K), a seeded
                       [K, 2] matrix of +-1 (the tests recompute it): one value off by an ulp anywhere shows
    tokens, logits     int64 [8], float32 [8, 512]: transformers' eager forward (fp32) of the model with those
                       dequantised weights (and every other tensor of the checkpoint as stored)

Deterministic: fixed seeds; a re-run with the versions in tests/fixtures/README.md rewrites the same values.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "prequant"
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=256,
             initializer_range=0.2, bos_token_id=507, eos_token_id=509, pad_token_id=507)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
WHOLE = "model.layers.0.self_attn.q_proj.weight"  # the weight kept whole in reference.npz (others: probes)
TOKENS = np.array([507, 12, 300, 45, 7, 99, 250, 509], np.int64)


def base_model(model_type: str, seed: int):
    """A tiny random bf16 model (random RMSNorm weights too, so a norm loaded wrong shows in the logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cls_cfg, cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[model_type]
    model = cls(cls_cfg(**SHAPE, architectures=[cls.__name__])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.to(torch.bfloat16)


def linear_names(model) -> list[str]:
    return [f"model.layers.{i}.{m}" for i in range(model.config.num_hidden_layers) for m in LINEARS]


def reference_logits(folder: Path, deq: dict[str, np.ndarray]) -> np.ndarray:
    """transformers' eager fp32 forward of the checkpoint's architecture with the dequantised weights `deq` (HF name
    -> [N, K]) and every other tensor of the folder as stored."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    if hasattr(cfg, "quantization_config"):  # the float architecture: the weights below are the dequantised ones
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    state = {}
    with safe_open(folder / "model.safetensors", "pt") as f:
        for k in f.keys():
            state[k] = f.get_tensor(k)
    plain = {k: v.float() for k, v in state.items() if k in model.state_dict() and k not in deq}
    plain.update({k: torch.from_numpy(v) for k, v in deq.items()})
    missing, unexpected = model.load_state_dict(plain, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)[None]).logits[0].float().numpy()


def probe(k: int) -> np.ndarray:
    """float64 [K, 2] of +-1 (seeded by K): `w @ probe(K)` fingerprints a [N, K] weight (tests recompute it)."""
    return np.random.default_rng(k).choice([-1.0, 1.0], size=(k, 2))


def finish(name: str, folder: Path, deq: dict[str, np.ndarray]) -> None:
    """reference.npz: layer 0's q_proj dequantised whole, every weight's probe fingerprint, the logits."""
    logits = reference_logits(folder, deq)
    arrays = {"tokens": TOKENS, "logits": logits}
    for k, v in deq.items():
        v = v.astype(np.float32)
        if k == WHOLE:
            arrays[f"weight:{k}"] = v
        arrays[f"probe:{k}"] = v.astype(np.float64) @ probe(v.shape[1])
    np.savez_compressed(folder / "reference.npz", **arrays)
    (folder / "generation_config.json").unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{name}: {len(deq)} quantised weights, {size / 1024:.0f} KiB")


# ---- transformers' FineGrainedFP8 ------------------------------------------------------------------------------

def make_fp8_block(folder: Path) -> None:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    model = base_model("qwen3", seed=1)
    qcfg = FineGrainedFP8Config(weight_block_size=(32, 64))
    quantizer = SimpleNamespace(quantization_config=qcfg)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    deq = {}
    for base in linear_names(model):
        out = Fp8Quantize(quantizer)._quantize_one(f"{base}.weight", state[f"{base}.weight"])
        assert set(out) == {f"{base}.weight", f"{base}.weight_scale_inv"}, f"{base}: not quantised"
        state.update(out)
        deq[f"{base}.weight"] = Fp8Dequantize(quantizer)._dequantize_one(
            out[f"{base}.weight"], out[f"{base}.weight_scale_inv"], output_dtype=torch.float32).numpy()
    model.config.quantization_config = qcfg.to_dict()
    model.config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    # transformers itself loads the folder (pre-quantised fp8 on a CPU: dequantised) to the same weights
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for k, v in deq.items():
        assert torch.equal(loaded.state_dict()[k], torch.from_numpy(v)), k
    finish("fp8_block", folder, deq)


# ---- compressed-tensors ----------------------------------------------------------------------------------------

def make_ct_fp8(folder: Path) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model = base_model("qwen3", seed=2)
    fp8 = dict(num_bits=8, type="float", symmetric=True)
    schemes = {
        "attention": QuantizationScheme(
            targets=["re:.*self_attn\\.(q|k|v|o)_proj$"], weights=QuantizationArgs(**fp8, strategy="tensor"),
            input_activations=QuantizationArgs(**fp8, strategy="tensor", dynamic=False)),
        "mlp_in": QuantizationScheme(
            targets=["re:.*mlp\\.(gate|up)_proj$"], weights=QuantizationArgs(**fp8, strategy="channel"),
            input_activations=QuantizationArgs(**fp8, strategy="token", dynamic=True)),
        "mlp_out": QuantizationScheme(
            targets=["re:.*mlp\\.down_proj$"],
            input_activations=QuantizationArgs(**fp8, strategy="token", dynamic=True),
            weights=QuantizationArgs(**fp8, strategy="block", block_structure=[128, 128])),
    }
    apply_quantization_config(model, QuantizationConfig(config_groups=schemes, ignore=["lm_head"]))
    # the weight observer's job (llm-compressor's MinMax observer): min / max over each strategy's reduction
    # groups, then compressed-tensors' calculate_qparams
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = module.weight.detach().float(), scheme.weights
        if args.strategy == "tensor":
            lo, hi = w.amin(), w.amax()
        elif args.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            bn, bk = args.block_structure
            n, k = w.shape
            padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
            blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
            lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        scale, _ = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            module.input_scale.data = torch.full_like(module.input_scale, 0.02)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    deq = {}
    with safe_open(folder / "model.safetensors", "pt") as f:
        for base in linear_names(model):
            args = model.get_submodule(base).quantization_scheme.weights
            weight, scale = f.get_tensor(f"{base}.weight"), f.get_tensor(f"{base}.weight_scale")
            assert scale.dtype == torch.bfloat16
            # compressed-tensors multiplies in the scale's dtype (bf16: the exact product rounded once); with the
            # scale widened to fp32 (exact) the same code gives the exact product, which rounds to those bf16 values
            exact = dequantize(weight, scale.float(), args=args, dtype=torch.float32)
            assert torch.equal(exact.bfloat16(), dequantize(weight, scale, args=args, dtype=torch.bfloat16)), base
            deq[f"{base}.weight"] = exact.numpy()
    finish("ct_fp8", folder, deq)


# ---- NVIDIA ModelOpt -------------------------------------------------------------------------------------------

def make_modelopt_nvfp4(folder: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor
    from modelopt.torch.quantization.utils.core_utils import update_quant_cfg_with_kv_cache_quant

    model = base_model("qwen3", seed=3)
    gen = torch.Generator().manual_seed(3)

    def calibrate(m):
        for _ in range(4):
            m(torch.randint(0, 512, (2, 24), generator=gen))

    # NVFP4 weights and activations with an FP8 KV cache, as nvidia/*-FP4 exports are made (hf_ptq.py's
    # --qformat nvfp4 --kv_cache_qformat fp8): k_proj.k_scale / v_proj.v_scale, kv_cache_scheme in config.json
    cfg = update_quant_cfg_with_kv_cache_quant(mtq.NVFP4_DEFAULT_CFG, mtq.FP8_KV_CFG["quant_cfg"])
    model = mtq.quantize(model, cfg, calibrate)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(folder))
    deq = {}
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
        for base in linear_names(model):
            packed = f.get_tensor(f"{base}.weight")
            n, half = packed.shape
            q = NVFP4QTensor((n, 2 * half), torch.float32, packed)
            deq[f"{base}.weight"] = q.dequantize(dtype=torch.float32, scale=f.get_tensor(f"{base}.weight_scale"),
                                                 double_scale=f.get_tensor(f"{base}.weight_scale_2"),
                                                 block_sizes={-1: 16}).numpy()
    assert any(n.endswith("input_scale") for n in names) and any(n.endswith("k_proj.k_scale") for n in names)
    finish("modelopt_nvfp4", folder, deq)


# ---- bitsandbytes ----------------------------------------------------------------------------------------------

def make_bnb_quant_states(folder: Path) -> None:
    """bitsandbytes' quantize_4bit (nf4, blocksize 64) of three matrices, saved as a Linear4bit saves them
    (`QuantState.as_dict(packed=True)` next to `<name>.weight`): a [32, 128] without double quant
    (compress_statistics=False: fp32 absmax), a [160, 128] with it (320 blocks: one full nested block of 256 and a
    partial one), a [64, 64] with it and bf16 quant storage (bnb_4bit_quant_storage=bfloat16)."""
    import bitsandbytes.functional as bnbf

    torch.manual_seed(6)
    cases = {"single": ((32, 128), False, torch.uint8), "nested": ((160, 128), True, torch.uint8),
             "storage_bf16": ((64, 64), True, torch.bfloat16)}
    tensors, arrays = {}, {}
    for name, (shape, nested, storage) in cases.items():
        w = (0.2 * torch.randn(shape)).to(torch.bfloat16)
        packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4",
                                           quant_storage=storage)
        tensors[f"{name}.weight"] = packed
        tensors.update({f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
        state.dtype = torch.float32
        deq = bnbf.dequantize_4bit(packed, state).numpy()
        arrays[f"probe:{name}.weight"] = deq.astype(np.float64) @ probe(shape[1])
        if name == "single":
            arrays[f"weight:{name}.weight"] = deq
    save_file(tensors, folder / "states.safetensors", metadata={"format": "pt"})
    np.savez_compressed(folder / "reference.npz", **arrays)
    print(f"bnb_quant_states: {len(cases)} weights")


def make_bnb_nf4(folder: Path) -> None:
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as tmp:
        base_model("llama", seed=4).save_pretrained(tmp)
        qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=qcfg, dtype=torch.bfloat16,
                                                     device_map="cpu")
        model.save_pretrained(folder)
    deq = {}
    for base in linear_names(model):
        param = model.get_submodule(base).weight
        state = param.quant_state
        assert state.nested and state.blocksize == 64
        state.dtype = torch.float32  # the dequantised values in fp32 (bnb computes them in fp32, then casts)
        deq[f"{base}.weight"] = bnbf.dequantize_4bit(param.data, state).numpy()
    finish("bnb_nf4", folder, deq)


MAKERS = {
    "fp8_block": make_fp8_block,
    "ct_fp8": make_ct_fp8,
    "modelopt_nvfp4": make_modelopt_nvfp4,
    "bnb_nf4": make_bnb_nf4,
    "bnb_quant_states": make_bnb_quant_states,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(MAKERS), help="make just these folders")
    args = parser.parse_args(argv)
    for name in args.only or MAKERS:
        folder = OUT / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        MAKERS[name](folder)
        for extra in folder.iterdir():  # what the tools write besides the checkpoint
            if extra.name not in ("config.json", "model.safetensors", "hf_quant_config.json", "reference.npz",
                                  "states.safetensors"):
                extra.unlink()
            else:
                extra.chmod(0o644)


if __name__ == "__main__":
    sys.exit(main())
