"""The jitted model runner over a paged KV pool.

The pool: k and v are each [L, num_blocks * block_size, K, H] (flattened slots). Token ``p`` of a sequence lives
in slot ``block_table[p // bs] * bs + p % bs``. A model whose layers have KV of two shapes (Gemma 4's full layers
with their own head size and kv heads) has one pool per shape, k_pool / v_pool then tuples, all addressed by the
same slots; KV-shared layers read their source layer's pool rows and have none of their own (`kv_pools`).

Each step the runner builds on the host a padded batch of the scheduled requests, an ``InputBatch``
(``input_batch.py``: tokens / positions / segment ids [R, T] (segment 1 = real, 0 = padding), each row's context
length ``start`` [R], adapter rows, the per-row sampling arrays and the rows' KV address), then runs ONE jitted call
``fn(graphdef, state, k_pool, v_pool, batch, settings)`` that does the forward, writes the new k/v into the pool and
samples on device (``surojax.generation.sampling.sample_batch``: per-row parameters as [R] arrays; the host fetches
the sampled ids once per call, used where the scheduler asked, ``sample=True``). ``settings`` (``StepSettings``,
static) holds what picks the compiled program: the runner's part (block size, decode kernel, FP8 scales, unroll,
LoRA, KV in the carry) is fixed when it is built, the call's (``BatchMode``, steps) set per call. With multi-LoRA
slots in the model, each row's adapter slot is set on the merged model inside the call
(``surojax.peft.multi_lora.set_adapter_rows``).

Two KV paths, same tokens and the same pool contents afterwards (``KVPath``), two implementations of one
interface (``input_batch.KVAccess``: ``address`` on the host, then ``step`` / ``multi_step`` / ``verify`` /
``propose``), chosen once when the runner is built (``kv_access``):

* paged (default, ``kv_paged.PagedAccess``): the host sends block tables [R, S / bs]; the decoder reads and
  writes the pool in place through them (``PagedKVCache``); decode rows read it by the ``PagedKernel``
  (gather, multiply + reduce, or the Pallas kernel). Speculative verification and draft proposals run here.
* reference (``kv_reference.ReferenceAccess``): the host sends slot lists, ctx [R, S] (O(context) numpy per row
  per step) and the new tokens' slots [R, T]; the call GATHERS every row's context from the pool into a dense
  view, runs the Decoder over it, then SCATTERS the new k/v back.

A hybrid model (linear-attention layers beside the attention ones, `serve.state_slots`): the pool covers the
attention layers only, and the runner also owns ``state_pool``, each running sequence's linear-layer states in
the slot the scheduler gave it (``ScheduledRequest.state_slot`` -> ``InputBatch.state_slots``); the step and
multi-step calls take it (``state_pool=``, donated) and return it after the KV pools.

A vision-language model (`Decoder.visual`): rows of requests with images (`serve.request_images`) get the vision
tower in their prefill call (every image with tokens in the chunk, its merged rows scattered into the chunk's
image tokens) and M-RoPE positions (prompt: the request's; later tokens: index + rope_delta on all three axes);
a call without image rows runs as for a text model.

Shapes are bucketed (R, T rounded up to powers of two; S to 2^k or 1.5 * 2^k, a multiple of the block size; a
prefill's R too with ``RunnerBuckets.fine_prefill_rows``) so the number of compilations stays logarithmic. Decode
rows (1 new token) and prefill rows run in separate calls so that one long prefill chunk does not pad every decode
row to its length; prefill rows of new sequences (start 0) and chunks continuing one run in separate calls too
(`_call_groups`). A paged prefill call of new sequences is ``fresh`` (`StepSettings.fresh`): attention over the
call's own tokens, nothing gathered from the pool (`PagedKVCache`); one more compiled variant per prefill shape.

Same-step prefix hits: the block manager publishes a block's hash when it is allocated, before its KV is
written. A request admitted in the same step can hit a block another request writes in this very step; a layer
that writes then attends would see it (the paged path does, within one call), but the reference path gathers
the context BEFORE the forward, and decode and prefill rows run in separate calls. So requests are split into
waves (both paths, to keep them equal): a request whose context blocks are written this step by another request
runs in a later call (after the writer's KV is in the pool). Usually there is one wave.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.paged_decode import kernel_applies
from pallas_kernels.paged_decode import prepare as prepare_paged_decode
from surojax.generation.sampling import MAX_TOP_LOGPROBS, BatchMode, SamplingParams
from surojax.models.decoder import Decoder
from surojax.models.kv import PagedKernel, StateCache
from surojax.models.vision.inputs import VisionTokens
from surojax.peft.multi_lora import multi_lora_modules
from surojax.serve.config import KVPath, RunnerBuckets
from surojax.serve.input_batch import InputBatch, KVAccess, StepSettings
from surojax.serve.kv_fp8 import KVScales, check_pool_dtype, is_fp8, kv_scales
from surojax.serve.kv_paged import PagedAccess, paged_step, verify_step
from surojax.serve.kv_pools import kv_pools
from surojax.serve.kv_reference import ReferenceAccess
from surojax.serve.prompt_logprobs import PromptLogprob, prompt_targets, read_rows, target_rows
from surojax.serve.request_images import chunk_images, group_rope_delta, group_rope_positions
from surojax.serve.scheduler import ScheduledRequest
from surojax.serve.speculative import sampling_arrays
from surojax.serve.state_slots import is_hybrid, state_pool

__all__ = ["PAGED_KERNEL", "PagedRunner", "StepResult", "kv_access", "paged_step", "verify_step"]

PAGED_KERNEL = {KVPath.PAGED: PagedKernel.GATHER, KVPath.REDUCE: PagedKernel.REDUCE,
                KVPath.PALLAS: PagedKernel.PALLAS}  # a paged KV path -> how its decode attention reads the pool


def _context_bucket(n: int, minimum: int, multiple: int) -> int:
    """Context length S: a power of two, or from 512 on the smallest of 2^k and 1.5 * 2^k that is
    >= max(n, minimum) (padding <= 33% where it costs, instead of <= 50%); always a multiple of ``multiple``."""
    n = max(n, minimum, 1)
    p = 1 << (n - 1).bit_length()
    for c in ((3 * p // 4, p) if p > 512 else (p,)):
        if c >= n and c % multiple == 0:
            return c
    return p if p % multiple == 0 else -(-p // multiple) * multiple


def _bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def _fine_bucket(n: int, minimum: int = 1) -> int:
    """Smallest of 2^k and 1.5 * 2^k (from 3 on) >= max(n, minimum): padding <= 33% instead of <= 50%."""
    p = _bucket(n, minimum)
    c = 3 * p // 4
    return c if p >= 4 and c >= max(n, minimum) else p


def _call_groups(rows: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], ...]:
    """One wave's rows by device call: decodes (one token); prefills of new sequences (start 0: a fresh call,
    `StepSettings.fresh`); prefill chunks that continue a sequence (a prefix hit or a chunked prompt). The last
    two apart so that one continuing chunk neither makes the new prompts' call read the pool nor pads it to the
    next power of two of rows (16 new prompts + 1 chunk: 16 + 1 rows, not 32)."""
    return ([s for s in rows if s.num_new_tokens == 1], [s for s in rows if s.num_new_tokens > 1 and s.start == 0],
            [s for s in rows if s.num_new_tokens > 1 and s.start > 0])


def kv_access(kv_path: KVPath, block_size: int, num_slots: int) -> KVAccess:
    """A resolved `KVPath` -> its implementation: REFERENCE -> `ReferenceAccess`, the others -> `PagedAccess`
    (their decode kernel is ``PAGED_KERNEL[kv_path]``, a `StepSettings` field)."""
    if kv_path is KVPath.REFERENCE:
        return ReferenceAccess(block_size, num_slots)
    return PagedAccess(block_size)


def _call(fn) -> None:
    if fn is not None:
        fn()


class StepResult(dict):
    """request id -> sampled token id; ``logprobs``: request id -> (logprob, [(id, logprob)] * top_logprobs).
    After a multi-step decode (rows with ``num_steps > 1``): request id -> list of ids, and logprobs -> a list
    of those tuples, one per id. ``prompt_logprobs``: request id -> {prompt position: `PromptLogprob`} for the
    prompt tokens this step's chunks scored (`serve.prompt_logprobs`)."""

    def __init__(self):
        super().__init__()
        self.logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = {}
        self.prompt_logprobs: dict[str, dict[int, PromptLogprob]] = {}


class PagedRunner:
    """Owns the device KV pool and runs one scheduler step: ``execute(scheduled) -> {request_id: token}``."""

    scores_prompts = True  # rows that ask score their prompt chunks (`serve.prompt_logprobs`); a draft does not

    def __init__(self, model: Decoder, *, num_blocks: int, block_size: int, kv_path: KVPath, kv_dtype=None,
                 adapter_slot=None, buckets: RunnerBuckets = RunnerBuckets(), kv_in_place: bool = True,
                 decode_steps: int = 1, unroll_layers: bool = False, num_state_slots: int | None = None,
                 hidden_sink=None):
        """kv_path: a resolved `KVPath` (not AUTO): PAGED / REDUCE / PALLAS read and write the pool in place
        through block tables (the host sends tables [R, S / block_size]); REFERENCE gathers a dense view and
        scatters back (slot lists [R, S]). Same tokens, same pool contents (REDUCE / PALLAS: equal up to float
        rounding). adapter_slot: adapter name -> slot of the model's multi-LoRA stacks (``AdapterSlots.slot``).
        buckets: the smallest shape buckets. kv_in_place (REFERENCE only): the decoder writes new k/v into
        its view in the layer scan's carry instead of copying every layer's view in and out; same values.
        unroll_layers: the layer loop inlined (``lax.scan(unroll=True)``), longer compiles; same values.
        decode_steps: multi-step calls always loop up to this many steps (the loop exits once every row
        stopped), so rows with fewer steps left do not compile smaller variants. kv_dtype: the pool's dtype
        (None: the model's); float8_e4m3fn makes an FP8 pool with per-layer scales bounded from the weights
        (`kv_fp8.kv_scales`, ``self.kv_scales``), refused for a model with LoRA slots. num_state_slots: a
        hybrid model's (linear-attention layers) state slots, one per sequence it may run at once (the
        scheduler's max_num_seqs; `serve.state_slots`): the pool ``self.state_pool``, donated to each step and
        multi-step call (None for other models). The KV pool then covers the attention layers only.
        hidden_sink: ``sink(batch, hidden)``, called with every paged step and verify call's `InputBatch` (tokens
        [R, T]; ``limit`` [R]: each row's real tokens, those whose KV the call keeps) and the target's final-normed
        hidden states [R, T, D] on the device, as soon as the call is dispatched (an MTP head mirrors the
        target's KV writes with them: `serve.mtp`). None: the calls return no hidden states."""
        if kv_path is KVPath.AUTO:
            raise ValueError("PagedRunner: kv_path AUTO must be resolved first (Engine does: resolve_kv_path)")
        self.kv_path = kv_path
        self.paged = kv_path is not KVPath.REFERENCE
        self.kernel = PAGED_KERNEL.get(kv_path, PagedKernel.GATHER)  # REFERENCE: unused
        if self.kernel is PagedKernel.PALLAS:
            prepare_paged_decode()
        self.decode_steps = decode_steps
        self.min_rows, self.min_prefill_rows = buckets.min_rows, buckets.min_prefill_rows
        self.min_context, self.min_prefill = buckets.min_context, buckets.min_prefill
        self.prefill_rows = _fine_bucket if buckets.fine_prefill_rows else _bucket
        cfg = model.cfg
        self.cfg = cfg
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.graphdef, self.state = nnx.split(model)
        self.lora = bool(multi_lora_modules(model))
        self.adapter_slot = adapter_slot or (lambda name: 0)
        self.pools = kv_pools(cfg)  # one per KV shape (Gemma 4's full layers), KV-shared layers in none
        if not self.paged and (len(self.pools) > 1 or self.pools[0].row_map is not None):
            parts = ", ".join(p.part for p in self.pools)
            raise ValueError(f"{cfg.model_type}: kv_path reference serves one KV pool whose every layer has rows of "
                             f"its own; this model has {len(self.pools)} pools ({parts}) or KV-shared layers: serve "
                             "it on a paged path (paged, reduce)")
        dtype = kv_dtype or model.dtype
        check_pool_dtype(dtype)
        self.kv_scales: KVScales | tuple[KVScales, ...] | None = None  # one per pool with several
        self.state_pool: StateCache | None = None
        if is_hybrid(model):
            if num_state_slots is None:
                raise ValueError(f"PagedRunner: {cfg.model_type} has linear-attention layers; give num_state_slots "
                                 "(one state slot per sequence run at once: the scheduler's max_num_seqs)")
            if is_fp8(dtype):
                raise ValueError(f"{cfg.model_type}: an FP8 KV pool is not supported for hybrid models (the scale "
                                 "bound reads every layer as an attention layer with plain RMSNorm weights)")
            self.state_pool = jax.tree.map(self._placed, state_pool(model, num_state_slots))
            self.num_state_slots = num_state_slots
        if is_fp8(dtype):
            if self.lora:
                raise ValueError("PagedRunner: an FP8 KV pool is not supported on a model with LoRA slots (the "
                                 "scales are bounded from the base weights, which an adapter changes)")
            self.kv_scales = kv_scales(model)
        # a vision-language model's image tokens and tower shape (None: a text model, or no tower loaded)
        self.vision = VisionTokens.from_config(cfg) if getattr(model, "visual", None) is not None else None
        self.access: KVAccess = kv_access(kv_path, block_size, self.num_slots)  # the KV path, chosen once
        self.settings = StepSettings(  # fields a path does not read keep their defaults: one compile, not two
            block_size=block_size, pools=self.pools if self.paged else (), lora=self.lora,
            unroll=True if unroll_layers else 1, kernel=self.kernel, scales=self.kv_scales,
            kv_in_place=kv_in_place and not self.paged, hidden=hidden_sink is not None)
        if hidden_sink is not None and not self.paged:
            raise ValueError("PagedRunner: a hidden-state sink (MTP speculation) needs a paged KV path")
        self.hidden_sink = hidden_sink
        self.k_pool, self.v_pool = self._new_pools(dtype), self._new_pools(dtype)
        shape = self.pools[0].shape(self.num_slots)
        if self.kernel is PagedKernel.PALLAS and not kernel_applies(shape, 1, cfg.sliding_window):
            warnings.warn(f"PagedRunner: kv_path PALLAS does not apply to this model / pool (pool {shape}, "
                          f"sliding window {cfg.sliding_window}): decode attention gathers instead "
                          "(the kernel needs no sliding window and a pool under 2^31 slots)", stacklevel=2)
        self.num_calls = 0  # forward calls (waves x decode/prefill groups), for tests / metrics
        self.num_multi_calls = 0  # multi-step decode calls
        self.num_deferred = 0  # requests run in a later wave (same-step prefix hits on blocks being written)

    def recover_pools(self) -> bool:
        """After a failed step: the pools were donated to the call and may be gone; make fresh (empty) ones.
        -> True when they had to be rebuilt (every cached KV is lost: drop the prefix cache too)."""
        pools = jax.tree.leaves((self.k_pool, self.v_pool, self.state_pool))
        lost = any(p.is_deleted() for p in pools)
        if lost:  # every running sequence was failed with the step: zeros will do
            self.k_pool, self.v_pool, self.state_pool = jax.tree.map(
                lambda x: self._new_pool(x.shape, x.dtype), (self.k_pool, self.v_pool, self.state_pool))
        return lost

    def _new_pools(self, dtype) -> jax.Array | tuple[jax.Array, ...]:
        """Empty k (or v) pools, one per `KVPool`: an array, or a tuple with several (`kv_pools.paged_cache`)."""
        pools = tuple(self._new_pool(p.shape(self.num_slots), dtype) for p in self.pools)
        return pools[0] if len(pools) == 1 else pools

    def _new_pool(self, shape, dtype) -> jax.Array:
        """An empty pool, placed as the step returns it (`_placed`)."""
        return self._placed(jnp.zeros(shape, dtype))

    def _placed(self, pool: jax.Array) -> jax.Array:
        """A pool placed as the step returns it: replicated on the weights' mesh when they have one (a trainer's
        model: GRPO rollouts), so the first step's output pool does not change the input types of the next calls
        (one compile per shape, not two)."""
        meshes = {x.sharding.mesh for x in jax.tree.leaves(self.state)
                  if isinstance(getattr(x, "sharding", None), NamedSharding)}
        return jax.device_put(pool, NamedSharding(meshes.pop(), P())) if len(meshes) == 1 else pool

    def refresh_weights(self, model: Decoder) -> None:
        """Take the model's current values (after an adapter was loaded into / unloaded from its slots)."""
        self.state = nnx.state(model)

    # ---- host-side batch building -------------------------------------------------------------------------
    def _address(self, group: list[ScheduledRequest], R: int, S: int, written: list[int] = (), width: int = 0):
        """The KV path's batch fields for ``group`` (`KVAccess.address`)."""
        return self.access.address([s.block_table for s in group], R, S, [s.start for s in group], written, width)

    def _waves(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """Wave index per request: a request whose context blocks another request writes this step runs later."""
        bs = self.block_size
        writer: dict[int, int] = {}
        for i, s in enumerate(scheduled):
            if s.num_new_tokens:
                for b in s.block_table[s.start // bs:(s.start + s.num_new_tokens - 1) // bs + 1]:
                    writer.setdefault(b, i)
        waves = [0] * len(scheduled)
        for i, s in enumerate(scheduled):
            w = 0
            for b in s.block_table[:-(-s.start // bs)]:
                o = writer.get(b, i)
                if o != i:
                    if o > i:
                        raise RuntimeError("a request reads KV written by a later request of the same step")
                    w = max(w, waves[o] + 1)
            waves[i] = w
        return waves

    def _sampling_rows(self, group: list[ScheduledRequest], R: int, S: int, bitmasks=None):
        """Per-row sampling arrays [R] (rows that do not sample this step get greedy defaults) + the BatchMode.

        ``BatchMode``: sampling, its top-k / top-p / min-p filter, penalties and logprobs each switched on only
        when a row of this step needs it (a filter sorts [R, V], logprobs take a top-20 over V, penalties carry
        [R, S] token arrays: a batch of plain temperature sampling pays none of them). The penalties' token
        arrays are [R, S], the context bucket, since a row's prompt + output tokens are its context plus this
        step's tokens. Structured output: when a sampling row
        has a bitmask (``bitmasks``: request id -> [W] int32), rows["token_bitmask"] [R, W] carries them (-1,
        every token allowed, for the other rows) and ``mode.mask`` is set; without one nothing is sent.
        """
        rows, mode = self._sampling_arrays(group, R, S)
        guided = [(r, bitmasks[s.request_id]) for r, s in enumerate(group) if s.sample and s.request_id in bitmasks] \
            if bitmasks else []
        if guided:
            token_bitmask = np.full((R, guided[0][1].shape[-1]), -1, np.int32)
            for r, m in guided:
                token_bitmask[r] = m
            rows["token_bitmask"] = token_bitmask
            mode = dataclasses.replace(mode, mask=True)
        return rows, mode

    def _sampling_arrays(self, group: list[ScheduledRequest], R: int, S: int):
        """``_sampling_rows`` without the bitmasks."""
        temperature = np.zeros(R, np.float32)
        top_k = np.zeros(R, np.int32)
        top_p = np.ones(R, np.float32)
        min_p = np.zeros(R, np.float32)
        seed = np.zeros(R, np.uint32)
        step = np.zeros(R, np.int32)
        rep = np.ones(R, np.float32)
        pres = np.zeros(R, np.float32)
        freq = np.zeros(R, np.float32)
        params = [(r, s, s.sampling_params if isinstance(s.sampling_params, SamplingParams) else SamplingParams())
                  for r, s in enumerate(group) if s.sample]
        sampled = [sp for *_, sp in params if not sp.greedy]
        mode = BatchMode(sample=bool(sampled),
                         filter=any(sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0 for sp in sampled),
                         penalties=any(sp.uses_penalties for *_, sp in params),
                         logprobs=any(sp.logprobs for *_, sp in params))
        rows = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step)
        if not (mode.sample or mode.penalties):
            return rows, mode
        if mode.penalties:
            ids = np.zeros((R, S), np.int32)
            valid = np.zeros((R, S), bool)
            is_out = np.zeros((R, S), bool)
        for r, s, sp in params:
            temperature[r], top_k[r], top_p[r], min_p[r] = sp.temperature, max(sp.top_k, 0), sp.top_p, sp.min_p
            seed[r] = (sp.seed or 0) & 0xFFFFFFFF
            step[r] = s.start + s.num_new_tokens  # position of the token being sampled
            rep[r], pres[r], freq[r] = sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty
            req = s.request
            if sp.uses_penalties and req is not None:
                n_p, n = len(req.prompt_token_ids), min(req.num_tokens, S)
                ids[r, :n] = req.all_token_ids[:n]
                valid[r, :n] = True
                is_out[r, n_p:n] = True
        if mode.penalties:
            rows.update(repetition=rep, presence=pres, frequency=freq, seen_ids=ids, seen_valid=valid,
                        seen_is_output=is_out)
        return rows, mode

    def _device_call(self, fn, batch: InputBatch, settings: StepSettings) -> list:
        """One jitted call of the KV path (`KVAccess`) on the runner's pools (donated, replaced by the returned
        ones) -> its other outputs."""
        self.num_calls += 1
        if self.state_pool is None:
            self.k_pool, self.v_pool, *out = fn(self.graphdef, self.state, self.k_pool, self.v_pool, batch, settings)
        else:
            self.k_pool, self.v_pool, self.state_pool, *out = fn(self.graphdef, self.state, self.k_pool, self.v_pool,
                                                                 batch, settings, state_pool=self.state_pool)
        return out

    def _state_slots(self, group: list[ScheduledRequest], R: int) -> dict[str, np.ndarray]:
        """A hybrid model's batch field ``state_slots`` [R] (padding rows: out of range); nothing otherwise."""
        if self.state_pool is None:
            return {}
        slots = np.full((R,), self.num_state_slots, np.int32)
        for r, s in enumerate(group):
            if s.state_slot < 0:
                raise RuntimeError(f"request {s.request_id!r} runs on a hybrid model without a state slot")
            slots[r] = s.state_slot
        return dict(state_slots=slots)

    def _run(self, group: list[ScheduledRequest], bitmasks=None, targets: list[list[int]] = ()):
        """targets: per row, the prompt tokens its chunk scores (`prompt_logprobs.prompt_targets`; empty: none)."""
        decode = group[0].num_new_tokens == 1  # groups are all-decode or all-prefill
        R = _bucket(len(group), self.min_rows) if decode else self.prefill_rows(len(group), self.min_prefill_rows)
        T = _bucket(max(s.num_new_tokens for s in group), 1 if decode else self.min_prefill)
        S = _context_bucket(max(s.start for s in group) + T, max(self.block_size, self.min_context), self.block_size)
        tokens = np.zeros((R, T), np.int32)
        positions = np.zeros((R, T), np.int32)
        segments = np.zeros((R, T), np.int32)
        ctx_len = np.zeros((R,), np.int32)
        last = np.zeros((R,), np.int32)
        for r, s in enumerate(group):
            n, st = s.num_new_tokens, s.start
            tokens[r, :n] = s.token_ids
            positions[r, :] = st + np.arange(T)
            segments[r, :n] = 1
            ctx_len[r] = st
            last[r] = n - 1
        rows, mode = self._sampling_rows(group, R, S, bitmasks)
        images = rope_positions = None
        if self.vision is not None:  # a vision-language model: image rows (`serve.request_images`)
            images = chunk_images(group, R, T, self.vision)
            rope_positions = group_rope_positions(group, R, T, positions)
        prompt_targets = target_rows(targets, R, T)
        if prompt_targets is not None:
            mode = dataclasses.replace(mode, prompt_logprobs=True)
        batch = InputBatch(tokens=tokens, start=ctx_len, sampling=rows, positions=positions, segment_ids=segments,
                           last_idx=last, adapter_rows=self._adapter_rows(group, R), prompt_targets=prompt_targets,
                           images=images, rope_positions=rope_positions, **self._state_slots(group, R),
                           **self._address(group, R, S, [s.num_new_tokens for s in group], T))
        # a prefill of rows with nothing cached (new prompts, no prefix hit) reads nothing back from the pool
        fresh = self.paged and not decode and not ctx_len.any()
        out = self._device_call(self.access.step, batch, self.settings.for_call(mode, fresh=fresh))[0]
        if self.hidden_sink is not None:
            out = dict(out)
            hidden = out.pop("hidden")
            self.hidden_sink(dataclasses.replace(batch, limit=segments.sum(axis=1, dtype=np.int32)), hidden)
        return out

    def _run_multi(self, group: list[ScheduledRequest]):
        """A multi-step decode group (every row decoding, up to ``num_steps`` tokens each): see ``multi_step``."""
        K = _bucket(max(max(s.num_steps for s in group), self.decode_steps))
        R = _bucket(len(group), self.min_rows)
        S = _context_bucket(max(s.start for s in group) + K, max(self.block_size, self.min_context), self.block_size)
        M = _bucket(max(len(s.request.stop_token_ids) if s.request is not None else 0 for s in group))
        tokens = np.zeros((R,), np.int32)
        start = np.zeros((R,), np.int32)
        limit = np.zeros((R,), np.int32)  # padding rows: 0 = stopped from the start
        stop = np.full((R, M), -1, np.int32)
        for r, s in enumerate(group):
            tokens[r] = s.token_ids[0]
            start[r], limit[r] = s.start, s.num_steps
            ids = sorted(s.request.stop_token_ids) if s.request is not None else []
            stop[r, :len(ids)] = ids
        rows, mode = self._sampling_rows(group, R, S)
        batch = InputBatch(tokens=tokens, start=start, sampling=rows, limit=limit, stop_ids=stop,
                           adapter_rows=self._adapter_rows(group, R), **self._state_slots(group, R),
                           rope_delta=group_rope_delta(group, R) if self.vision is not None else None,
                           **self._address(group, R, S, [s.num_steps for s in group], K))
        self.num_multi_calls += 1
        return self._device_call(self.access.multi_step, batch, self.settings.for_call(mode, K))[0]

    def _collect_multi(self, group: list[ScheduledRequest], host: dict, out: StepResult) -> None:
        for r, s in enumerate(group):
            n = int(host["count"][r])
            out[s.request_id] = [int(t) for t in host["ids"][r, :n]]
            sp = s.sampling_params
            if isinstance(sp, SamplingParams) and sp.logprobs:
                k = min(sp.top_logprobs, MAX_TOP_LOGPROBS)
                out.logprobs[s.request_id] = [
                    (float(host["logprob"][r, i]),
                     [(int(a), float(b)) for a, b in zip(host["top_ids"][r, i, :k], host["top_logprobs"][r, i, :k])])
                    for i in range(n)]

    def _adapter_rows(self, group: list[ScheduledRequest], R: int) -> np.ndarray:
        """[R] int32: each row's adapter slot in the model's multi-LoRA stacks (0 on padding rows and without LoRA)."""
        adapters = np.zeros((R,), np.int32)
        if self.lora:
            for r, s in enumerate(group):
                adapters[r] = self.adapter_slot(s.adapter)
        return adapters

    # ---- speculative verification -------------------------------------------------------------------------
    def verify_shape(self, group: list[ScheduledRequest], num_tokens: int) -> tuple[int, int]:
        """(R, S) of a verify (or draft) call over ``group`` (decoding rows) with K = num_tokens proposals."""
        R = _bucket(len(group), self.min_rows)
        S = _context_bucket(max(s.start for s in group) + num_tokens + 1, max(self.block_size, self.min_context),
                            self.block_size)
        return R, S

    def verify(self, group: list[ScheduledRequest], proposals, num_proposed, draft_probs=None) -> StepResult:
        """Verify the rows' proposals in one target call (``kv_paged.verify_step``; the reference path refuses)
        -> request id -> the emitted tokens (accepted proposals, then the target's next token). proposals [R, K]
        and num_proposed [R] (-1 on padding rows) with R from ``verify_shape``, host or device arrays;
        draft_probs [R, K, V] or None."""
        K = proposals.shape[1]
        R, S = self.verify_shape(group, K)
        last = np.zeros(R, np.int32)
        start = np.zeros(R, np.int32)
        params = []
        for r, s in enumerate(group):
            last[r], start[r] = s.token_ids[0], s.start
            params.append(s.sampling_params if isinstance(s.sampling_params, SamplingParams) else SamplingParams())
        rows = sampling_arrays(params, R)
        batch = InputBatch(tokens=last, start=start, sampling=rows, proposals=proposals, num_proposed=num_proposed,
                           draft_probs=draft_probs, adapter_rows=self._adapter_rows(group, R),
                           **self._state_slots(group, R), **self._address(group, R, S))
        mode = BatchMode(sample=bool((rows["temperature"] > 0).any()))
        res, = self._device_call(self.access.verify, batch, self.settings.for_call(mode))
        hidden = None
        if self.hidden_sink is not None:
            res = dict(res)
            hidden = res.pop("hidden")
        host = jax.device_get(res)
        if hidden is not None:  # the kept tokens: [last, d_1 .. d_a] (a = count - 1 accepted; ids[:a] are those)
            kept = np.concatenate([last[:, None], np.asarray(host["ids"][:, :K], np.int32)], axis=1)
            count = np.where(np.asarray(num_proposed) >= 0, host["count"], 0).astype(np.int32)  # padding rows: 0
            self.hidden_sink(dataclasses.replace(batch, tokens=kept, limit=count,
                                                 proposals=None, num_proposed=None, draft_probs=None), hidden)
        out = StepResult()
        for r, s in enumerate(group):
            out[s.request_id] = [int(t) for t in host["ids"][r, :int(host["count"][r])]]
        return out

    # ---- one step -----------------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledRequest], bitmasks=None, on_dispatch=None) -> StepResult:
        """Run the forward for every scheduled request (writing its KV) and sample where ``sample`` is True.

        bitmasks: request id -> allowed-token bitmask [W] int32 (structured output, ``serve/guided.py``) for the
        sampling rows that have a grammar; single steps only (the scheduler never multi-steps a guided request).
        One host sync per step: every forward call is dispatched first, then the sampled ids (and logprobs
        when asked) of all of them come back together. on_dispatch: called once the calls are dispatched, before
        the host waits for them (host work of the caller's that then overlaps the device's).
        """
        out = StepResult()
        scheduled = [s for s in scheduled if s.num_new_tokens > 0]
        if not scheduled:
            return out
        if any(s.num_steps > 1 for s in scheduled):  # the scheduler makes these all-decode steps, one wave
            if bitmasks:
                raise ValueError("token bitmasks need single steps (a guided request is never multi-stepped)")
            result = self._run_multi(scheduled)
            _call(on_dispatch)
            self._collect_multi(scheduled, jax.device_get(result), out)
            return out
        waves = self._waves(scheduled)
        self.num_deferred += sum(w > 0 for w in waves)
        calls = []  # every call is dispatched before any result is read back (the pool orders them on device)
        for w in range(max(waves) + 1):
            in_wave = [s for s, wi in zip(scheduled, waves) if wi == w]
            for group in _call_groups(in_wave):
                if group:
                    targets = [prompt_targets(s) for s in group] if self.scores_prompts else []
                    sampled = self._run(group, bitmasks, targets)
                    if any(s.sample for s in group) or any(targets):
                        calls.append((group, targets, sampled))
        _call(on_dispatch)
        for (group, targets, _), host in zip(calls, jax.device_get([x for *_, x in calls])):
            if any(targets):
                read_rows(group, targets, host, out.prompt_logprobs)
            for r, s in enumerate(group):
                if not s.sample:
                    continue
                out[s.request_id] = int(host["ids"][r])
                sp = s.sampling_params
                if isinstance(sp, SamplingParams) and sp.logprobs:
                    k = min(sp.top_logprobs, MAX_TOP_LOGPROBS)
                    top = [(int(i), float(v)) for i, v in zip(host["top_ids"][r, :k], host["top_logprobs"][r, :k])]
                    out.logprobs[s.request_id] = (float(host["logprob"][r]), top)
        return out
