"""Pallas kernels of surojax, one folder per op, each with

    kernel.py     the Pallas kernel (Triton lowering on GPU, interpret mode elsewhere)
    reference.py  its pure-jnp reference
    api.py        the public function: custom_vjp and the choice of backend

Ops:
    quant_matmul  fused dequantise + matmul of a quantised frozen weight (LoRA over Q4_K, Q5_K, Q6_K, Q8_0, NF4,
                  NVFP4, FP8-block); layout.py holds the kernel layout a format hands over (arrays + LayoutSpec)
    fp8_cast      an FP8 training operand quantised into both layouts (q, q^T) with its amax, in one pass
    adam8bit      one 8-bit AdamW step of a stacked parameter (moments, update, requantisation) in one pass
    decode_gemv   the decode GEMV of a plain weight stored [N, K] (M <= 64 rows: an FMA body to 8, a tensor-core
                  body above), with an RMSNorm prologue and gated-product / residual epilogues
    gated_delta   the gated delta rule (Gated DeltaNet): reference recurrence and decode step, chunked jnp form,
                  the chunk forward and backward as Pallas kernels

This package imports nothing from surojax (tests/pallas_kernels/test_no_surojax_imports.py): callers hand their
data over as arrays and small specs defined here. See docs/quant_kernels.md.
"""
