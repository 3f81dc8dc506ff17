"""Fused dequantise + matmul for quantised frozen weights.

    layout     KernelLayout (K-major codes, float32 scales / offsets) and LayoutSpec, the interface a weight
               format implements: it hands over its codes and scales, `to_layout` packs them
    kernel     the two Pallas kernels: y = x @ W (`forward`) and dx = g @ W^T (`transposed`), `Tiles`
    reference  their pure-jnp references over the same layout (`dequantize_layout` + jnp.dot, fp32 accumulation)
    api        `quant_matmul(x, w)`: custom_vjp over the kernels, or XLA's dequantise-then-matmul
               (mode = auto | pallas | xla: the caller's; surojax's SUROJAX_QUANT_MATMUL setting)
"""
