"""Golden fixture for LFM2-MoE (Liquid's short-convolution + GQA hybrid with a sparse feed-forward): a tiny random
checkpoint made by transformers, the logits it computes on it and its greedy generation.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_lfm2_moe_fixtures.py [NAME ...]   # tests/fixtures/models/NAME/

    lfm2_moe/        Lfm2MoeForCausalLM: 5 layers, layer_types [conv, full, conv, conv, full], num_dense_layers 0
                     (every layer sparse), use_expert_bias (the `expert_bias` buffer, 0.5 N(0, 1) here so it changes
                     which experts are chosen), norm_topk_prob, routed_scaling_factor 1.5
    lfm2_moe_dense/  6 layers [conv, full, conv, conv, full, conv], num_dense_layers 3 (layers 0 - 2: dense SwiGLU
                     MLPs of intermediate_size 48, two conv layers and one attention layer), no expert bias,
                     norm_topk_prob false, routed_scaling_factor 1 (the router's other branches)

Both: 6 experts of width 16, 2 per token; vocab 256, hidden 32, 4 query heads over 2 kv heads (head_dim 8), q / k
layernorms, conv_L_cache 3, tied embeddings, norm_eps 1e-5, rope_theta 1e6 (the family default).

Every RMSNorm weight is 1 + 0.3 N(0, 1), fp32. expected.npz: the keys of make_lfm2_fixtures (tokens0..2, logits0..2
computed in float64, greedy: 32 tokens of transformers' cached greedy generation after tokens1, float64, checked
equal to argmax over full recomputation; num_params: parameters, the expert_bias buffers left out);
lfm2_moe_dense also serve_greedy.npz (make_lfm2_fixtures' prompts of 3 .. 41 tokens, 12 greedy tokens each). The script
checks that the expert bias and the scaling factor change the logits (a router that ignores either fails), and
that the saved folder reloads in transformers to the same logits.
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.make_lfm2_fixtures import _expected, _perturb  # noqa: E402

MODELS_DIR = ROOT / "tests" / "fixtures" / "models"
COMMON = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5,
              max_position_embeddings=256, initializer_range=0.1, intermediate_size=48, moe_intermediate_size=16,
              num_experts=6, num_experts_per_tok=2, conv_bias=False, conv_L_cache=3, tie_word_embeddings=True)
CONFIGS = {
    "lfm2_moe": dict(num_hidden_layers=5, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
                     num_dense_layers=0, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5),
    "lfm2_moe_dense": dict(num_hidden_layers=6, layer_types=["conv", "full_attention", "conv", "conv",
                                                             "full_attention", "conv"],
                           num_dense_layers=3, use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=1.0),
}
SEEDS = {"lfm2_moe": 50, "lfm2_moe_dense": 52}


def _changes(model, tokens, ref, edit) -> float:
    other = copy.deepcopy(model)
    edit(other)
    with torch.no_grad():
        return float((other(tokens).logits - ref).abs().max())


def make(name: str) -> None:
    from transformers import AutoModelForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM
    SEED = SEEDS[name]
    torch.manual_seed(SEED)
    model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**COMMON, **CONFIGS[name]))
    model.config._attn_implementation = "eager"
    model.set_experts_implementation("eager")  # the reference loop over experts (float64 runs too)
    _perturb(model, SEED)
    g = torch.Generator().manual_seed(SEED + 7)
    with torch.no_grad():
        for buffer, b in model.named_buffers():
            if buffer.endswith("expert_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    model.eval()
    out = MODELS_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    _expected(model, out, SEED + 1, serve=name == "lfm2_moe_dense")
    x = torch.tensor(np.load(out / "expected.npz")["tokens2"])[None]
    with torch.no_grad():
        ref = model(x).logits

    def no_bias(m):
        for buffer, b in m.named_buffers():
            if buffer.endswith("expert_bias"):
                b.zero_()

    def unscaled(m):
        for layer in m.model.layers:
            layer.feed_forward.gate.routed_scaling_factor = 1.0

    def dense_as_sparse(m):  # the dense leading layers matter: give them the next layer's (sparse) feed-forward
        sparse = m.model.layers[m.config.num_dense_layers].feed_forward
        for layer in m.model.layers[:m.config.num_dense_layers]:
            layer.feed_forward = sparse

    edits = {"lfm2_moe": (("expert_bias", no_bias), ("routed_scaling_factor", unscaled)),
             "lfm2_moe_dense": (("the dense layers", dense_as_sparse),)}[name]
    for what, edit in edits:
        moved = _changes(model, x, ref, edit)
        assert moved > 1e-2, (what, moved)
        print(f"{what} moves the logits by {moved:.3f}")
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                experts_implementation="eager").eval()  # the folder reloads as is
    with torch.no_grad():
        assert torch.equal(back(x).logits, ref)
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
    print(json.loads((out / "config.json").read_text()).get("architectures"),
          sum(p.numel() for p in model.parameters()), sorted(p.name for p in out.iterdir()))
    print([n for n in names if "layers.0." in n])


if __name__ == "__main__":
    for n in sys.argv[1:] or SEEDS:
        make(n)
