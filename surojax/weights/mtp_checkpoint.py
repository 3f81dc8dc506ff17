"""A checkpoint's MTP head (`mtp.*` tensors, models/mtp.py) -> an `MTPDecoder` over the loaded target model.

The plain loader skips `mtp.*` (registry `Family.skipped_prefixes`); `load_mtp` reads them only when MTP
speculation is asked for. Names (vLLM's Qwen3_5MTP layout; HF [out, in] kernels transposed as everywhere):

    mtp.fc.weight [D, 2D]                    -> fc.kernel [2D, D]   (input: [embedding | hidden])
    mtp.pre_fc_norm_embedding.weight [D]     -> pre_fc_norm_embedding.scale
    mtp.pre_fc_norm_hidden.weight [D]        -> pre_fc_norm_hidden.scale
    mtp.norm.weight [D]                      -> final_norm.scale
    mtp.layers.0.*                           -> layers.* : the attention layer rows of the family's own table
                                                (registry.qwen3_5_weights under the prefix `mtp.`; MoE experts per
                                                expert or fused, whichever the checkpoint holds)

The embedding and the LM head are the target's. Refused, naming what is missing: a family without MTP heads, a
config without `mtp_num_hidden_layers`, a checkpoint without (or with wrongly shaped) mtp tensors, a pre-quantised
checkpoint. Layers past the first (mtp_num_hidden_layers > 1) are not run (logged).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.models.decoder import Decoder
from surojax.models.mtp import MTP_FAMILIES, MTP_LAYERS_KEY, MTP_PREFIX, MTPDecoder, mtp_num_layers, share_target_weights
from surojax.models.registry import WeightRow, qwen3_5_weights
from surojax.weights.hf_checkpoint import _half, _hf_to_state, _listing, open_checkpoint
from surojax.weights.prequant import read_scheme

log = logging.getLogger(__name__)


class MTPError(ValueError):
    """A model / checkpoint that cannot give MTP speculation (what is missing is named)."""

    is_user_error = True


def mtp_weight_rows(moe: bool, fused: bool = False) -> tuple[WeightRow, ...]:
    """The MTP head's weight table (module docstring); `fused`: a MoE's experts as transformers 5 names them."""
    layer = tuple(r for r in qwen3_5_weights(MTP_PREFIX, moe=moe, fused=fused) if r.stack == "layers")
    return (*layer,
            WeightRow(MTP_PREFIX + "fc.weight", "fc.kernel", True),
            WeightRow(MTP_PREFIX + "pre_fc_norm_embedding.weight", "pre_fc_norm_embedding.scale"),
            WeightRow(MTP_PREFIX + "pre_fc_norm_hidden.weight", "pre_fc_norm_hidden.scale"),
            WeightRow(MTP_PREFIX + "norm.weight", "final_norm.scale"))


def _expected(rows, shapes: dict, num_experts: int) -> dict[str, tuple[WeightRow, tuple, tuple]]:
    """HF name -> (row, index into the state's stacked axes, expected HF shape) for MTP layer 0."""
    out = {}
    for row in rows:
        shape = shapes[row.path][int(row.per_layer) + int(row.per_expert):]
        if row.half is not None:
            shape = shape[:-1] + (shape[-1] // 2,)
        if row.transpose:
            shape = shape[:-2] + shape[-2:][::-1]
        for e in (range(num_experts) if row.per_expert else [None]):
            index = tuple(x for x in ((0 if row.per_layer else None), e) if x is not None)
            out[row.hf.format(i=0, e=e)] = (row, index, tuple(shape))
    return out


def load_mtp(model_dir: str | os.PathLike, target: Decoder, *, attention="auto") -> MTPDecoder:
    """The MTP head of the checkpoint folder `model_dir` whose text model `target` was loaded from (same dtypes;
    its embedding and head shared). Raises `MTPError` naming what is missing."""
    cfg = target.cfg
    model_dir = Path(model_dir)
    if cfg.model_type not in MTP_FAMILIES:
        raise MTPError(f"{cfg.model_type}: MTP speculation runs the MTP heads of the Qwen3.5 / Qwen3.6 families "
                       f"({', '.join(MTP_FAMILIES)}); this model type has none")
    n_layers = mtp_num_layers(cfg)
    if n_layers < 1:
        raise MTPError(f"{model_dir}/config.json: no `{MTP_LAYERS_KEY}` (>= 1): the checkpoint declares no MTP "
                       "layers (speculate with --speculative-method ngram or draft instead)")
    if read_scheme(model_dir) is not None:
        raise MTPError(f"{model_dir}: MTP speculation on a pre-quantised checkpoint is not supported yet (its "
                       "mtp.* tensors would need the quantised reader); use the float checkpoint")
    where = open_checkpoint(model_dir)
    present = {n for n in where if n.startswith(MTP_PREFIX)}
    moe = cfg.moe is not None
    dtype = target.dtype
    param_dtype = target.embed.embedding.get_value().dtype
    abstract_model = nnx.eval_shape(lambda: MTPDecoder(cfg, dtype=dtype, param_dtype=param_dtype,
                                                       attention=attention, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(abstract_model)
    shapes = {".".join(map(str, p)): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(abstract)}
    E = cfg.moe.num_experts if moe else 0
    tables = [_expected(mtp_weight_rows(moe, fused), shapes, E) for fused in ((False, True) if moe else (False,))]
    expected = max(tables, key=lambda t: sum(1 for n in t if n in present))
    later = sorted(n for n in present if n.startswith(MTP_PREFIX + "layers.") and not n.startswith(
        MTP_PREFIX + "layers.0."))
    if later:
        log.info("%s: %s %d: only the first MTP layer runs (%d tensors of later layers not loaded)", model_dir,
                 MTP_LAYERS_KEY, n_layers, len(later))
    present -= set(later)
    missing = [n for n in expected if n not in present]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    unexpected = [n for n in present if n not in expected]
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    for name, (_, _, shape) in expected.items():
        if name in where and name in present and tuple(where[name].shape(name)) != shape:
            problems.append(f"tensor {name} has shape {list(where[name].shape(name))}, the config implies "
                            f"{list(shape)}")
    if problems:
        raise MTPError(f"{model_dir}: the MTP head (`{MTP_PREFIX}*`, {MTP_LAYERS_KEY} {n_layers}) does not match "
                       f"config.json ({cfg.model_type}):\n  - " + "\n  - ".join(problems))

    np_dtype = np.dtype(jnp.dtype(param_dtype))
    state = {}
    for name, (row, index, _) in expected.items():
        if row.path not in state:
            state[row.path] = np.zeros(shapes[row.path], np_dtype)
        value = state[row.path]
        value[index + (Ellipsis, _half(row, value.shape[-1]))] = _hf_to_state(where[name].get(name), row)

    def fill(path, var):
        key = ".".join(map(str, path))
        return var.replace(jnp.asarray(state[key])) if key in state else var

    mtp = nnx.merge(graphdef, nnx.map_state(fill, abstract))
    log.info("%s: MTP head loaded (%d tensors; embedding and LM head shared with the model)", model_dir,
             len(expected))
    return share_target_weights(mtp, target)


__all__ = ["MTPError", "load_mtp", "mtp_weight_rows"]
