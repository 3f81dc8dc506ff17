"""PEFT-format LoRA adapters: a folder with adapter_config.json + adapter_model.safetensors.

Tensor names and layouts are PEFT's (torch Linear layout, one tensor per layer):

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [R, in]   = lora_a[i].T  (lora_a [L, in, R])
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, R]  = lora_b[i].T  (lora_b [L, R, out])

The module part (`model.layers.{i}.self_attn.q_proj`) comes from the family's weight table
(surojax.models.registry), so a family with other HF names needs no code here. A hybrid's (Qwen3.5) adapter is
kept per site (models/targets.py: `gate_proj` in `layers`, `linear_layers.gate_proj`, `linear_layers.in_proj_qkv`,
...), each [rows of its stack, ...]; its tensors are named by the HF layer index of each row
(registry.stack_layers), so on disk it is PEFT's one adapter over `model.layers.{i}` whatever the stack. Reading also accepts names
with PEFT's in-memory adapter segment (`lora_A.default.weight`) and without the `base_model.model.` prefix.
A MoE model's expert adapters use PEFT's `target_parameters` layout (surojax.peft.peft_experts: one adapter per
expert stacked into the rank axis, nested `.base_layer` names). A MoE router trained with the adapter
(surojax.peft.trained_router) is PEFT's `modules_to_save`: `["gate"]` (`["router"]` for gpt_oss, `["mlp.gate"]`
with a shared expert) and the router's full weights per layer under the module's name
(`base_model.model.model.layers.{i}.mlp.gate.weight`, torch [E, D]); the loader reads them into
`PeftAdapter.router` when the caller passes the family's router rows. Anything this loader cannot reproduce
exactly (DoRA, per-module rank/alpha patterns, biases, other saved modules, layer subsets, ...) is an error that
names the option, never silently ignored.

A shared expert's projections (qwen2_moe) are plain Linear targets under their module names
(`model.layers.{i}.mlp.shared_expert.gate_proj`), written to `target_modules` as `shared_expert.gate_proj` etc.
(PEFT matches a module by the end of its name). PEFT's bare `gate_proj` / `up_proj` / `down_proj` on such a model
match only the shared expert's modules (transformers 5's routed experts are parameters, not modules), so an adapter
that lists them is read as the shared expert's when the model has no dense MLP (`_peft_meaning`).

A vision-language model's tower adapters (surojax.peft.vision_lora: `train_vision` with LoRA) are tensors under
the tower's transformers names, one per module (its blocks are separate modules, no layer axis):

    base_model.model.model.visual.blocks.{i}.attn.qkv.lora_A.weight   [R, in]   = A.T  (A [in, R])

and `target_modules` entries that reach the tower only (vision_lora.peft_vision_entries). A loader for a model
without a tower (or the server's runtime adapter slots) refuses such tensors by name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from surojax.models.registry import (LINEAR_ATTENTION_MODULES, LINEAR_MODULES, LLAMA_STYLE_WEIGHTS,
                                     SHARED_EXPERT_MODULES, SHORT_CONV_MODULES, WeightRow, stack_layers, weight_rows)
from surojax.peft.lora import (ATTENTION_TARGETS, EXPERT_TARGETS, lora_modules, lora_scaling, resolve_targets, site_key,
                               site_stack, target_name, vision_lora_modules)
from surojax.peft.peft_experts import (PEFT_PARAMETERS, expert_module_name, experts_modules, from_peft,
                                       matches_parameter, target_parameter, to_peft)
from surojax.peft.vision_lora import PATCH_EMBED, is_vision_entry, matched_paths, peft_vision_entries, tower_linears
from surojax.weights.atomic import atomic_path
from surojax.weights.json_file import read_json_object
from surojax.weights.safetensors_file import SafetensorsFile, WeightsError, write_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
VISION_PREFIX = "model.visual."  # the tower's modules in transformers' VLMs (models/vision/hf_weights.py)
_LIST_LIMIT = 8
# `modules_to_save` entries this loader reads: the end of a MoE family's router module's name (PEFT matches a
# module by the end of its name, as a string). qwen3_moe / mixtral: `gate`; gpt_oss: `router`; a family with a
# shared expert `mlp.gate` (a bare `gate` would also match its `mlp.shared_expert_gate`).
ROUTER_MODULES = ("gate", "router", "mlp.gate", "mlp.router")
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


class AdapterError(WeightsError):
    """An adapter folder that cannot be read or written as asked: the message names the file and the tensor."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The shape and scale of one adapter (what adapter_config.json records)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return lora_scaling(self.rank, self.alpha, self.use_rslora)


@dataclasses.dataclass
class PeftAdapter:
    """An adapter read from disk, in our layout: target -> (A [L, in, R], B [L, R, out]) numpy arrays (an expert
    target: A [L, E, in, R], B [L, E, R, out]). router: the MoE router saved with it (`modules_to_save`), Decoder
    path -> full weight (layers.mlp.router.kernel [L, D, E], layers.mlp.router.bias [L, E]); empty when none.
    vision: the vision tower's adapters, tower path (`blocks.0.attn.qkv`) -> (A [in, R], B [R, out]); empty when
    none."""

    spec: LoraSpec
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    base_model_name_or_path: str | None = None
    path: Path | None = None
    router: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    vision: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return next(iter(self.weights.values()))[0].shape[0]


# The Linear targets an adapter file names by module (PEFT's `target_modules`); the experts go by parameter.
MODULE_TARGETS: dict[str, str] = {**LINEAR_MODULES, **SHARED_EXPERT_MODULES, **LINEAR_ATTENTION_MODULES,
                                  **SHORT_CONV_MODULES}


def module_names(rows: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS) -> dict[str, str]:
    """Target site key -> its HF module path, "{i}" for the layer: q_proj -> model.layers.{i}.self_attn.q_proj (the
    Linear targets the family's table has, in each stack: a MoE family has no dense MLP rows; a hybrid's
    linear_layers.gate_proj -> model.layers.{i}.mlp.gate_proj)."""
    by_path = {r.path: r.hf for r in rows}
    out = {}
    for stack in dict.fromkeys(r.stack for r in rows if r.stack is not None):
        for name, sub in MODULE_TARGETS.items():
            hf = by_path.get(f"{stack}.{sub}.kernel")
            if hf is not None:
                out[site_key(stack, name)] = hf.removesuffix(".weight")
    return out


def peft_target_modules(targets, rows: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS) -> list[str]:
    """PEFT's `target_modules` entries for our Linear target names: the name itself where the family's HF module
    ends with it (q_proj, shared_expert.gate_proj, LFM2's conv.in_proj), else the module's name after
    `layers.{i}.` (LFM2's self_attn.out_proj for o_proj, feed_forward.w1 for gate_proj): PEFT matches a module by
    the end of its name."""
    modules = module_names(rows)
    out = []
    for t in targets:
        if t not in MODULE_TARGETS:
            continue
        hf = next((m for k, m in modules.items() if target_name(k) == t), None)
        out.append(t if hf is None or hf.endswith("." + t) else hf.split("{i}.", 1)[1])
    return out


def _by_suffix(names: list[str], modules: dict[str, str], path: Path) -> tuple[str, ...]:
    """`target_modules` entries resolved as PEFT resolves them (a module matches an entry that is its whole name or
    the end of it after a dot; "all-linear" every Linear target) -> our target names, in the modules' order."""
    out = []
    for entry in names:
        hits = [target_name(k) for k, m in modules.items()
                if entry == "all-linear" or m == entry or m.endswith("." + entry)]
        if not hits:
            raise AdapterError(f"{path}: target_modules entry {entry!r} matches no Linear module of this model (its "
                               f"modules: {', '.join(m.split('{i}.', 1)[-1] for m in modules.values())})")
        out += hits
    return tuple(dict.fromkeys(t for t in (target_name(k) for k in modules) if t in out))


def expert_sites(rows: tuple[WeightRow, ...], targets, entries=()) -> dict[str, str]:
    """Site key -> PEFT's module path ("{i}" for the layer) of the expert targets among `targets` (target names or
    site keys), in every stack whose rows have experts (peft_experts.experts_modules: `mlp.experts`, Gemma 4's
    `experts`, LFM2-MoE's `feed_forward.experts`). Rows without experts (an adapter read without its model's table):
    `layers`, the module of the adapter's `target_parameters` `entries` under `model.layers.{i}.` (default
    `mlp.experts`; the model's dims check the tensors later)."""
    names = tuple(dict.fromkeys(target_name(t) for t in targets if target_name(t) in PEFT_PARAMETERS))
    module = next((e.rpartition(".")[0] for e in entries if "." in e), "mlp.experts")
    modules = experts_modules(rows) or {"layers": "model.layers.{i}." + module}
    return {site_key(stack, t): expert_module_name(t, names, module) for stack, module in modules.items()
            for t in names}


def peft_target_parameters(targets, rows: tuple[WeightRow, ...]) -> list[str]:
    """PEFT's `target_parameters` entries for the expert targets among `targets` (target names), in the family's
    module (`feed_forward.experts.gate_up_proj` on LFM2-MoE; one entry for all stacks: they share the name)."""
    modules = experts_modules(rows) or {"layers": "model.layers.{i}.mlp.experts"}
    return list(dict.fromkeys(target_parameter(t, m) for m in modules.values() for t in PEFT_PARAMETERS
                              if t in targets))


def _hf_layers(cfg, key: str, rows: int) -> tuple[int, ...]:
    """The HF layer index of each row of a site's adapter (registry.stack_layers; without a config, 0..rows-1)."""
    return tuple(range(rows)) if cfg is None else stack_layers(cfg, site_stack(key))


def _listing(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


# ---- writing ------------------------------------------------------------------------------------------------

def adapter_config(spec: LoraSpec, base_model_name_or_path: str | None,
                   rows: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS, vision_entries: list[str] = ()) -> dict:
    """adapter_config.json for a plain LoRA, with the keys every PEFT release since rsLoRA/DoRA understands.
    `rows`: the family's weight table (PEFT's module names: `peft_target_modules`); `vision_entries`: the entries
    that select the tower's adapted modules (vision_lora.peft_vision_entries)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "r": spec.rank,
        "lora_alpha": int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha,
        "lora_dropout": spec.dropout,
        # PEFT: Linear modules by name; the fused expert parameters by `target_parameters` (None when absent)
        "target_modules": peft_target_modules(spec.targets, rows) + list(vision_entries) or None,
        "target_parameters": peft_target_parameters(spec.targets, rows) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": spec.use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def base_reference(base_model_name_or_path: str | os.PathLike | None) -> str | None:
    """What adapter_config.json records as the base: an existing local path made absolute (as PEFT does, so the
    adapter loads from any directory); anything else (a Hugging Face repo id) as given."""
    if base_model_name_or_path is None:
        return None
    name = os.fspath(base_model_name_or_path)
    path = Path(name).expanduser()
    return os.path.abspath(path) if path.exists() else name


def adapter_of(model) -> PeftAdapter:
    """The model's current (trainable) adapter as numpy arrays in our layout (the vision tower's in `vision`)."""
    mods, tower = lora_modules(model), vision_lora_modules(model)
    if not mods and not tower:
        raise AdapterError("the model has no LoRA adapter to save (apply_lora or load_adapter_into first)")
    specs = {(m.rank, m.alpha, m.use_rslora, m.dropout) for m in (*mods.values(), *tower.values())}
    if len(specs) != 1:
        raise AdapterError(f"the model's adapters differ in (rank, alpha, use_rslora, dropout): {sorted(specs)}; "
                           "one PEFT adapter needs one setting")
    rank, alpha, use_rslora, dropout = specs.pop()
    names = tuple(dict.fromkeys(target_name(k) for k in mods))  # the HF target names (a hybrid: over its stacks)
    spec = LoraSpec(rank=rank, alpha=alpha, targets=names, dropout=dropout, use_rslora=use_rslora)
    weights = {name: (np.asarray(jax.device_get(m.lora_a.get_value())),  # [L, in, R]
                      np.asarray(jax.device_get(m.lora_b.get_value())))  # [L, R, out]
               for name, m in mods.items()}
    vision = {path: (np.asarray(jax.device_get(m.lora_a.get_value())),  # [in, R]
                     np.asarray(jax.device_get(m.lora_b.get_value())))  # [R, out]
              for path, m in tower.items()}
    return PeftAdapter(spec, weights, vision=vision)


def peft_tensors(adapter: PeftAdapter, rows: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS,
                 dtype=None, cfg=None) -> dict[str, np.ndarray]:
    """Our layout -> PEFT's tensor names and torch layout (A [R, in], B [out, R] per layer). cfg: the model's
    config, which maps a stack's rows to HF layer indices (needed for a hybrid; None: row r is layer r)."""
    names = module_names(rows)
    names.update(expert_sites(rows, adapter.weights))
    np_dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
    out = {}
    for target, (a, b) in adapter.weights.items():
        for r, i in enumerate(_hf_layers(cfg, target, a.shape[0])):
            prefix = PEFT_PREFIX + names[target].format(i=i)
            pair = to_peft(a[r], b[r]) if target_name(target) in PEFT_PARAMETERS else (a[r].T, b[r].T)
            for ab, w in zip("AB", pair):
                out[f"{prefix}.lora_{ab}.weight"] = np.ascontiguousarray(w if np_dtype is None else w.astype(np_dtype))
    for path, (a, b) in adapter.vision.items():
        for ab, w in zip("AB", (a.T, b.T)):
            out[f"{PEFT_PREFIX}{VISION_PREFIX}{path}.lora_{ab}.weight"] = np.ascontiguousarray(
                w if np_dtype is None else w.astype(np_dtype))
    return out


def save_peft_adapter(model, out_dir: str | os.PathLike, base_model_name_or_path: str | None, *, dtype=None,
                      overwrite: bool = False, rows: tuple[WeightRow, ...] | None = None) -> Path:
    """Write the model's adapter as a PEFT folder that `peft.PeftModel.from_pretrained` loads.

    base_model_name_or_path: the base model; a local path is recorded absolute (`base_reference`), a hub repo id
    as given. dtype: dtype of the saved tensors (default: as stored, fp32 master weights). The folder is written under
    a temporary name next to `out_dir` and renamed at the end; a non-empty `out_dir` is an error unless
    `overwrite`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise AdapterError(f"{out_dir}: exists and is not empty; choose another output folder (or overwrite=True)")
    adapter = adapter_of(model)
    if rows is None:
        rows = tuple(weight_rows(model.cfg))
    tensors = peft_tensors(adapter, rows, dtype, cfg=model.cfg)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would stay on the renamed folder; mkdir gives the usual umask mode.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        vision = peft_vision_entries(adapter.vision, tower_linears(model)) if adapter.vision else []
        cfg = adapter_config(adapter.spec, base_reference(base_model_name_or_path), rows, vision)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        write_safetensors(tmp / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
        if out_dir.exists():
            shutil.rmtree(out_dir) if out_dir.is_dir() else out_dir.unlink()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def copy_adapter_files(adapter_dir: str | os.PathLike, dest: str | os.PathLike) -> list[Path]:
    """Copy an adapter's two files (adapter_config.json, adapter_model.safetensors) into `dest`, each written under a
    temporary name and renamed, weights first: `dest` then is a PEFT adapter folder too (a training run's output_dir,
    where Surogate writes its adapter)."""
    adapter_dir, dest = Path(adapter_dir), Path(dest)
    out = []
    for name in (WEIGHTS_FILE, CONFIG_FILE):  # the config last: a folder with it is taken as a whole adapter
        with atomic_path(dest / name) as tmp:
            shutil.copyfile(adapter_dir / name, tmp)
        out.append(dest / name)
    return out


# ---- reading ------------------------------------------------------------------------------------------------

# Options of PEFT's LoraConfig that change what the adapter computes; a value other than the neutral one is
# refused. (init_lora_weights, inference_mode, revision, runtime_config ... do not matter for a saved adapter.)
_NEUTRAL = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None,),
    "layers_pattern": (None, [], ""),
    "layer_replication": (None,),
    "trainable_token_indices": (None,),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None,),
    "use_bdlora": (None, False),
}


def read_adapter_config(adapter_dir: str | os.PathLike, modules: dict[str, str] | None = None
                        ) -> tuple[dict, LoraSpec]:
    """Parse and check adapter_config.json; returns the raw dict and the spec (targets from target_modules).
    `modules` (site key -> HF module path, `module_names`): resolve target_modules against the model's modules by
    PEFT's own rule (`_by_suffix`; LFM2, whose HF module names are not our target names)."""
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {CONFIG_FILE} (expected a PEFT adapter folder)")
    cfg = read_json_object(path, AdapterError)
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    bad = [f"{k}={cfg[k]!r}" for k, ok in _NEUTRAL.items() if k in cfg and cfg[k] not in ok]
    if bad:
        raise AdapterError(f"{path}: unsupported LoRA options: {', '.join(bad)} (surojax reads plain LoRA adapters: "
                           "no DoRA, bias, rank/alpha patterns, saved modules or layer subsets)")
    saved = cfg.get("modules_to_save")
    if saved not in (None, []) and (not isinstance(saved, list) or any(m not in ROUTER_MODULES for m in saved)
                                    or len(saved) != 1):
        raise AdapterError(f"{path}: modules_to_save={saved!r} is not supported (surojax reads one saved module: a "
                           "MoE router trained with the adapter, ['gate'] for qwen3_moe / mixtral, ['router'] for "
                           "gpt_oss)")
    try:
        rank = int(cfg["r"])
        alpha = float(cfg["lora_alpha"])
        dropout = float(cfg.get("lora_dropout") or 0.0)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise AdapterError(f"{path}: needs numeric r and lora_alpha (and lora_dropout), found {e!r}") from None
    if rank <= 0:
        raise AdapterError(f"{path}: r must be positive, got {rank}")
    tm = cfg.get("target_modules")
    targets: tuple[str, ...] = ()
    if modules is not None and (isinstance(tm, list) or tm == "all-linear"):
        targets = _by_suffix([tm] if isinstance(tm, str) else tm, modules, path)
    elif isinstance(tm, list) or tm == "all-linear":
        names = [tm] if isinstance(tm, str) else [t for t in tm if not is_vision_entry(t)]  # the tower's: read later
        known = [t for t in names if t == "all-linear" or t in LINEAR_MODULES or t in LINEAR_ATTENTION_MODULES]
        shared = tuple(t for t in SHARED_EXPERT_MODULES if t in names)
        unknown = [t for t in names if t not in known and t not in shared]
        if unknown:
            raise AdapterError(f"{path}: target_modules {unknown} are not supported (supported: "
                               f"{', '.join(MODULE_TARGETS)})")
        hybrid = any(t in LINEAR_ATTENTION_MODULES for t in known)  # "all-linear": the tensors say (below)
        targets = (resolve_targets(known, hybrid=hybrid) if known else ()) + shared
    # A regex string (or anything else): the tensors decide which modules carry an adapter.
    tp = cfg.get("target_parameters") or []
    if not isinstance(tp, list) or any(_expert_target(p) is None for p in tp):
        raise AdapterError(f"{path}: target_parameters {tp!r} are not supported (supported: the fused experts' "
                           f"{' / '.join(PEFT_PARAMETERS.values())}, e.g. mlp.experts.gate_up_proj, Gemma 4's "
                           "experts.gate_up_proj, LFM2-MoE's feed_forward.experts.gate_up_proj)")
    if tp:
        if dropout:
            raise AdapterError(f"{path}: lora_dropout {dropout} with target_parameters (PEFT refuses it too)")
        chosen = {_expert_target(p) for p in tp}
        if tm == "all-linear":  # PEFT's all-linear: the Linear modules; here the dense names, not a MoE model's
            targets = tuple(t for t in targets if t in ATTENTION_TARGETS)
        # bare gate/up/down_proj stay: on a model with a shared expert they are its modules (_peft_meaning)
        targets = targets + tuple(t for t in EXPERT_TARGETS if t in chosen)
    spec = LoraSpec(rank=rank, alpha=alpha, targets=targets, dropout=dropout,
                    use_rslora=bool(cfg.get("use_rslora", False)))
    return cfg, spec


def _expert_target(entry) -> str | None:
    """Our expert target of a `target_parameters` entry, by the parameter's name (its last part); None if none."""
    by_param = {v: k for k, v in PEFT_PARAMETERS.items()}
    return by_param.get(entry.rsplit(".", 1)[-1]) if isinstance(entry, str) else None


def _check_target_parameters(entries: list[str], modules: dict[str, str], path: Path) -> None:
    """Each `target_parameters` entry must select this model's expert parameter as PEFT matches it (`modules`: stack
    -> the experts module): an adapter made for another family's experts module is refused by name."""
    for entry in entries:
        target = _expert_target(entry)
        if not any(matches_parameter(entry, target, m) for m in modules.values()):
            have = sorted({f"{m}.{PEFT_PARAMETERS[target]}" for m in modules.values()})
            raise AdapterError(f"{path}: target_parameters entry {entry!r} matches no parameter of this model (its "
                               f"experts: {', '.join(have)}; PEFT matches the whole name or its end, no layer "
                               "subsets): the adapter was made for another family")


def load_peft_adapter(adapter_dir: str | os.PathLike, *, rows: tuple[WeightRow, ...] = LLAMA_STYLE_WEIGHTS,
                      num_layers: int | None = None, dims: dict[str, tuple[int, int]] | None = None,
                      num_experts: int | None = None, router_rows: tuple[WeightRow, ...] = (),
                      model_cfg=None, vision_dims: dict[str, tuple[int, int]] | None = None) -> PeftAdapter:
    """Read a PEFT LoRA folder into our layout, checking names, shapes and completeness.

    When loading for a model, pass its `num_layers` (every targeted module must have tensors for exactly
    layers 0..L-1) and `dims` (target -> (in, out) of its Linear; every tensor is checked against them).
    Without `dims`, every layer must have layer 0's shapes. Expert targets (from `target_parameters`) are read in
    PEFT's ParamWrapper layout (surojax.peft.peft_experts); `num_experts` (E of the model) is then checked too.
    router_rows: the model's router rows under PEFT's names (surojax.peft.trained_router.peft_router_rows); an
    adapter with `modules_to_save` needs them (its module must be that router, with a tensor per row and layer).
    model_cfg: the model's ModelConfig, which maps each stack's rows to HF layer indices (registry.stack_layers);
    a hybrid needs it (its MLP modules have one HF name in both stacks: the layer index says which). Weights are
    keyed by target site (models/targets.py), spec.targets are the HF target names.
    vision_dims: the model's vision tower Linears, path -> (in, out) (vision_lora.tower_dims); the adapter's tower
    tensors (`model.visual.*`) are read into `PeftAdapter.vision`. None: a model without a tower, or a caller that
    takes language-model adapters only: such tensors are an error naming them.
    """
    adapter_dir = Path(adapter_dir)
    by_suffix = any(r.stack == "conv_layers" for r in rows)  # LFM2: its HF module names are not our target names
    cfg, spec = read_adapter_config(adapter_dir, module_names(rows) if by_suffix else None)
    wpath = adapter_dir / WEIGHTS_FILE
    if not wpath.is_file():
        others = [p.name for p in adapter_dir.glob("adapter_model.*")]
        hint = f" (found {', '.join(others)}: convert it to safetensors first)" if others else ""
        raise AdapterError(f"{adapter_dir}: no {WEIGHTS_FILE}{hint}")
    f = SafetensorsFile(wpath)

    modules = module_names(rows)
    spec = dataclasses.replace(spec, targets=_peft_meaning(spec.targets, modules))
    entries = cfg.get("target_parameters") or []
    if experts_modules(rows):
        _check_target_parameters(entries, experts_modules(rows), adapter_dir / CONFIG_FILE)
    modules.update(expert_sites(rows, spec.targets, entries))
    if cfg.get("target_modules") == "all-linear" and model_cfg is not None and model_cfg.linear_attention is not None:
        moe = model_cfg.moe
        linear = resolve_targets("all-linear", moe=moe is not None, hybrid=True,
                                 shared_expert=bool(moe and moe.shared_expert_intermediate_size))
        chosen = [t for t in linear if t not in PEFT_PARAMETERS or t in spec.targets]  # experts: target_parameters
        spec = dataclasses.replace(spec, targets=tuple(chosen))
    patterns = {t: re.compile("^" + re.escape(m).replace(re.escape("{i}"), r"(\d+)") + "$")
                for t, m in modules.items()}
    held = None if model_cfg is None else {k: set(_hf_layers(model_cfg, k, 0)) for k in modules}
    found: dict[tuple[str, int, str], str] = {}  # (target, layer, "A"|"B") -> tensor name
    unexpected = []
    router_found = _router_names(cfg.get("modules_to_save"), router_rows, f.names(), adapter_dir)
    have = dict.fromkeys(target_name(k) for k in modules if target_name(k) not in PEFT_PARAMETERS)  # HF names
    absent = [t for t in spec.targets if t not in have and t not in PEFT_PARAMETERS]
    if absent:
        raise AdapterError(f"{adapter_dir / CONFIG_FILE}: target_modules {absent} name modules this model does not "
                           f"have (its Linear modules: {', '.join(have)}; a MoE model's experts are "
                           "target_parameters)")
    vision_found: dict[tuple[str, str], str] = {}  # (tower path, "A"|"B") -> tensor name
    for name in f.names():
        if name in router_found.values():
            continue
        m = _NAME.match(name)
        if m and m["module"].startswith(VISION_PREFIX):
            vision_found[(m["module"].removeprefix(VISION_PREFIX), m["ab"])] = name
            continue
        hit = None
        if m:
            module = m["module"]
            for candidate in (module, "model." + module):  # also a base saved without the CausalLM wrapper
                hits = [(t, int(mm[1]), m["ab"]) for t, pat in patterns.items() if (mm := pat.match(candidate))]
                # one HF module name in several stacks (a hybrid's MLP): the stack that holds layer i
                hit = next((h for h in hits if held is None or h[1] in held[h[0]]), hits[0] if hits else None)
                if hit:
                    break
        if hit is None:
            unexpected.append(name)
        elif hit in found:
            raise AdapterError(f"{wpath}: tensors {found[hit]!r} and {name!r} are the same weight")
        else:
            found[hit] = name
    if unexpected:
        raise AdapterError(f"{wpath}: unexpected tensors ({len(unexpected)}): {_listing(unexpected)} "
                           "(only LoRA A/B of the decoder's linear modules are supported)")
    if not found and not vision_found:
        raise AdapterError(f"{wpath}: holds no LoRA tensors")
    vision = _read_vision(f, wpath, vision_found, vision_dims, cfg.get("target_modules"), spec.rank)

    present = tuple(t for t in modules if any(k[0] == t for k in found))
    targets = tuple(k for k in modules if target_name(k) in spec.targets) if spec.targets else present
    L = num_layers if num_layers is not None else 1 + max((k[1] for k in found), default=-1)
    if model_cfg is not None:
        L = model_cfg.num_layers
    ids = {t: _hf_layers(model_cfg, t, L) for t in modules}  # the HF layers of each site, in its row order
    names = modules
    missing = [PEFT_PREFIX + names[t].format(i=i) + f".lora_{ab}.weight"
               for t in targets for i in ids[t] for ab in "AB" if (t, i, ab) not in found]
    extra = [found[k] for k in found if k[0] not in targets or k[1] not in ids[k[0]]]
    if missing:
        raise AdapterError(f"{wpath}: missing tensors ({len(missing)}): {_listing(missing)}")
    if extra:
        why = f"the model has {L} layers" if num_layers is not None or model_cfg is not None else \
            f"target_modules is {list(targets)}"
        raise AdapterError(f"{wpath}: tensors outside the adapter ({why}): {_listing(extra)}")

    weights = {}
    for t in targets:
        a_list, b_list = [], []
        for i in ids[t]:
            na, nb = found[(t, i, "A")], found[(t, i, "B")]
            for n in (na, nb):
                if len(f.shape(n)) != 2:
                    raise AdapterError(f"{wpath}: tensor {n} has shape {list(f.shape(n))}, expected a matrix")
                if f.dtype(n) not in _FLOATS:
                    raise AdapterError(f"{wpath}: tensor {n} has dtype {f.dtype(n)}, expected a float (f32, f16, bf16)")
            if dims is not None and t not in dims:
                raise AdapterError(f"{wpath}: the adapter targets {t}, which the model does not have "
                                   f"(it has {', '.join(dims)})")
            expert = target_name(t) in PEFT_PARAMETERS
            if expert:
                E = num_experts if num_experts is not None else f.shape(na)[0] // spec.rank
                d_in, d_out = dims[t] if dims is not None else (f.shape(na)[-1], f.shape(nb)[0])
                want_a, want_b = (E * spec.rank, d_in), (d_out, spec.rank * E)
                why = f"r={spec.rank}, {E} experts need"
            elif dims is not None:
                want_a, want_b, why = (spec.rank, dims[t][0]), (dims[t][1], spec.rank), "the model needs"
            elif a_list:
                want_a, want_b, why = a_list[0].shape[::-1], b_list[0].shape[::-1], "layer 0 has"
            else:
                want_a, want_b = (spec.rank, f.shape(na)[-1]), (f.shape(nb)[0], spec.rank)
                why = f"{CONFIG_FILE} has r={spec.rank}, so it should be"
            for n, want in ((na, want_a), (nb, want_b)):
                if tuple(f.shape(n)) != tuple(want):
                    raise AdapterError(f"{wpath}: tensor {n} has shape {list(f.shape(n))}, {why} {list(want)}")
            if expert:
                a, b = from_peft(np.asarray(f.get(na)), np.asarray(f.get(nb)), spec.rank)  # [E, in, R], [E, R, out]
            else:
                a, b = np.asarray(f.get(na)).T, np.asarray(f.get(nb)).T  # [in, R], [R, out]
            a_list.append(a)
            b_list.append(b)
        weights[t] = (np.stack(a_list), np.stack(b_list))  # [L, (E,) in, R], [L, (E,) R, out]
    spec = dataclasses.replace(spec, targets=tuple(dict.fromkeys(target_name(t) for t in targets)))
    router = _read_router(f, wpath, router_found, router_rows, L, model_cfg)
    return PeftAdapter(spec, weights, cfg.get("base_model_name_or_path"), adapter_dir, router, vision)


def _read_vision(f: SafetensorsFile, wpath: Path, found: dict[tuple[str, str], str],
                 dims: dict[str, tuple[int, int]] | None, target_modules, rank: int
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The tower's adapters: path -> (A [in, R], B [R, out]), each module's A and B present with the model's shapes;
    with a `target_modules` list, exactly the tower modules its entries select (as peft selects them)."""
    if not found:
        return {}
    names = sorted(found.values())
    if dims is None:
        raise AdapterError(f"{wpath}: holds adapters on a vision tower ({len(names)} tensors: {_listing(names)}); this "
                           "model has no vision tower, or this loader takes language-model adapters only (the server's "
                           "runtime adapter slots): serve the adapter folder as the model, or merge it (surojax merge)")
    paths = {p for p, _ in found}
    if PATCH_EMBED in paths or any(p not in dims for p in paths):
        bad = sorted(p for p in paths if p not in dims)
        raise AdapterError(f"{wpath}: adapters on {', '.join(VISION_PREFIX + p for p in bad)}, which are not Linears "
                           f"of the vision tower that surojax adapts (its blocks' attn.qkv / attn.proj / mlp.linear_fc1 / "
                           f"linear_fc2 and the mergers' linear_fc1 / linear_fc2; not {PATCH_EMBED}, a Conv3d)")
    if isinstance(target_modules, list):
        chosen = set(matched_paths([e for e in target_modules if is_vision_entry(e)], dims))
        if PATCH_EMBED in chosen:
            raise AdapterError(f"{wpath.parent / CONFIG_FILE}: target_modules {target_modules} select the vision "
                               f"tower's {PATCH_EMBED} (a Conv3d in transformers): adapters there are not supported")
        paths |= chosen
    missing = sorted(PEFT_PREFIX + VISION_PREFIX + f"{p}.lora_{ab}.weight" for p in paths for ab in "AB"
                     if (p, ab) not in found)
    if missing:
        raise AdapterError(f"{wpath}: missing tensors ({len(missing)}): {_listing(missing)}")
    out = {}
    for p in sorted(paths):
        (d_in, d_out), na, nb = dims[p], found[(p, "A")], found[(p, "B")]
        for n, want in ((na, (rank, d_in)), (nb, (d_out, rank))):
            if f.dtype(n) not in _FLOATS:
                raise AdapterError(f"{wpath}: tensor {n} has dtype {f.dtype(n)}, expected a float (f32, f16, bf16)")
            if tuple(f.shape(n)) != want:
                raise AdapterError(f"{wpath}: tensor {n} has shape {list(f.shape(n))}, the model needs {list(want)}")
        out[p] = (np.asarray(f.get(na)).T, np.asarray(f.get(nb)).T)
    return out


def _peft_meaning(targets: tuple[str, ...], modules: dict[str, str]) -> tuple[str, ...]:
    """The targets as PEFT applied them to this family: a bare gate_proj / up_proj / down_proj on a model without a
    dense MLP but with a shared expert matched the shared expert's module (PEFT matches by the end of the name)."""
    names = {target_name(k) for k in modules}
    out = []
    for t in targets:
        shared = f"shared_expert.{t}"
        t = shared if t not in names and shared in names else t
        if t not in out:
            out.append(t)
    return tuple(out)


def _router_names(saved: list[str] | None, router_rows: tuple[WeightRow, ...], names, adapter_dir: Path
                  ) -> dict[tuple[str, int], str]:
    """The saved router's tensors: (Decoder path, layer) -> tensor name; empty without `modules_to_save`."""
    if not saved:
        return {}
    if not router_rows:
        raise AdapterError(f"{adapter_dir}: modules_to_save={saved!r} holds a MoE router, and this model has none "
                           "to load it into (a dense model, Gemma 4's MoE-block router, which does not train with an "
                           "adapter, or a loader that takes no saved router)")
    module = router_rows[0].hf.format(i=0).removesuffix(".weight")  # model.layers.0.mlp.gate
    if len(saved) != 1 or not module.endswith("." + saved[0]):
        raise AdapterError(f"{adapter_dir}: modules_to_save={saved!r}, but this model's router module is "
                           f"{module.rsplit('.', 1)[-1]!r}: the adapter was trained on another family ({module} here)")
    patterns = {r.path: re.compile(r"^(?:base_model\.model\.)?" + re.escape(r.hf).replace(re.escape("{i}"), r"(\d+)")
                                   + "$") for r in router_rows}
    found = {}
    for name in names:
        for path, pat in patterns.items():
            m = pat.match(name)
            if m:
                found[(path, int(m[1]))] = name
    return found


def _read_router(f: SafetensorsFile, wpath: Path, found: dict[tuple[str, int], str],
                 router_rows: tuple[WeightRow, ...], num_layers: int, model_cfg=None) -> dict[str, np.ndarray]:
    """Stack the saved router tensors into our layout (kernel [rows, D, E], bias [rows, E]), every layer present:
    each row's stack holds the HF layers registry.stack_layers gives it (without a config: 0..num_layers-1)."""
    if not found:
        return {}
    rows = {r.path: r for r in router_rows}
    layers = {p: tuple(range(num_layers)) if model_cfg is None else stack_layers(model_cfg, r.stack)
              for p, r in rows.items()}
    missing = [PEFT_PREFIX + rows[p].hf.format(i=i) for p in rows for i in layers[p] if (p, i) not in found]
    extra = sorted({n for (p, i), n in found.items() if i >= num_layers})
    if missing or extra:
        raise AdapterError(f"{wpath}: the saved router needs one tensor per row and layer (L={num_layers}); "
                           f"missing: {_listing(missing) or 'none'}; "
                           f"beyond the last layer: {_listing(extra) or 'none'}")
    router = {}
    for path, row in rows.items():
        values = []
        for i in layers[path]:
            name = found[(path, i)]
            if f.dtype(name) not in _FLOATS:
                raise AdapterError(f"{wpath}: tensor {name} has dtype {f.dtype(name)}, expected a float")
            v = np.asarray(f.get(name))
            values.append(v.T if row.transpose else v)  # torch [E, D] -> [D, E]
        shapes = {v.shape for v in values}
        if len(shapes) != 1:
            raise AdapterError(f"{wpath}: the router's {path} differs in shape across layers: {sorted(shapes)}")
        router[path] = np.stack(values)
    return router
