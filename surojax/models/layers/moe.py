"""Mixture-of-experts feed-forward: a router picks k of E experts per token, dropless grouped GEMMs run them.

    x [B, T, D] -> tokens X = B*T rows -> router logits [X, E] (fp32) -> k experts per token (ids, weights [X, k])
    assignments A = X*k, sorted by expert (stable) -> one grouped GEMM per projection, each expert's rows against
    its own weight: gate_up [E, D, 2F], activation, down [E, F, D]  -> back to assignment order
    -> each token's k outputs summed with its routing weights -> y [B, T, D]
    (+ sigmoid(x @ shared_expert_gate [D, 1]) * shared_expert(x), with a shared expert: a SwiGLU MLP every token runs)

Few rows (a decode step: X * k assignments small against E, `expert_path`) take the gathered form instead:

    assignments A = X*k in token order -> each one's expert weights gathered (gate_up [A, D, 2F], down [A, F, D];
    a quantised expert's packed blocks and scales, dequantised after the gather) -> row-by-row products
    -> the same activation, weighted sum and stats

so only the routed experts' bytes cross HBM (the grouped GEMM reads all E experts' weights for a handful of
rows). Same math and dtype rules (pallas_kernels.grouped_matmul.gathered); chosen by static shapes only, so a
jitted decode step compiles one form. It has no capacity: it runs where no expert could overflow one.

Dropless by default: every assignment is computed, whatever the load (no capacity, no padding to a capacity,
no token dropped). `capacity_factor` (optional) caps each expert at ceil(factor * A / E) assignments per call;
those past the cap (in token order) get no expert output and are counted in the stats as dropped.

The gradient through the routing is the exact one: the sort, gathers and grouped GEMMs are differentiable
permutations and matmuls, and the router receives its gradient through the routing weights (top-k selection is
piecewise constant), as in the dense one-hot formulation tests/models/test_moe.py checks against.

Each call also returns `RouterStats` (sums over the call's real tokens, segment id != 0): per-expert assignment
counts and router-probability sums (the load-balancing loss needs both, summed over layers, see
surojax.losses.router), the router z-loss and entropy sums, the dropped-assignment count. They are tiny.

A shared expert (MoEConfig.shared_expert_intermediate_size > 0; qwen2_moe, qwen3_5_moe) is not routed: it runs on
every token beside the routed experts, after them and outside any `runner` (expert parallelism splits the routed
experts only; the shared one is an ordinary replicated / tensor-sharded MLP), and the stats do not see it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.grouped_matmul import gathered_dot
from pallas_kernels.grouped_matmul import grouped_dot as kernel_grouped_dot
from surojax.kernel_settings import MoeDecode, kernel_settings
from surojax.models.config import MoEConfig
from surojax.models.layers.linear import Linear, dot
from surojax.models.layers.mlp import MLP
from surojax.models.layers.norm import rms_norm_unscaled
from surojax.models.layers.params import param


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """One MoE call's router statistics over its real tokens (fp32; under the layer scan each gains [L])."""

    expert_counts: jax.Array  # [E] assignments routed to each expert (k per token)
    prob_sums: jax.Array  # [E] router softmax probabilities summed over tokens
    z_sum: jax.Array  # [] sum over tokens of logsumexp(logits)^2 (the router z-loss numerator)
    entropy_sum: jax.Array  # [] sum over tokens of the router distribution's entropy (nats)
    dropped: jax.Array  # [] assignments past an expert's capacity (0 without a capacity)
    tokens: jax.Array  # [] real tokens seen


def grouped_dot(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """x [A, I] (rows sorted by group) @ w [E, I, O] per group -> [A, O] in x's dtype; rows past
    sum(group_sizes) give 0. A quantised weight (any pytree with `grouped_matmul`) runs its own path; a plain one
    the Pallas grouped GEMM on a GPU, jax.lax.ragged_dot elsewhere (pallas_kernels.grouped_matmul.grouped_dot)."""
    if hasattr(w, "grouped_matmul"):
        return w.grouped_matmul(x, group_sizes)
    return kernel_grouped_dot(x, w, group_sizes)


class ExpertLinear(nnx.Module):
    """E stacked linears: kernel [E, in, out] (`x @ W`-ready), optional bias [E, out]. Called on assignment rows
    sorted by expert: x [A, in], group_sizes [E], row_expert [A] (each row's expert, for the bias)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, axes: tuple[str, str], *,
                 use_bias: bool = False, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = param(rngs, (num_experts, in_features, out_features), ("experts",) + axes, param_dtype)
        self.bias = (param(rngs, (num_experts, out_features), ("experts", axes[1]), param_dtype, init="zeros")
                     if use_bias else None)

    def __call__(self, x: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        y = grouped_dot(x, self.kernel[...], group_sizes)  # [A, out]
        if self.bias is not None:
            # a dropped row (expert id E, past the groups) gets no bias: its output stays 0
            y = y + jnp.take(self.bias[...], row_expert, axis=0, mode="fill", fill_value=0).astype(y.dtype)
        return y

    def gathered(self, x: jax.Array, expert_ids: jax.Array) -> jax.Array:
        """The few-rows form: x [A, in] in any order, expert_ids [A] (each row's expert) -> [A, out], row a
        against expert_ids[a]'s kernel (gathered, quantised blocks included: only those experts' bytes are read;
        or a served layer stack read in place by the gathered GEMV kernels: surojax.quant.expert_stack for plain
        experts, surojax.quant.expert_layout for quantised ones) and bias; the same values as __call__ on the rows
        sorted by expert. The kernel setting moe_gather_kernel picks the kernel or XLA."""
        w, mode = self.kernel[...], kernel_settings().moe_gather_kernel.value
        if getattr(w, "experts_in_place", False):  # the stack and this layer's index, read in place
            y = w.gathered(x, expert_ids, mode)
        else:
            y = gathered_dot(x, w, expert_ids, kernel=mode)
        if self.bias is not None:
            y = y + jnp.take(self.bias[...], expert_ids, axis=0).astype(y.dtype)
        return y


class Router(nnx.Module):
    """logits = x @ kernel [D, E] (+ bias [E]), computed and returned in fp32. Gemma 4 (`router_input_norm`): x is
    first RMS-normalised without a weight, times `scale` [D] and D^-0.5. Its routing parameters beside the logits
    (`route`): lfm2_moe's `selection_bias` [E], Gemma 4's `per_expert_scale` [E]."""

    def __init__(self, dim: int, moe: MoEConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        E = moe.num_experts
        self.kernel = param(rngs, (dim, E), ("embed", None), param_dtype)
        self.bias = param(rngs, (E,), (None,), param_dtype, init="zeros") if moe.router_bias else None
        self.input_norm_eps = moe.router_input_norm
        self.scale = param(rngs, (dim,), ("embed",), param_dtype, init="ones") \
            if moe.router_input_norm is not None else None
        self.selection_bias = param(rngs, (E,), (None,), param_dtype, init="zeros") if moe.selection_bias else None
        self.per_expert_scale = param(rngs, (E,), (None,), param_dtype, init="ones") if moe.per_expert_scale else None

    def __call__(self, x: jax.Array) -> jax.Array:  # [X, D] -> [X, E] fp32
        if self.scale is not None:  # Gemma 4: RMSNorm without a weight, then scale [D] * D^-0.5
            D = x.shape[-1]
            x = rms_norm_unscaled(x, self.input_norm_eps) * self.scale[...].astype(x.dtype) \
                * jnp.asarray(D ** -0.5, x.dtype)
        logits = dot(x, self.kernel[...]).astype(jnp.float32)
        if self.bias is not None:
            logits = logits + self.bias[...].astype(jnp.float32)
        return logits

    def route(self, logits: jax.Array, moe: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`route` with this router's selection bias and per-expert scales."""
        return route(logits, moe, selection_bias=None if self.selection_bias is None else self.selection_bias[...],
                     per_expert_scale=None if self.per_expert_scale is None else self.per_expert_scale[...])


def route(logits: jax.Array, moe: MoEConfig, *, selection_bias: jax.Array | None = None,
          per_expert_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [X, E] fp32 -> (weights [X, k] fp32, expert ids [X, k] int32, softmax probabilities [X, E]).

    The probabilities are the softmax of the logits whatever the router (the load-balancing and z losses and the
    stats read them); the weights are the router's own (MoEConfig.router): softmax_topk the k largest
    probabilities, topk_softmax a softmax over the k largest logits, sigmoid_topk the sigmoid scores of the k
    experts with the largest score + `selection_bias` [E]; then renormalised (norm_topk_prob), times
    routed_scaling_factor, times `per_expert_scale` [E] of each chosen expert."""
    probs = jax.nn.softmax(logits, axis=-1)
    k = moe.experts_per_token
    if moe.router == "topk_softmax":
        top_logits, ids = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top_logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits) if moe.router == "sigmoid_topk" else probs
        if selection_bias is None:
            weights, ids = jax.lax.top_k(scores, k)
        else:
            _, ids = jax.lax.top_k(scores + selection_bias.astype(jnp.float32), k)
            weights = jnp.take_along_axis(scores, ids, axis=-1)
        if moe.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + moe.norm_topk_eps)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * jnp.float32(moe.routed_scaling_factor)
    if per_expert_scale is not None:
        weights = weights * jnp.take(per_expert_scale.astype(jnp.float32), ids)
    return weights, ids.astype(jnp.int32), probs


def expert_activation(h: jax.Array, moe: MoEConfig) -> jax.Array:
    """gate_up output h [A, 2F] -> [A, F]."""
    if moe.activation == "swiglu_clamped":  # gpt_oss: gate / up interleaved
        gate, up = h[..., ::2], h[..., 1::2]
        gate = jnp.minimum(gate, moe.swiglu_limit)
        up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * moe.swiglu_alpha))
    gate, up = jnp.split(h, 2, axis=-1)
    if moe.activation == "geglu":  # Gemma 4: tanh-approximated GELU, in the input dtype as torch computes it
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


# The gather path reads A = X * k expert matrices (one per assignment, an expert routed twice read twice) where the
# grouped GEMM reads all E, but it writes the gathered copy before the products read it again (unless XLA fuses
# the gather into them): ~3 A matrices of traffic against E. `auto` gathers while A <= E * GATHER_CROSSOVER:
# one user on Qwen3-30B-A3B (A = 8, E = 128) up to 8 users (A = 64); Mixtral (E = 8, k = 2) one user. Quantised
# experts: the grouped GEMM dequantises all E first, so the gather wins longer (Qwen3-30B-A3B Q4_K on an H100,
# session 21: 664 against 1,320 us a layer at 16 rows, 1,280 against 1,330 at 32, 2,580 against 1,440 at 64):
# A <= E * GATHER_CROSSOVER_QUANTISED. Prefill and training (thousands of rows) keep the grouped GEMM.
# benchmarks/moe_decode.py measures the crossover.
GATHER_CROSSOVER = 0.5
GATHER_CROSSOVER_QUANTISED = 2.0


def expert_path(num_assignments: int, num_experts: int, capacity: int | None, quantised: bool = False) -> MoeDecode:
    """How a MoE call of `num_assignments` (X * k, static) runs its experts: GATHER or GROUPED, by the kernel
    setting `moe_decode` (surojax/kernel_settings.py): auto = GATHER while num_assignments <= num_experts *
    GATHER_CROSSOVER (GATHER_CROSSOVER_QUANTISED for quantised experts). The gather has no capacity: it runs only
    where no expert can overflow one (capacity None or >= num_assignments); forcing it where one could is a
    ValueError, as it would change which rows are dropped."""
    setting = kernel_settings().moe_decode
    no_drops = capacity is None or capacity >= num_assignments
    if setting is MoeDecode.GATHER:
        if not no_drops:
            raise ValueError(f"SUROJAX_MOE_DECODE=gather: this MoE call has an expert capacity ({capacity} of "
                             f"{num_assignments} assignments), which only the grouped path applies")
        return MoeDecode.GATHER
    crossover = GATHER_CROSSOVER_QUANTISED if quantised else GATHER_CROSSOVER
    if setting is MoeDecode.AUTO and no_drops and num_assignments <= num_experts * crossover:
        return MoeDecode.GATHER
    return MoeDecode.GROUPED


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Assignments sorted by expert: `order` [A] (assignment index a = token * k + slot, in expert order) and
    its inverse `inverse` [A] (where each assignment sits in that order), `group_sizes` [E] (rows per expert
    that are computed), `row_expert` [A] (each sorted row's expert; E for a dropped row, which sits past
    sum(group_sizes)), `kept` [A] (in assignment order)."""

    order: jax.Array
    group_sizes: jax.Array
    row_expert: jax.Array
    kept: jax.Array
    inverse: jax.Array


def _inverse(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


# The two permutations of a MoE call as gathers in both directions: the transpose of a gather is a scatter-add
# (atomics on a GPU, duplicates assumed); a permutation's transpose is the gather by its inverse.
@jax.custom_vjp
def gather_token_rows(xs: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """xs [X, D] -> [A, D]: row i is the token of assignment order[i] (token = assignment // k, A = X * k)."""
    return jnp.take(xs, order // (order.shape[0] // xs.shape[0]), axis=0)


def _gather_fwd(xs, order, inverse):
    return gather_token_rows(xs, order, inverse), (order, inverse, xs.shape[0])


def _gather_bwd(res, g):
    order, inverse, X = res
    per_assignment = jnp.take(g, inverse, axis=0)  # [A, D] in assignment order: token-major, k slots each
    return per_assignment.reshape(X, -1, g.shape[-1]).sum(axis=1, dtype=jnp.float32).astype(g.dtype), None, None


gather_token_rows.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def permute_rows(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """x [A, D] -> x[perm]; `inverse` is perm's inverse (the gradient gathers by it)."""
    return jnp.take(x, perm, axis=0)


def _permute_fwd(x, perm, inverse):
    return permute_rows(x, perm, inverse), (perm, inverse)


def _permute_bwd(res, g):
    perm, inverse = res
    return jnp.take(g, inverse, axis=0), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def dispatch(ids: jax.Array, num_experts: int, capacity: int | None = None) -> Dispatch:
    """ids [X, k] -> the sorted layout. Stable: within an expert, rows keep token order."""
    flat = ids.reshape(-1)  # [A]
    A = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts)  # [E]
    if capacity is None:
        return Dispatch(order, counts.astype(jnp.int32), flat[order], jnp.ones((A,), bool), _inverse(order))
    starts = jnp.cumsum(counts) - counts  # [E] first sorted row of each expert
    sorted_expert = flat[order]
    rank = jnp.arange(A) - starts[sorted_expert]  # position inside its expert's group
    kept_sorted = rank < capacity
    kept = jnp.zeros((A,), bool).at[order].set(kept_sorted)
    # re-sort with the dropped rows last (key E), so each expert's kept rows stay contiguous
    key = jnp.where(kept, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.minimum(counts, capacity).astype(jnp.int32)
    return Dispatch(order, group_sizes, key[order], kept, _inverse(order))


class MoE(nnx.Module):
    """The sparse feed-forward of one layer: `router` and `experts` (gate_up_proj [E, D, 2F], down_proj [E, F, D]);
    with a shared expert also `shared_expert` (an MLP of width F_s) and `shared_expert_gate` (Linear [D, 1])."""

    def __init__(self, dim: int, moe: MoEConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.moe = moe
        self.capacity_factor: float | None = None  # set from outside (training option); None = dropless
        # set from outside (surojax.parallel.expert): runner(self, x, segment_ids) -> (y, stats) computes the layer
        # across devices with the same contract as __call__; None = this device computes every expert
        self.runner: Callable[[MoE, jax.Array, jax.Array], tuple[jax.Array, RouterStats]] | None = None
        self.router = Router(dim, moe, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(dim, moe, param_dtype=param_dtype, rngs=rngs)
        Fs = moe.shared_expert_intermediate_size
        self.shared_expert = MLP(dim, Fs, param_dtype=param_dtype, rngs=rngs) if Fs else None
        self.shared_expert_gate = Linear(dim, 1, ("embed", None), param_dtype=param_dtype, rngs=rngs) if Fs else None

    def capacity(self, num_assignments: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_assignments / self.moe.num_experts))

    def __call__(self, x: jax.Array, segment_ids: jax.Array,
                 router_input: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
        """x [B, T, D], segment_ids [B, T] (0 = padding: routed but left out of the stats) -> (y [B, T, D], stats).
        router_input [B, T, D]: what the router reads when it is not x (Gemma 4: the block's residual stream, the
        experts reading its own pre-norm of it); None: x."""
        if self.runner is None:
            y, stats = self.routed(x, segment_ids, router_input)
        elif router_input is not None:
            raise ValueError("expert parallelism runs MoE layers whose router reads the experts' input; this "
                             "model's router reads another (Gemma 4's MoE block)")
        else:
            y, stats = self.runner(self, x, segment_ids)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [B, T, 1] * [B, T, D]
        return y, stats

    def routed(self, x: jax.Array, segment_ids: jax.Array,
               router_input: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
        """The routed experts alone, on this device: (y [B, T, D], stats). The grouped GEMMs over all experts, or
        with few assignments against E the gathered form (`expert_path`); both give the same values and stats."""
        B, T, D = x.shape
        E, k = self.moe.num_experts, self.moe.experts_per_token
        A = B * T * k
        xs = x.reshape(B * T, D)  # [X, D]
        logits = self.router(xs if router_input is None else router_input.reshape(B * T, D))  # [X, E] fp32
        weights, ids, probs = self.router.route(logits, self.moe)
        capacity = self.capacity(A)
        if expert_path(A, E, capacity, self.experts.quantised()) is MoeDecode.GATHER:
            rows = jnp.repeat(xs, k, axis=0)  # [A, D] each assignment's token, in assignment order
            out = self.experts.gathered(rows, ids.reshape(-1))  # [A, D]
            kept = jnp.ones((A,), bool)
        else:
            d = dispatch(ids, E, capacity)
            rows = gather_token_rows(xs, d.order, d.inverse)  # [A, D] each assignment's token, in expert order
            h = self.experts(rows, d.group_sizes, d.row_expert)  # [A, D]
            out = permute_rows(h, d.inverse, d.order)  # [A, D] back to assignment order (dropped rows are 0)
            kept = d.kept
        y = jnp.einsum("xkd,xk->xd", out.reshape(B * T, k, D).astype(jnp.float32), weights)
        return y.astype(x.dtype).reshape(B, T, D), router_stats(logits, probs, ids, kept, segment_ids, E)


class Experts(nnx.Module):
    """gate_up_proj [E, D, 2F] -> activation -> down_proj [E, F, D], on rows sorted by expert."""

    def __init__(self, dim: int, moe: MoEConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        E, F = moe.num_experts, moe.expert_intermediate_size
        E = moe.num_experts
        self.moe = moe
        self.gate_up_proj = ExpertLinear(E, dim, 2 * F, ("embed", "mlp"), use_bias=moe.expert_bias,
                                         param_dtype=param_dtype, rngs=rngs)
        self.down_proj = ExpertLinear(E, F, dim, ("mlp", "embed"), use_bias=moe.expert_bias,
                                      param_dtype=param_dtype, rngs=rngs)

    def __call__(self, rows: jax.Array, group_sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
        h = expert_activation(self.gate_up_proj(rows, group_sizes, row_expert), self.moe)  # [A, F]
        return self.down_proj(h, group_sizes, row_expert)  # [A, D]

    def quantised(self) -> bool:
        """Whether an expert kernel is held in a quantised format (the grouped GEMM dequantises all E of it)."""
        return any(getattr(node.get_value(), "quantised", False) for _, node in nnx.iter_graph(self)
                   if isinstance(node, nnx.Variable))

    def gathered(self, rows: jax.Array, expert_ids: jax.Array) -> jax.Array:
        """The few-rows form: rows [A, D] in any order, expert_ids [A] -> [A, D] (ExpertLinear.gathered)."""
        h = expert_activation(self.gate_up_proj.gathered(rows, expert_ids), self.moe)  # [A, F]
        return self.down_proj.gathered(h, expert_ids)  # [A, D]


def router_stats(logits, probs, ids, kept, segment_ids, num_experts: int) -> RouterStats:
    """The stats of one call over its real tokens (segment id != 0)."""
    real = (segment_ids.reshape(-1) != 0).astype(jnp.float32)  # [X]
    k = ids.shape[-1]
    counts = jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(real, k))
    lse = jax.nn.logsumexp(logits, axis=-1)  # [X]
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    dropped = jnp.sum((~kept).astype(jnp.float32) * jnp.repeat(real, k))
    return RouterStats(expert_counts=jax.lax.stop_gradient(counts), prob_sums=jnp.sum(probs * real[:, None], 0),
                       z_sum=jnp.sum(lse * lse * real), entropy_sum=jax.lax.stop_gradient(jnp.sum(entropy * real)),
                       dropped=dropped, tokens=jnp.sum(real))
