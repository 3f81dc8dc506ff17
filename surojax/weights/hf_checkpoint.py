"""Hugging Face checkpoint folders <-> a `Decoder`.

A folder holds config.json and either model.safetensors or model.safetensors.index.json + its shards.
Loading checks everything before any weight is converted: the files exist and are whole, every tensor the
config implies is present with the shape the config implies, and nothing unexpected is left over. The
name mapping is the family's weight table (surojax.models.registry), data rather than code.

A vision-language family's vision tower (`model.visual.*`, registry `Family.vision`) is loaded beside the text model
as `Decoder.visual` (models/vision/hf_weights.py, its tensors checked before the text weights convert) and written
back by save_model; a checkpoint without those tensors loads text-only.

A pre-quantised checkpoint (a quantization_config surojax.weights.prequant reads: FP8 block / per-tensor /
per-channel scales, NVFP4, bitsandbytes NF4) shows each quantised weight as one tensor under its plain name. With
`keep_quantized` the decoder's Linear kernels stay in their format (stacked over layers in a `QuantParam`, as
`qlora:` leaves them), the frozen base of LoRA and of serving; embeddings, norms, the router and the LM head are
dequantised (a quantised one) or loaded as stored. Without it every weight is dequantised to `param_dtype`.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from surojax.hub import model_path
from surojax.models.config import ModelConfig, ModelConfigError
from surojax.models.decoder import Decoder
from surojax.models.layers.attention_backend import AttentionBackend
from surojax.models.registry import WeightRow, family_for, row_layers, weight_rows
from surojax.models.vision.config import VisionConfig
from surojax.models.vision.hf_weights import PREFIX as VISION_PREFIX
from surojax.models.vision.hf_weights import load_vision_tower, vision_tower_tensors
from surojax.quant.base import QuantFormat
from surojax.quant.transform import QuantParam
from surojax.weights.json_file import read_json_object
from surojax.weights.mxfp4_checkpoint import packed_stack, with_mxfp4_pairs
from surojax.weights.prequant import PrequantTensor, QuantScheme, read_scheme, with_prequant
from surojax.weights.prequant.stacking import stack_quantized
from surojax.weights.safetensors_file import SafetensorsFile, WeightsError, write_safetensors

log = logging.getLogger(__name__)

# Tensors some exporters write that carry nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LIST_LIMIT = 8


def _listing(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{model_dir}: no config.json (expected a Hugging Face model folder)")
    hf = read_json_object(path, WeightsError)
    try:
        return ModelConfig.from_hf(hf)
    except (ModelConfigError, ValueError, TypeError, KeyError) as e:
        raise WeightsError(f"{path}: {e}") from None


def open_checkpoint(model_dir: str | os.PathLike) -> dict[str, SafetensorsFile]:
    """Tensor name -> the opened file that holds it (single file or sharded with an index)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    single = d / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"{index}: not a valid safetensors index "
                               "(weight_map must map tensor names to shard file names)")
        for fname in sorted(set(weight_map.values())):
            if not (d / fname).is_file():
                listed = [n for n, f in weight_map.items() if f == fname]
                raise WeightsError(f"{d / fname}: shard file not found; {index.name} lists {len(listed)} "
                                   f"tensor(s) in it: {_listing(listed)}")
        files = {f: SafetensorsFile(d / f) for f in sorted(set(weight_map.values()))}
        where = {}
        for name, fname in weight_map.items():
            if name not in files[fname]:
                raise WeightsError(f"{d / fname}: the index lists tensor {name!r} in this file but it is not there")
            where[name] = files[fname]
        return where
    if single.is_file():
        f = SafetensorsFile(single)
        return {name: f for name in f.names()}
    others = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    hint = f" (found {', '.join(others)}: convert them to safetensors first)" if others else ""
    raise WeightsError(f"{d}: no model.safetensors or model.safetensors.index.json{hint}")


def _expected(cfg: ModelConfig, abstract: nnx.State, *, fused: bool = False
              ) -> dict[str, tuple[WeightRow, tuple[int, ...], tuple]]:
    """HF name -> (row, index into the state's stacked axes ((), (r,) or (r, e): r the row of HF layer i in its
    stack, registry.row_layers), expected HF shape)."""
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(abstract)}
    E = cfg.moe.num_experts if cfg.moe is not None else 0
    out = {}
    for row in weight_rows(cfg, fused=fused):
        shape = tuple(flat[row.path].get_value().shape)
        shape = shape[int(row.per_layer) + int(row.per_expert):]
        if row.half is not None:
            shape = shape[:-1] + (shape[-1] // 2,)
        if row.transpose:
            shape = shape[:-2] + shape[-2:][::-1]
        experts = range(E) if row.per_expert else [None]
        for r, i in enumerate(row_layers(cfg, row)):  # r: the row in the stack, i: the HF layer index
            for e in experts:
                index = tuple(x for x in (None if i is None else r, e) if x is not None)
                out[row.hf.format(i=i, e=e)] = (row, index, shape)
    return out


def _hf_to_state(arr: np.ndarray, row: WeightRow) -> np.ndarray:
    """An HF tensor in our axis order ([in, out] kernels: the last two axes swapped when `transpose`)."""
    return np.swapaxes(arr, -1, -2) if row.transpose else arr


def _half(row: WeightRow, width: int) -> slice:
    """The slice of the state's last axis a `half` row fills (all of it for other rows)."""
    if row.half is None:
        return slice(None)
    return slice(row.half * width // 2, (row.half + 1) * width // 2)


def load_model(model_dir: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
               attention: AttentionBackend | str = "auto", cfg: ModelConfig | None = None, keep_quantized: bool = False,
               shardings_of: Callable[[nnx.State], nnx.State] | None = None) -> Decoder:
    """Load a Hugging Face checkpoint folder (or a Hub id, fetched by surojax.hub) into a `Decoder`.

    dtype: compute dtype; param_dtype: storage dtype of the weights (default: same as dtype).
    keep_quantized: a pre-quantised checkpoint's Linear kernels (FP8, NVFP4, bitsandbytes NF4) and gpt-oss's
    published MXFP4 experts stay in their format (module docstring; the experts as `mxfp4` in a QuantParam, leaves
    [L, E, ...]: a frozen base, for LoRA and serving; surojax.weights.mxfp4_checkpoint); else (and always for a
    float checkpoint) every weight is `param_dtype` (MXFP4 dequantises exactly in bf16). Quantised kernels are
    made whole on the default device (shardings_of places the float parameters only; the caller places the rest).
    shardings_of: the abstract state -> its shardings (e.g. `parallel.param_shardings` over a mesh). With it, each
    parameter is made straight into its shards: a process reads only the tensors whose part lands on its devices
    (the layers of its pipeline stage, say) and no device ever holds more than its shards. Without it, each
    parameter is put whole on the default device (one process, placed afterwards).
    """
    cfg = cfg or read_config(model_path(model_dir, weights=False))  # a Hub id: its config before its weights
    model_dir = model_path(model_dir)
    param_dtype = param_dtype or dtype
    where = with_mxfp4_pairs(open_checkpoint(model_dir))  # gpt-oss's published MXFP4 experts
    scheme = read_scheme(model_dir)  # a pre-quantised checkpoint's reader, None for float weights
    unused: tuple[str, ...] = ()
    if scheme is not None:
        where, unused = with_prequant(where, scheme)

    abstract_model = nnx.eval_shape(
        lambda: Decoder(cfg, dtype=dtype, param_dtype=param_dtype, attention=attention, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(abstract_model)
    present = {n for n in where if not n.endswith(_IGNORED_SUFFIXES)}
    skipped = family_for(cfg.model_type).skipped_prefixes
    if skipped and any(n.startswith(skipped) for n in present):
        not_text = sorted(n for n in present if n.startswith(skipped))
        present -= set(not_text)
        log.info("%s: skipping %d tensors outside the language model (%s: a vision tower / MTP heads surojax does "
                 "not run)", model_dir, len(not_text), ", ".join(p for p in skipped if any(n.startswith(p)
                                                                                         for n in not_text)))
    family = family_for(cfg.model_type)
    visual = sorted(n for n in present if n.startswith(VISION_PREFIX)) if family.vision else []
    present -= set(visual)
    expected = _expected(cfg, abstract)
    if family.fused_weights:  # a second naming (MoE: fused experts; gemma3: published layout; qwen3_vl_moe: layout)
        fused = _expected(cfg, abstract, fused=True)
        if _fit(fused, present, where) > _fit(expected, present, where):
            expected = fused
    if cfg.tie_word_embeddings and "lm_head.weight" in present:
        present.discard("lm_head.weight")  # a tied head saved anyway: the embedding is used
        log.info("%s: ignoring lm_head.weight (tie_word_embeddings is true)", model_dir)
    unused_kv = [n for n in present if n not in expected and _shared_kv_tensor(cfg, n)]
    if unused_kv:  # Gemma 4's KV-shared layers never read them (transformers ignores them on load too)
        present -= set(unused_kv)
        log.info("%s: ignoring %d k / v tensors of KV-shared layers (they read an earlier layer's keys / values)",
                 model_dir, len(unused_kv))
    missing = [n for n in expected if n not in present]
    unexpected = [n for n in present if n not in expected]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    for name, (row, _, shape) in expected.items():
        if name in where:
            got = where[name].shape(name)
            if tuple(got) != shape:
                problems.append(f"{where[name].path.name}: tensor {name} has shape {list(got)}, "
                                f"the config implies {list(shape)}")
            elif where[name].dtype(name) not in (np.float32, np.float16, ml_dtypes.bfloat16):
                problems.append(f"{where[name].path.name}: tensor {name} has dtype {where[name].dtype(name)}, "
                                f"expected a float (a pre-quantised checkpoint says how it is quantised in "
                                f"config.json's quantization_config)")
    if problems:
        raise WeightsError(f"{model_dir}: the weights do not match config.json ({cfg.model_type}):\n  - "
                           + "\n  - ".join(problems))

    tower = None
    if visual:  # the vision tower (models/vision/): its config and tensors checked before the text weights load
        vision_cfg = VisionConfig.from_hf(cfg.hf_extra.get("vision_config") or {}, cfg.model_type,
                                          source=f"{model_dir}/config.json")
        tower = load_vision_tower(vision_cfg, {n: where[n].get(n) for n in visual}, param_dtype=param_dtype,
                                  source=str(model_dir))

    np_dtype = np.dtype(jnp.dtype(param_dtype))
    shapes = {".".join(map(str, p)): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(abstract)}
    by_path: dict[str, list[tuple[str, WeightRow, tuple[int, ...]]]] = {}
    for name, (row, index, _) in expected.items():
        by_path.setdefault(row.path, []).append((name, row, index))
    state = _quantized_state(model_dir, scheme, by_path, where, shapes, unused, np_dtype) \
        if scheme is not None and keep_quantized else {}
    if scheme is not None and not keep_quantized:
        log.info("%s: %s, dequantised to %s", model_dir, scheme.describe(), np_dtype)

    # One parameter at a time: each tensor read is a host copy, converted into the parameter's buffer and dropped,
    # so host memory holds one parameter (all its layers) beyond the device copies.
    placed = None if shardings_of is None else {
        ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(shardings_of(abstract))}
    for path, items in by_path.items():
        if path in state:  # kept quantised
            continue
        packed = packed_stack(items, where) if keep_quantized else None  # MXFP4 experts: read whole, placed later
        if packed is not None:
            state[path] = packed
            continue
        if placed is not None:
            state[path] = _load_sharded(shapes[path], np_dtype, items, where, placed[path])
            continue
        value = np.empty(shapes[path], np_dtype)  # [L, (E,) ...] or the unstacked shape
        for name, row, index in items:
            value[index + (Ellipsis, _half(row, value.shape[-1]))] = _hf_to_state(where[name].get(name), row)
        state[path] = jnp.asarray(value)
        del value

    def fill(path, var):
        key = ".".join(map(str, path))
        if key not in state:
            return var
        if isinstance(state[key], QuantFormat):
            return QuantParam(state[key], **var.get_metadata())
        return var.replace(state[key])

    filled = nnx.map_state(fill, abstract)
    model = nnx.merge(graphdef, filled)
    model.visual = tower
    return model


def _fit(expected: dict, present: set, where: dict) -> int:
    """How many of a table's tensors the checkpoint holds with the table's shape (picks between two namings, or
    two layouts under one naming: qwen3_vl_moe's experts)."""
    return sum(1 for name, (_, _, shape) in expected.items()
               if name in present and tuple(where[name].shape(name)) == shape)


def _kept_quantized(row: WeightRow) -> bool:
    """A decoder Linear kernel (a layer stack's, experts included; not the router, not the LM head)."""
    return row.transpose and row.stack is not None and row.path.endswith(".kernel") and ".router." not in row.path


_SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight$")


def _shared_kv_tensor(cfg, name: str) -> bool:
    """A k / v projection or norm of one of Gemma 4's KV-shared layers (`num_kv_shared_layers`): a checkpoint may
    hold them, transformers' Gemma4TextModel lists them in `_keys_to_ignore_on_load_unexpected`."""
    m = _SHARED_KV.search(name)
    return bool(m) and getattr(cfg, "kv_shared_layers", 0) > 0 and cfg.layer_is_kv_shared(int(m.group(1)))


def _quantized_state(model_dir: Path, scheme: QuantScheme, by_path: dict, where: dict, shapes: dict,
                     unused: tuple[str, ...], np_dtype: np.dtype) -> dict[str, QuantFormat]:
    """State path -> the stacked quantised pytree of every Linear kernel the checkpoint stores quantised in all its
    layers (surojax.weights.prequant.stacking); the others are left to the float path, with the reason logged."""
    out, dequantised = {}, []
    for path, items in by_path.items():
        stored = [isinstance(where[name], PrequantTensor) for name, _, _ in items]
        if not any(stored):
            continue
        if not _kept_quantized(items[0][1]):
            dequantised.append(f"{path} (not a decoder Linear)")
            continue
        if not all(stored):
            dequantised.append(f"{path} (some of its layers are stored in float)")
            continue
        parts: dict[tuple[int, ...], dict] = {}
        for name, row, index in items:
            parts.setdefault(index, {})[row.half] = where[name].quantized()
        value, why = stack_quantized(parts, shapes[path][:len(items[0][2])])
        if value is None:
            dequantised.append(f"{path} ({why})")
            continue
        out[path] = value
    log.info("%s: %s; %d Linear kernels kept quantised", model_dir, scheme.describe(), len(out))
    if dequantised:
        log.info("%s: dequantised to %s: %s", model_dir, np_dtype, "; ".join(dequantised))
    if unused:
        log.info("%s: %d activation / KV-cache scale tensors are not used (weight-only: activations and the KV cache "
                 "run in the compute dtype): %s", model_dir, len(unused), _listing(unused))
    return out


def param_block(shape: tuple[int, ...], dtype, items: list[tuple[str, WeightRow, tuple[int, ...]]],
                index: tuple[slice, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
    """Block `index` of one parameter of `shape` (the slices `jax.make_array_from_callback` asks for), assembled
    from its HF tensors `items` ((name, row, leading index: () | (layer,) | (layer, expert))). Only the tensors
    whose part of the parameter meets the block are read (`read(name)`: the HF tensor as stored)."""
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape))
    out = np.empty(tuple(s.stop - s.start for s in index), dtype)
    last = index[-1]
    for name, row, lead in items:
        if not all(s.start <= i < s.stop for i, s in zip(lead, index)):
            continue
        part = slice(*_half(row, shape[-1]).indices(shape[-1])[:2])  # the span of the last axis this tensor fills
        lo, hi = max(part.start, last.start), min(part.stop, last.stop)
        if lo >= hi:
            continue
        src = _hf_to_state(read(name), row)[(*index[len(lead):-1], slice(lo - part.start, hi - part.start))]
        out[(*(i - s.start for i, s in zip(lead, index)), Ellipsis, slice(lo - last.start, hi - last.start))] = src
    return out


def _load_sharded(shape: tuple[int, ...], dtype, items, where: dict[str, SafetensorsFile], sharding) -> jax.Array:
    """One parameter as a global array of `sharding`: this process's blocks only (`param_block`); each HF tensor
    is read once however many local devices need a part of it, and dropped with the parameter."""
    cache: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if name not in cache:
            cache[name] = where[name].get(name)
        return cache[name]

    return jax.make_array_from_callback(shape, sharding, lambda index: param_block(shape, dtype, items, index, read))


def hf_tensors(model: Decoder, dtype=None) -> dict[str, np.ndarray]:
    """The language model's weights under their Hugging Face names (the published layout), in `dtype` (default: as
    stored); a vision tower's are `vision_tower_tensors(model.visual)` (save_model writes both)."""
    cfg = model.cfg
    params = nnx.state(model, nnx.Param)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(params)}
    values: dict[str, np.ndarray] = {}
    out = {}
    for name, (row, index, _) in _expected(cfg, params).items():
        if row.path not in values:
            value = np.asarray(jax.device_get(flat[row.path]))
            values[row.path] = value if dtype is None else value.astype(np.dtype(jnp.dtype(dtype)))
        value = values[row.path]
        part = value[index + (Ellipsis, _half(row, value.shape[-1]))]
        out[name] = np.ascontiguousarray(_hf_to_state(part, row))
    return out


def save_model(model: Decoder, out_dir: str | os.PathLike, *, dtype=None, max_shard_bytes: int = 5 * 2**30,
               tokenizer_dir: str | os.PathLike | None = None, overwrite: bool = False) -> Path:
    """Write config.json + safetensors (sharded with an index past `max_shard_bytes`) that transformers loads.

    The folder is written under a temporary name and renamed at the end, so a crash leaves no half folder,
    and an existing non-empty folder is never overwritten unless `overwrite` is set.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise WeightsError(f"{out_dir}: exists and is not a folder; choose another output folder")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise WeightsError(f"{out_dir}: exists and is not empty; choose another output folder")
    tensors = hf_tensors(model, dtype)
    if getattr(model, "visual", None) is not None:  # the vision tower under model.visual.*
        tensors |= vision_tower_tensors(model.visual, dtype)
    hf_cfg = model.cfg.to_hf()
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = str(next(iter(tensors.values())).dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would stay on the renamed folder; mkdir gives the usual umask mode.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        shards, current, size = [], {}, 0
        for name, arr in tensors.items():
            if current and size + arr.nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name] = arr
            size += arr.nbytes
        shards.append(current)
        if len(shards) == 1:
            write_safetensors(tmp / "model.safetensors", shards[0])
        else:
            weight_map = {}
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(tmp / fname, shard)
                weight_map.update({n: fname for n in shard})
            total = sum(a.nbytes for a in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# what a saved model, merged model or adapter folder carries beside the weights: the tokenizer, the chat template,
# generation defaults and a vision model's image processor (without it the folder takes no images)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "preprocessor_config.json")


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copyfile(p, Path(dst) / name)  # the contents: the copy gets a new file's mode, not the source's
