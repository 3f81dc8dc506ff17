"""Golden fixtures for PEFT LoRA adapters: a tiny HF Llama, a PEFT adapter on it, and the expected logits.

Run with the reference environment (torch + transformers + peft), never from the surojax venv:

    /work/refenv/bin/python scripts/make_peft_fixtures.py          # writes tests/fixtures/peft/

Deterministic (fixed seeds); a re-run rewrites the same bytes with the library versions recorded in
tests/fixtures/peft/versions.json. What is written (< 500 KB in all):

    base/           LlamaForCausalLM.save_pretrained (fp32): vocab 128, hidden 64, 2 layers, 4 heads, 2 kv heads
    adapter/        PeftModel.save_pretrained: LoRA r=4, alpha=8, all 7 linear modules, A and B random (non-zero)
    expected.npz    tokens [1, T]; base_logits and logits (base + adapter) [1, T, V], eager attention, fp32
    moe/            the same for a tiny Qwen3-MoE (4 experts, top-2, hidden 64, expert F 32, 2 layers; transformers 5
                    saves the fused expert names): base/, adapter/ (LoRA r=4, alpha=8 on q_proj, v_proj and, through
                    target_parameters, the experts' gate_up_proj and down_proj: PEFT's ParamWrapper layout),
                    expected.npz
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "peft"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = [[1, 17, 42, 99, 3, 64, 127, 8, 55, 21, 0, 77]]
MOE_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def save_adapter(pmodel, out: Path) -> None:
    pmodel.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card template, not needed
    cfg_path = out / "adapter_config.json"  # PEFT writes target_modules from a set: fix the order
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["target_modules"] = sorted(adapter_cfg["target_modules"])
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")


def scale_b(pmodel, factor: float) -> None:
    """init_lora_weights=False keeps torch's Linear init for both A and B, so B is non-zero; scaled down so the
    adapter changes the logits by a realistic amount rather than swamping them."""
    with torch.no_grad():
        for name, p in pmodel.named_parameters():
            if "lora_B" in name:
                p.mul_(factor)


def make_moe(out: Path) -> None:
    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                         tie_word_embeddings=False, attn_implementation="eager", bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        base_logits = model(tokens).logits.float().numpy()
    (out / "base").mkdir(parents=True)
    model.save_pretrained(out / "base", safe_serialization=True)  # before PEFT wraps the experts
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=MOE_TARGET_PARAMETERS,
                      lora_dropout=0.0, task_type="CAUSAL_LM", init_lora_weights=False)
    pmodel = get_peft_model(model, lora).eval()
    scale_b(pmodel, 0.2)
    with torch.no_grad():
        logits = pmodel(tokens).logits.float().numpy()
    save_adapter(pmodel, out / "adapter")
    np.savez(out / "expected.npz", tokens=np.array(TOKENS, np.int32), base_logits=base_logits, logits=logits)
    print(f"moe: max |logits - base_logits| = {np.abs(logits - base_logits).max():.4f}")


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                      attn_implementation="eager", bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        base_logits = model(tokens).logits.float().numpy()

    if OUT.exists():
        shutil.rmtree(OUT)
    (OUT / "base").mkdir(parents=True)
    model.save_pretrained(OUT / "base", safe_serialization=True)

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM",
                      init_lora_weights=False)
    pmodel = get_peft_model(model, lora).eval()
    scale_b(pmodel, 0.2)
    with torch.no_grad():
        logits = pmodel(tokens).logits.float().numpy()
    save_adapter(pmodel, OUT / "adapter")

    np.savez(OUT / "expected.npz", tokens=np.array(TOKENS, np.int32), base_logits=base_logits, logits=logits)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    (OUT / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(f"max |logits - base_logits| = {np.abs(logits - base_logits).max():.4f}")
    make_moe(OUT / "moe")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
