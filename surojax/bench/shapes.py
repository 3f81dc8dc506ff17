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
    # Gemma 3 text (transformers 5.17's Gemma3TextConfig; layer_types left to its default: every 6th layer full
    # attention, the others sliding). 1B = google/gemma-3-1b-pt's config.json; 4B = google/gemma-3-4b-pt's
    # text_config (linear rope scaling x8 on the full-attention layers), both with their legacy rope keys
    # (rope_theta 1e6, rope_local_base_freq 1e4, rope_scaling) written as transformers 5's rope_parameters.
    "gemma3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      query_pre_attn_scalar=256, sliding_window=512, hidden_activation="gelu_pytorch_tanh",
                      rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                           sliding_attention=dict(rope_type="default", rope_theta=1e4)),
                      max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "gemma3-4b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                      num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      query_pre_attn_scalar=256, sliding_window=1024, hidden_activation="gelu_pytorch_tanh",
                      rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                           sliding_attention=dict(rope_type="default", rope_theta=1e4)),
                      max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # LFM2-1.2B (LiquidAI/LFM2-1.2B's config.json: 10 short-convolution and 6 attention layers, full_attn_idxs
    # [2, 5, 8, 10, 12, 14] written as layer_types; the SwiGLU's width 2/3 x 12288 = 8192 by
    # block_auto_adjust_ff_dim, as transformers' Lfm2MLP computes it).
    "lfm2-1.2b": dict(model_type="lfm2", vocab_size=65536, hidden_size=2048, intermediate_size=12288,
                      block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3,
                      conv_bias=False, layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention",
                                                    "conv", "conv", "full_attention", "conv", "full_attention", "conv",
                                                    "full_attention", "conv", "full_attention", "conv"],
                      rope_parameters=dict(rope_type="default", rope_theta=1e6), norm_eps=1e-5,
                      max_position_embeddings=128000, tie_word_embeddings=True),
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
    # Qwen3-VL-2B-Instruct (its config.json; transformers 5 keys): the image anchor's model
    # (benchmarks/anchors/hf_vlm_peft_baseline.py, its SHAPES plus the model_type; a test keeps them equal).
    "qwen3-vl-2b": dict(
        model_type="qwen3_vl",
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, tie_word_embeddings=True,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                           num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
                           hidden_act="gelu_pytorch_tanh"),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=True),
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
    # CPU-sized Gemma 3 text: 6 layers (5 sliding of window 16, then 1 full), both ropes.
    "debug-gemma3": dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=16, hidden_activation="gelu_pytorch_tanh",
                         rope_parameters=dict(full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                              sliding_attention=dict(rope_type="default", rope_theta=1e4)),
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    # CPU-sized Qwen3-VL (the image anchor's debug-vl): 2 language layers, a 2-block tower with one deepstack layer.
    "debug-vl": dict(
        model_type="qwen3_vl",
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         tie_word_embeddings=True,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh"),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        tie_word_embeddings=True),
    # CPU-sized LFM2: 4 layers (conv, conv, attention, conv).
    "debug-lfm2": dict(model_type="lfm2", vocab_size=512, hidden_size=64, intermediate_size=128,
                       block_auto_adjust_ff_dim=False, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, conv_L_cache=3, conv_bias=False,
                       layer_types=["conv", "conv", "full_attention", "conv"],
                       rope_parameters=dict(rope_type="default", rope_theta=1e6), norm_eps=1e-5,
                       tie_word_embeddings=True),
}


def shape_hf_config(name: str) -> dict:
    if name not in SHAPES:
        raise ValueError(f"shape {name!r} is unknown; expected one of {', '.join(SHAPES)}")
    return dict(SHAPES[name])


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(shape_hf_config(name))
