"""Golden fixtures for LFM2 (Liquid's short-convolution + GQA attention hybrid): tiny random checkpoints made by
transformers, the logits it computes on them and its greedy generations.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_lfm2_fixtures.py [NAME ...]   # tests/fixtures/models/NAME/ (default: all)

    lfm2/           Lfm2ForCausalLM: 6 layers, layer_types [conv, conv, full, conv, full, conv] (no shorter period:
                    like the published models' irregular pattern), tied embeddings (the family default), no conv
                    bias, conv_L_cache 3; the feed-forward width from block_auto_adjust_ff_dim: intermediate_size
                    100 -> int(2 * 100 / 3) = 66 -> int(1.5 * 66) = 99 -> up to a multiple of 16 = 112
    lfm2_conv_bias/ Lfm2ForCausalLM in an older config.json's spelling: `full_attn_idxs` [1] (no layer_types) over
                    3 layers, `block_ff_dim` for intermediate_size, `tie_embedding` for tie_word_embeddings,
                    conv_bias true (in_proj, conv and out_proj biases), untied head, conv_L_cache 4,
                    block_auto_adjust_ff_dim false (the MLP is intermediate_size 40 wide)

Both: vocab 256, hidden 32, 4 query heads over 2 kv heads (head_dim 8), q / k layernorms, rope_theta 1e6 (the
family's default: config.json leaves it to transformers), norm_eps 1e-5. Every RMSNorm weight is 1 + 0.3 N(0, 1)
and every bias 0.2 N(0, 1) (transformers initialises them to ones / zeros), fp32. expected.npz: tokens0..2 ([5],
[9], [20] int64), logits0..2 ([T, 256]: each sequence alone, eager attention, computed in float64, stored fp32),
greedy ([32]: transformers' cached greedy generation after tokens1, float64: the conv state carried in its cache),
num_params. serve_greedy.npz (lfm2 only): prompt0..4 (lengths 3, 7, 12, 26, 41) and greedy0..4 ([12]: cached
greedy generation after each prompt alone, float64). The smallest top-1 - top-2 logit gap over every generated
token is printed (the fp32 engine must not flip a near tie).
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
GREEDY_TOKENS = 32
SERVE_PROMPTS = (3, 7, 12, 26, 41)
SERVE_TOKENS = 12

COMMON = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5,
              max_position_embeddings=256, initializer_range=0.1)
CONFIGS = {
    "lfm2": dict(num_hidden_layers=6, layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
                 intermediate_size=100, block_multiple_of=16, block_ffn_dim_multiplier=1.5,
                 block_auto_adjust_ff_dim=True, conv_bias=False, conv_L_cache=3, tie_word_embeddings=True),
    "lfm2_conv_bias": dict(num_hidden_layers=3, full_attn_idxs=[1], intermediate_size=40,
                           block_auto_adjust_ff_dim=False, conv_bias=True, conv_L_cache=4, tie_word_embeddings=False),
}
SEEDS = {"lfm2": 40, "lfm2_conv_bias": 41}


def _perturb(model, seed: int) -> None:
    """Norm weights and biases away from their init, so that a wrong formula shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)


def _greedy(model, prompt, n: int, gaps: list) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt)[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    for scores in out.scores:
        top = torch.topk(scores[0], 2).values
        gaps.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt):].numpy()


def _expected(model, out: Path, seed: int, serve: bool) -> None:
    rng = np.random.default_rng(seed)
    f64 = copy.deepcopy(model).double()  # float64: the truth a 1e-4 check needs
    arrays, gaps = {}, []
    for i, n in enumerate(LENGTHS):
        tokens = rng.integers(0, COMMON["vocab_size"], size=n)
        with torch.no_grad():
            logits = f64(torch.tensor(tokens)[None]).logits[0].float().numpy()
        arrays[f"tokens{i}"], arrays[f"logits{i}"] = tokens, logits
    arrays["greedy"] = _greedy(f64, arrays["tokens1"], GREEDY_TOKENS, gaps)
    # the cached generation equals argmax over full recomputation (the conv state is carried right)
    seq = arrays["tokens1"].tolist()
    for t in arrays["greedy"]:
        with torch.no_grad():
            assert int(f64(torch.tensor(seq)[None]).logits[0, -1].argmax()) == int(t)
        seq.append(int(t))
    arrays["num_params"] = np.int64(sum(p.numel() for p in model.parameters()))
    np.savez(out / "expected.npz", **arrays)
    if serve:
        served = {}
        for i, n in enumerate(SERVE_PROMPTS):
            prompt = rng.integers(0, COMMON["vocab_size"], size=n)
            served[f"prompt{i}"], served[f"greedy{i}"] = prompt, _greedy(f64, prompt, SERVE_TOKENS, gaps)
        np.savez(out / "serve_greedy.npz", **served)
    print(f"{out.name}: smallest top-1 - top-2 logit gap {min(gaps):.2e}")


def make(name: str) -> None:
    from transformers import AutoModelForCausalLM, Lfm2Config, Lfm2ForCausalLM
    seed = SEEDS[name]
    torch.manual_seed(seed)
    cfg = Lfm2Config(**COMMON, **CONFIGS[name])
    model = Lfm2ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    _perturb(model, seed)
    model.eval()
    out = MODELS_DIR / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    if name == "lfm2_conv_bias":  # an older config.json's spelling: full_attn_idxs alone, block_ff_dim, tie_embedding
        hf = json.loads((out / "config.json").read_text())
        del hf["layer_types"]
        hf["block_ff_dim"], hf["tie_embedding"] = hf.pop("intermediate_size"), hf.pop("tie_word_embeddings")
        (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    _expected(model, out, seed + 1, serve=name == "lfm2")
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()  # the folder reloads as is
    with torch.no_grad():
        x = torch.tensor(np.load(out / "expected.npz")["tokens2"])[None]
        assert torch.equal(back(x).logits, model(x).logits)
    print(name, json.loads((out / "config.json").read_text()).get("architectures"),
          sum(p.numel() for p in model.parameters()), sorted(p.name for p in out.iterdir()))
    print({k: tuple(v.shape) for k, v in list(model.state_dict().items())[:14]})


if __name__ == "__main__":
    import sys
    for name in sys.argv[1:] or SEEDS:
        make(name)
