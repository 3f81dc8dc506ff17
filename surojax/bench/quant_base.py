"""Random quantised bases for throughput benchmarks (`surojax bench train --quant FMT` and `--base-format FMT`,
benchmarks/quant_matmul_h200.py).

Speed does not depend on the weight values, so a benchmark base is random codes in the format's own layout with
sane scales: `surojax.quant.random_weights.random_weight`, the one builder of random quantised weights (re-exported
here). `randomize_base(model, fmt, key)` replaces every targeted Linear kernel of a built Decoder by such a stacked
[L, ...] pytree (the shape `quantize_model` produces). Called inside the jit that builds the model
(`init_sharded`), the bf16 kernels it replaces are dead code and never materialise: a 70B base needs only its
quantised bytes on the device. Under `nnx.eval_shape` it gives the abstract quantised model that
`offload/host_init.py` fills on the host (one layer from `random_weight` on the CPU backend, repeated over L).
"""
from __future__ import annotations

import jax

from surojax.models.targets import base_linear, resolve_targets
from surojax.quant import FORMATS
from surojax.quant.gguf_mixed import GGUFMixed
from surojax.quant.random_weights import RANDOM_FORMATS, random_weight
from surojax.quant.transform import QuantParam

# `--quant`: the formats with a fused dequantise + matmul kernel (a QuantFormat.kernel_spec), built on the device
KERNEL_FORMATS = ("q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nvfp4", "fp8")
# `--base-format`: GGUF legacy block types (one fp16 scale per 32 values), built on the host (offload/host_init.py)
GGUF_LEGACY_FORMATS = ("q4_0", "q5_0", "q8_0")
ATTENTION = "q_proj,k_proj,v_proj,o_proj"


def randomize_base(model, fmt: str, key, targets: str = "all-linear") -> None:
    """Replace the targeted stacked kernels [L, K, N] of `model.layers` by random `fmt` weights (in place). A MoE
    model's base is its attention projections and its experts' kernels [L, E, K, N] (the router stays as it is);
    the experts run the format's `grouped_matmul` (surojax.models.layers.moe.grouped_dot), so a format without
    one is refused here, before anything is built."""
    linears = [base_linear(model, name) for name in resolve_targets(ATTENTION if model.cfg.moe else targets)]
    if model.cfg.moe is not None:
        if not hasattr(FORMATS[fmt], "grouped_matmul"):
            raise ValueError(f"{fmt} weights have no grouped_matmul on this checkout: MoE experts cannot be {fmt}")
        experts = model.layers.mlp.experts
        # an expert projection wrapped by LoRA (LoRAExpertLinear) keeps its frozen ExpertLinear as `base`
        linears += [getattr(lin, "base", lin) for lin in (experts.gate_up_proj, experts.down_proj)]
    for i, lin in enumerate(linears):
        var = lin.kernel
        *lead, k, n = tuple(var.get_value().shape)
        q = random_weight(fmt, k, n, jax.random.fold_in(key, i), tuple(lead))
        lin.kernel = QuantParam(q, **var.get_metadata())


def randomize_gguf_mix(model, file_type: str, key) -> dict[str, tuple[str, ...]]:
    """Replace every Linear kernel of a built dense Decoder's layers by random weights typed as llama.cpp's
    `file_type` (e.g. q4_k_m) types that tensor on each layer (quantize_mix.tensor_type: Q4_K_M puts attn_v and
    ffn_down in Q6_K on some layers): a stack whose layers share one type is that format, a mixed one a
    `GGUFMixed`, as surojax.weights.gguf_checkpoint loads such a file. Eager (GGUFMixed is stacked on the host),
    after the model is built. -> target -> the types of its layers."""
    from surojax.quant.quantize_mix import TARGET_TENSORS, tensor_type  # needs the optional `gguf` package

    cfg = model.cfg
    if cfg.moe is not None:
        raise ValueError("randomize_gguf_mix: dense models only")
    n_gqa = cfg.num_heads // cfg.num_kv_heads
    out = {}
    for t, name in enumerate(TARGET_TENSORS):
        lin = base_linear(model, name)
        var = lin.kernel
        L, k, n = tuple(var.get_value().shape)
        types = tuple(tensor_type(file_type, f"blk.{i}.{TARGET_TENSORS[name]}.weight", k, n_layers=L, n_gqa=n_gqa,
                                  arch=cfg.model_type) for i in range(L))
        layers = [random_weight(ty, k, n, jax.random.fold_in(key, t * 1000 + i)) for i, ty in enumerate(types)]
        if len(set(types)) == 1:
            w = jax.tree.map(lambda *a: jax.numpy.stack(a), *layers)
        else:
            w = GGUFMixed.from_layers(layers)
        lin.kernel = QuantParam(w, **var.get_metadata())
        out[name] = types
    return out


__all__ = ["GGUF_LEGACY_FORMATS", "KERNEL_FORMATS", "RANDOM_FORMATS", "random_weight", "randomize_base",
           "randomize_gguf_mix"]
