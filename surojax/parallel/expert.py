"""Expert parallelism: each device of the mesh's `expert` axis holds E / ep of a MoE layer's experts, and the tokens
go to the devices of their experts and back. Applied to a built model from outside: `apply_expert_parallel(model,
mesh)` sets every MoE layer's `runner` (surojax/models/layers/moe.py), so the model code stays the same.

Layout. The `expert` axis splits the batch like data parallelism does (the `batch` rule is data x fsdp x expert;
global batch = per-device batch x data x fsdp x expert, as in Megatron / DeepSpeed EP). Expert weights
[E, D, 2F] / [E, F, D] carry the `experts` logical axis, which PARAM_RULES maps to `expert`: E / ep experts per
device (E % ep != 0 is refused here). Every other parameter is replicated over `expert`, so attention, norms,
embeddings and the router are data-parallel on it (their gradients are all-reduced over it).

One MoE layer under `jax.shard_map`, manual over the batch axes (data, fsdp, expert; tensor stays automatic, so the
experts' `mlp` split over tensor keeps working inside), on the device that holds tokens X_l = B_l*T and experts
[e*E_l, (e+1)*E_l) of its expert group (the ep devices that share its data and fsdp coordinates):

    1. route its own tokens: router logits [X_l, E] (fp32), top-k ids / weights [X_l, k]
    2. all_gather over `expert` of the tokens [X_l, D] -> [X_g, D] (X_g = ep*X_l) and of ids, weights [X_g, k]
    3. its assignments among the group's X_g*k: those whose expert is local, sorted by expert (stable, so in
       token order), in a buffer of R = X_g * min(k, E_l) rows (the most that can be local: dropless);
       one grouped GEMM per projection over its local experts (ragged_dot; rows past the groups give 0)
    4. each group token's partial output: the sum of its local experts' outputs x routing weights, [X_g, D] fp32
    5. psum_scatter over `expert`: every token's partial sums from the ep devices added, and each device keeps
       its own X_l rows [X_l, D]
    6. router statistics of its own tokens, psum over the batch axes: the sums over the whole batch, as one
       device computes them (the router losses read these sums)

Exact and dropless: every assignment is computed on the device of its expert, with the same weights and the
same arithmetic per row as on one device; only the fp32 sum of a token's k expert outputs is taken in another
order (per device, then across devices). The gradient is the transposed program: the psum_scatter's transpose
is an all_gather, the all_gather's a psum_scatter (in fp32, as step 5: `_gather_tokens`), and the parameters'
gradients are summed over the devices that share them (expert weights over data and fsdp, the router over all
batch axes) in fp32 (`fp32_sums.vary` on entry, so those sums never run in the bf16 of the compute copies; XLA
CPU also aborts compiling a bf16 all-reduce of this partially manual shard_map). With `capacity_factor` the
capacity is per expert group (ceil(factor * X_g * k / E) assignments per expert, in the group's token order), as
GShard does.

Why all_gather + psum_scatter and not `jax.lax.ragged_all_to_all`: XLA:CPU has no ragged-all-to-all (JAX 0.11.2:
"HLO opcode ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), so that path could not be tested here;
this one is exact on every backend.

Cost, per MoE layer and device (X_l tokens, hidden D, ep devices in the group, k of E experts, E_l = E / ep):
  * traffic: the all_gather receives (ep-1)*X_l*D values (bf16 tokens), the psum_scatter sends (ep-1)*X_l*D
    (fp32, for exactness; bf16 would halve it); backward the same with the roles swapped (both sums fp32). An
    all-to-all of the assignments moves (ep-1)/ep * k*X_l*D each way, so for ep <= k+1 (Qwen3-30B-A3B: k = 8,
    ep <= 8) the gathered exchange moves no more bytes.
  * memory: expert activations of R = X_g*min(k, E_l) rows ([R, D] in, [R, 2F] hidden, X_g = ep*X_l) and the
    [X_g*k, D] combine buffer: the dropless worst case (every assignment of the group on this device), which
    any static-shape dropless exchange reserves too; a ragged all-to-all saves it only with a capacity.
  * compute: the grouped GEMM gets R rows of which about X_l*k are real (ep times fewer when E_l >= k). ragged_dot
    / a grouped GEMM that walks only the filled tiles costs the real rows; one that computes the whole buffer
    costs ep times more: measure it (benchmarks/) before trusting EP throughput.
What an H200 node should show, Qwen3-30B-A3B (D = 2048, F = 768, k = 8, E = 128), ep = 8, X_l = 8192 tokens:
the exchange is ~0.24 GB gathered + ~0.47 GB reduce-scattered per layer forward (as much again backward), ~1.5 ms
at ~450 GB/s NVLink per direction, against ~1 ms of expert GEMMs (0.6 TFLOP forward): communication-bound unless
XLA overlaps it with attention, so EP pays on one node only when the experts do not fit otherwise; data / fsdp
over the whole model is the faster choice for a model that fits. The ragged all-to-all path (GPU only) and a bf16
reduce-scatter are the next steps, both to be benchmarked against this one.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from surojax.models.layers.moe import MoE, RouterStats, dispatch, router_stats
from surojax.models.layers.params import AXES
from surojax.parallel import fp32_sums
from surojax.parallel.rules import batch_axes, batch_parallel_size

EXPERT_AXIS = "expert"  # the mesh axis (surojax.parallel.mesh) that splits the experts
EXPERTS = "experts"  # the logical axis of the expert dimension of a parameter


class ExpertParallelError(ValueError):
    """A model or batch that expert parallelism cannot split."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The runner of a MoE layer under expert parallelism on `mesh` (set as `MoE.runner`).

    runner(moe, x [B, T, D], segment_ids [B, T]) -> (y [B, T, D], RouterStats summed over the whole batch): the
    same contract as MoE's local computation. B must be a multiple of data x fsdp x expert.
    """

    mesh: Mesh

    def __call__(self, moe: MoE, x: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, RouterStats]:
        axes, split = batch_axes(self.mesh), batch_parallel_size(self.mesh)
        if x.shape[0] % split:
            raise ExpertParallelError(f"expert parallelism splits the batch over {' x '.join(axes)} = {split} "
                                      f"devices, but the MoE layer got {x.shape[0]} rows")
        graphdef, state = nnx.split(moe)
        specs = jax.tree.map(_expert_spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        rows = P(axes)
        run = jax.shard_map(functools.partial(_local_moe, graphdef, axes), mesh=self.mesh,
                            in_specs=(specs, rows, rows), out_specs=(rows, P()), axis_names=set(axes),
                            check_vma=True)
        return run(state, x, segment_ids)


def _expert_spec(var: nnx.Variable):
    """A Variable's in_spec over the manual axes: its `experts` dimension split over `expert`, the rest whole.

    Under the decoder's layer scan the Variables are one layer's slices: their `axes` still name the stacked
    `layers` axis first, so the trailing axes are the ones of the value."""
    value = var.get_value()
    axes = tuple(var.get_metadata().get(AXES, ()))

    def leaf_spec(leaf):
        ndim = jnp.ndim(leaf)
        own = axes[len(axes) - ndim:] if len(axes) >= ndim else ()
        if EXPERTS in axes and EXPERTS not in own:
            raise ExpertParallelError(f"a parameter with axes {axes} holds a leaf of shape {jnp.shape(leaf)} whose "
                                      f"expert dimension is not known: expert parallelism cannot split it "
                                      f"(a quantised expert weight?)")
        return P(*(EXPERT_AXIS if a == EXPERTS else None for a in own))

    return var.replace(jax.tree.map(leaf_spec, value))


def _local_moe(graphdef, manual_axes: tuple[str, ...], state, x, segment_ids):
    """One device's part (shard_map body over `manual_axes`): x [B_l, T, D], segment_ids [B_l, T], its E_l experts
    in `state`."""
    # every parameter varying over all the manual axes from here: the transposes of these casts (the parameter
    # gradients' sums over the devices that share the parameter) add in fp32, as the rest of the model's do, not
    # in the bf16 of the compute copies made at each use
    state = jax.tree.map(lambda v: fp32_sums.vary(v, manual_axes), state)
    moe = nnx.merge(graphdef, state)
    B, T, D = x.shape
    E, k = moe.moe.num_experts, moe.moe.experts_per_token
    ep = jax.lax.axis_size(EXPERT_AXIS)
    E_l = E // ep
    X = B * T
    xs = x.reshape(X, D)  # [X_l, D]
    logits = moe.router(xs)  # [X_l, E] fp32
    weights, ids, probs = moe.router.route(logits, moe.moe)  # [X_l, k], [X_l, k], [X_l, E]

    # 2. the expert group's tokens and routing, in the group's token order
    xs_g = _gather_tokens(xs)  # [X_g, D]
    ids_g = jax.lax.all_gather(ids, EXPERT_AXIS, tiled=True)  # [X_g, k]
    weights_g = jax.lax.all_gather(weights, EXPERT_AXIS, tiled=True)  # [X_g, k]
    X_g = ep * X
    flat = ids_g.reshape(-1)  # [A_g] assignment a = token * k + slot
    capacity = moe.capacity(X_g * k)
    kept = jnp.ones(flat.shape, bool) if capacity is None else dispatch(ids_g, E, capacity).kept

    # 3. the local experts' assignments first, sorted by local expert; the rest keyed past them (E_l)
    first = jax.lax.axis_index(EXPERT_AXIS) * E_l
    local = flat - first
    key = jnp.where(kept & (local >= 0) & (local < E_l), local, E_l)  # [A_g]
    R = X_g * min(k, E_l)  # a token's k experts are distinct: at most min(k, E_l) of them are local
    order = jnp.argsort(key, stable=True)[:R]  # [R]
    group_sizes = jnp.bincount(key, length=E_l + 1)[:E_l].astype(jnp.int32)  # [E_l]
    rows = jnp.take(xs_g, order // k, axis=0)  # [R, D]
    h = moe.experts(rows, group_sizes, key[order])  # [R, D]; rows not local (key E_l) give 0

    # 4. + 5. combine each token's local outputs, add the group's partial sums, keep this device's tokens
    out = jnp.zeros((X_g * k, D), h.dtype).at[order].set(h, unique_indices=True)  # assignment order
    partial = jnp.einsum("xkd,xk->xd", out.reshape(X_g, k, D).astype(jnp.float32), weights_g)  # [X_g, D]
    y = jax.lax.psum_scatter(partial, EXPERT_AXIS, scatter_dimension=0, tiled=True)  # [X_l, D]

    # 6. stats of this device's tokens, summed over every batch axis
    kept_own = jax.lax.dynamic_slice_in_dim(kept, jax.lax.axis_index(EXPERT_AXIS) * X * k, X * k)
    stats = router_stats(logits, probs, ids, kept_own, segment_ids, E)
    stats = jax.tree.map(lambda s: jax.lax.psum(s, manual_axes), stats)
    return y.astype(x.dtype).reshape(B, T, D), stats


@jax.custom_vjp
def _gather_tokens(xs):
    """all_gather over `expert` (tiled); its transpose, the sum of the group's token gradients, in fp32 like the
    forward combine (step 5) rather than in the tokens' bf16 (XLA CPU also aborts compiling a bf16 one)."""
    return jax.lax.all_gather(xs, EXPERT_AXIS, tiled=True)


def _gather_tokens_fwd(xs):
    return _gather_tokens(xs), None


def _gather_tokens_bwd(_, g):
    summed = jax.lax.psum_scatter(g.astype(jnp.float32), EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return (summed.astype(g.dtype),)


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


def apply_expert_parallel(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Run every MoE layer of `model` expert-parallel on `mesh` (in place; returns the model).

    A mesh whose `expert` axis has size 1 changes nothing (no runner is set: the layers compute locally, GSPMD
    splits them like any other layer). Refuses a MoE whose expert count the expert axis does not divide.
    """
    ep = dict(mesh.shape).get(EXPERT_AXIS, 1)
    if ep == 1:
        return model
    runner = ExpertParallel(mesh)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            E = node.moe.num_experts
            if E % ep:
                raise ExpertParallelError(f"parallel.expert = {ep} does not divide the model's {E} experts: each "
                                          f"device must hold E / expert of them (choose a divisor of {E})")
            node.runner = runner
    return model


__all__ = ["ExpertParallel", "ExpertParallelError", "apply_expert_parallel"]
