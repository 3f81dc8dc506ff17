"""LoRA as a transform on a built `Decoder`: targeted `Linear`s inside `model.layers` become `LoRALinear`s.

    y = base(x) + ((dropout(x) @ A) * scaling) @ B       A [L, in, R], B [L, R, out]; per layer A [in, R], B [R, out]
    scaling = alpha / R,  or alpha / sqrt(R) with rsLoRA (use_rslora)

A MoE model's expert projections (`ExpertLinear`, kernel [L, E, in, out]) become `LoRAExpertLinear`s: one adapter
per expert, A [L, E, in, R], B [L, E, R, out], applied to the rows sorted by expert with the same grouped GEMM as
the base (x @ A[e] * scaling, then @ B[e]). Target names (`resolve_targets`): on a dense model the seven HF
module names; on a MoE model q/k/v/o_proj, and for the experts `gate_up_proj` (or `gate_proj` + `up_proj`
together: the experts' gate and up are one fused weight, in transformers 5 and PEFT too), `down_proj`, or
`experts` (both), and with a shared expert (qwen2_moe) `shared_expert` or its projections one by one
(`shared_expert.gate_proj` ..., plain LoRALinears); "all-linear" is every one the model has. Internally the
expert targets are called `experts.gate_up_proj` / `experts.down_proj` (registry.EXPERT_MODULES). PEFT refuses
dropout on expert adapters (its ParamWrapper), so do we.

Init as PEFT does: A ~ kaiming-uniform(a=sqrt(5)) of the torch [R, in] matrix, i.e. U(-1/sqrt(in), 1/sqrt(in));
B = 0, so a fresh adapter leaves the model's output exactly unchanged. The rank-R product is formed first
(x @ A is [..., R]) and scaled there, where it is cheapest, then projected up by B.

Variable types (the trainer selects by type, never by name):
    adapters      `nnx.LoRAParam` (flax's own subclass of `nnx.Param`): lora_a ('layers', in_axis, None),
                  lora_b ('layers', None, out_axis)
    frozen base   plain `nnx.Param` (the original Linear, kept as `LoRALinear.base`)
    dropout key   `LoRADropoutKey` (an `nnx.Variable`, not a Param): per-layer key data [L, ...]

so `nnx.state(model, TRAINABLE)` / `nnx.DiffState(0, TRAINABLE)` / `nnx.Optimizer(..., wrt=TRAINABLE)` pick
exactly the adapter, `nnx.state(model, FROZEN)` the base weights, and `nnx.state(model, nnx.Param)` — because
LoRAParam is a Param — every weight of the model, adapter included. Only one adapter is trainable at a time:
a previous one is folded into the base (`merge_lora`, adapter_init_mode: merge) or continued
(adapter_init_mode: trainable); see surojax.peft.stacked.

The vision tower's Linears take the same LoRALinear, unstacked (A [in, R], B [R, out]; surojax.peft.vision_lora):
`vision_lora_modules` lists them; merge_lora, adapters_disabled and set_dropout_key cover them too.

Dropout runs on the adapter's input only, and only when the module is in training mode (`deterministic`
False: `model.train()`, or `nnx.view(model, deterministic=False)`); `apply_lora` leaves it in eval mode. The
decoder runs the layers under `lax.scan` and drops whatever state the body changes, so a self-advancing
rng stream cannot live in the layers: each LoRALinear holds a per-layer key ([L] on the scanned axis) and the
training step calls `set_dropout_key(model, step_key)` before the forward pass, inside the jitted step.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.layers.linear import dot
from surojax.models.layers.moe import ExpertLinear, gathered_dot, grouped_dot
from surojax.models.layers.params import AXES, logical_axes
from surojax.models.registry import EXPERT_MODULES, stack_layers
from surojax.models.targets import (  # noqa: F401 - the target names, re-exported where LoRA users look for them
    ATTENTION_TARGETS, EXPERT_TARGETS, HYBRID_TARGETS, LORA_TARGETS, MOE_TARGETS, SHARED_EXPERT_TARGETS, TARGET_PATHS,
    base_linear, is_moe,
    model_targets, module_at, replace_module, resolve_model_targets, resolve_targets, site, site_key, site_stack,
    target_name,
)

TRAINABLE = nnx.LoRAParam
FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


TOWER_STREAM = 2**31 - 1  # set_dropout_key's stream for the vision tower's adapters


class LoRADropoutKey(nnx.Variable):
    """Raw PRNG key data [L, *key_shape] for LoRA dropout (one key per layer); set by `set_dropout_key`."""


def lora_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRALinear(nnx.Module):
    """A frozen `base` Linear plus a low-rank update. Inside the scanned decoder it sees one layer's slice."""

    def __init__(self, base: nnx.Module, lora_a: nnx.LoRAParam, lora_b: nnx.LoRAParam, *, rank: int,
                 alpha: float, use_rslora: bool = False, dropout: float = 0.0,
                 dropout_key: LoRADropoutKey | None = None):
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {dropout}")
        if dropout > 0.0 and dropout_key is None:
            raise ValueError("lora dropout > 0 needs a dropout_key variable")
        self.base = base
        self.lora_a = lora_a  # [L, in, R]
        self.lora_b = lora_b  # [L, R, out]
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.dropout = dropout
        self.dropout_key = dropout_key if dropout > 0.0 else None
        self.deterministic = True  # eval mode until model.train()
        self.enabled = True  # False: the base output alone (adapters_disabled)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        y = self.base(x)
        if not self.enabled:
            return y
        if self.dropout > 0.0 and not self.deterministic:
            key = jax.random.wrap_key_data(self.dropout_key[...])
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x)).astype(x.dtype)
        h = dot(x, self.lora_a[...]) * self.scaling  # [..., R]
        return y + dot(h, self.lora_b[...])  # [..., out]


class LoRAExpertLinear(nnx.Module):
    """A frozen `base` ExpertLinear plus one low-rank update per expert; the same call as ExpertLinear:
    x [A, in] (rows sorted by expert), group_sizes [E], row_expert [A] -> [A, out]. Rows past sum(group_sizes)
    (dropped by a capacity) get no update, as they get no base output. Per layer: A [E, in, R], B [E, R, out]."""

    dropout = 0.0
    dropout_key = None  # PEFT's ParamWrapper has no dropout on expert adapters; neither do we

    def __init__(self, base: ExpertLinear, lora_a: nnx.LoRAParam, lora_b: nnx.LoRAParam, *, rank: int,
                 alpha: float, use_rslora: bool = False):
        self.base = base
        self.lora_a = lora_a  # [L, E, in, R]
        self.lora_b = lora_b  # [L, E, R, out]
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.enabled = True  # False: the base output alone (adapters_disabled)

    def __call__(self, x: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        y = self.base(x, group_sizes, row_expert)  # [A, out]
        if not self.enabled:
            return y
        h = grouped_dot(x, self.lora_a[...], group_sizes) * self.scaling  # [A, R]
        return y + grouped_dot(h.astype(x.dtype), self.lora_b[...], group_sizes)  # [A, out]

    def gathered(self, x: jax.Array, expert_ids: jax.Array) -> jax.Array:
        """The few-rows form (ExpertLinear.gathered): x [A, in] in any order, expert_ids [A] -> [A, out]."""
        y = self.base.gathered(x, expert_ids)  # [A, out]
        if not self.enabled:
            return y
        h = gathered_dot(x, self.lora_a[...], expert_ids) * self.scaling  # [A, R]
        return y + gathered_dot(h.astype(x.dtype), self.lora_b[...], expert_ids)  # [A, out]


# ---- the adapters of a model ---------------------------------------------------------------------------

def lora_modules(model) -> dict[str, LoRALinear | LoRAExpertLinear]:
    """Target site key (the target name on a one-stack model; models/targets.py) -> the LoRALinear /
    LoRAExpertLinear that replaced it (only the targets that carry an adapter)."""
    out = {}
    for name in model_targets(model):
        mod = module_at(*site(model, name))
        if isinstance(mod, (LoRALinear, LoRAExpertLinear)):
            out[name] = mod
    return out


def vision_lora_modules(model) -> dict[str, LoRALinear]:
    """The vision tower's adapters (surojax.peft.vision_lora): its module path (`blocks.0.attn.qkv`) -> the
    LoRALinear there; {} without a tower or without adapters on it."""
    tower = getattr(model, "visual", None)
    if tower is None:
        return {}
    return {".".join(str(p) for p in path): m for path, m in nnx.iter_modules(tower) if isinstance(m, LoRALinear)}


def tower_parent(tower, path: str):
    """(the module holding the tower module at `path`, its attribute name there): `blocks.0.attn.qkv` ->
    (tower.blocks[0].attn, "qkv")."""
    *parents, leaf = path.split(".")
    node = tower
    for p in parents:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node, leaf


# ---- apply / merge ------------------------------------------------------------------------------------------

def apply_lora(model, *, targets: str | Sequence[str] = LORA_TARGETS, rank: int, alpha: float,
               dropout: float = 0.0, use_rslora: bool = False, rngs: nnx.Rngs, dtype=jnp.float32):
    """Wrap each targeted Linear of the layer stacks in a LoRALinear, each targeted ExpertLinear of a MoE model in a
    LoRAExpertLinear (in place; returns the model). Target names: see `resolve_targets`; on a hybrid a name
    applies in every stack that has it (its MLP projections in both, models/targets.py's sites).

    dtype: storage dtype of A and B (fp32 master weights by default, whatever the base's dtype).
    """
    targets = resolve_model_targets(model, targets)
    if rank <= 0:
        raise ValueError(f"lora rank must be positive, got {rank}")
    existing = lora_modules(model)
    if existing:
        raise ValueError(f"the model already has LoRA adapters on {', '.join(existing)}: fold them into the base "
                         "first (merge_lora) or continue them (load_adapter_into(..., trainable=True))")
    experts = [t for t in targets if target_name(t) in EXPERT_MODULES]  # site keys (a hybrid: in both stacks)
    if experts and dropout > 0.0:
        raise ValueError(f"lora_dropout {dropout} cannot apply to the expert adapters ({', '.join(experts)}): PEFT "
                         "does not support dropout there either (its ParamWrapper); set lora_dropout: 0")
    for name in experts:
        root, path = site(model, name)
        L = len(stack_layers(model.cfg, site_stack(name)))
        replace_module(root, path, _expert_adapter(module_at(root, path), L, model.cfg.moe.num_experts, rank, alpha,
                                                   use_rslora, rngs, dtype))
    for name in (t for t in targets if t not in experts):
        root, path = site(model, name)
        L = len(stack_layers(model.cfg, site_stack(name)))
        base = module_at(root, path)
        d_in, d_out = base.in_features, base.out_features
        kernel_axes = logical_axes(base.kernel) if isinstance(base.kernel, nnx.Variable) else ("layers", None, None)
        _, in_axis, out_axis = kernel_axes
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)) on torch's [R, in]: gain*sqrt(3/fan_in)
        a = jax.random.uniform(rngs.params(), (L, d_in, rank), jnp.float32, -bound, bound).astype(dtype)
        lora_a = nnx.LoRAParam(a, **{AXES: ("layers", in_axis, None)})
        lora_b = nnx.LoRAParam(jnp.zeros((L, rank, d_out), dtype), **{AXES: ("layers", None, out_axis)})
        key = None
        if dropout > 0.0:
            data = jax.random.key_data(jax.random.split(rngs.params(), L))  # [L, *key_shape]
            key = LoRADropoutKey(data, **{AXES: ("layers",) + (None,) * (data.ndim - 1)})
        replace_module(root, path,
                       LoRALinear(base, lora_a, lora_b, rank=rank, alpha=alpha, use_rslora=use_rslora,
                                  dropout=dropout, dropout_key=key))
    return model


def _expert_adapter(base: ExpertLinear, L: int, E: int, rank: int, alpha: float, use_rslora: bool, rngs: nnx.Rngs,
                    dtype) -> LoRAExpertLinear:
    """A fresh per-expert adapter for `base` (kernel [L, E, in, out]): A as PEFT inits its Linear(in, R*E), B = 0."""
    d_in, d_out = base.in_features, base.out_features
    _, _, in_axis, out_axis = logical_axes(base.kernel)
    bound = 1.0 / math.sqrt(d_in)
    a = jax.random.uniform(rngs.params(), (L, E, d_in, rank), jnp.float32, -bound, bound).astype(dtype)
    lora_a = nnx.LoRAParam(a, **{AXES: ("layers", "experts", in_axis, None)})
    lora_b = nnx.LoRAParam(jnp.zeros((L, E, rank, d_out), dtype), **{AXES: ("layers", "experts", None, out_axis)})
    return LoRAExpertLinear(base, lora_a, lora_b, rank=rank, alpha=alpha, use_rslora=use_rslora)


def fold_into(linear: nnx.Module, a: jax.Array, b: jax.Array, scaling: float) -> None:
    """kernel [L, in, out] += scaling * A [L, in, R] @ B [L, R, out] (an ExpertLinear: [L, E, in, out] += A [L, E, in,
    R] @ B [L, E, R, out]), computed in fp32, stored in the kernel's dtype."""
    kernel = linear.kernel
    if not isinstance(kernel, nnx.Variable) or hasattr(kernel.get_value(), "dequantize"):
        raise ValueError("cannot fold a LoRA adapter into a quantized base weight; merge into the unquantized "
                         "model, then quantize")
    w = kernel.get_value()
    delta = jnp.einsum("...ir,...ro->...io", jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    kernel.set_value((w.astype(jnp.float32) + scaling * delta).astype(w.dtype))


def merge_lora(model):
    """Fold every adapter into its base kernel and put the plain Linear back (in place; returns the model).

    The result has the structure of a freshly loaded base (same graphdef, only nnx.Param), so `save_model`
    and `hf_tensors` work on it.
    """
    for name, mod in lora_modules(model).items():
        fold_into(mod.base, mod.lora_a.get_value(), mod.lora_b.get_value(), mod.scaling)
        replace_module(*site(model, name), mod.base)
    for path, mod in vision_lora_modules(model).items():  # the tower's (train_vision with LoRA)
        fold_into(mod.base, mod.lora_a.get_value(), mod.lora_b.get_value(), mod.scaling)
        parent, leaf = tower_parent(model.visual, path)
        setattr(parent, leaf, mod.base)
    return model


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside the block every LoRA module of `model` returns its base output alone: the model without its adapter
    (DPO's reference for LoRA / QLoRA, with no second copy of the weights). A Python-level switch read at trace
    time, so a forward pass traced inside the block is the base model's; restored on exit."""
    mods = [*lora_modules(model).values(), *vision_lora_modules(model).values()]
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


# ---- dropout ------------------------------------------------------------------------------------------------

def set_dropout_key(model, key: jax.Array) -> None:
    """Give every LoRA dropout a fresh key derived from `key` (distinct per module and per layer).

    Call it inside the training step, once per micro-batch (e.g. with fold_in(step_rng, micro_index)), before
    the forward pass. A no-op when no adapter uses dropout.
    """
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    for i, (_, mod) in enumerate(sorted(lora_modules(model).items())):
        if mod.dropout_key is not None:
            n = mod.dropout_key.get_value().shape[0]
            mod.dropout_key.set_value(jax.random.key_data(jax.random.split(jax.random.fold_in(key, i), n)))
    tower = jax.random.fold_in(key, TOWER_STREAM)  # the tower's adapters: one key each (its blocks are not scanned)
    for i, (_, mod) in enumerate(sorted(vision_lora_modules(model).items())):
        if mod.dropout_key is not None:
            mod.dropout_key.set_value(jax.random.key_data(jax.random.fold_in(tower, i)))
