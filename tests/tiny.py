"""The tiny model presets the tests share, as HF config dicts (what `model_config:` in a training YAML and
`ModelConfig.from_hf` take).

    QWEN3       dense, qwen3: q/k norms, GQA 4 heads over 2 kv heads, head_dim 8, 2 layers, vocabulary 512 (the
                fixture tokenizer's size, so it trains on the fixture data)
    QWEN3_MOE   qwen3_moe at the same widths: 4 experts of width 16, top 2

`hf(preset, **changes)` is a fresh copy with some keys changed (a test that needs another vocabulary or depth says
which); `model_config(preset, **changes)` the ModelConfig. A test whose check depends on particular shapes (the
hand-written shardings of tests/parallel, the block sizes of a quantised format, a widths-vs-memory slope) keeps
its own config beside its check. (A dense llama-like preset joins when a test outside tests/models, tests/serve
and tests/train/test_step* uses one: none does today.)
"""
from __future__ import annotations

from typing import Any

from surojax.models.config import ModelConfig

QWEN3: dict[str, Any] = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
QWEN3_MOE: dict[str, Any] = {**QWEN3, "model_type": "qwen3_moe", "moe_intermediate_size": 16, "num_experts": 4,
                             "num_experts_per_tok": 2}


def hf(preset: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of `preset` with `changes` (HF keys) applied."""
    return {**preset, **changes}


def model_config(preset: dict[str, Any], **changes: Any) -> ModelConfig:
    return ModelConfig.from_hf(hf(preset, **changes))
