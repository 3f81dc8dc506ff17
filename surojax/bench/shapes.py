"""Model shapes for benchmarks: HF config.json fields, exactly those of the HF+PEFT anchor's SHAPES
(benchmarks/anchors/hf_peft_baseline.py, which runs without surojax; a test keeps the two equal), plus tiny
ones that run on a CPU in seconds.

Weights are random (throughput does not depend on their values), so a shape is all a benchmark needs.
"""
from __future__ import annotations

from surojax.models.config import ModelConfig

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Qwen3.5 (Gated DeltaNet hybrid: three DeltaNet layers, then one gated-attention layer; transformers 5.17's
    # Qwen3_5TextConfig, text backbone only). 0.8B: the published widths (24 layers, D 1024, F 3584, 8 heads / 2 KV
    # of 256, 16 / 16 DeltaNet heads of 128, tied); 9B = Qwen3_5TextConfig's defaults (its docstring's model).
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                         rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3.5-9b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                       rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
                       rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Mixture of experts: 128 experts, 8 per token, every layer sparse; the HF MoE anchor's model
    # (benchmarks/anchors/hf_moe_baseline.py; `intermediate_size` is the dense MLP's, used by no layer).
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # The correctness check's model: Qwen3-0.6B widths and vocabulary, 4 layers.
    "qwen3-small": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # CPU-sized: tests and smoke runs.
    "debug": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # CPU-sized mixture of experts (qwen3_moe): 8 experts, 2 per token.
    "debug-moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # CPU-sized Qwen3.5 hybrid: 4 layers (3 DeltaNet + 1 gated attention).
    "debug-qwen3.5": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
                          rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                               mrope_section=[1, 1, 0]),  # 4 rotary dims: 2 pairs
                          rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def shape_hf_config(name: str) -> dict:
    if name not in SHAPES:
        raise ValueError(f"shape {name!r} is unknown; expected one of {', '.join(SHAPES)}")
    return dict(SHAPES[name])


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(shape_hf_config(name))
