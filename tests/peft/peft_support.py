"""Shared pieces of the PEFT tests: a tiny decoder per family and a way to make an adapter non-trivial.

(A uniquely named module rather than conftest.py, so that `from peft_support import ...` cannot pick up
another folder's conftest.)
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.peft.lora import lora_modules

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "peft"

TINY = {
    "llama": ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8),
    "qwen2": ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True),
    "qwen3": ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=True),
}
TOKENS = jnp.array([[1, 5, 9, 33, 2, 17, 60, 8], [4, 4, 21, 0, 63, 12, 7, 30]], jnp.int32)  # [B=2, T=8]


@nnx.jit
def forward(model, tokens):
    """The model's logits, jitted once for the test process: models of one structure and input shape (a model
    and its reloaded copy, a base before and after a merge) share one compilation. An eager `model(tokens)`
    traces and compiles the layer scan again on every call."""
    return model(tokens)


def tiny_model(family: str = "llama", seed: int = 0) -> Decoder:
    return Decoder(TINY[family], rngs=nnx.Rngs(seed))


def randomize_adapter(model, seed: int = 1, scale: float = 0.1) -> None:
    """Give every adapter a random non-zero B (and a new A), so the adapter changes the output."""
    key = jax.random.key(seed)
    for i, (_, mod) in enumerate(sorted(lora_modules(model).items())):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        a, b = mod.lora_a.get_value(), mod.lora_b.get_value()
        mod.lora_a.set_value(jax.random.uniform(ka, a.shape, jnp.float32, -0.5, 0.5).astype(a.dtype))
        mod.lora_b.set_value((scale * jax.random.normal(kb, b.shape, jnp.float32)).astype(b.dtype))
