"""Surogate's config spellings, read as surojax's at load time (before validation): one table, applied by `translate`.

Surogate's training YAML (github.com/invergent-ai/surogate, docs/reference/config.md) and surojax's share most keys.
Every key of Surogate's reference that surojax spells differently, or does not have, is an entry here:

    RENAMED      key -> the surojax key (a dotted path) it is, the value unchanged      zero_level -> zero_stage
    VALUES       surojax key -> {Surogate's value spelling: surojax's}                 recipe: fp8-hybrid -> fp8_hybrid
    REFUSED_VALUES  surojax key -> {a value Surogate documents that surojax lacks: why, naming the nearest}
    REFUSED      key -> why surojax has no such thing (naming the nearest surojax key), and the values that ask
                 for nothing (read as what surojax does: `use_zero_copy: false`)
    rules        keys whose reading depends on other keys (gpus, cpu_training, torch_dtype, shard_weights, ...):
                 the functions `translate` runs
    DATASET_*    the same for each entry of datasets / validation_datasets

Keys surojax reads under Surogate's own name (model_type, use_cuda_graphs, template, truncation_strategy, ...) are
ordinary schema fields; SUROGATE_NAMED lists them. A Surogate key given together with the surojax key it becomes must
agree with it, else an error at the Surogate key. Errors keep pointing at the user's key and line: `translate`
returns where each surojax key came from (`origins`).

A config *looks like Surogate's* when it writes any key or value listed here, or a key of SUROGATE_NAMED set away
from surojax's default; the loader records those spellings on the config (`TrainConfig._surogate_spellings`). Such
a run prints at start every Surogate default that differs from surojax's and that the config leaves unset
(config/surogate_defaults.py; docs/surogate_compat.md gives the decisions and reasons).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from surojax.config.base import differs_from_default
from surojax.config.errors import ConfigProblem, format_key
from surojax.config.explain import Loc, Positions

if TYPE_CHECKING:
    from surojax.config.schema import TrainConfig


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A Surogate key surojax does not read: `why` (naming the nearest surojax key), and the values that ask for
    nothing, which are read as what surojax does anyway."""

    why: str
    off: tuple[Any, ...] = ()


RENAMED: dict[str, str] = {
    "zero_level": "zero_stage",
    "adamw_beta1": "adam_beta1", "adamw_beta2": "adam_beta2", "adamw_epsilon": "adam_epsilon",
    "train_seed": "seed",
    "ep_size": "parallel.expert",
}
# Keys whose documented default is null, which surojax reads as its own default (a key it does not let be null)
NULL_IS_DEFAULT = ("master_dtype", "validation_datasets", "router_z_loss_coef")
_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
VALUES: dict[str, dict[Any, Any]] = {
    "recipe": {"fp8-hybrid": "fp8_hybrid"},
    "lora_target_modules": {"all": "all-linear"},  # element by element
    "master_dtype": _DTYPES, "gradient_dtype": _DTYPES, "lora_dtype": _DTYPES,
}
# Values Surogate documents for a key surojax has, that surojax does not have: value -> why, naming the nearest
REFUSED_VALUES: dict[str, dict[Any, str]] = {
    "recipe": {"nvfp4_quartet": "Quartet's FP4 training recipe is not available; the nearest is recipe: nvfp4 "
                                "(NVIDIA's: 16-value blocks with E4M3 scales, random Hadamard transform, stochastic "
                                "rounding of the gradients)"},
}
_OFF = (False,)
REFUSED: dict[str, Refusal] = {
    "apply_recommended_values": Refusal("surojax has no pass of recommended values: its defaults are its own "
                                       "(docs/surogate_compat.md lists where they differ from Surogate's)", _OFF),
    "offload_residual": Refusal("the FFN residuals alone are not offloaded; the nearest surojax setting is "
                                "recompute: offload (each layer's saved activations in host memory)", _OFF),
    "offload_quants": Refusal("the quantised base is not kept in host memory on its own; offload_base_weights "
                              "streams the whole frozen base (quantised or not) from host memory", _OFF),
    "persistent_quants": Refusal("a qlora_* base is quantised once at load and kept; fp8_hybrid / nvfp4 weights "
                                 "are quantised in each step's program: there is nothing to persist", _OFF),
    "use_zero_copy": Refusal("host memory access is XLA's; see offload_optimizer / offload_master", _OFF),
    "use_write_combined": Refusal("host memory access is XLA's; see offload_optimizer / offload_master", _OFF),
    "use_all_to_all_reduce": Refusal("collectives are chosen by XLA (NCCL on GPU)", _OFF),
    "memcpy_all_gather": Refusal("collectives are chosen by XLA (NCCL on GPU)", _OFF),
    "memcpy_send_recv": Refusal("collectives are chosen by XLA (NCCL on GPU)", _OFF),
    "ep_load_balance_threshold": Refusal("LLEP's dynamic expert placement is not available: experts are split "
                                         "statically over parallel.expert"),
    "ep_plan_refresh_interval": Refusal("LLEP's dynamic expert placement is not available: experts are split "
                                        "statically over parallel.expert"),
    "parallelism": Refusal("dispatch-PP is not available; surojax's pipeline is parallel: {stage: N} (the layers "
                           "split over N devices, circular schedule)", (None, "ddp")),
    "distributed": Refusal("Ray clusters are not used: a multi-node run is one process per GPU started by "
                           "`surojax launch` or SLURM (jax.distributed), with the mesh in parallel:", (None,)),
    "fp4_backend": Refusal("nvfp4's matmuls are XLA programs (emulated with bf16 GEMMs on Hopper): there is no "
                           "kernel backend to choose"),
    "use_fused_rope": Refusal("XLA fuses the rotary embedding into its neighbours itself: there is no separate "
                              "kernel to choose", _OFF),
    "init_projections_to_zero": Refusal("from_scratch initialises every projection randomly (the model's "
                                        "initializer_range)", _OFF),
    "attn_bwd_chunks": Refusal("the attention backward is one XLA / cuDNN call; lmhead_chunks chunks the LM head",
                               (1,)),
    "qlora_four_over_six": Refusal("four-over-six block scaling is not available for the NVFP4 base (each block "
                                   "is scaled to max 6)", _OFF),
    "qlora_selective_expert_dequant": Refusal("experts are dequantised per layer inside the step's program", _OFF),
    "qlora_offload_experts": Refusal("experts are not offloaded on their own; offload_base_weights streams the "
                                     "whole frozen base, experts included", _OFF),
    "log_file": Refusal("the console log is not written to a file (redirect it: 2> train.log); metrics go to "
                        "<output_dir>/metrics.jsonl", (None,)),
    "log_gpu_util": Refusal("GPU utilisation is not logged; `surojax bench` measures throughput and MFU"),
    "debug_time_breakdown": Refusal("no per-phase timing; `surojax bench train` profiles a step", _OFF),
    "debug_memory_breakdown": Refusal("no memory breakdown; the start-up summary prints the planned peak", _OFF),
    "loss_scale": Refusal("the loss is on assistant / output tokens (loss_scale: default), or on every token with "
                          "train_on_inputs: true", ("default",)),
    "sequence_parallel_size": Refusal("sequence parallelism is not available; the mesh is parallel: {data, fsdp, "
                                      "tensor, expert, stage}", (1,)),
    "response_prefix": Refusal("applies when generating; the chat template writes the assistant's prefix", (None,)),
    "norm_bbox": Refusal("bounding boxes in the text are not rescaled to the resized images (grounding data): "
                         "write them in the coordinates the model expects", (None, "none")),
    "agent_template": Refusal("tool calls are rendered by the tokenizer's chat template (the tools column: "
                              "datasets[].tools_field)", (None,)),
    "normuon_momentum": Refusal("normuon is not available (optimizer: adamw | adamw_8bit)"),
    "normuon_beta2": Refusal("normuon is not available (optimizer: adamw | adamw_8bit)"),
    "normuon_cautious_wd": Refusal("normuon is not available (optimizer: adamw | adamw_8bit)"),
    # GRPO's train.yaml (Surogate's trainer / orchestrator / server processes): surojax rolls out in-process
    "transport_type": Refusal("surojax's GRPO samples its rollouts in the training process (surojax grpo): no "
                              "batches travel between processes"),
    "weight_broadcast_type": Refusal("surojax's GRPO samples with the weights being trained (co-located, in "
                                     "process): nothing is broadcast"),
    "max_async_level": Refusal("surojax's GRPO is synchronous: each step's rollouts come from the current weights"),
    "pad_to_multiple_of": Refusal("rows are sequence_len long", (1,)),
    "doc_masking": Refusal("packed samples never attend to each other in surojax (always on)", (True,)),
    "single_sample_bins": Refusal("one sample per row is sample_packing: false", _OFF),
    "turn_diagnostics": Refusal("the loss is one program; per-token log-probs are not exposed", _OFF),
}
DATASET_REFUSED: dict[str, Refusal] = {
    "enable_thinking_field": Refusal("the thinking prefix is the chat template's own (no per-row switch)"),
}
DISTILLATION_KEYS = {"teacher_model": "teacher", "top_k": "teacher_top_k", "temperature": "temperature"}
DISTILLATION_REFUSED = {
    "teacher_batch_size": "the teacher runs in the training step (or once with `surojax distill --precompute`)",
    "kd_dir": "surojax's sidecar is its own format: teacher_logprobs, written by `surojax distill CONFIG "
              "--precompute`",
    "teacher_api_base": "the teacher is a local model (teacher:); an OpenAI-compatible server is not read",
    "teacher_api_key_var": "the teacher is a local model (teacher:); an OpenAI-compatible server is not read",
    "teacher_api_concurrency": "the teacher is a local model (teacher:); an OpenAI-compatible server is not read",
    "teacher_api_timeout": "the teacher is a local model (teacher:); an OpenAI-compatible server is not read",
}
# `loss:` (Surogate's DPO / GRPO loss block) -> surojax key; refused keys with their no-op values
LOSS_KEYS = {"dpo_beta": "beta", "reference_free": "reference_free"}
LOSS_REFUSED: dict[str, Refusal] = {
    "length_norm": Refusal("length-normalised (SimPO-style) log-probs are not available; loss_type ipo compares "
                           "mean-token log-ratios", _OFF),
    "span_mask": Refusal("the whole response is scored", _OFF),
    "target_margin": Refusal("a target margin is not available", (0, 0.0)),
    **dict.fromkeys(("ipo_mask_low", "ipo_mask_high", "adv_tau", "teacher_tau", "kl_tau", "ratio_clip"), Refusal(
        "surojax's GRPO loss is TRL's (loss_type: dapo | grpo | dr_grpo | gspo, epsilon / epsilon_high clipping, "
        "beta for the KL)")),
}
# Keys surojax reads under Surogate's own name (schema fields): they too make a config look like Surogate's.
SUROGATE_NAMED = ("model_type", "use_cuda_graphs", "template", "use_chat_template", "truncation_strategy",
                  "max_length", "dataloader_num_workers", "run_name", "wandb_name", "aim_experiment", "aim_repo",
                  "aim_name", "qlora_bnb", "qlora_fp8", "qlora_fp4", "max_pixels", "train_vision")
DATASET_NAMED = ("system_field", "tools_field", "prompt_format", "prompt_format_no_input",
                 "message_property_mappings")
DATASET_SECTIONS = ("datasets", "validation_datasets")


@dataclasses.dataclass
class Translation:
    """What `translate` made of a mapping: the surojax mapping and its key positions, where each surojax key came
    from, the problems found (each at the user's key), and the Surogate spellings read (empty: not Surogate's)."""

    data: dict[str, Any]
    positions: Positions
    origins: dict[Loc, Loc]
    problems: list[ConfigProblem]
    spellings: list[str]
    notes: list[str]


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (True is not 1, 1 is 1.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


class _Work:
    """The mapping being translated, its positions, and what was found."""

    def __init__(self, data: Mapping[str, Any], positions: Positions | None):
        self.data = copy.deepcopy(dict(data))
        self.positions: Positions = dict(positions or {})
        self.origins: dict[Loc, Loc] = {}
        self.problems: list[ConfigProblem] = []
        self.spellings: list[str] = []
        self.notes: list[str] = []

    # -- reading
    def node(self, loc: Loc) -> Any:
        node: Any = self.data
        for part in loc:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                return _MISSING
        return node

    def where(self, loc: Loc) -> tuple[int | None, int | None]:
        for n in range(len(loc), 0, -1):
            pos = self.positions.get(loc[:n], _MISSING)
            if pos is not _MISSING:
                return pos if pos is not None else (None, None)
        return None, None

    def problem(self, loc: Loc, message: str) -> None:
        self.problems.append(ConfigProblem(format_key(loc), message, *self.where(loc)))

    def take(self, loc: Loc) -> Any:
        """Remove the key at `loc` (it must exist) and count it as a Surogate spelling."""
        *parent, key = loc
        value = self.node(tuple(parent)).pop(key)
        self.spellings.append(format_key(loc))
        return value

    # -- writing
    def put(self, source: Loc, target: Loc, value: Any, meaning: str | None = None) -> None:
        """Set `target` to `value`, read from the user's `source` key; a different value already at `target` is a
        problem at `source` (`meaning` says what the source means, default: that it is target's spelling)."""
        meaning = meaning or f"is Surogate's spelling of {format_key(target)} ({_yaml(value)})"
        node: Any = self.data
        for i, part in enumerate(target[:-1]):
            if isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
                continue
            if not isinstance(node, dict):
                self.problem(source, f"{meaning}, but {format_key(target[:i])} is not a mapping")
                return
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        if not isinstance(node, dict):
            self.problem(source, f"{meaning}, but {format_key(target[:-1])} is not a mapping")
            return
        key = target[-1]
        if key in node and not _same(node[key], value):
            by = f"{format_key(self.origins[target])}" if target in self.origins else "the config"
            self.problem(source, f"{meaning}, but {by} also sets {format_key(target)}: {_yaml(node[key])}: "
                         "keep one")
            return
        node[key] = value
        self.origins.setdefault(target, source)
        for loc, pos in list(self.positions.items()):  # the value's own positions move with it
            if loc[:len(source)] == source and loc[:len(target)] != target:
                self.positions.setdefault(target + loc[len(source):], pos)


def _yaml(value: Any) -> str:
    """A value as YAML writes it (true, null, 1e-4, text)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


_MISSING = object()


def _in(work: _Work, key: str) -> bool:
    return key in work.data


def _renames(work: _Work, prefix: Loc, node: dict, renamed: Mapping[str, str]) -> None:
    for key in [k for k in renamed if k in node]:
        source = prefix + (key,)
        value = work.take(source)
        work.put(source, tuple(renamed[key].split(".")), value)


def _refusals(work: _Work, prefix: Loc, node: dict, refused: Mapping[str, Refusal]) -> None:
    for key in [k for k in refused if k in node]:
        source = prefix + (key,)
        value = work.take(source)
        rule = refused[key]
        if not any(_same(value, off) for off in rule.off):
            work.problem(source, f"is not read by surojax: {rule.why}"
                         + (f"; remove the key (or write {' or '.join(_yaml(v) for v in rule.off)})"
                            if rule.off else "; remove the key"))


def _values(work: _Work) -> None:
    for key, table in REFUSED_VALUES.items():
        value = work.data.get(key, _MISSING)
        if isinstance(value, str) and value in table:
            work.take((key,))
            work.problem((key,), f"{value} is not read by surojax: {table[value]}")
    for key, table in VALUES.items():
        value = work.data.get(key, _MISSING)
        if value is _MISSING:
            continue
        if isinstance(value, str) and value in table:
            work.data[key] = table[value]
            work.spellings.append(f"{key}: {value}")
        elif isinstance(value, list) and any(isinstance(v, str) and v in table for v in value):
            work.spellings += [f"{key}: {v}" for v in value if isinstance(v, str) and v in table]
            work.data[key] = [table.get(v, v) if isinstance(v, str) else v for v in value]


# -- rules: keys whose reading depends on other keys ----------------------------------------------------------------

def _gpus(work: _Work) -> None:
    """gpus: N -> parallel.data = N / (the other parallel sizes); 0 (all GPUs) is surojax's data: -1."""
    if not _in(work, "gpus"):
        return
    n = work.take(("gpus",))
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        work.problem(("gpus",), f"must be a number of devices, 0 for all of them (got {n!r})")
        return
    if n == 0:
        return
    par = work.data.get("parallel") if isinstance(work.data.get("parallel"), dict) else {}
    others = {a: par[a] for a in ("fsdp", "tensor", "expert", "stage") if isinstance(par.get(a), int)}
    if any(v == -1 for v in others.values()):
        work.problem(("gpus",), f"sets the device count, but parallel {others} has a -1 (the rest of the devices): "
                     "give every size")
        return
    other = math.prod(others.values())
    if n % other:
        work.problem(("gpus",), f"{n} devices cannot hold the other parallel sizes {others} (product {other})")
        return
    work.put(("gpus",), ("parallel", "data"), n // other,
             meaning=f"{n} devices are parallel.data: {n // other} here (over the other parallel sizes)")


def _zero(work: _Work) -> None:
    """zero_level, with shard_gradients (at least 2) and shard_weights (3), -> zero_stage."""
    flags = [k for k in ("zero_level", "shard_gradients", "shard_weights") if _in(work, k)]
    if not flags:
        return
    level = work.take(("zero_level",)) if "zero_level" in flags else None
    source = ("zero_level",) if level is not None else (flags[0],)
    stage = level
    for key, implies in (("shard_gradients", 2), ("shard_weights", 3)):
        if key not in flags:
            continue
        on = work.take((key,))
        if not isinstance(on, bool):
            work.problem((key,), f"must be true or false (got {on!r})")
        elif on:
            stage = implies if stage is None or (isinstance(stage, int) and stage < implies) else stage
            source = (key,) if level is None else source
    if stage is not None:
        work.put(source, ("zero_stage",), stage, meaning=f"is zero_stage: {_yaml(stage)} here")


def _cpu_training(work: _Work) -> None:
    """cpu_training: LoRA -> the frozen base streamed from host memory, double-buffered; full fine-tuning -> master
    weights and optimizer state in host memory, updated layer by layer."""
    if not _in(work, "cpu_training"):
        return
    on = work.take(("cpu_training",))
    if not isinstance(on, bool):
        work.problem(("cpu_training",), f"must be true or false (got {on!r})")
        return
    if not on:
        return
    lora = work.data.get("lora") is True
    level = work.data.get("zero_stage") if work.origins.get(("zero_stage",)) == ("zero_level",) else None
    if not lora and _same(level, 1):
        # Surogate's cpu_training runs the whole optimizer on every rank's CPU: its zero_level 1 (the documented
        # default) shards nothing there
        work.data["zero_stage"] = 0
        work.notes.append("zero_level: 1 with cpu_training is zero_stage: 0 (Surogate's CPU optimizer is whole on "
                          "every device)")
    elif not lora and isinstance(level, int) and not isinstance(level, bool) and level > 1:
        work.problem(("cpu_training",), f"keeps a full fine-tune's optimizer whole in host memory, which excludes "
                     f"zero_level: {level} (as in Surogate); drop one of the two")
        return
    keys = ("offload_base_weights", "offload_prefetch") if lora else ("offload_master", "offload_optimizer")
    for k in keys:
        work.put(("cpu_training",), (k,), True, meaning=f"is {k}: true here")


_TORCH_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32", "float": "fp32",
                 "float16": "fp16", "fp16": "fp16", "half": "fp16", "auto": None}


def _torch_dtype(work: _Work) -> None:
    """torch_dtype: the dtype the model computes in: bfloat16 (recipes bf16 / fp8_hybrid / nvfp4) or float32
    (recipe fp32); float16 is refused (no loss scaling)."""
    if not _in(work, "torch_dtype"):
        return
    value = work.take(("torch_dtype",))
    dtype = _TORCH_DTYPES.get(str(value).lower().removeprefix("torch."), _MISSING)
    if dtype is _MISSING:
        work.problem(("torch_dtype",), f"{value!r} is not a dtype; choose one of bfloat16, float32, auto")
    elif dtype == "fp16":
        work.problem(("torch_dtype",), "float16 is not available: surojax computes in bf16 (recipe bf16, "
                     "fp8_hybrid, nvfp4) or fp32 (recipe fp32); float16 needs loss scaling, which it does not have: "
                     "use bfloat16")
    elif dtype == "fp32":
        work.put(("torch_dtype",), ("recipe",), "fp32", meaning="float32 is recipe: fp32")
    elif dtype == "bf16" and work.data.get("recipe") == "fp32":
        work.problem(("torch_dtype",), "bfloat16 contradicts recipe: fp32 (which computes in float32): keep one")


def _seeds_and_layout(work: _Work) -> None:
    if _in(work, "eval_seed"):
        seed = work.take(("eval_seed",))
        if isinstance(seed, bool) or not isinstance(seed, int):
            work.problem(("eval_seed",), f"must be an integer (got {seed!r})")
        else:
            work.notes.append("eval_seed: every validation row is evaluated, in order; the mean eval loss does not "
                              "depend on a seed")
    if _in(work, "padding_side"):
        side = work.take(("padding_side",))
        if side != "right":
            work.problem(("padding_side",), f"{side!r}: surojax pads training rows on the right (packing fills each "
                         "row from its start; each sample has its own positions, so the side changes no loss): "
                         "remove the key or write right")
    if _in(work, "padding_free"):
        free = work.take(("padding_free",))
        if not isinstance(free, bool):
            work.problem(("padding_free",), f"must be true or false (got {free!r})")
        elif free and work.data.get("sample_packing") is False:
            work.problem(("padding_free",), "padding-free rows are surojax's packing (samples back to back, never "
                         "attending to each other): it needs sample_packing: true")
    if _in(work, "noise_scheduler"):
        noise = work.take(("noise_scheduler",))
        if noise is not None and not (isinstance(noise, dict) and noise.get("enabled", False) is False):
            work.problem(("noise_scheduler",), "is not read by surojax: QeRL rollout noise is not available; remove "
                         "the block (or write enabled: false)")
    for key in NULL_IS_DEFAULT:
        if key in work.data and work.data[key] is None:
            work.take((key,))


def _system(work: _Work) -> None:
    """system: the system prompt of every dataset entry that sets none."""
    if not _in(work, "system"):
        return
    text = work.take(("system",))
    if text is None:
        return
    if not isinstance(text, str):
        work.problem(("system",), f"must be the system prompt text (got {text!r})")
        return
    for section in DATASET_SECTIONS:
        entries = work.data.get(section)
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if isinstance(entry, dict) and entry.get("system_prompt") is None:
                work.put(("system",), (section, i, "system_prompt"), text)


def _block(work: _Work, key: str) -> dict | None:
    """A Surogate block (a mapping) left in place so that its keys can be taken one by one; None when absent."""
    if key not in work.data:
        return None
    block = work.data[key]
    if block is None or not isinstance(block, dict):
        work.take((key,))
        if block is not None:
            work.problem((key,), f"must be a mapping of keys (got {block!r})")
        return None
    return block


def _leftovers(work: _Work, key: str, block: dict) -> None:
    for sub in list(block):
        work.take((key, sub))
        work.problem((key, sub), f"unknown key of Surogate's {key} block")
    work.take((key,))


def _distillation(work: _Work) -> None:
    """distillation: {teacher_model, top_k, temperature, kd_weight, ce_weight} -> trainer: distill and its keys
    (surojax's loss is alpha x KD + (1 - alpha) x CE: kd_weight is alpha, ce_weight must be 1 - kd_weight)."""
    block = _block(work, "distillation")
    if block is None:
        return
    work.put(("distillation",), ("trainer",), "distill", meaning="is trainer: distill")
    for key in [k for k in block if k in DISTILLATION_KEYS]:
        loc = ("distillation", key)
        work.put(loc, (DISTILLATION_KEYS[key],), work.take(loc))
    for key in [k for k in block if k in DISTILLATION_REFUSED]:
        work.take(("distillation", key))
        work.problem(("distillation", key), f"is not read by surojax: {DISTILLATION_REFUSED[key]}")
    kd = block.get("kd_weight", 0.5)
    if "kd_weight" in block:
        work.put(("distillation", "kd_weight"), ("alpha",), work.take(("distillation", "kd_weight")))
    if "ce_weight" in block:
        ce = work.take(("distillation", "ce_weight"))
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ce, kd))
        if not numbers or abs(ce - (1 - kd)) > 1e-9:
            work.problem(("distillation", "ce_weight"), f"the CE term's weight is 1 - alpha in surojax (alpha = "
                         f"kd_weight = {kd!r}); {ce!r} is not available")
    _leftovers(work, "distillation", block)


def _loss_block(work: _Work) -> None:
    """loss: Surogate's DPO loss block ({type: dpo, dpo_beta, reference_free, ...}); its GRPO keys are refused."""
    block = _block(work, "loss")
    if block is None:
        return
    if "type" in block:
        kind = work.take(("loss", "type"))
        if kind == "dpo":
            work.put(("loss", "type"), ("trainer",), "dpo", meaning="dpo is trainer: dpo")
        else:
            work.problem(("loss", "type"), f"{kind!r}: Surogate's loss type is dpo (surojax: trainer: dpo with "
                         "loss_type sigmoid | ipo | hinge)")
    _renames(work, ("loss",), block, LOSS_KEYS)
    _refusals(work, ("loss",), block, LOSS_REFUSED)
    _leftovers(work, "loss", block)


def _system_prompt_type(work: _Work, loc: Loc, entry: dict) -> None:
    """system_prompt_type: field + system_prompt_field -> system_field; fixed needs system_prompt."""
    kind = work.take(loc + ("system_prompt_type",)) if "system_prompt_type" in entry else None
    field = work.take(loc + ("system_prompt_field",)) if "system_prompt_field" in entry else None
    if kind == "field":
        if not field:
            work.problem(loc + ("system_prompt_type",), "field needs system_prompt_field (the column holding the "
                         "system prompt)")
        else:
            work.put(loc + ("system_prompt_field",), loc + ("system_field",), field)
    elif kind == "fixed":
        if not entry.get("system_prompt"):
            work.problem(loc + ("system_prompt_type",), "fixed needs system_prompt (the text)")
        if field is not None:
            work.problem(loc + ("system_prompt_field",), "is read with system_prompt_type: field only")
    elif kind is not None:
        work.problem(loc + ("system_prompt_type",), f"{kind!r} is not allowed; choose one of: field, fixed")
    elif field is not None:
        work.problem(loc + ("system_prompt_field",), "needs system_prompt_type: field")


def _datasets(work: _Work) -> None:
    for section in DATASET_SECTIONS:
        entries = work.data.get(section)
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, dict):
                continue
            loc = (section, i)
            _system_prompt_type(work, loc, entry)
            _refusals(work, loc, entry, DATASET_REFUSED)


def translate(data: Mapping[str, Any], positions: Positions | None = None) -> Translation:
    """Read Surogate's spellings in `data` (a config mapping, as parsed) as surojax's; see the module docstring."""
    work = _Work(data, positions)
    if isinstance(work.data.get("report_to"), list) and "aim" in work.data["report_to"] or \
            work.data.get("report_to") == "aim":
        work.spellings.append("report_to: aim")
    if isinstance(work.data.get("rope_scaling"), str):  # a type name or JSON text (run.py reads both)
        work.spellings.append("rope_scaling")
    _refusals(work, (), work.data, REFUSED)
    _zero(work)  # zero_level together with the shard_* flags
    _renames(work, (), work.data, RENAMED)
    for rule in (_gpus, _distillation, _loss_block, _cpu_training, _torch_dtype, _seeds_and_layout, _system,
                 _datasets):
        rule(work)  # _gpus after the renames: ep_size is parallel.expert by then
    _values(work)
    return Translation(work.data, work.positions, work.origins, work.problems, work.spellings, work.notes)


def named_spellings(cfg: TrainConfig) -> list[str]:
    """The keys of SUROGATE_NAMED / DATASET_NAMED that `cfg` sets away from surojax's default (a key at its
    default, as a dumped config writes it, says nothing about where the config came from)."""
    out = [k for k in SUROGATE_NAMED if k in cfg.model_fields_set and differs_from_default(cfg, k)]
    for section in DATASET_SECTIONS:
        for i, spec in enumerate(getattr(cfg, section)):
            out += [format_key((section, i, k)) for k in DATASET_NAMED if k in spec.model_fields_set
                    and differs_from_default(spec, k)]
    return out
