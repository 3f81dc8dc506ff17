"""A pre-quantised FP8 checkpoint as the LoRA base on the GPU: correctness against transformers, then the Trainer.

    python benchmarks/campaigns/prequant_gpu.py                 # on an H100 / H200 (torch + transformers on CUDA beside JAX)
    python benchmarks/campaigns/prequant_gpu.py --cpu-smoke     # 2 layers, narrow widths, on the CPU (any machine)

The checkpoint is made the way published FP8 models are (Qwen/Qwen3-*-FP8, DeepSeek): a Qwen3 with 0.6B's widths
and vocabulary (`--layers`, default 28) and random weights, every decoder Linear quantised by transformers'
FineGrainedFP8 quantiser (`Fp8Quantize`, E4M3, 128x128 blocks, `weight_scale_inv`), config.json
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`.

(a) logits of one batch (2 x 512 tokens), bf16 compute, against transformers' forward (sdpa, bf16) over the weights
    transformers' own `Fp8Dequantize` gives:
        kept   surojax, the FP8 kernels kept (the frozen base of a LoRA run, serving)
        deq    surojax, the checkpoint dequantised at load (bf16 parameters)
    rel(a, b) = ||a - b|| / ||b|| (Frobenius, fp32).  pass: rel(kept, hf) <= 2 * rel(deq, hf) + 1e-3: keeping the
    weights in FP8 adds no error beyond recomputing in bf16 (both read the same values).
(b) the Trainer (LoRA r16 on all 7 targets, bf16 recipe, the defaults a user gets) over the FP8 checkpoint and over
    its bf16 original, same data: losses finite and falling, the FP8 base still FP8 after training; steady tok/s
    (median step of the second half) and peak device memory of each. One `RESULT {json}` line at the end.
Exit code 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU with JAX here
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rope_theta=1e6,
                 tie_word_embeddings=True)
SMOKE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=True)


def make_checkpoints(out: Path, shape: dict, layers: int, device: str) -> tuple[Path, Path, dict]:
    """bf16/ (the original) and fp8/ (transformers' FineGrainedFP8 of it) + HF name -> dequantised bf16 weight."""
    import torch
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config, Qwen3Config, Qwen3ForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, num_hidden_layers=layers, architectures=["Qwen3ForCausalLM"])
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    bf16, fp8 = out / "bf16", out / "fp8"
    for d in (bf16, fp8):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in TOKENIZER.iterdir():
            if f.is_file() and f.name != "expected_chat.json":
                shutil.copyfile(f, d / f.name)
    model.save_pretrained(bf16)
    qcfg = FineGrainedFP8Config(weight_block_size=(128, 128))
    quantizer = SimpleNamespace(quantization_config=qcfg)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    deq = {}
    for i in range(layers):
        for m in LINEARS:
            name = f"model.layers.{i}.{m}"
            w = state[f"{name}.weight"].to(device)
            q = Fp8Quantize(quantizer)._quantize_one(f"{name}.weight", w)
            state.update({k: v.cpu() for k, v in q.items()})
            deq[f"{name}.weight"] = Fp8Dequantize(quantizer)._dequantize_one(
                q[f"{name}.weight"], q[f"{name}.weight_scale_inv"], output_dtype=torch.bfloat16).cpu()
    model.config.quantization_config = qcfg.to_dict()
    model.config.save_pretrained(fp8)
    save_file(state, fp8 / "model.safetensors", metadata={"format": "pt"})
    return bf16, fp8, deq


def hf_logits(bf16: Path, deq: dict, tokens, device: str):
    """transformers' bf16 forward with the dequantised weights in place of the originals."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    with torch.no_grad():
        sd = model.state_dict()
        for k, v in deq.items():
            sd[k].copy_(v.to(device))
        logits = model(torch.from_numpy(tokens).to(device)).logits.float().cpu().numpy()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits


def ours_logits(folder: Path, tokens, keep: bool):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from surojax.model_loader import load_base
    from surojax.quant.model import is_quantized
    from surojax.weights.model_ref import resolve_model

    model, _ = load_base(resolve_model(str(folder)), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                         keep_quantized=keep)
    formats = sorted(set(is_quantized(model).values()))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).astype(jnp.float32))
    out = jax.device_get(fwd(state, jnp.asarray(tokens)))
    del model, state
    return out, formats


def rel(a, b) -> float:
    import numpy as np
    return float(np.linalg.norm((a - b).astype(np.float64)) / np.linalg.norm(b.astype(np.float64)))


def write_text_data(path: Path, rows: int = 4000) -> Path:
    import random
    rng = random.Random(0)
    words = ("the model reads a row of tokens and learns which word comes next in the long sentence about "
             "apples pears numbers seven eleven rivers mountains cities and quiet evenings").split()
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(40, 400)))}) + "\n")
    return path


def train(folder: Path, out: Path, data: Path, a) -> dict:
    import jax
    import numpy as np

    from surojax.api import build_trainer
    from surojax.models.targets import base_linear
    from surojax.config.lora import LORA_TARGETS

    trainer = build_trainer({
        "model": str(folder), "output_dir": str(out), "recipe": "bf16", "lora": True, "lora_rank": 16,
        "lora_alpha": 32, "lora_target_modules": "all-linear", "datasets": [{"path": str(data), "type": "text"}],
        "sequence_len": a.seq, "per_device_train_batch_size": a.batch, "learning_rate": 1e-3,
        "max_steps": a.steps, "logging_steps": 1, "seed": 0})
    times, losses = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        m = trainer.step()
        losses.append(float(m["loss"]))
        times.append(time.perf_counter() - t0)
    model = trainer.trained_model()
    kinds = sorted({type(base_linear(model, t).kernel.get_value()).__name__ for t in LORA_TARGETS})
    steady = float(np.median(times[len(times) // 2:]))
    stats = jax.devices()[0].memory_stats() or {}
    return {"losses": losses, "step_s": steady, "tok_s": a.batch * a.seq / steady, "base_kernels": kinds,
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("/tmp/prequant_gpu"))
    a = ap.parse_args()
    if a.cpu_smoke:
        a.layers, a.steps, a.seq, a.batch = a.layers or 2, min(a.steps, 4), 128, 2
    shape, layers, device = (SMOKE if a.cpu_smoke else QWEN3_06B), a.layers or 28, "cpu" if a.cpu_smoke else "cuda"
    import numpy as np

    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bf16, fp8, deq = make_checkpoints(a.out, shape, layers, device)
    print(f"checkpoints in {time.perf_counter() - t0:.0f} s: {fp8}", flush=True)
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 512 if not a.cpu_smoke else 64), dtype=np.int64)
    hf = hf_logits(bf16, deq, tokens, device)
    del deq
    kept, kept_formats = ours_logits(fp8, tokens, keep=True)
    plain, plain_formats = ours_logits(fp8, tokens, keep=False)
    r_kept, r_deq, r_kd = rel(kept, hf), rel(plain, hf), rel(kept, plain)
    logits_ok = r_kept <= 2 * r_deq + 1e-3 and kept_formats == ["fp8"] and not plain_formats
    print(f"(a) logits  rel(kept, hf) {r_kept:.2e}  rel(deq, hf) {r_deq:.2e}  rel(kept, deq) {r_kd:.2e}  "
          f"kept formats {kept_formats}  -> {'PASS' if logits_ok else 'FAIL'}", flush=True)

    data = write_text_data(a.out / "text.jsonl")
    runs = {}
    for name, folder in (("fp8", fp8), ("bf16", bf16)):
        shutil.rmtree(a.out / f"run_{name}", ignore_errors=True)
        runs[name] = train(folder, a.out / f"run_{name}", data, a)
        r = runs[name]
        print(f"(b) {name:4s} base: losses {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, {r['tok_s']:,.0f} tok/s "
              f"({r['step_s'] * 1e3:.1f} ms/step), peak {r['peak_gib']:.1f} GiB, base kernels {r['base_kernels']}",
              flush=True)
    f = runs["fp8"]
    train_ok = (all(np.isfinite(f["losses"])) and f["losses"][-1] < f["losses"][0]
                and f["base_kernels"] == ["FP8Block"])
    print(f"(b) -> {'PASS' if train_ok else 'FAIL'}; fp8 base / bf16 base tok/s "
          f"{f['tok_s'] / runs['bf16']['tok_s']:.3f}", flush=True)
    import jax
    print("RESULT " + json.dumps({"bench": "prequant_gpu", "device": str(jax.devices()[0].device_kind),
                                  "layers": layers, "seq": a.seq, "batch": a.batch,
                                  "rel_kept_hf": r_kept, "rel_deq_hf": r_deq, "rel_kept_deq": r_kd,
                                  "logits_ok": logits_ok, "train_ok": train_ok, "runs": runs}))
    return 0 if logits_ok and train_ok else 1


if __name__ == "__main__":
    sys.exit(main())
