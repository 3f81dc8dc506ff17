"""FLOPs of a hybrid step: the matmul weights and LoRA adapters surojax.bench.flops counts are those of the built
model (Qwen3.5: 3 DeltaNet layers + 1 gated-attention layer; LFM2: 3 short-conv layers + 1 attention layer), not a
dense model's."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from surojax.bench.flops import adapter_params, flop_targets, linear_params, step_flops
from surojax.bench.shapes import model_config
from surojax.models.decoder import Decoder


# shape -> (its second stack, the depthwise conv's module path there, all-linear's target count)
HYBRIDS = {"debug-qwen3.5": ("linear_layers", ["linear_attn", "conv1d"], 12),
           "debug-lfm2": ("conv_layers", ["conv", "conv"], 9)}


@pytest.mark.parametrize("shape", sorted(HYBRIDS))
def test_hybrid_matmul_weights_and_adapters_are_the_built_models(shape):
    cfg = model_config(shape)
    second, depthwise, n_targets = HYBRIDS[shape]
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    kernels = 0  # every projection's kernel in both stacks (the depthwise conv is not a matmul)
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        if names[-1] == "kernel" and names[1:-1] != depthwise:
            kernels += int(np.prod(leaf.shape))
    assert linear_params(cfg) == kernels + cfg.hidden_size * cfg.vocab_size  # + the (tied) head
    # LoRA on all-linear: r (d_in + d_out) per target on the layers that have it = the adapters' parameter count
    targets = flop_targets(cfg, "all-linear")
    r = 4
    per_stack = {"layers": cfg.num_attention_layers, second: cfg.num_layers - cfg.num_attention_layers}
    expected = 0
    for stack, n in per_stack.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(getattr(model, stack), nnx.Param)):
            names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
            if names[-1] == "kernel" and (names[-2] in targets or ".".join(names[-3:-1]) in targets):
                assert leaf.shape[0] == n
                expected += n * r * (leaf.shape[-2] + leaf.shape[-1])
    assert len(targets) == n_targets and adapter_params(cfg, r, targets) == expected
    # attention pairs count on the attention layers only; the DeltaNet mixing is its own term
    fl = step_flops(cfg, mode="lora", tokens=256, segment_lengths=[256], rank=r, targets=targets)
    assert fl["attention"] == 3 * cfg.num_attention_layers * 4 * cfg.num_heads * cfg.head_dim * (256 * 257 // 2)
    assert (fl["linear_attention"] > 0) == (cfg.linear_attention is not None) and fl["total"] == sum(fl[k] for k in ("linear", "adapters", "attention",
                                                                           "linear_attention"))


def test_attention_pairs_take_each_layers_window():
    """Gemma 3: five sliding layers of window 16 and one full layer, each with its own (query, key) pairs."""
    cfg = model_config("debug-gemma3")
    fl = step_flops(cfg, mode="full", tokens=256, segment_lengths=[256])
    pairs = 5 * (16 * 17 // 2 + (256 - 16) * 16) + 256 * 257 // 2
    assert fl["attention"] == 3 * 4 * cfg.num_heads * cfg.head_dim * pairs
