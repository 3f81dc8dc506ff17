"""Golden fixtures for Gemma 4 text: tiny random checkpoints made by transformers, and the logits it computes on them.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_gemma4_fixtures.py [NAME ...]   # tests/fixtures/models/NAME/ (default: all)

    gemma4_text/  Gemma4ForCausalLM (model_type gemma4_text), tensors model.layers.{i}...
    gemma4_text_moe/  gemma4_text with the MoE block (enable_moe_block: 4 experts of width 16, top 2, beside the
                  dense MLP in every layer); the router's input scale 1 + 0.3 N(0, 1) and its per-expert scales
                  0.5 + U(0, 1), checked to change the logits
    gemma4_text_global/  gemma4_text with full-attention layers of their own shape, as every published size has:
                  global_head_dim 32 (twice the sliding layers' 16), num_global_key_value_heads 1 and
                  attention_k_eq_v (no v_proj on the full layers: their values are the key projection's output);
                  transformers saves it as per_layer_config {"2": {head_dim 32, num_key_value_heads 1}, "5": ...}
    gemma4_text_shared/  gemma4_text_global plus per-layer input embeddings (hidden_size_per_layer_input 8: the
                  table model.embed_tokens_per_layer [256, 6 x 8], per_layer_model_projection, per_layer_projection_norm,
                  each layer's per_layer_input_gate / per_layer_projection / post_per_layer_input_norm) and the last 2
                  layers KV-shared (num_kv_shared_layers 2: no k / v projections there) with use_double_wide_mlp
                  (their MLPs 128 wide): the four features of the published E2B / E4B in one model
    gemma4/       Gemma4ForConditionalGeneration (model_type gemma4: config.json with text_config and vision_config,
                  no audio), the language model under model.language_model.*, a 1-layer vision tower
                  (model.vision_tower.*) and its embedder (model.embed_vision.*) saved with it

The dense text model (what surojax supports; per-layer input embeddings, KV-shared layers, attention_k_eq_v and the
MoE block are off and refused by surojax's config reading): vocab 256, hidden 32, 4 query heads over 2 kv heads of
head_dim 16 (global_head_dim 16: the full-attention layers' head size equals the sliding layers'), intermediate 64,
6 layers with layer_types [sliding, sliding, full] x 2, sliding_window 4 (shorter than the 9- and 12-token
sequences), rope: full-attention layers `proportional` (partial_rotary_factor 0.5: half the frequencies zero,
rope_theta 100: a short base, so the zeroed frequencies matter), sliding layers default rope_theta 1e4, GeGLU, the four sandwich norms, q/k norms and the unscaled
v norm, softmax scale 1, embeddings scaled by sqrt(32), tied head, no soft-capping. Every RMSNorm weight (plain w,
not 1 + w) is 1 + 0.3 N(0, 1) and every layer_scalar (a saved buffer) 0.5 + U(0, 1), so a wrong norm formula or
a dropped scalar shows. fp32, eager attention.

expected.npz (test_hf_parity's keys): tokens0..2 ([5], [9], [12] int64), logits0..2 ([T, 256]: each sequence alone,
computed in float64, stored fp32), greedy_prompt ([7]), greedy_tokens ([32]: transformers' greedy generate in
float64, eos never stopping it; checked equal to argmax over full recomputation, every top-1 / top-2 gap > 1e-3),
num_params (the language model's parameters, vision tower and layer_scalar buffers left out, the tied head once),
softcap (2.0) / softcap_logits2 (logits2 with final_logit_softcapping 2), serve_prompt0..3 ([3], [11], [26], [41]) and serve_greedy0..3 ([12] each: transformers' greedy generate in
float64, top-1 / top-2 gap > 1e-3: the served-greedy test's requests).
The script also checks that the window, each rope and the layer scalars change the logits (so a test that ignores
one fails), and that the saved folder reloads in transformers to the same logits.
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
from scripts.make_gemma3_fixtures import LENGTHS, _logits, greedy_and_serve  # noqa: E402

MODELS_DIR = ROOT / "tests" / "fixtures" / "models"
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2

TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
            initializer_range=0.08, sliding_window=4, layer_types=LAYER_TYPES, hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1, final_logit_softcapping=None,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=256, num_kv_shared_layers=0,
            attention_k_eq_v=False, enable_moe_block=False, use_double_wide_mlp=False,
            rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 100.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
# gemma4_text_moe: the MoE block beside the MLP in every layer (4 experts of width 16, 2 per token)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
# gemma4_text_global: the full layers wider, with one kv head, keys as values (published Gemma 4's shape)
GLOBAL = dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True)
# gemma4_text_shared: every feature of the published E2B / E4B together: the global shape above, per-layer input
# embeddings (P 8), the last 2 layers KV-shared (layer 4 reads layer 3's keys / values, layer 5 layer 2's) with
# double-wide MLPs
SHARED = GLOBAL | dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
                       use_double_wide_mlp=True)
VARIANTS = {"gemma4_text": {}, "gemma4_text_moe": MOE, "gemma4_text_global": GLOBAL, "gemma4_text_shared": SHARED}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)


def _language_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def _perturb(model, seed: int) -> None:
    """Norm weights away from one and layer scalars away from one, so that a wrong formula shows."""
    g = torch.Generator().manual_seed(seed)
    lm = _language_model(model)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for layer in lm.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
            if layer.enable_moe_block:  # the router's input scale and per-expert scales (ones at init)
                layer.router.scale.copy_(1 + 0.3 * torch.randn(layer.router.scale.shape, generator=g))
                layer.router.per_expert_scale.copy_(0.5 + torch.rand(layer.router.per_expert_scale.shape,
                                                                     generator=g))


def _changes(model, tokens, ref, edit) -> float:
    """Max |logits change| on `tokens` after `edit(language model)` (a copy of the model)."""
    m = copy.deepcopy(model)
    edit(_language_model(m))
    return float(np.abs(_logits(m, tokens) - ref).max())


def _rope(lm, layer_type, **changes):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
    lm.config.rope_parameters[layer_type].update(changes)
    lm.rotary_emb = Gemma4TextRotaryEmbedding(lm.config)


def _window(lm):
    lm.config.sliding_window = 64
    for layer in lm.layers:
        if layer.self_attn.is_sliding:
            layer.self_attn.sliding_window = 64


def _scalars(lm):
    with torch.no_grad():
        for layer in lm.layers:
            layer.layer_scalar.fill_(1.0)


def _per_expert_scales(lm):
    with torch.no_grad():
        for layer in lm.layers:
            layer.router.per_expert_scale.fill_(1.0)


def _router_scales(lm):
    with torch.no_grad():
        for layer in lm.layers:
            layer.router.scale.fill_(1.0)


def _no_per_layer_table(lm):
    with torch.no_grad():
        lm.embed_tokens_per_layer.weight.zero_()


def _values_from_queries(lm):
    """The full layers' values from another projection than the keys' (a reader that ignored k = v)."""
    import torch.nn as nn
    with torch.no_grad():
        for layer in lm.layers:
            attn = layer.self_attn
            if attn.use_alternative_attention and not attn.is_kv_shared_layer:
                attn.v_proj = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
                attn.v_proj.weight.copy_(attn.k_proj.weight.flip(0))


def _expected(model, out: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = TEXT["vocab_size"]
    arrays = {}
    for i, n in enumerate(LENGTHS):
        tokens = rng.integers(3, vocab, size=n)
        arrays[f"tokens{i}"], arrays[f"logits{i}"] = tokens, _logits(model, tokens)
    arrays |= greedy_and_serve(model, rng, vocab)  # the same prompts / checks as Gemma 3's fixtures
    arrays["num_params"] = np.int64(sum(p.numel() for p in _language_model(model).parameters()))
    long, ref = arrays["tokens2"], arrays["logits2"]
    checks = {
        "window": _window,
        "local rope base": lambda lm: _rope(lm, "sliding_attention", rope_theta=1_000_000.0),
        "proportional rope": lambda lm: _rope(lm, "full_attention", partial_rotary_factor=1.0),
        "layer scalars": _scalars,
    }
    if _language_model(model).config.hidden_size_per_layer_input:
        checks |= {"per-layer input table": _no_per_layer_table}
    if _language_model(model).config.attention_k_eq_v:
        checks |= {"keys as values": _values_from_queries}
    if _language_model(model).config.enable_moe_block:
        checks |= {"per-expert scales": _per_expert_scales, "router input scale": _router_scales}
    for what, edit in checks.items():
        delta = _changes(model, long, ref, edit)
        print(f"  {what}: logits change {delta:.3g}")
        assert delta > 1e-2, (what, delta)
    capped = copy.deepcopy(model)  # the logits soft-capped at 2 (published checkpoints: 30; 2 bites here)
    capped.config.get_text_config().final_logit_softcapping = 2.0
    capped.config.final_logit_softcapping = 2.0
    arrays["softcap"], arrays["softcap_logits2"] = np.float64(2.0), _logits(capped, long)
    delta = float(np.abs(arrays["softcap_logits2"] - ref).max())
    print(f"  soft-capping: logits change {delta:.3g}")
    assert delta > 1e-1 and np.abs(arrays["softcap_logits2"]).max() < 2.0
    np.savez(out / "expected.npz", **arrays)


def _reloads(cls, out: Path, tokens, ref) -> None:
    """The saved folder reloads in transformers to the same logits."""
    again = cls.from_pretrained(out, attn_implementation="eager", experts_implementation="eager")
    assert np.abs(_logits(again, tokens) - ref).max() < 1e-6


def make(name: str, seed: int) -> None:
    from transformers import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                              Gemma4VisionConfig)
    torch.manual_seed(seed)
    if name in VARIANTS:
        text = copy.deepcopy(TEXT) | VARIANTS[name]
        cls, model = Gemma4ForCausalLM, Gemma4ForCausalLM(Gemma4TextConfig(**text))
    else:
        cfg = Gemma4Config(text_config=Gemma4TextConfig(**copy.deepcopy(TEXT)),
                           vision_config=Gemma4VisionConfig(**VISION), audio_config=None, tie_word_embeddings=True)
        cls, model = Gemma4ForConditionalGeneration, Gemma4ForConditionalGeneration(cfg)
    model.config._attn_implementation = "eager"
    model.config.get_text_config()._attn_implementation = "eager"
    if name == "gemma4_text_moe":
        model.set_experts_implementation("eager")  # the reference loop over experts (float64 runs too)
    _perturb(model, seed)
    model.eval()
    out = MODELS_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    _expected(model, out, seed + 1)
    exp = np.load(out / "expected.npz")
    _reloads(cls, out, exp["tokens2"], exp["logits2"])
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < 600_000, size
    print(name, json.loads((out / "config.json").read_text()).get("architectures"), f"{size / 1e3:.0f} kB",
          sorted(p.name for p in out.iterdir()))


SEEDS = {"gemma4_text": 42, "gemma4": 45, "gemma4_text_moe": 47, "gemma4_text_global": 51, "gemma4_text_shared": 53}

if __name__ == "__main__":
    import sys
    for n in sys.argv[1:] or SEEDS:
        make(n, SEEDS[n])
