"""Golden fixtures for the Qwen3.5 dense family (Gated DeltaNet + gated attention hybrid): tiny random checkpoints
made by transformers, and the logits it computes on them.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_qwen3_5_fixtures.py [NAME ...]   # tests/fixtures/models/NAME/ (default: all)

    qwen3_5_text/   Qwen3_5ForCausalLM (model_type qwen3_5_text): 6 layers, layer_types from full_attention_interval
                    4 = [linear x 3, full, linear x 2] (one group of the period and a remainder), untied head
    qwen3_5/        Qwen3_5ForConditionalGeneration (model_type qwen3_5, config.json with text_config and
                    vision_config): 4 layers [linear x 3, full], tied embeddings, a 1-block vision tower saved with
                    it (model.visual.*), the language model under model.language_model.*

    qwen3_5_moe_text/  Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text): qwen3_5_text's 6 layers with every MLP
                    the sparse MoE (both stacks): 4 experts, top-2 (renormalised), moe_intermediate_size 16, a shared
                    expert of 24 and its sigmoid gate, router_aux_loss_coef 0.02; untied head
    qwen3_5_moe/    Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe): qwen3_5's 4 layers with the same MoE,
                    tied, a 1-block vision tower (model.visual.*), the language model under model.language_model.*

All: vocab 256, hidden 32, 4 query heads over 2 kv heads of head_dim 16, attention output gate, partial rotary
0.25 (rotary dim 4, mrope_section [1, 1, 0]), linear attention with 2 key heads of dim 8 and 4 value heads of
dim 16 (the key heads repeated), conv kernel 4. Every (1 + w) RMSNorm weight is 0.3 N(0, 1) (transformers
initialises it to zeros), the gated norm's weight 1 + 0.3 N(0, 1), dt_bias N(0, 1), the MoE's router 4x its init (so the top-2 choice is
clear of ties: the smallest gap between the 2nd and 3rd router probabilities is printed), fp32. transformers 5
keeps the experts fused in memory (mlp.experts.gate_up_proj [E, 2F, D]) and save_pretrained writes the published
per-expert names (mlp.experts.{e}.gate_proj.weight ...). expected.npz:
tokens0..2 ([5], [9], [20] int64), logits0..2 ([T, 256]: each sequence alone, eager attention, computed in float64, stored fp32), greedy ([32]: transformers' greedy
generation after tokens1, float64, cached), num_params
(the language model's parameters as transformers counts them: the vision tower left out, a tied head once);
MoE fixtures also aux_loss ([]: transformers' load_balancing_loss_func over every layer's router logits for
tokens2, both stacks, float64) and router_counts ([L, E]: each layer's top-k assignments per expert for
tokens2, in HF layer order).
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "tests" / "fixtures" / "models"
LENGTHS = (5, 9, 20)

TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=256,
            initializer_range=0.05,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True})


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           router_aux_loss_coef=0.02)


def _perturb(model, seed: int) -> None:
    """Norm weights and the DeltaNet's dt_bias away from their init, so that a wrong formula shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.3 * noise)
            elif name.endswith("dt_bias"):
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(4.0)


GREEDY_TOKENS = 32


def _expected(model, out: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    arrays = {}
    for i, n in enumerate(LENGTHS):
        tokens = rng.integers(0, TEXT["vocab_size"], size=n)
        with torch.no_grad():  # float64: transformers' own fp32 is up to 8e-5 off (a 1e-4 check needs the truth)
            logits = copy.deepcopy(model).double()(torch.tensor(tokens)[None]).logits[0].float().numpy()
        arrays[f"tokens{i}"], arrays[f"logits{i}"] = tokens, logits
    prompt = torch.tensor(arrays["tokens1"])[None]  # greedy continuation of the 9-token sequence, in float64
    with torch.no_grad():
        greedy = copy.deepcopy(model).double().generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                                        min_new_tokens=GREEDY_TOKENS)
    arrays["greedy"] = greedy[0, prompt.shape[1]:].numpy()
    arrays["num_params"] = np.int64(sum(p.numel() for n, p in model.named_parameters() if "visual" not in n))
    if "moe" in model.config.model_type:
        gaps = []
        for i in range(len(LENGTHS)):
            with torch.no_grad():
                res = copy.deepcopy(model).double()(torch.tensor(arrays[f"tokens{i}"])[None], output_router_logits=True)
            top = [torch.topk(torch.softmax(r, -1), 3, -1).values for r in res.router_logits]
            gaps.append(min(float((t[:, 1] - t[:, 2]).min()) for t in top))
        arrays["aux_loss"] = np.float64(res.aux_loss)  # tokens2's (the last sequence)
        E, k = model.config.get_text_config().num_experts, model.config.get_text_config().num_experts_per_tok
        arrays["router_counts"] = np.stack([np.bincount(torch.topk(r, k, -1).indices.reshape(-1).numpy(),
                                                        minlength=E) for r in res.router_logits])  # [L, E] HF order
        print(f"router logits of {len(res.router_logits)} layers; smallest 2nd - 3rd probability gap {min(gaps):.2e}")
    np.savez(out / "expected.npz", **arrays)


def make(name: str, seed: int) -> None:
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                              Qwen3_5MoeTextConfig, Qwen3_5TextConfig)
    torch.manual_seed(seed)
    dense = {k: v for k, v in TEXT.items() if k != "intermediate_size"}  # the MoE text config has no dense MLP
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    if name == "qwen3_5_moe_text":
        cfg = Qwen3_5MoeTextConfig(num_hidden_layers=6, tie_word_embeddings=False, **dense, **MOE)
        model = Qwen3_5MoeForCausalLM(cfg)
    elif name == "qwen3_5_moe":
        text = Qwen3_5MoeTextConfig(num_hidden_layers=4, tie_word_embeddings=True, **dense, **MOE).to_dict()
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    elif name == "qwen3_5_text":
        cfg = Qwen3_5TextConfig(num_hidden_layers=6, tie_word_embeddings=False, **TEXT)
        model = Qwen3_5ForCausalLM(cfg)
    else:
        text = Qwen3_5TextConfig(num_hidden_layers=4, tie_word_embeddings=True, **TEXT).to_dict()
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
        model = Qwen3_5ForConditionalGeneration(cfg)
    model.config._attn_implementation = "eager"
    if "moe" in name:  # transformers' eager experts loop (the modeling code as written), not torch._grouped_mm
        model.set_experts_implementation("eager")
    _perturb(model, seed)
    model.eval()
    out = MODELS_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    _expected(model, out, seed + 1)
    print(name, json.loads((out / "config.json").read_text()).get("architectures"),
          sum(p.numel() for p in model.parameters()), sorted(p.name for p in out.iterdir()))


SEEDS = {"qwen3_5_text": 35, "qwen3_5": 36, "qwen3_5_moe_text": 37, "qwen3_5_moe": 38}

if __name__ == "__main__":
    import sys
    for name in sys.argv[1:] or SEEDS:
        make(name, SEEDS[name])
