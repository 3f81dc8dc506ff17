"""The tiny models of the GGUF tests and fixtures (scripts/make_gguf_fixtures.py imports this too).

qwen3 (q/k norm) and llama (Llama 3 rope scaling, factor 8 / low 1 / high 4 / original 32): vocab 512 (the fixture
tokenizer of tests/fixtures/tokenizer), hidden 256, 2 layers, 4 heads of 64, 2 kv heads, intermediate 256, so that
every weight's rows are whole 256-value super-blocks and the K-quants apply. Weights come from numpy's seeded
generator (not from JAX initialisers) so the same bytes come out on any machine: linear weights N(0, 0.05^2),
norms 1 + 0.1 N(0, 1), the head untied ("qwen3_tied": tied).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parents[1] / "fixtures"
TOKENIZER_DIR = FIXTURES / "tokenizer"
PROMPT_IDS = [507, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 44, 280, 301, 120]

CONFIGS = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1000000.0},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 32}},
}


def tiny_hf_config(family: str) -> dict:
    base = family.removesuffix("_tied")
    return {**CONFIGS[base], "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": family.endswith("_tied"),
            "hidden_act": "silu", "torch_dtype": "float32"}


def tiny_model_dir(family: str, out_dir, seed: int = 0) -> Path:
    """Write the tiny HF model folder (config.json, model.safetensors, tokenizer files) and return it."""
    from surojax.models.config import ModelConfig
    from surojax.models.registry import weight_rows
    from surojax.weights.safetensors_file import write_safetensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = tiny_hf_config(family)
    cfg = ModelConfig.from_hf(hf)
    D, F, V, H = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    shapes = {"embed_tokens": (V, D), "q_proj": (cfg.q_dim, D), "k_proj": (cfg.kv_dim, D), "v_proj": (cfg.kv_dim, D),
              "o_proj": (D, cfg.q_dim), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F),
              "lm_head": (V, D), "q_norm": (H,), "k_norm": (H,)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for row in weight_rows(cfg):
        for i in (range(cfg.num_layers) if row.per_layer else [None]):
            name = row.hf.format(i=i) if i is not None else row.hf
            part = name.split(".")[-2]
            shape = shapes.get(part, (D,))
            if name.endswith(".bias"):
                tensors[name] = (0.2 * rng.standard_normal(shape[:1])).astype(np.float32)
            elif "norm" in part:
                tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                tensors[name] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    write_safetensors(out_dir / "model.safetensors", tensors)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (TOKENIZER_DIR / f).is_file():
            shutil.copy(TOKENIZER_DIR / f, out_dir / f)
    return out_dir
