"""The vision tower's parameters from transformers' tensor names (`model.visual.` + the module path).

Our module paths mirror transformers' (patch_embed.proj, pos_embed, blocks.{i}.attn.qkv, ..., merger,
deepstack_merger_list.{j}); the leaf and the layout differ:
- Linear `kernel` [in, out] <- `weight` [out, in] transposed; `bias` <- `bias`;
- LayerNorm `scale` <- `weight`, `bias` <- `bias`;
- pos_embed `embedding` <- `pos_embed.weight`;
- patch_embed.proj `kernel` [C*T*P*P, D] <- the Conv3d `weight` [D, C, T, P, P] flattened (C, T, P, P) and transposed.
Every expected tensor must be present with its shape, and no other tensor may be under the prefix: a missing,
extra or misshapen tensor is an error naming it, raised before any parameter is built.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.vision.config import VisionConfig
from surojax.models.vision.tower import VisionTower

PREFIX = "model.visual."


class VisionWeightsError(ValueError):
    """A checkpoint's vision tensors do not fit the tower; the message names the tensor."""


def _hf_name(path: tuple) -> str:
    *modules, leaf = (str(p) for p in path)
    base = ".".join(modules)
    if modules == ["pos_embed"]:
        return "pos_embed.weight"
    return f"{base}.{'bias' if leaf == 'bias' else 'weight'}"


def _from_hf(path: tuple, tensor: np.ndarray) -> np.ndarray:
    leaf = str(path[-1])
    if leaf == "kernel":
        if tuple(str(p) for p in path[:-1]) == ("patch_embed", "proj"):
            return tensor.reshape(tensor.shape[0], -1).T
        return tensor.T
    return tensor


def load_vision_tower(cfg: VisionConfig, tensors: Mapping[str, np.ndarray], *, prefix: str = PREFIX,
                      param_dtype=jnp.float32, source: str = "checkpoint") -> VisionTower:
    """A VisionTower of `cfg` holding `tensors[prefix + hf name]` (name -> array, e.g. a safetensors file's)."""
    abstract = nnx.eval_shape(lambda: VisionTower(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    wanted = {prefix + _hf_name(path): path for path in flat}
    present = {name for name in tensors if name.startswith(prefix)}
    missing, extra = sorted(set(wanted) - present), sorted(present - set(wanted))
    if missing or extra:
        raise VisionWeightsError(f"{source}: the vision tower's tensors do not match its config (depth {cfg.depth}, "
                                 f"{len(cfg.deepstack_visual_indexes)} deepstack mergers): missing {missing[:8]}"
                                 f"{' ...' if len(missing) > 8 else ''}, unexpected {extra[:8]}"
                                 f"{' ...' if len(extra) > 8 else ''}")
    for name, path in wanted.items():
        variable = flat[path]
        value = _from_hf(path, np.asarray(tensors[name]))
        if value.shape != tuple(variable.get_value().shape):
            raise VisionWeightsError(f"{source}: tensor {name} has shape {tuple(np.asarray(tensors[name]).shape)}, "
                                     f"which does not give {tuple(variable.get_value().shape)} for "
                                     f"{'.'.join(map(str, path))}")
        variable.set_value(jnp.asarray(value, param_dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def vision_tower_tensors(tower: VisionTower, dtype=None) -> dict[str, np.ndarray]:
    """The tower's parameters under transformers' names (`model.visual.*`, the inverse of `load_vision_tower`), in
    `dtype` (default: as stored)."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        value = np.asarray(variable.get_value())
        if dtype is not None:
            value = value.astype(np.dtype(jnp.dtype(dtype)))
        if str(path[-1]) == "kernel":
            value = value.T
            if tuple(str(p) for p in path[:-1]) == ("patch_embed", "proj"):
                cfg = tower.cfg
                value = value.reshape(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                      cfg.patch_size)
        out[PREFIX + _hf_name(path)] = np.ascontiguousarray(value)
    return out

