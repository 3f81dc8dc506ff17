"""Golden fixtures for PEFT LoRA adapters: a tiny HF Llama, a PEFT adapter on it, and the expected logits.

Run with the reference environment (torch + transformers + peft), never from the surojax venv:

    /work/refenv/bin/python scripts/make_peft_fixtures.py          # writes tests/fixtures/peft/

Deterministic (fixed seeds); a re-run rewrites the same bytes with the library versions recorded in
tests/fixtures/peft/versions.json. What is written (< 1 MB in all):

    base/           LlamaForCausalLM.save_pretrained (fp32): vocab 128, hidden 64, 2 layers, 4 heads, 2 kv heads
    adapter/        PeftModel.save_pretrained: LoRA r=4, alpha=8, all 7 linear modules, A and B random (non-zero)
    expected.npz    tokens [1, T]; base_logits and logits (base + adapter) [1, T, V], eager attention, fp32
    moe/            the same for a tiny Qwen3-MoE (4 experts, top-2, hidden 64, expert F 32, 2 layers; transformers 5
                    saves the fused expert names): base/, adapter/ (LoRA r=4, alpha=8 on q_proj, v_proj and, through
                    target_parameters, the experts' gate_up_proj and down_proj: PEFT's ParamWrapper layout),
                    expected.npz
    shared_expert/  the same for a tiny Qwen2-MoE with a shared expert (4 experts, top-2, hidden 32, expert F 16,
                    shared expert F 24, 2 layers; q/k/v biases): base/, adapter/ (LoRA r=4, alpha=8, target_modules
                    q_proj, v_proj and the bare gate_proj, up_proj, down_proj, which PEFT matches to the shared
                    expert's modules only, plus the routed experts through target_parameters), expected.npz
                    (also `loss`: the causal-LM loss of `tokens`, and `grad:<tensor name>`: its gradient for each
                    shared-expert LoRA tensor, in PEFT's layout).
                    Alone: `make_peft_fixtures.py --only shared_expert` (the other folders stay as they are).
    qwen3_5/        a PEFT LoRA adapter (r=4, alpha=8, "all-linear": attention, MLP and the Gated DeltaNet
                    projections in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj) on the Qwen3.5 parity
                    fixture tests/fixtures/models/qwen3_5_text (its base, not copied): adapter/, expected.npz
                    (tokens; logits with the adapter; `losses`: the causal-LM loss before each of 3 plain SGD steps
                    (lr 0.1) on the adapter's tensors, and after the last: PEFT's loss curve).
                    Alone: `make_peft_fixtures.py --only qwen3_5`.
    gemma3/         the same protocol ("all-linear": q/k/v/o and gate/up/down) on the Gemma 3 parity fixture
                    tests/fixtures/models/gemma3_text (sliding and global layers, GeGLU, sandwich norms).
                    Alone: `make_peft_fixtures.py --only gemma3`.
    gemma4/         the same protocol on the Gemma 4 parity fixture tests/fixtures/models/gemma4_text (the dense
                    text model: v norm, layer scalars, proportional rope). Alone: `make_peft_fixtures.py --only gemma4`.
    gemma4_moe/     expert adapters on a family whose experts are not `mlp.experts`: LoRA r=4, alpha=8 on q_proj,
    lfm2_moe/       v_proj and, through target_parameters, both fused expert parameters (Gemma 4's MoE block:
                    `experts.gate_up_proj` / `experts.down_proj` on models/gemma4_text_moe; LFM2-MoE:
                    `feed_forward.experts.*` on models/lfm2_moe_dense, three dense leading layers then sparse conv
                    and attention layers), A and B random (B x 0.2), eager attention and experts, fp32:
                    adapter/, expected.npz (tokens, base_logits, logits). Alone: `--only gemma4_moe` / `lfm2_moe`.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

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


def make_shared_expert(out: Path) -> None:
    torch.manual_seed(2)
    cfg = Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                         attn_implementation="eager", bos_token_id=1, eos_token_id=2)
    model = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # q/k/v biases non-zero (transformers initialises them to zero)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        base_logits = model(tokens).logits.float().numpy()
    if out.exists():
        shutil.rmtree(out)
    (out / "base").mkdir(parents=True)
    model.save_pretrained(out / "base", safe_serialization=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                      target_parameters=MOE_TARGET_PARAMETERS, lora_dropout=0.0, task_type="CAUSAL_LM",
                      init_lora_weights=False)
    pmodel = get_peft_model(model, lora).eval()
    wrapped = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in pmodel.named_parameters() if "lora_A" in n and ".0." in n})
    assert any("shared_expert.gate_proj" in n for n in wrapped) and not any("shared_expert_gate" in n for n in wrapped)
    scale_b(pmodel, 0.2)
    with torch.no_grad():
        logits = pmodel(tokens).logits.float().numpy()
    save_adapter(pmodel, out / "adapter")
    # one training step's gradient: the causal-LM loss (mean next-token cross-entropy, no aux loss without
    # output_router_logits) and its gradient for the shared expert's adapters, under their saved names
    loss = pmodel(tokens, labels=tokens).loss
    loss.backward()
    grads = {"grad:" + n.removeprefix("base_model.model.").replace(".default", ""): p.grad.numpy()
             for n, p in pmodel.named_parameters() if ".shared_expert." in n and "lora_" in n}
    assert len(grads) == 2 * 3 * 2 and all(np.abs(g).max() > 0 for g in grads.values())
    np.savez(out / "expected.npz", tokens=np.array(TOKENS, np.int32), base_logits=base_logits, logits=logits,
             loss=np.float32(loss.item()), **grads)
    print(f"shared_expert: max |logits - base_logits| = {np.abs(logits - base_logits).max():.4f}, "
          f"loss {loss.item():.4f}")


QWEN3_5_BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3_5_text"
SGD_LR, SGD_STEPS = 0.1, 3


GEMMA3_BASE = ROOT / "tests" / "fixtures" / "models" / "gemma3_text"
GEMMA4_BASE = ROOT / "tests" / "fixtures" / "models" / "gemma4_text"


def make_qwen3_5(out: Path) -> None:
    _all_linear_sgd(out, QWEN3_5_BASE, 3, {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj",
                                           "gate_proj"})


def make_gemma3(out: Path) -> None:
    _all_linear_sgd(out, GEMMA3_BASE, 4, set(TARGETS))


def make_gemma4(out: Path) -> None:
    _all_linear_sgd(out, GEMMA4_BASE, 5, set(TARGETS))


def save_fixture_adapter(pmodel, out: Path, base: Path) -> None:
    """A fresh folder `out` with PEFT's adapter/ of a parity fixture `base`, recorded by its path in the repo."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_adapter(pmodel, out / "adapter")
    cfg_path = out / "adapter" / "adapter_config.json"  # the base by its path in the repo, not this machine's
    cfg_path.write_text(cfg_path.read_text().replace(str(base), str(base.relative_to(ROOT))))


MOE_FAMILY_BASES = {"gemma4_moe": (ROOT / "tests" / "fixtures" / "models" / "gemma4_text_moe", "experts", 6),
                    "lfm2_moe": (ROOT / "tests" / "fixtures" / "models" / "lfm2_moe_dense", "feed_forward.experts", 7)}


def make_moe_family(out: Path) -> None:
    """An adapter on q_proj, v_proj and the fused experts of a parity fixture whose experts module is not
    `mlp.experts` (see the docstring: gemma4_moe/, lfm2_moe/)."""
    base, module, seed = MOE_FAMILY_BASES[out.name]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager").eval()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        base_logits = model(tokens).logits.float().numpy()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=[f"{module}.gate_up_proj", f"{module}.down_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM", init_lora_weights=False)
    pmodel = get_peft_model(model, lora).eval()
    wrapped = {n.split("lora_A")[0] for n, _ in pmodel.named_parameters() if "lora_A" in n and ".experts." in n}
    assert wrapped, "peft wrapped no expert parameter"
    scale_b(pmodel, 0.2)
    with torch.no_grad():
        logits = pmodel(tokens).logits.float().numpy()
    save_fixture_adapter(pmodel, out, base)
    np.savez(out / "expected.npz", tokens=np.array(TOKENS, np.int32), base_logits=base_logits, logits=logits)
    print(f"{out.name}: max |logits - base_logits| = {np.abs(logits - base_logits).max():.4f}")


def _all_linear_sgd(out: Path, base: Path, seed: int, wrapped_at_least: set) -> None:
    """An "all-linear" adapter on a parity fixture `base`, its logits and PEFT's SGD loss curve (see the docstring)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM",
                      init_lora_weights=False)
    pmodel = get_peft_model(model, lora).eval()
    wrapped = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in pmodel.named_parameters() if "lora_A" in n}
    assert wrapped_at_least <= wrapped, wrapped
    scale_b(pmodel, 0.2)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits = pmodel(tokens).logits.float().numpy()
    save_fixture_adapter(pmodel, out, base)
    params = [p for n, p in pmodel.named_parameters() if "lora_" in n]
    losses = []
    for _ in range(SGD_STEPS):  # the loss curve of plain SGD on the adapter: mean next-token cross-entropy
        loss = pmodel(tokens, labels=tokens).loss
        losses.append(loss.item())
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= SGD_LR * p.grad
    with torch.no_grad():
        losses.append(pmodel(tokens, labels=tokens).loss.item())
    np.savez(out / "expected.npz", tokens=np.array(TOKENS, np.int32), logits=logits,
             losses=np.array(losses, np.float64), lr=np.float64(SGD_LR))
    print(f"{out.name}: losses {losses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["shared_expert", "qwen3_5", "gemma3", "gemma4", "gemma4_moe", "lfm2_moe"],
                        help="write only this folder")
    only = parser.parse_args().only
    if only:
        {"shared_expert": make_shared_expert, "qwen3_5": make_qwen3_5, "gemma3": make_gemma3,
         "gemma4": make_gemma4, "gemma4_moe": make_moe_family, "lfm2_moe": make_moe_family}[only](OUT / only)
        return
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
    make_shared_expert(OUT / "shared_expert")
    make_qwen3_5(OUT / "qwen3_5")
    make_gemma3(OUT / "gemma3")
    make_gemma4(OUT / "gemma4")
    make_moe_family(OUT / "gemma4_moe")
    make_moe_family(OUT / "lfm2_moe")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
