"""What the low-precision recipes (fp8_hybrid, nvfp4) share as transforms on a built `Decoder`: the per-layer
mask of the layers kept in bf16, and the swap of the decoder's base Linear layers (q, k, v, o, gate, up, down; the
`base` of a LoRALinear) for a recipe's own Linear.

The stacked layers share one scan body, so a layer kept in bf16 cannot be a different module: each swapped Linear
holds an [L] bool flag on the `layers` axis and picks the low-precision or the bf16 matmul with `lax.cond`.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import Linear
from surojax.models.registry import LINEAR_MODULES
from surojax.models.targets import module_at, replace_module
from surojax.peft.lora import LoRALinear


class QuantLayerMask(nnx.Variable):
    """[L] bool: True where the layer's matmuls run in the recipe's low precision (False: kept in bf16)."""


def layer_mask(num_layers: int, skip_first: int, skip_last: int, precision: str) -> jax.Array | None:
    """[L] bool (False on the first / last skipped layers), or None when every layer runs in `precision`."""
    if skip_first < 0 or skip_last < 0 or skip_first + skip_last >= num_layers:
        raise ValueError(f"skip_quant_first_layers ({skip_first}) + skip_quant_last_layers ({skip_last}) must leave "
                         f"at least one of the model's {num_layers} layers in {precision}")
    if skip_first == 0 and skip_last == 0:
        return None
    index = jnp.arange(num_layers)
    return (index >= skip_first) & (index < num_layers - skip_last)


def swap_base_linears(model, make: Callable[[str, Linear], Linear], recipe: str) -> list[str]:
    """Replace every base Linear of `model.layers` by make(path, linear) (in place); returns the target names.
    Raises ValueError for a Linear already swapped or a kernel that is already quantised (qlora_* bases)."""
    if getattr(model, "linear_layers", None) is not None:  # a hybrid: a second stack this swap does not walk yet
        raise ValueError(f"the {recipe} recipe does not support a hybrid model yet ({model.cfg.model_type}: its "
                         "Gated DeltaNet layers' projections would stay bf16 while the recipe reports them swapped); "
                         "train it with recipe: bf16")
    done = []
    for name, path in LINEAR_MODULES.items():
        mod = module_at(model.layers, path)
        holder, lin = (mod, mod.base) if isinstance(mod, LoRALinear) else (None, mod)
        if type(lin) is not Linear:
            raise ValueError(f"{path}: a low-precision recipe is already applied ({type(lin).__name__})")
        if not isinstance(lin.kernel.get_value(), jax.Array):
            raise ValueError(f"{path}: kernel is already quantised ({type(lin.kernel.get_value()).__name__}); the "
                             f"{recipe} recipe needs a bf16 / fp32 base (remove the qlora_* key)")
        new = make(path, lin)
        if holder is not None:
            holder.base = new
        else:
            replace_module(model.layers, path, new)
        done.append(name)
    return done


__all__ = ["QuantLayerMask", "layer_mask", "swap_base_linears"]
