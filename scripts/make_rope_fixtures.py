"""Golden YaRN rope tables from transformers, for tests/models/test_yarn_rope.py.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_rope_fixtures.py      # writes tests/fixtures/rope/

For each case: the config (JSON, what `config.to_dict()` gives: the rope keys as transformers standardised
them) and transformers' own rotary embedding's inv_freq [H/2] plus cos / sin [1, T, H] in fp32 at POSITIONS.
Deterministic (no randomness).

    gpt_oss        GptOssConfig's default yarn (factor 32, beta 32 / 1, truncate false, original 4096), theta 150000
    llama_mscale   a LlamaConfig with yarn factor 4, mscale / mscale_all_dim, truncate left at its default (true)
    llama_implied  a LlamaConfig with yarn factor null (implied by max_position_embeddings / original) and an
                   explicit attention_factor
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import GptOssConfig, LlamaConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "rope"
POSITIONS = [0, 1, 2, 7, 100, 1000, 4095, 4096, 20000, 131071]
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def cases():
    yield "gpt_oss", GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2), GptOssRotaryEmbedding
    yield "llama_mscale", LlamaConfig(**TINY, max_position_embeddings=8192, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5}), LlamaRotaryEmbedding
    yield "llama_implied", LlamaConfig(**TINY, max_position_embeddings=16384, rope_parameters={
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": None, "original_max_position_embeddings": 2048,
        "attention_factor": 1.25}), LlamaRotaryEmbedding


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    configs = {}
    for name, config, rotary_cls in cases():
        rotary = rotary_cls(config)
        pos = torch.tensor([POSITIONS])
        cos, sin = rotary(torch.zeros(1, len(POSITIONS), 16, dtype=torch.float32), pos)
        if cos.shape[-1] == config.head_dim // 2:  # gpt_oss keeps the H/2 half (its rope chunks, no rotate_half)
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        np.savez(OUT / f"{name}.npz", inv_freq=rotary.inv_freq.numpy(), cos=cos.numpy(), sin=sin.numpy(),
                 positions=np.asarray(POSITIONS, np.int32), attention_scaling=np.float64(rotary.attention_scaling))
        configs[name] = json.loads(config.to_json_string())
    (OUT / "configs.json").write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
