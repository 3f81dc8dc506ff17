"""Continuous-batching scheduler (pure Python), after vLLM v1's ``schedule()``.

Architecture choices:

* One notion of work: ``schedule()`` returns, per request, how many tokens to compute this step. A prompt prefill,
  a chunk of a long prompt and a decode (1 token) are the same thing: ``num_computed_tokens`` catches up with
  ``len(all_token_ids)``. When it does, the runner samples one token, which ``update`` appends.
* Running requests are served first (decodes, then unfinished prefill chunks, in admission order); waiting
  requests are admitted FIFO while there is token budget (``max_num_batched_tokens``), a free seat
  (``max_num_seqs``) and free KV blocks. The head of the queue blocks the rest (no overtaking: deterministic).
  A waiting request is not started with a chunk the budget cuts short (shorter than its prompt and than
  ``chunk_size``) in a step that already prefills others: the runner pads a prefill call's rows to its longest
  chunk and its row count to a power of two, so 16 prompts of 512 tokens plus a 64-token head of a 17th ran as
  a 32 x 512 call, 68 ms against 38 for 16 x 512 (Qwen3-0.6B, H100, RESULTS.md session 26), and the 17th gets no
  token sooner for it. Beside decodes alone it starts (a long prompt is never starved by running decodes).
* Preemption by recompute: when a running request cannot get a block, the most recently admitted running request
  is sent back to the front of the waiting queue with its blocks freed and ``num_computed_tokens = 0``; when
  re-admitted it recomputes prompt + generated tokens (often mostly from the prefix cache, since freed blocks keep
  their hashes). No new requests are admitted in a step that preempted.
* Multi-step decode (``decode_steps`` K > 1): when no waiting request has a free seat and every running request
  is decoding, one step schedules up to K decode tokens per request (``ScheduledRequest.num_steps``; fewer where max_tokens or
  max_model_len come first) and reserves their slots ahead (lookahead blocks). The runner then runs the K
  forwards in one device call; ``update`` takes the list of tokens a row produced (it stops early on a stop id
  or its limit). When the free blocks do not cover every lookahead, the step falls back to one token.
* Speculative decoding (``speculative_tokens``, a function request -> the k it proposes this step): a decoding
  request is scheduled as one token plus ``num_spec`` = k lookahead slots (k capped by max_tokens and
  max_model_len; without the blocks for them it decodes plainly). A step where some running request has
  proposals is a single step (multi-step decode runs only when none has: n-gram lookup that finds nothing costs
  nothing against speculation off). ``update`` takes the accepted proposals plus the target's
  next token, keeps the KV of the accepted ones and rolls the rest back: the sequence's length is what was
  accepted and the blocks that held only rejected tokens are freed (``KVCacheManager.free_tail``).
* State slots (a hybrid model's linear-attention states, ``state_slots.py``): a request takes a slot when it is
  admitted and gives it back when it finishes, is aborted or is preempted, like its blocks; its
  ``ScheduledRequest.state_slot`` tells the runner where its state lives.
* Prompt logprobs (``serve.prompt_logprobs``): a request with ``skip_prefix_cache`` takes no prefix-cache hits (a
  cached block has no logits to score its tokens with); one with ``max_tokens`` 0 finishes ("length") when its
  prompt is computed, without a token.
* Sampling params are opaque here; stop token ids / max_tokens / max_model_len are the scheduler's to enforce
  (stop *strings* need detokenisation and belong to the engine, which calls ``abort``/``finish`` for them).
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Mapping

from surojax.serve.config import SchedulerConfig
from surojax.serve.kv_cache import KVCacheManager

if TYPE_CHECKING:  # the scheduler stays pure Python: state_slots.py imports jax
    from surojax.serve.state_slots import StateSlots


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, will recompute
    FINISHED_STOPPED = "stop"  # stop token id
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


_arrival = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    stop_token_ids: frozenset[int] | set[int] | tuple[int, ...] = ()
    sampling_params: Any = None  # opaque to the scheduler
    adapter: str | None = None  # LoRA adapter name; None = base model
    single_step: bool = False  # the host decides each token's mask (a grammar): never in a multi-step decode
    skip_prefix_cache: bool = False  # computes every prompt token (prompt logprobs: a cached block has no logits)
    images: Any = None  # a vision-language prompt's `request_images.RequestImages` (None: text only)
    arrival: int = field(default_factory=lambda: next(_arrival))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission (-1: not yet)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def cache_key(self) -> Hashable:
        return self.adapter

    def block_cache_key(self, first: int, stop: int) -> Hashable:
        """The prefix-cache key of the block of tokens first .. stop - 1: `cache_key`, with the content hashes of
        the images whose tokens the block holds (`RequestImages.block_key`; a block without image tokens keeps
        the text key)."""
        hashes = self.images.block_key(first, stop) if self.images is not None else ()
        return (self.adapter, hashes) if hashes else self.adapter


@dataclass
class ScheduledRequest:
    request_id: str
    num_new_tokens: int  # tokens to compute this step
    start: int  # position of the first of them (== num_computed_tokens before the step)
    token_ids: list[int]  # all_token_ids[start:start + num_new_tokens]
    block_table: list[int]
    sample: bool  # True when this step reaches the end of the sequence: the runner samples one token
    adapter: str | None = None
    sampling_params: Any = None
    request: Any = field(default=None, repr=False)  # the Request (the runner reads its tokens for penalties)
    num_steps: int = 1  # multi-step decode: up to this many tokens sampled in one call (slots reserved ahead)
    num_spec: int = 0  # speculative decode: slots reserved for this many proposals after the one token
    state_slot: int = -1  # a hybrid model: the sequence's slot in the runner's state pool (serve/state_slots.py)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # finished/aborted since the last step

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" (internal: never sent to a client as such)
    error: str | None = None  # why the engine aborted it, for the client ("abort" outputs; None: the client left)
    logprobs: list | None = None  # per new token: (logprob, [(id, logprob), ...]) when the request asked
    prompt_logprobs: list | None = None  # the request's first output, when it asked: [None, PromptLogprob, ...]
    text: str = ""  # detokenised delta (engine with a tokenizer)
    reasoning_text: str = ""  # delta inside <think> ... </think> (requests that split reasoning)


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig,
                 speculative_tokens: Callable[[Request], int] | None = None, state_slots: StateSlots | None = None):
        """config.max_model_len must be resolved (not None: `Engine` resolves it from the model).
        speculative_tokens: request -> how many tokens may be proposed for it per step (None: no speculation).
        state_slots: a hybrid model's per-sequence state slots (at least max_num_seqs): a request gets one when
        it is admitted and gives it back when it finishes or is preempted."""
        if state_slots is not None and state_slots.num_slots < config.max_num_seqs:
            raise ValueError(f"Scheduler: {state_slots.num_slots} state slots for max_num_seqs "
                             f"{config.max_num_seqs}: every running sequence needs one")
        if config.max_model_len is None:
            raise ValueError("Scheduler: config.max_model_len is None; resolve it first (Engine does)")
        if kv.num_blocks * kv.block_size < config.max_model_len:
            raise ValueError("KV pool smaller than max_model_len: a lone request could never finish")
        self.kv = kv
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.chunk_size = config.chunk_size or config.max_num_batched_tokens
        self.decode_steps = config.decode_steps
        self.num_multi_steps = 0  # steps scheduled as multi-step decodes (tests / metrics)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._last: dict[str, ScheduledRequest] = {}
        self.num_preemptions = 0
        self.speculative_tokens = speculative_tokens
        self.state_slots = state_slots

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("empty prompt")
        if len(req.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(req.prompt_token_ids)} tokens >= max_model_len {self.max_model_len}")
        if req.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 (0: the prompt is computed, nothing is generated)")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (client disconnect): frees its blocks now. False if unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request from outside (abort, or a stop string the engine found): frees its blocks now."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status)
        return True

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self._free_state_slot(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------------------
    def _num_new(self, req: Request, budget: int, num_computed: int) -> int:
        n = req.num_tokens - num_computed
        return max(0, min(n, self.chunk_size, budget, self.max_model_len - num_computed))

    def _free_state_slot(self, req: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.free(req.request_id)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        s = req.num_computed_tokens
        slot = -1 if self.state_slots is None else self.state_slots.slot(req.request_id)
        return ScheduledRequest(
            req.request_id, n, s, req.all_token_ids[s:s + n], self.kv.block_table(req.request_id),
            sample=s + n == req.num_tokens, adapter=req.adapter, sampling_params=req.sampling_params, request=req,
            state_slot=slot)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._free_state_slot(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _steps_left(self, req: Request) -> int:
        """Tokens a decoding request may still produce (max_tokens, max_model_len), capped at ``decode_steps``."""
        return max(1, min(self.decode_steps, req.max_tokens - len(req.output_token_ids),
                          self.max_model_len - req.num_tokens))

    def _num_spec(self, req: Request, budget: int) -> int:
        """Proposals for a decoding request this step: its K, capped so that every token the step may emit
        (k + 1) fits max_tokens and max_model_len and the step's token budget."""
        if self.speculative_tokens is None or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        cap = min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens - 1, budget - 1)
        return min(self.speculative_tokens(req), cap) if cap > 0 else 0

    def _schedule_multi_step(self, out: SchedulerOutput) -> bool:
        """All running requests decode K tokens each, with their slots reserved ahead. False (nothing changed)
        unless K > 1, no waiting request could be admitted (one waits only while every seat is taken: steady
        arrivals at full occupancy keep multi-step; a free seat and a waiting request make this a single step,
        which admits it), every running one is decoding and none is ``single_step``, and the free blocks cover
        the lookahead."""
        admissible = self.waiting and len(self.running) < self.max_num_seqs
        if (self.decode_steps == 1 or admissible or not self.running
                or len(self.running) > self.max_num_batched_tokens or any(r.single_step for r in self.running)
                or any(r.num_computed_tokens != r.num_tokens - 1 for r in self.running)):
            return False
        steps = [self._steps_left(r) for r in self.running]
        if max(steps) == 1 or any(self._num_spec(r, self.max_num_batched_tokens) for r in self.running):
            return False  # a request with proposals is verified in a single step (the others decode beside it)
        need = sum(max(0, self.kv.blocks_needed(r.num_computed_tokens + n) - len(self.kv.block_table(r.request_id)))
                   for r, n in zip(self.running, steps))
        if need > self.kv.num_free_blocks:
            return False
        for r, n in zip(self.running, steps):
            if not self.kv.allocate(r, n):  # cannot fail: the free blocks were counted above
                raise RuntimeError(f"lookahead allocation failed for {r.request_id!r}")
            s = self._scheduled(r, 1)
            s.num_steps = n
            out.scheduled.append(s)
        self.num_multi_steps += 1
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if self._schedule_multi_step(out):
            self._last = {s.request_id: s for s in out.scheduled}
            return out
        budget = self.max_num_batched_tokens

        # 1. running requests, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new(req, budget, req.num_computed_tokens)
            if n == 0:
                i += 1
                continue
            k = self._num_spec(req, budget)
            if k and self.kv.allocate(req, 1 + k):  # else: a plain decode (with preemption if need be)
                s = self._scheduled(req, 1)
                s.num_spec = k
                out.scheduled.append(s)
                budget -= 1 + k
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, n))
                budget -= n
                i += 1

        # 2. admit waiting requests FIFO (not in a step that preempted)
        while (self.waiting and not out.preempted_request_ids and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            blocks, n_hit = self.kv.get_computed_blocks(req) if not req.skip_prefix_cache else ([], 0)
            n = self._num_new(req, budget, n_hit)
            if n < min(req.num_tokens - n_hit, self.chunk_size) and any(x.num_new_tokens > 1 for x in out.scheduled):
                break  # the budget would cut its chunk short beside other prefills: it starts whole next step
            if n == 0 or not self.kv.allocate(req, n, blocks):
                break
            self.waiting.popleft()
            if self.state_slots is not None:  # a seat: len(running) < max_num_seqs <= the slots
                self.state_slots.allocate(req.request_id)
            if not req.skip_prefix_cache:
                self.kv.record_prefix_query(req.num_tokens, n_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            req.num_computed_tokens = n_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n

        self._last = {s.request_id: s for s in out.scheduled}
        return out

    def update(self, sampled: Mapping[str, int | list[int]] | Iterable[tuple[str, int | list[int]]] = ()
               ) -> list[RequestOutput]:
        """Advance the last ``schedule()``'s requests. ``sampled`` maps request id -> sampled token for those with
        ``sample=True`` (others are ignored), or the list of tokens a multi-step decode produced (in order).
        Finishes on stop token / max_tokens / max_model_len and frees blocks (tokens after the one that finishes
        a request are dropped). Requests aborted since ``schedule()`` are skipped."""
        sampled = dict(sampled)
        outs: list[RequestOutput] = []
        last, self._last = self._last, {}
        for rid, s in last.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or req.num_computed_tokens != s.start:
                continue  # aborted (or preempted and re-admitted) since schedule()
            req.num_computed_tokens += s.num_new_tokens
            if not s.sample:
                continue
            if req.max_tokens == 0:  # the prompt only (its logprobs): done once it is computed, no token kept
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                outs.append(RequestOutput(rid, [], True, RequestStatus.FINISHED_LENGTH.value))
                continue
            if rid not in sampled:
                raise KeyError(f"no sampled token for {rid!r}")
            toks = sampled[rid]
            toks = [int(t) for t in toks] if isinstance(toks, (list, tuple)) else [int(toks)]
            if not toks or len(toks) > max(s.num_steps, s.num_spec + 1):
                raise ValueError(f"{rid!r}: {len(toks)} sampled tokens for a step of {s.num_steps}"
                                 f" (+{s.num_spec} proposals)")
            status, new = None, []
            for i, tok in enumerate(toks):
                if i:
                    req.num_computed_tokens += 1  # the previous token's KV was written in the same call
                req.output_token_ids.append(tok)
                new.append(tok)
                if tok in req.stop_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    break
            if s.num_steps > 1 or s.num_spec:  # as single steps would have: blocks whose KV is written are cached
                self.kv.publish(req, req.num_computed_tokens)
            if s.num_spec and status is None:  # roll back past the rejected proposals
                self.kv.free_tail(req, req.num_computed_tokens)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            outs.append(RequestOutput(rid, new, status is not None, status.value if status else None))
        return outs
