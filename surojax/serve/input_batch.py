"""What one jitted call of the serving runner takes: an `InputBatch` (arrays), `StepSettings` (static), a `KVAccess`.

Every call of the runner has the same form, ``fn(graphdef, state, k_pool, v_pool, batch, settings)`` (a hybrid
model's step and multi-step calls also take ``state_pool=``, its linear layers' state slots, `serve.state_slots`,
donated and returned after the KV pools):

* ``batch`` (`InputBatch`, a pytree dataclass): the host-built arrays of the call, one field per meaning. A call
  reads only the fields its kind needs; the others stay None (no leaves: nothing is sent).
* ``settings`` (`StepSettings`, frozen and hashable: a jit static value): what picks the compiled program. The
  runner fixes the KV path's part once (block size, decode kernel, FP8 scales, layer unroll, LoRA rows, KV in
  the carry) and sets the call's part (`BatchMode`, number of steps) with ``dataclasses.replace``.
* the pools, donated: each call returns the new pools first (k_pool / v_pool: arrays, or tuples of one per KV
  shape: `kv_pools`).

The KV path's implementation (`KVAccess`, chosen once when the runner is built): ``address`` builds the batch
fields that locate the rows' KV in the pool on the host, and ``step`` / ``multi_step`` / ``verify`` / ``propose``
are its jitted calls. Two implementations: `kv_paged.PagedAccess` (block tables; the decoder reads and writes
the pool in place) and `kv_reference.ReferenceAccess` (slot lists; gather a dense view, scatter back).

`run_decoder` is the serving code's one call of ``Decoder.hidden_states``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from surojax.generation.sampling import BatchMode
from surojax.models.kv import PagedKernel
from surojax.models.layer_runner import LayerScan
from surojax.serve.kv_fp8 import KVScales
from surojax.serve.kv_pools import KVPool

Array = Any  # a jax or numpy array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InputBatch:
    """The arrays of one runner call (R rows, bucketed). Which call reads what:

    ========================  ===========================================================================
    step (prefill / decode)   tokens [R, T], positions, segment_ids [R, T] (0 = padding: not written),
                              start, last_idx, adapter_rows [R]
    multi-step decode         tokens [R] (each row's last token), start, limit, adapter_rows [R], stop_ids [R, M]
    verify (speculative)      tokens [R] (last token), start [R], proposals [R, K], num_proposed [R] (-1 on
                              padding rows), draft_probs [R, K, V] or None
    propose (draft model)     tokens [R] (last token), start [R], limit [R] (proposals wanted, -1 on padding)
    propose (MTP head)        the same, and state_slots [R] (the rows' slots of the head's hidden-state pool)
    mirror (MTP head)         tokens [R, T], hidden [R, T, D] (a target call's), start [R], limit [R] (real
                              tokens), state_slots [R]  (`serve.mtp`)
    ========================  ===========================================================================

    A step call with a row that scores its prompt (``BatchMode.prompt_logprobs``) also reads ``prompt_targets``
    [R, T] (the prompt token after each position, -1 where none is scored: `serve.prompt_logprobs`).

    A vision-language model's calls with image rows (`serve.request_images`) also read: step, ``images`` (the
    tower's input: the images with tokens in the rows' chunks; None when no chunk holds one) and
    ``rope_positions`` [3, R, T]; multi-step, ``rope_delta`` [R]. None (the 1-D rope) without image rows.

    A hybrid model's step / multi-step calls also read ``state_slots`` [R] (each row's slot in the runner's
    state pool, `serve.state_slots`; out of range on padding rows); None (no leaves) otherwise.

    Every call: ``sampling``, the per-row sampling arrays of `sample_batch` / `speculative.sampling_arrays`;
    the KV address of its path (`KVAccess.address`): paged ``block_table`` [R, NB], or reference
    ``ctx_slots`` [R, S] (the pool slots of each row's context) and ``write_slots`` [R, T or K] (of its new
    tokens; out of range where nothing is written). Built once per call on the host and not changed after (not
    frozen only because a frozen dataclass's __init__ costs microseconds more on every call).
    """

    tokens: Array
    start: Array  # [R] each row's KV length before the call (= the position of its first new token)
    sampling: dict
    positions: Array | None = None
    segment_ids: Array | None = None
    last_idx: Array | None = None
    adapter_rows: Array | None = None
    limit: Array | None = None
    stop_ids: Array | None = None
    proposals: Array | None = None
    num_proposed: Array | None = None
    draft_probs: Array | None = None
    block_table: Array | None = None
    ctx_slots: Array | None = None
    write_slots: Array | None = None
    state_slots: Array | None = None
    prompt_targets: Array | None = None
    hidden: Array | None = None  # [R, T, D] an MTP mirror call: the target's hidden states of `tokens` (`serve.mtp`)
    images: Any = None  # models.vision.inputs.ImageInputs of a step call's image tokens (`serve.request_images`)
    rope_positions: Array | None = None  # [3, R, T] M-RoPE positions of a step call with image rows
    rope_delta: Array | None = None  # [R] multi-step decode: M-RoPE position = 1-D position + delta (image rows)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The static part of a runner call (one compiled variant per distinct value).

    block_size: the pools'; pools: the runner's `kv_pools.KVPool`s (one per KV shape; empty: one pool, every cache
    row its own: `kv_pools.paged_cache`); lora: set each row's adapter slot (``adapter_rows``); unroll: the layer
    scan's (1 rolled, True inlined); kernel: how paged decode rows read the pool; scales: an FP8 pool's `KVScales`
    (a tuple of one per pool with several; None: the pool holds the compute dtype); kv_in_place (reference path):
    the dense view rides in the layer scan's carry. Per call: mode (`BatchMode`; verify / propose read
    ``mode.sample`` only); num_steps (multi-step decode: K steps; propose: K proposals); fresh (paged step calls):
    no row has context in the pool before the call, so attention reads nothing back (`PagedKVCache.fresh`:
    self-attention over the call's tokens). hidden (the runner's, paged step / verify calls): also return the
    final-normed hidden states [R, T, D] under ``"hidden"`` (an MTP head reads them: `serve.mtp`)."""

    block_size: int
    pools: tuple[KVPool, ...] = ()
    lora: bool = False
    unroll: int | bool = 1
    kernel: PagedKernel = PagedKernel.GATHER
    scales: KVScales | tuple[KVScales, ...] | None = None
    kv_in_place: bool = False
    mode: BatchMode = BatchMode()
    num_steps: int = 1
    fresh: bool = False
    hidden: bool = False

    def __hash__(self) -> int:  # computed once: jit hashes its static arguments on every call
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def for_call(self, mode: BatchMode, num_steps: int = 1, fresh: bool = False) -> StepSettings:
        """These settings with a call's part set; the same object for the same call part (cached), so that
        jit's static-argument lookup is a dictionary hit on a cached hash."""
        key = (mode, num_steps, fresh)
        calls = self.__dict__.setdefault("_calls", {})
        found = calls.get(key)
        if found is None:
            found = calls[key] = dataclasses.replace(self, mode=mode, num_steps=num_steps, fresh=fresh)
        return found


def run_decoder(model, tokens, positions, segment_ids, cache, settings: StepSettings, *, images=None,
                rope_positions=None, rope_delta=None):
    """The decoder over a serving cache -> (h, cache). A paged cache always rides in the layer scan's carry;
    a dense view does where ``settings.kv_in_place``. images / rope_positions [3, R, T]: a vision-language step
    (`Decoder.hidden_states`); rope_delta [R]: M-RoPE positions = positions + delta on all three axes (decode
    after an image prompt)."""
    runner = LayerScan(unroll=settings.unroll, carry_cache=settings.kv_in_place)
    if rope_delta is not None:
        rope_positions = jnp.broadcast_to((positions + rope_delta[:, None])[None], (3, *positions.shape))
    h, cache, _ = model.hidden_states(tokens, positions, segment_ids, cache=cache, runner=runner, images=images,
                                      rope_positions=rope_positions)
    return h, cache


class KVAccess(Protocol):
    """A KV path's implementation: how the runner's calls address, read and write the pool."""

    def address(self, block_tables: list[list[int]], R: int, S: int, starts: list[int] = (),
                written: list[int] = (), width: int = 0) -> dict[str, np.ndarray]:
        """The batch fields that locate the rows' KV (rows past ``len(block_tables)`` are padding): context of S
        tokens; row r writes ``written[r]`` new tokens from position ``starts[r]`` (``width`` >= each)."""

    def step(self, graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings):
        """One forward + sample -> (k_pool, v_pool, sampled)."""

    def multi_step(self, graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings):
        """Up to ``settings.num_steps`` decode steps -> (k_pool, v_pool, dict(ids, count, ...))."""

    def verify(self, graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings):
        """Speculative verification -> (k_pool, v_pool, dict(ids, count))."""

    def propose(self, graphdef, state, k_pool, v_pool, batch: InputBatch, settings: StepSettings):
        """Draft proposals -> (k_pool, v_pool, proposals, q)."""


__all__ = ["InputBatch", "KVAccess", "StepSettings", "run_decoder"]
