"""Golden fixtures for Gemma 3 text: tiny random checkpoints made by transformers, and the logits it computes on them.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_gemma3_fixtures.py [NAME ...]   # tests/fixtures/models/NAME/ (default: all)

    gemma3_text/  Gemma3ForCausalLM (model_type gemma3_text), tensors model.layers.{i}...
    gemma3/       Gemma3ForConditionalGeneration (model_type gemma3: config.json with text_config and vision_config),
                  the language model under model.language_model.*, a 1-layer SigLIP vision tower
                  (model.vision_tower.*) and the projector (model.multi_modal_projector.*) saved with it

Both: vocab 256, hidden 32, 4 query heads over 2 kv heads of head_dim 16 (q dim 64), intermediate 64, 5 layers with
layer_types [sliding, sliding, full, sliding, sliding] (the pattern [sliding x 2, full] once and a remainder of
two), sliding_window 4 (shorter than the 9- and 12-token sequences), query_pre_attn_scalar 24 (not head_dim: the
query scale shows), rope: full-attention layers rope_theta 1e6 with linear scaling factor 8, sliding layers
rope_theta 1e4 (two bases), GeGLU (gelu_pytorch_tanh), the four sandwich norms, q/k norms, embeddings scaled by
sqrt(32), tied head, no soft-capping (null, as published). Every (1 + w) RMSNorm weight is 0.3 N(0, 1)
(transformers initialises them to zeros), fp32, eager attention.

expected.npz (test_hf_parity's keys): tokens0..2 ([5], [9], [12] int64), logits0..2 ([T, 256]: each sequence
alone, computed in float64, stored fp32), greedy_prompt ([7]), greedy_tokens ([32]: transformers' greedy generate
in float64, eos never stopping it; checked equal to argmax over full recomputation, every top-1 / top-2 gap
> 1e-3), num_params (the language model's, vision tower left out, the tied head once), serve_prompt0..3
([3], [11], [26], [41]) and serve_greedy0..3 ([12] each: transformers' greedy generate in float64, top-1 / top-2
gap > 1e-3: the served-greedy test's requests). The script also checks
that the window, the query scale and each rope base change the logits (so a test that ignores one fails).
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
LENGTHS = (5, 9, 12)
GREEDY_PROMPT_LEN, GREEDY_TOKENS = 7, 32
SERVE_PROMPTS, SERVE_TOKENS = (3, 11, 26, 41), 12
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]

TEXT = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
            initializer_range=0.08, query_pre_attn_scalar=24, sliding_window=4, layer_types=LAYER_TYPES,
            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
            eos_token_id=1, final_logit_softcapping=None, attn_logit_softcapping=None,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4, num_channels=3)


def _perturb(model, seed: int) -> None:
    """(1 + w) norm weights away from zero, so that a wrong norm formula shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal" in name:
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _logits(model, tokens) -> np.ndarray:
    with torch.no_grad():  # float64: the truth a 1e-4 check needs
        return copy.deepcopy(model).double()(torch.tensor(tokens)[None]).logits[0].float().numpy()


def _text_config(model):
    return model.config.get_text_config()


def _changes(model, tokens, ref, edit) -> float:
    """Max |logits change| on `tokens` after `edit(text config)` (a copy of the model)."""
    m = copy.deepcopy(model)
    edit(_text_config(m))
    if hasattr(m, "model") and hasattr(m.model, "language_model"):
        lm = m.model.language_model
    else:
        lm = m.model
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    lm.rotary_emb = Gemma3RotaryEmbedding(_text_config(m))
    for layer in lm.layers:
        layer.self_attn.scaling = _text_config(m).query_pre_attn_scalar ** -0.5
    return float(np.abs(_logits(m, tokens) - ref).max())


def greedy_and_serve(model, rng, vocab: int) -> dict:
    """greedy_prompt / greedy_tokens (transformers' float64 greedy generate, checked against argmax over full
    recomputation, every top-1 / top-2 gap > 1e-3) and serve_prompt0..3 / serve_greedy0..3 (the serving test's
    requests, gaps > 1e-3), drawing the prompts from `rng` (make_gemma4_fixtures.py uses it too)."""
    arrays = {}
    prompt = rng.integers(3, vocab, size=GREEDY_PROMPT_LEN)
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        x = torch.tensor(prompt)[None]
        gen = m64.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                           eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        greedy = gen[0, GREEDY_PROMPT_LEN:].numpy()
        assert greedy.shape == (GREEDY_TOKENS,), greedy.shape
        cur, margins = x, []
        for _ in range(GREEDY_TOKENS):  # the same tokens by full recomputation (generate's cache added nothing)
            last = m64(cur).logits[0, -1]
            top2 = last.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            cur = torch.cat([cur, last.argmax().view(1, 1)], dim=1)
        assert np.array_equal(cur[0, GREEDY_PROMPT_LEN:].numpy(), greedy), (cur, greedy)
        assert min(margins) > 1e-3, min(margins)
        print(f"  greedy margin >= {min(margins):.4f}")
    arrays["greedy_prompt"], arrays["greedy_tokens"] = prompt, greedy.astype(np.int64)
    for i, n in enumerate(SERVE_PROMPTS):  # the serving test's requests (several chunks, past the window)
        x = torch.tensor(rng.integers(3, vocab, size=n))[None]
        with torch.no_grad():
            gen = m64.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=SERVE_TOKENS,
                               eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None,
                               output_logits=True, return_dict_in_generate=True)
        gaps = [float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in gen.logits]
        assert min(gaps) > 1e-3, (n, min(gaps))
        arrays[f"serve_prompt{i}"], arrays[f"serve_greedy{i}"] = x[0].numpy(), gen.sequences[0, n:].numpy()
    return arrays


def _expected(model, out: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = TEXT["vocab_size"]
    arrays = {}
    for i, n in enumerate(LENGTHS):
        tokens = rng.integers(3, vocab, size=n)
        arrays[f"tokens{i}"], arrays[f"logits{i}"] = tokens, _logits(model, tokens)
    arrays |= greedy_and_serve(model, rng, vocab)
    skip = ("vision_tower", "multi_modal_projector", "lm_head")  # lm_head: tied to the embedding
    arrays["num_params"] = np.int64(sum(p.numel() for n, p in model.named_parameters()
                                        if not any(s in n for s in skip)))
    # each ingredient changes the logits of the longest sequence (past the window)
    long, ref = arrays["tokens2"], arrays["logits2"]
    checks = {
        "window": lambda c: setattr(c, "sliding_window", 64),
        "query scale": lambda c: setattr(c, "query_pre_attn_scalar", 16),
        "local rope base": lambda c: c.rope_parameters["sliding_attention"].update(rope_theta=1_000_000.0),
        "global rope": lambda c: c.rope_parameters["full_attention"].update(rope_type="default", factor=None),
    }
    for what, edit in checks.items():
        delta = _changes(model, long, ref, edit)
        print(f"  {what}: logits change {delta:.3g}")
        assert delta > 1e-2, (what, delta)
    np.savez(out / "expected.npz", **arrays)


def make(name: str, seed: int) -> None:
    from transformers import (Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)
    torch.manual_seed(seed)
    if name == "gemma3_text":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**copy.deepcopy(TEXT)))
    else:
        text = Gemma3TextConfig(**copy.deepcopy(TEXT))
        cfg = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
                           boi_token_index=253, eoi_token_index=254, image_token_index=255, tie_word_embeddings=True)
        model = Gemma3ForConditionalGeneration(cfg)
    model.config._attn_implementation = "eager"
    _text_config(model)._attn_implementation = "eager"
    _perturb(model, seed)
    model.eval()
    out = MODELS_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    _expected(model, out, seed + 1)
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < 400_000, size
    print(name, json.loads((out / "config.json").read_text()).get("architectures"), f"{size / 1e3:.0f} kB",
          sorted(p.name for p in out.iterdir()))


SEEDS = {"gemma3_text": 30, "gemma3": 31}

if __name__ == "__main__":
    import sys
    for n in sys.argv[1:] or SEEDS:
        make(n, SEEDS[n])
