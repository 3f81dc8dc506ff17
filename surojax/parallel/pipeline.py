"""Pipeline parallelism over the `stage` mesh axis: the stacked decoder layers split into S stages, the batch
into M microbatches, run on a circular schedule written with `jax.shard_map` (manual over `stage` only) and
`jax.lax.ppermute`.

Layout. The stacked layers [L, ...] are cut into C = S x R chunks of Lc = L / C consecutive layers (R = `repeats`).
Stage s runs chunks s, s + S, s + 2S, ... (circular / interleaved pipelining): a microbatch goes through stages
0 .. S-1 R times. With R = 1 stage s holds the contiguous layers [s L/S, (s+1) L/S), which is exactly how the
`layers` rule (surojax/parallel/rules.py: layers -> stage) shards the stacked parameters, so the reshape
[L, ...] -> [S, R, Lc, ...] moves no data. With R > 1 the chunks of a stage are not contiguous in [L, ...]: XLA
regathers the stage's layers inside every step (an all-to-all of the layer weights over `stage`); R > 1 buys a
smaller bubble with that traffic.

The batch rows h [B, T, D] (and every per-row constant: cos / sin, segment ids, positions) split into M
microbatches of B / M rows, row b in microbatch b mod M, so that each data shard keeps (B / dp) / M rows of every
microbatch: the data / fsdp / expert split of the rows stays as it was (M must divide the rows per data shard).

Schedule (each stage, SPMD; P = max(M, S) iterations per repeat, N = (R-1) P + M + S - 1 iterations in all):

    iteration t, stage s:  u = t - s,  repeat r = u // P,  microbatch m = u mod P   (work when 0 <= u, m < M, r < R)
        input   stage 0, r = 0:  microbatch m of the batch
                stage 0, r > 0:  what stage S-1 sent back for microbatch m (held P - S iterations when M > S)
                stage s > 0:     what stage s-1 sent at the end of iteration t-1
        compute chunk r of this stage's layers (Lc layers, a scan) on it
        send    ppermute to stage s+1 (stage S-1 to stage 0)
    output  stage S-1's results of repeat R-1 (iterations (R-1) P + S - 1 + m), broadcast over `stage` (psum)

An idle (bubble) iteration computes on a real microbatch and its result is never read, so it adds nothing to the
values or the gradients. Useful iterations per stage: M R of N, so the bubble fraction is 1 - M R / N, which is
(S-1) / (M R + S - 1) when M >= S (`bubble_fraction`).

Backward: autodiff of the schedule (ppermute's transpose is the reverse permute; the broadcast inputs' cotangents
are summed over `stage` by shard_map). Each iteration's stage compute is a `jax.checkpoint`: the backward pass keeps
one microbatch input per iteration and recomputes the chunk, inside which the run's recompute policy (`recompute:`)
wraps each layer as in the plain scan. The other mesh axes stay automatic inside the shard_map, so data, fsdp and
tensor sharding of the weights and activations work as outside it.

Not covered: a KV cache (generation runs the plain scan), MoE router statistics, host-streamed weights; the
embedding and LM head run on every stage (their work is replicated over `stage`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from surojax.models.layer_runner import LAYER_INPUT, HiddenStates, LayerPattern, Recompute, uniform_stack
from surojax.parallel import fp32_sums
from surojax.parallel.rules import batch_parallel_size

STAGE = "stage"


class PipelineError(ValueError):
    """A pipeline shape that cannot run (layers, stages, microbatches and rows that do not divide)."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """How the layers are pipelined when the mesh has a `stage` axis > 1 (`parallel.pipeline_*` in the config)."""

    microbatches: int | None = None  # None: `default_microbatches` of the rows per data shard
    repeats: int = 1  # chunks per stage (circular schedule); 1: one contiguous block of layers per stage


def schedule_length(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Iterations of the circular schedule: (R-1) max(M, S) + M + S - 1."""
    return (repeats - 1) * max(microbatches, stages) + microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of iterations a stage idles: 1 - M R / N; (S-1) / (M R + S - 1) when M >= S; 0 for one stage."""
    return 1.0 - microbatches * repeats / schedule_length(stages, microbatches, repeats)


def default_microbatches(stages: int, rows_per_shard: int) -> int:
    """The largest divisor of the rows per data shard that is at most 2 S (a bubble of (S-1) / (3S-1) < 1/3 when
    the rows allow; fewer, larger microbatches keep the matmuls large)."""
    return max(m for m in range(1, min(2 * stages, rows_per_shard) + 1) if rows_per_shard % m == 0)


def check_pipeline(*, num_layers: int, rows: int, data_parallel: int, stages: int, microbatches: int,
                   repeats: int) -> None:
    """Refuse shapes the schedule cannot run, naming the numbers."""
    if microbatches < 1 or repeats < 1:
        raise PipelineError(f"pipeline_microbatches ({microbatches}) and pipeline_repeats ({repeats}) must be >= 1")
    if num_layers % (stages * repeats):
        raise PipelineError(f"{num_layers} layers do not split into {stages} stages x {repeats} repeats "
                            f"(pipeline_repeats): the layer count must be a multiple of {stages * repeats}")
    if rows % data_parallel:
        raise PipelineError(f"{rows} rows do not split over the {data_parallel} data-parallel devices")
    per_shard = rows // data_parallel
    if per_shard % microbatches:
        raise PipelineError(f"pipeline_microbatches {microbatches} does not divide the {per_shard} rows per "
                            f"data shard (per_device_train_batch_size); use a divisor of it")


def _to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...], row b in microbatch b mod M (each data shard keeps its rows)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _from_microbatches(x: jax.Array) -> jax.Array:
    """[M, B/M, ...] -> [B, ...], the inverse of `_to_microbatches`."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _stage_major(x: jax.Array, stages: int, repeats: int) -> jax.Array:
    """[L, ...] -> [S, R, Lc, ...]: [s, r] is chunk r S + s (layers (r S + s) Lc .. + Lc - 1)."""
    lc = x.shape[0] // (stages * repeats)
    return x.reshape(repeats, stages, lc, *x.shape[1:]).swapaxes(0, 1)


def pipeline_layers(apply_layer: Callable, layer_state, h: jax.Array, consts: tuple, *, mesh: Mesh,
                    microbatches: int, repeats: int = 1, recompute: Recompute = Recompute.NONE,
                    unroll: int | bool = 1) -> jax.Array:
    """h [B, T, D] after every layer of `layer_state` (every leaf stacked [L, ...]), pipelined over `stage`.

    apply_layer(state_l, h, consts) -> h: one layer on one microbatch (state_l: the layer's slice; h [B/M, T, D];
    consts: the microbatch's rows of each `consts` array, every one [B, ...] on its leading axis). recompute:
    the policy wrapping the per-layer body (surojax.models.layer_runner.Recompute). unroll: the
    per-stage layer scan's. Equal to the plain scan over the layers, up to float reassociation (none in fp32 on
    CPU: the same ops run per row).
    """
    stages = mesh.shape[STAGE]
    leading = {jnp.shape(x)[0] for x in jax.tree.leaves(layer_state)}
    if len(leading) != 1:
        raise PipelineError(f"the pipeline splits the layers axis: every layer leaf must be stacked [L, ...] on one "
                            f"L (leading sizes {sorted(leading)})")
    (num_layers,) = leading
    rows = h.shape[0]
    check_pipeline(num_layers=num_layers, rows=rows, data_parallel=batch_parallel_size(mesh), stages=stages,
                   microbatches=microbatches, repeats=repeats)
    M, S, R = microbatches, stages, repeats
    per_repeat = max(M, S)  # P: iterations between a microbatch's visits of stage 0
    hold = per_repeat - S  # iterations stage 0 holds a returning microbatch (M > S)
    n_iter = schedule_length(S, M, R)
    first_out = (R - 1) * per_repeat + S - 1  # iteration of stage S-1's last repeat of microbatch 0

    def run_chunk(x, chunk_state, c):  # Lc layers on one microbatch; recomputed in the backward pass
        def body(x, state_l):
            x = checkpoint_name(x, LAYER_INPUT)  # what `recompute: offload` keeps in host memory
            return apply_layer(state_l, x, c), None

        body = recompute.wrap(body)
        return jax.lax.scan(body, x, chunk_state, unroll=unroll)[0]

    run_chunk = jax.checkpoint(run_chunk)

    def local(xs, stage_state, consts_mb):
        # xs [M, B/M, T, D] and consts_mb (the same on every stage); stage_state leaves [1, R, Lc, ...] (this stage)
        s = jax.lax.axis_index(STAGE)
        chunks = jax.tree.map(lambda x: x[0], stage_state)  # [R, Lc, ...]
        to_next = [(i, (i + 1) % S) for i in range(S)]

        def iteration(carry, t):
            received, held = carry  # received: sent to this stage last iteration; held [hold, B/M, T, D] (stage 0)
            u = t - s
            r, m = u // per_repeat, u % per_repeat
            working = (u >= 0) & (m < M) & (r < R)
            r, m = jnp.clip(r, 0, R - 1), jnp.clip(m, 0, M - 1)
            fresh = xs[m]
            returned = held[0] if hold else received
            x = jnp.where(s == 0, jnp.where(r == 0, fresh, returned), received)
            x = jnp.where(working, x, fresh)  # an idle iteration computes on real rows; its result is never read
            chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False), chunks)
            c = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False), consts_mb)
            y = run_chunk(x, chunk, c)
            held = jnp.concatenate([held[1:], received[None]]) if hold else held
            return (jax.lax.ppermute(y, STAGE, to_next), held), y

        # the broadcast inputs varying over `stage` here, so the sums of their cotangents over the stages (the
        # transposes) add in fp32 (fp32_sums: exact either way, one stage contributes, the others add zeros)
        xs = fp32_sums.vary(xs, (STAGE,))
        consts_mb = jax.tree.map(lambda c: fp32_sums.vary(c, (STAGE,)), consts_mb)
        zero = jnp.zeros_like(xs[0])  # varying, as xs
        held = jax.lax.pcast(jnp.zeros((hold,) + xs.shape[1:], xs.dtype), STAGE, to="varying")
        _, ys = jax.lax.scan(iteration, (zero, held), jnp.arange(n_iter))  # ys [N, B/M, T, D]
        out = jax.lax.slice_in_dim(ys, first_out, first_out + M)  # stage S-1: repeat R-1 of microbatches 0..M-1
        # stage S-1's results to every stage, added in fp32 (one fp32 [B, T, D] transfer per step instead of bf16)
        return fp32_sums.psum(jnp.where(s == S - 1, out, jnp.zeros_like(out)), STAGE)

    run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(STAGE), P()), out_specs=P(), axis_names={STAGE})
    stage_state = jax.tree.map(lambda x: _stage_major(x, S, R), layer_state)
    consts_mb = jax.tree.map(lambda x: _to_microbatches(x, M), tuple(consts))
    return _from_microbatches(run(_to_microbatches(h, M), stage_state, consts_mb))


@dataclasses.dataclass(frozen=True)
class PipelinedLayers:
    """The decoder's layer runner for `parallel.stage > 1` (surojax.models.layer_runner.LayerRunner):
    `pipeline_layers` with the run's microbatches, repeats and per-layer recompute policy. One stack of one layer
    type; no KV cache, no router statistics."""

    mesh: Mesh
    microbatches: int
    repeats: int = 1
    recompute: Recompute = Recompute.NONE
    unroll: int | bool = 1

    def run(self, pattern: LayerPattern, stacks, h: jax.Array, consts: tuple, *, cache=None,
            kv_meta=None) -> HiddenStates:
        if cache is not None:
            raise PipelineError("the pipelined layer runner is for training: it takes no KV cache")
        graphdef, layer_state = nnx.split(uniform_stack(pattern, stacks, "the pipelined layer runner"))

        def apply_layer(state_l, h, consts):
            return nnx.merge(graphdef, state_l)(h, *consts)[0]

        return HiddenStates(pipeline_layers(apply_layer, layer_state, h, consts, mesh=self.mesh,
                                            microbatches=self.microbatches, repeats=self.repeats,
                                            recompute=self.recompute, unroll=self.unroll))

    def describe(self) -> str:
        S = self.mesh.shape[STAGE]
        return (f"pipeline {S} stages x {self.repeats} repeat(s), {self.microbatches} microbatches, "
                f"bubble {100 * bubble_fraction(S, self.microbatches, self.repeats):.1f}%")


def pipeline_stages(mesh) -> int:
    """The size of the mesh's `stage` axis (1 when it has none)."""
    return dict(mesh.shape).get(STAGE, 1)


def pipelined_layer_loop(mesh: Mesh, spec: PipelineSpec, *, rows_per_shard: int, num_layers: int,
                         recompute: Recompute, unroll: int | bool = 1) -> PipelinedLayers:
    """The layer runner of a run on a mesh with stage > 1, its shapes checked before anything compiles.
    rows_per_shard: rows of one data shard per micro-batch (per_device_train_batch_size); recompute / unroll:
    the run's per-layer policy and the per-stage scan's unroll."""
    stages = pipeline_stages(mesh)
    microbatches = spec.microbatches or default_microbatches(stages, rows_per_shard)
    dp = batch_parallel_size(mesh)
    check_pipeline(num_layers=num_layers, rows=rows_per_shard * dp, data_parallel=dp, stages=stages,
                   microbatches=microbatches, repeats=spec.repeats)
    return PipelinedLayers(mesh, microbatches, spec.repeats, recompute, unroll)


__all__ = ["PipelineError", "PipelineSpec", "PipelinedLayers", "bubble_fraction", "check_pipeline",
           "default_microbatches", "pipeline_layers", "pipeline_stages", "pipelined_layer_loop", "schedule_length"]
