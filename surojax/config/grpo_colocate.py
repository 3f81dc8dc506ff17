"""Surogate's three-file GRPO form (`grpo-colocate --train T --infer I --orch O`) as surojax's one-YAML GRPO config.

train.yaml is a training config (read like any other, Surogate's spellings included) and the base of the merge.
The keys of infer.yaml (Surogate's inference server) and orch.yaml (its orchestrator) that are surojax GRPO keys
are added to it; where train.yaml sets the same surojax key, both must agree:

    orch.yaml   rollouts_per_example          num_generations
                batch_size                    samples (rows) per step: gradient_accumulation_steps x
                                              per_device_train_batch_size (the latter from train.yaml, default 1)
                sampling.max_tokens           max_completion_length
                sampling.temperature / top_p  temperature / top_p
                sequence_len, max_steps       sequence_len, max_steps
                model.name / lora_rank / lora_alpha   model / lora_rank / lora_alpha
                use_token_client: true        (surojax's rollouts are token ids already)
    infer.yaml  model                         model
                max_model_len                 must be sequence_len (prompt + completion are one training row)
                max_num_seqs                  at least the samples of a step (surojax samples them all at once)
                max_lora_rank                 at least lora_rank
                backend: surogate, enable_lora: true (with lora), tp / dp: 1, kv_cache_dtype: auto
                                              (what surojax's co-located engine does)

Every other key describes Surogate's separate server and orchestrator (port, host, output_dir, env, lora_adapter,
weight_broadcast_type, ...) and is refused, naming why: surojax samples its rollouts in the training process, from
prompts in `datasets` (type: prompt) scored by `reward_functions`, written in train.yaml. The merged mapping is
`surojax grpo`'s config (the CLI writes it to <output_dir>/grpo_colocate.yaml and runs it).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from surojax.config.errors import ConfigProblem, format_key
from surojax.config.explain import Loc, Positions

COLOCATED = "surojax samples its rollouts in the training process (no server, no orchestrator)"
INFER_OK = {"backend": ("surogate",), "tp": (1,), "dp": (1,), "kv_cache_dtype": (None, "auto")}
INFER_REFUSED = {
    "port": COLOCATED, "host": COLOCATED, "gpu_memory_utilization": "the co-located engine's KV pool is sized for "
    "one generation batch (surojax/train/grpo_rollout.py)", "weight_broadcast_type": COLOCATED + ": the engine "
    "samples with the weights being trained",
}
ORCH_REFUSED = {
    "env": "environments are not available: surojax's GRPO reads prompts from datasets (type: prompt) and scores "
           "them with reward_functions, both in train.yaml",
    "output_dir": COLOCATED + ": the run writes train.yaml's output_dir only",
    "lora_adapter": COLOCATED + ": the adapter being trained is the one sampled (no adapter name to serve)",
}


@dataclasses.dataclass
class Merged:
    """The one-YAML config mapping, and each file's problems (file role -> problems; none: it merged)."""

    data: dict[str, Any]
    problems: dict[str, list[ConfigProblem]]

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())


class _File:
    def __init__(self, role: str, data: Any, positions: Positions | None):
        self.role, self.positions = role, positions or {}
        self.data = copy.deepcopy(data) if isinstance(data, dict) else {}
        self.problems: list[ConfigProblem] = []
        if data is not None and not isinstance(data, dict):
            self.problem((), f"the top level must be a mapping of keys (got {type(data).__name__})")

    def problem(self, loc: Loc, message: str) -> None:
        line, col = self.positions.get(loc) or (None, None)
        self.problems.append(ConfigProblem(format_key(loc), message, line, col))


def _agree(out: dict, key: str, value: Any, f: _File, loc: Loc) -> None:
    """Set train's `key` from another file's `loc`, or check that train.yaml's own value is the same."""
    if key in out and out[key] != value:
        f.problem(loc, f"{value!r} disagrees with train.yaml's {key}: {out[key]!r} (they are one key in surojax)")
    else:
        out[key] = value


def _pop(f: _File, *loc: str) -> Any:
    node = f.data
    for part in loc[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return node.pop(loc[-1], _MISSING) if isinstance(node, dict) else _MISSING


_MISSING = object()


def merge_colocate(train: Any, infer: Any, orch: Any, positions: dict[str, Positions | None] | None = None) -> Merged:
    """Merge the three parsed files (see the module docstring); `positions` per role (train / infer / orch)."""
    positions = positions or {}
    t, i, o = (_File(role, data, positions.get(role)) for role, data in
               (("train", train), ("infer", infer), ("orch", orch)))
    out = copy.deepcopy(t.data)
    if out.get("trainer", "grpo") != "grpo":
        t.problem(("trainer",), f"{out['trainer']!r}: grpo-colocate runs trainer: grpo")
    out["trainer"] = "grpo"
    _orch(o, out)
    _infer(i, out)
    return Merged(out, {"train": t.problems, "infer": i.problems, "orch": o.problems})


def _orch(o: _File, out: dict) -> None:
    model = _pop(o, "model")
    if model is not _MISSING:
        if not isinstance(model, dict):
            o.problem(("model",), f"must be a mapping (name, lora_rank, lora_alpha), got {model!r}")
        else:
            for key, target in (("name", "model"), ("lora_rank", "lora_rank"), ("lora_alpha", "lora_alpha")):
                if key in model:
                    _agree(out, target, model.pop(key), o, ("model", key))
            if "lora_adapter" in model:
                model.pop("lora_adapter")
                o.problem(("model", "lora_adapter"), f"is not read: {ORCH_REFUSED['lora_adapter']}")
            for key in model:
                o.problem(("model", key), "is not read by surojax (model: name, lora_rank, lora_alpha)")
    for key, target in (("rollouts_per_example", "num_generations"), ("sequence_len", "sequence_len"),
                        ("max_steps", "max_steps")):
        value = _pop(o, key)
        if value is not _MISSING:
            _agree(out, target, value, o, (key,))
    sampling = _pop(o, "sampling")
    if isinstance(sampling, dict):
        for key, target in (("max_tokens", "max_completion_length"), ("temperature", "temperature"),
                            ("top_p", "top_p")):
            if key in sampling:
                _agree(out, target, sampling.pop(key), o, ("sampling", key))
        for key in sampling:
            o.problem(("sampling", key), "is not read by surojax (sampling: max_tokens, temperature, top_p)")
    elif sampling is not _MISSING:
        o.problem(("sampling",), f"must be a mapping (max_tokens, temperature, top_p), got {sampling!r}")
    batch = _pop(o, "batch_size")
    if batch is not _MISSING:
        _rows_per_step(o, out, batch)
    client = _pop(o, "use_token_client")
    if client is not _MISSING and client is not True:
        o.problem(("use_token_client",), "surojax's rollouts are token ids (true); text round trips are not used")
    for key, why in ORCH_REFUSED.items():
        if _pop(o, key) is not _MISSING:
            o.problem((key,), f"is not read: {why}")
    for key in o.data:
        o.problem((key,), "is not read by surojax's GRPO (the keys that map: docs/surogate_compat.md, GRPO)")


def _rows_per_step(o: _File, out: dict, batch: Any) -> None:
    """batch_size (samples a step) -> gradient_accumulation_steps over train.yaml's per_device_train_batch_size."""
    per_device = out.get("per_device_train_batch_size", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        o.problem(("batch_size",), f"must be a positive number of samples (got {batch!r})")
    elif not isinstance(per_device, int) or batch % per_device:
        o.problem(("batch_size",), f"{batch} samples a step are not a multiple of train.yaml's "
                  f"per_device_train_batch_size ({per_device!r})")
    else:
        accumulation = out.get("gradient_accumulation_steps")
        if accumulation is not None and accumulation * per_device != batch:
            o.problem(("batch_size",), f"{batch} samples a step, but train.yaml's per_device_train_batch_size x "
                      f"gradient_accumulation_steps is {per_device} x {accumulation}")
        out["gradient_accumulation_steps"] = batch // per_device


def _infer(i: _File, out: dict) -> None:
    model = _pop(i, "model")
    if model is not _MISSING:
        _agree(out, "model", model, i, ("model",))
    for key, ok in INFER_OK.items():
        value = _pop(i, key)
        if value is not _MISSING and value not in ok:
            i.problem((key,), f"{value!r}: surojax's co-located engine is {ok[0]!r} here ({COLOCATED})")
    lora = _pop(i, "enable_lora")
    if lora is not _MISSING and lora is not bool(out.get("lora")):
        i.problem(("enable_lora",), f"{lora!r} disagrees with train.yaml's lora: {out.get('lora', False)!r} (the "
                  "engine samples the model being trained)")
    length = _pop(i, "max_model_len")
    if length is not _MISSING and length != out.get("sequence_len", length):
        i.problem(("max_model_len",), f"{length!r}: surojax's rollouts hold prompt + completion in one training row "
                  f"of sequence_len ({out.get('sequence_len')!r}): set them equal")
    seqs = _pop(i, "max_num_seqs")
    rows = out.get("per_device_train_batch_size", 1) * out.get("gradient_accumulation_steps", 1)
    if seqs is not _MISSING and (not isinstance(seqs, int) or seqs < rows):
        i.problem(("max_num_seqs",), f"{seqs!r}: surojax samples the {rows} samples of a step at once")
    rank = _pop(i, "max_lora_rank")
    if rank is not _MISSING and (not isinstance(rank, int) or rank < out.get("lora_rank", 16)):
        i.problem(("max_lora_rank",), f"{rank!r} is below lora_rank ({out.get('lora_rank', 16)})")
    for key, why in INFER_REFUSED.items():
        if _pop(i, key) is not _MISSING:
            i.problem((key,), f"is not read: {why}")
    for key in i.data:
        i.problem((key,), "is not read by surojax's co-located engine (the keys that map: docs/surogate_compat.md, "
                  "GRPO)")
