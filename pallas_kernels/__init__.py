"""Pallas kernels of surojax.

Fused dequantise + matmul for quantised frozen bases (LoRA over Q4_K, Q5_K, Q6_K, Q8_0, NF4, NVFP4, FP8-block):
    layout      the kernel layout of a quantised weight (K tiles on rows) and its bit-exact conversion
    fused       the two Pallas kernels: y = x @ W and dx = g @ W^T (Triton on GPU, interpret mode elsewhere)
    reference   their pure-jnp references (dequantize + jnp.dot, fp32 accumulation)
    dispatch    quant_matmul: custom_vjp over the kernels, or XLA's dequantise-then-matmul (SUROJAX_QUANT_MATMUL)
See docs/quant_kernels.md.
"""
