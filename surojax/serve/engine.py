"""The serving engine: scheduler (continuous batching, prefix caching, preemption) + paged runner + text.

    engine = Engine(model, EngineConfig(scheduler=SchedulerConfig(max_model_len=4096)), tokenizer=tok)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, stop_token_ids=(eos,), stop=("\\n\\n",)))
    while engine.has_unfinished():
        for out in engine.step(): ...   # RequestOutput(request_id, new_token_ids, finished, finish_reason,
                                        #               logprobs, text, reasoning_text)
    engine.generate([prompt, ...], max_tokens=32) -> [[new ids], ...]   # run to completion, in prompt order

Every setting is a field of `EngineConfig` (surojax/serve/config.py, the defaults live there). The engine
decides once what the config leaves open: max_model_len None -> the model's (`default_max_model_len`),
num_blocks None -> from free device memory (`capacity.num_kv_blocks`), kv_path AUTO -> PALLAS on a GPU where
the kernel applies, else PAGED (`resolve_kv_path`); with PALLAS a pool sized from free memory is capped at the
kernel's 2^31 slots over all layers (its int32 slot indices; far past any GPU's memory at today's shapes).

Greedy results do not depend on the batch: every row attends only to its own context, and the batched sampler
takes each row's argmax (or its own seeded key) whatever the other rows ask for.

Text: with a tokenizer, each request is detokenised incrementally (``detokenize.RequestText``); a stop string
ends the request in the step that produced it (its blocks are freed at once) and its text is cut before the
match. LoRA: ``lora=AdapterSlots(...)`` (built on the model before the engine) maps ``adapter`` names to slots.
Multi-step decode (``decode_steps`` K > 1): when nothing waits and every running request decodes, up to K tokens
per request come from one device call (``multi_step``); the outputs of such a step carry several tokens each.
Stop strings are checked token by token afterwards: the tokens after a match are dropped, as K single steps
would. Structured output (``SamplingParams.grammar``, ``guided.py``): each guided request has a matcher; every
step the matchers of the sampling rows write their allowed-token bitmasks, which the runner applies on the
device; each accepted token advances the matcher, and a grammar that admits nothing more ends the request
("stop"). Guided requests decode one token per step (no multi-step).

Prompt logprobs (``SamplingParams.prompt_logprobs``, `serve.prompt_logprobs`): the prefill chunks of a request
that asks score its prompt tokens on the device; the scores are collected by position and handed out with the
request's first output (``RequestOutput.prompt_logprobs``). Such a request reads no prefix-cache blocks; with
max_tokens 0 it ends when its prompt is computed.

Speculative decoding (``config.speculative``, `serve.speculative`): decoding requests without penalties or
logprobs get up to K proposals a step, from prompt lookup (NGRAM), the draft model (DRAFT: ``draft_model``, a
`DraftRunner` on its own pool that mirrors the target's; the pool size from free memory is shared between the
two in proportion to their KV bytes per token) or the checkpoint's MTP head (MTP: ``mtp_head``, an `MTPRunner`
on its own one-layer pool, fed the target's hidden states by every target call: `serve.mtp`; hybrid Qwen3.5
models only; no sleep mode). The step verifies every speculating row in one target call
BEFORE the other rows run (their prefix hits may read blocks it writes), then runs the rest as usual. Outputs
then carry several tokens; greedy tokens equal plain decoding's, sampled ones follow the target's distribution.
``spec_stats`` counts proposals and acceptances (/metrics). Refused with LoRA; guided requests are not
speculated.

Hybrid models (Qwen3.5: Gated DeltaNet layers beside the attention layers): the paged pool holds the attention
layers' KV, and each running sequence holds a state slot for its linear layers' states (`serve.state_slots`:
allocated at admission, zeroed when the sequence starts, freed with it; chunked prefill and multi-step decode
continue from it). Prefix caching is turned off (logged: `state_slots.prefix_caching_off`). Speculative decoding
works (the verify step replays each row's state to its last accepted token: `kv_paged.verify_step`), but a
hybrid draft model is refused (`HybridServingError`: `state_slots.SPECULATIVE_REFUSED`: its drafted states would
need the same); so is an FP8 KV pool. Runtime LoRA slots (`peft.multi_lora`) wrap both stacks.

Images (a vision-language model: ``add_request(ids, ..., images=ImagePrompt)``, `serve.request_images`): the
vision tower runs in the prefill call of each chunk that holds an image's tokens, the prompt takes its M-RoPE
positions and every later token index + rope_delta on all three axes; the prefix cache keys the blocks that hold
image tokens by the images' content hashes. Multi-step decode and LoRA adapters serve image requests as any
other; speculative decoding does not propose for them (they decode one token a step beside speculating rows).

Sleep mode (`serve.sleep`, vLLM's level 1): ``sleep()`` (refused with requests in flight) moves the weights of
every runner to host memory, deletes their device buffers and the KV pools, and drops the prefix cache;
``wake_up()`` puts them back. ``add_request`` and the LoRA calls wake a sleeping engine first, so a request
waits for the weights instead of failing; greedy output after a wake equals the output before the sleep.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random

import jax
import numpy as np

from pallas_kernels.paged_decode import max_pool_blocks
from surojax.generation.sampling import SamplingParams
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.mtp import MTPDecoder
from surojax.serve.capacity import kv_bytes_per_token, kv_pool_dtype, num_kv_blocks
from surojax.serve.config import EngineConfig, KVPath, SpecMethod, default_max_model_len
from surojax.serve.detokenize import RequestText, apply_text
from surojax.serve.guided import GrammarError, GrammarMatcher, GrammarVocab
from surojax.serve.draft import DraftRunner
from surojax.serve.mtp import MTPRunner
from surojax.serve.kv_cache import KVCacheManager
from surojax.serve.prompt_logprobs import PromptScores
from surojax.serve.request_images import RequestImages
from surojax.serve.runner import PagedRunner, StepResult
from surojax.serve.scheduler import Request, RequestOutput, RequestStatus, ScheduledRequest, Scheduler
from surojax.serve import sleep as sleep_mode
from surojax.serve.speculative import SpecStats, ngram_propose, speculation_allowed
from surojax.serve.state_slots import (StateSlots, is_hybrid, prefix_caching_off, speculative_refused,
                                       state_pool_bytes)

log = logging.getLogger(__name__)


def resolve_kv_path(kv_path: KVPath, cfg: ModelConfig, block_size: int, num_blocks: int | None) -> KVPath:
    """AUTO -> PALLAS on a GPU where the kernel applies (no sliding window; an explicit num_blocks must fit under
    the kernel's 2^31 slots, a pool sized from free memory is capped to fit), else PAGED. Any other path
    is returned as it is."""
    if kv_path is not KVPath.AUTO:
        return kv_path
    fits = num_blocks is None or num_blocks <= max_pool_blocks(cfg.num_attention_layers, block_size,
                                                                cfg.num_kv_heads, cfg.head_dim)
    choice = KVPath.PALLAS if jax.default_backend() == "gpu" and cfg.sliding_window is None and fits \
        else KVPath.PAGED
    log.info("KV path: %s (auto: the Pallas kernel needs a GPU, no sliding window and a pool under 2^31 "
             "slots)", choice.value)
    return choice


def _once(fn):
    """``fn`` (or nothing, for None) as a function that runs it on its first call only."""
    pending = [fn] if fn is not None else []

    def call():
        if pending:
            pending.pop()()

    return call


class HybridServingError(ValueError):
    """A serving feature a hybrid model (linear-attention layers with per-sequence state) cannot have."""

    is_user_error = True


class EngineBusyError(RuntimeError):
    """An engine with requests in flight cannot sleep."""


class Engine:
    def __init__(self, model: Decoder, config: EngineConfig = EngineConfig(), *, tokenizer=None, lora=None,
                 kv_dtype=None, draft_model: Decoder | None = None, mtp_head: MTPDecoder | None = None):
        """config: every setting (`EngineConfig`); tokenizer: for text and stop strings; lora: `AdapterSlots`
        built on the model; kv_dtype: the pool's dtype (None: config.kv_cache_dtype's); draft_model: the
        speculative draft (exactly when config.speculative.method is DRAFT; same vocabulary); mtp_head: the
        model's MTP head (exactly when the method is MTP: `weights.mtp_checkpoint.load_mtp`)."""
        cfg = model.cfg
        spec = config.speculative
        hybrid = is_hybrid(model)
        if draft_model is not None and is_hybrid(draft_model):
            raise HybridServingError(f"the draft model ({draft_model.cfg.model_type}): "
                                     f"{speculative_refused(draft_model)}")
        if hybrid and config.enable_prefix_caching:
            log.info("%s: %s", cfg.model_type, prefix_caching_off(model))
            config = dataclasses.replace(config, enable_prefix_caching=False)
        if spec is not None and spec.method is SpecMethod.MTP and lora is not None:
            raise ValueError("MTP speculation is not supported with LoRA adapters (the head predicts the base model)")
        if (draft_model is not None) != (spec is not None and spec.method is SpecMethod.DRAFT):
            raise ValueError("Engine: pass draft_model exactly when the speculative method is 'draft'")
        if (mtp_head is not None) != (spec is not None and spec.method is SpecMethod.MTP):
            raise ValueError("Engine: pass mtp_head exactly when the speculative method is 'mtp'")
        if mtp_head is not None and not hybrid:
            raise ValueError(f"{cfg.model_type}: MTP speculation is implemented for the Qwen3.5 / Qwen3.6 families "
                             "(hybrid models: the head's pending hidden state lives at each sequence's state slot)")
        if draft_model is not None and draft_model.cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size}) differs from the "
                             f"target's ({cfg.vocab_size}): speculation needs the same tokenizer")
        kv_dtype = kv_pool_dtype(config.kv_cache_dtype, model.dtype, kv_dtype)
        sched = config.scheduler
        if sched.max_model_len is None:
            sched = dataclasses.replace(sched, max_model_len=default_max_model_len(cfg.max_position_embeddings))
        bs = config.block_size
        kv_path = resolve_kv_path(config.kv_path, cfg, bs, config.num_blocks)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = num_kv_blocks(cfg, kv_dtype, bs, sched.max_model_len,
                                       memory_utilization=config.memory_utilization,
                                       reserved_bytes=state_pool_bytes(model, sched.max_num_seqs),
                                       others_bytes_in_use=config.others_bytes_in_use)
            helper = draft_model if draft_model is not None else mtp_head
            if helper is not None:  # the draft's / MTP head's pool has as many blocks: share the memory
                t, d = kv_bytes_per_token(cfg, kv_dtype), kv_bytes_per_token(helper.cfg, helper.dtype)
                num_blocks = max(1, num_blocks * t // (t + d))
            if kv_path is KVPath.PALLAS:  # the kernel indexes the pool's slots with int32
                num_blocks = min(num_blocks, max_pool_blocks(cfg.num_attention_layers, bs, cfg.num_kv_heads,
                                                              cfg.head_dim))
        self.config = dataclasses.replace(config, scheduler=sched, num_blocks=num_blocks, kv_path=kv_path)
        self.model = model
        self.tokenizer = tokenizer
        self.lora = lora
        self.max_model_len = sched.max_model_len
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, sched, self._speculative_tokens if spec is not None else None,
                                   StateSlots(sched.max_num_seqs) if hybrid else None)
        self.mtp = None
        if mtp_head is not None:
            self.mtp = MTPRunner(mtp_head, num_blocks=num_blocks, block_size=bs, kv_path=kv_path,
                                 num_state_slots=sched.max_num_seqs, buckets=config.buckets,
                                 unroll_layers=config.unroll_layers)
        self.runner = PagedRunner(model, num_blocks=num_blocks, block_size=bs, kv_path=kv_path, kv_dtype=kv_dtype,
                                  adapter_slot=lora.slot if lora is not None else None, buckets=config.buckets,
                                  kv_in_place=config.kv_in_place, decode_steps=sched.decode_steps,
                                  unroll_layers=config.unroll_layers,
                                  num_state_slots=sched.max_num_seqs if hybrid else None,
                                  hidden_sink=self.mtp.mirror if self.mtp is not None else None)
        self.draft = None
        if draft_model is not None:
            self.draft = DraftRunner(draft_model, num_blocks=num_blocks, block_size=bs, kv_path=kv_path,
                                     kv_dtype=draft_model.dtype, buckets=config.buckets,
                                     unroll_layers=config.unroll_layers)
        self.spec_stats = SpecStats() if spec is not None else None
        self._ngram: dict[str, list[int]] = {}  # request id -> this step's prompt-lookup proposals
        self._ids = itertools.count()
        self._seeds = random.Random(0)
        self._text: dict[str, RequestText] = {}
        self._matchers: dict[str, GrammarMatcher] = {}  # structured output: request id -> its grammar's state
        self._prompt_scores: dict[str, PromptScores] = {}  # prompt logprobs not yet handed out, by request id
        self._slept: sleep_mode.Slept | None = None  # sleep mode: the weights on the host, no KV pool (`sleep`)

    @functools.cached_property
    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer as the grammar engine sees it (built on first use: seconds for a 150k vocabulary)."""
        if self.tokenizer is None:
            raise ValueError("structured output (a grammar) needs an engine with a tokenizer")
        return GrammarVocab(self.tokenizer, self.model.cfg.vocab_size)

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | int | None = None,
                    stop_token_ids=None, *, request_id: str | None = None, adapter: str | None = None,
                    split_reasoning: bool = False, images=None, **sampling) -> str:
        """Queue a request -> its id. ``params`` (or keyword arguments building one; the old positional form
        ``add_request(ids, max_tokens, stop_token_ids, temperature=...)`` also works). images: the
        `image_prompt.ImagePrompt` whose ``ids`` are ``prompt_ids`` (a vision-language model only)."""
        if not isinstance(params, SamplingParams):
            if params is not None:
                sampling["max_tokens"] = params
            if stop_token_ids is not None:
                sampling["stop_token_ids"] = tuple(stop_token_ids)
            if "stop" in sampling and isinstance(sampling["stop"], str):
                sampling["stop"] = (sampling["stop"],)
            params = SamplingParams(**sampling)
        params.validate(self.model.cfg.vocab_size)
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(32))
        if (params.stop or split_reasoning) and self.tokenizer is None:
            raise ValueError("stop strings and reasoning need an engine with a tokenizer")
        if self.lora is not None:
            self.lora.slot(adapter)  # raises for an unknown adapter
        elif adapter is not None:
            raise ValueError("LoRA adapters need an engine built with lora=AdapterSlots(...)")
        matcher = None
        if params.grammar is not None:  # GrammarError (a ValueError) for an invalid grammar
            matcher = self.grammar_vocab.matcher(params.grammar, params.stop_token_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        prompt_ids = [int(t) for t in prompt_ids]
        request_images = self._images(prompt_ids, images) if images is not None else None
        if self._slept is not None:  # a request for a sleeping engine waits for its weights to come back
            self.wake_up()
        self.scheduler.add_request(Request(rid, prompt_ids, max_tokens=params.max_tokens,
                                           stop_token_ids=frozenset(params.stop_token_ids),
                                           sampling_params=params, adapter=adapter, single_step=matcher is not None,
                                           skip_prefix_cache=params.prompt_logprobs is not None,
                                           images=request_images))
        if params.prompt_logprobs is not None:
            self._prompt_scores[rid] = PromptScores(len(prompt_ids))
        if matcher is not None:
            self._matchers[rid] = matcher
        if self.tokenizer is not None:
            self._text[rid] = RequestText(self.tokenizer, prompt_ids, stop=params.stop,
                                          stop_token_ids=params.stop_token_ids,
                                          think_ids=self.think_ids() if split_reasoning else None)
        return rid

    def _images(self, prompt_ids: list[int], prompt) -> RequestImages:
        """A request's `ImagePrompt` -> its `RequestImages`, checked against the prompt and the model."""
        vision = self.runner.vision
        if vision is None:
            raise ValueError(f"{self.model.cfg.model_type}: this model has no vision tower: it takes no images")
        if list(prompt.ids) != prompt_ids:
            raise ValueError("images: the ImagePrompt's ids are not the request's prompt ids")
        width = np.asarray(prompt.pixel_values).shape[-1]
        if width != vision.vision.patch_dim:
            raise ValueError(f"images: pixel rows of {width} values; the vision tower takes {vision.vision.patch_dim} "
                             "(channels x temporal_patch_size x patch_size^2)")
        return RequestImages.from_prompt(prompt, len(prompt_ids))

    def think_ids(self) -> tuple[int, int] | None:
        """(<think>, </think>) token ids when the tokenizer has both."""
        if self.tokenizer is None:
            return None
        a, b = self.tokenizer.token_to_id("<think>"), self.tokenizer.token_to_id("</think>")
        return (a, b) if a is not None and b is not None else None

    def abort(self, request_id: str) -> bool:
        self._text.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._prompt_scores.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- speculation ------------------------------------------------------------------------------------------
    def _speculative_tokens(self, req: Request) -> int:
        """The proposals a decoding request has this step: 0 for requests the verify step cannot serve (penalties,
        logprobs, images); n-gram: the tokens prompt lookup finds (kept for `_speculate`; 0 when nothing recurs or
        more requests run than `disable_by_batch_size`, so the request decodes plainly, multi-step included); a
        draft / MTP head proposes K."""
        sp = req.sampling_params
        if (isinstance(sp, SamplingParams) and not speculation_allowed(sp)) or req.images is not None:
            return 0
        spec = self.config.speculative
        if spec.method is not SpecMethod.NGRAM:
            return spec.num_tokens
        if spec.disable_by_batch_size is not None and len(self.scheduler.running) > spec.disable_by_batch_size:
            return 0
        found = self._ngram.get(req.request_id)  # asked again in one schedule (multi-step check, then the step)
        if found is None:
            found = self._ngram[req.request_id] = ngram_propose(req.all_token_ids, spec.num_tokens, spec.ngram_max,
                                                                spec.ngram_min)
        return len(found)

    def _speculate(self, group: list[ScheduledRequest]) -> StepResult:
        """Propose for the speculating rows, verify in one target call -> request id -> emitted tokens."""
        spec = self.config.speculative
        K = spec.num_tokens
        R, S = self.runner.verify_shape(group, K)
        proposer = self.draft if self.draft is not None else self.mtp
        if proposer is not None:
            proposals, counts, q = proposer.propose(group, K, R, S)
        else:  # the n-gram proposals found when the step was scheduled, as many as it reserved slots for
            proposals, counts, q = np.zeros((R, K), np.int32), np.full(R, -1, np.int32), None
            for r, s in enumerate(group):
                found = self._ngram[s.request_id][:s.num_spec]
                proposals[r, :len(found)], counts[r] = found, len(found)
        out = self.runner.verify(group, proposals, counts, q)
        for r, s in enumerate(group):
            self.spec_stats.record(int(counts[r]), len(out[s.request_id]) - 1)
        return out

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward (writing KV into the pool), sample, advance, detokenise. -> this step's outputs.
        A stop string ends its request in this very step (its blocks are freed at once)."""
        outs = self.step_tokens()
        for o in outs:
            text = self._text.get(o.request_id)
            if text is not None and apply_text(o, text):
                self.finish(o.request_id)
            if o.finished:
                self._text.pop(o.request_id, None)
        return outs

    def step_tokens(self, on_dispatch=None) -> list[RequestOutput]:
        """`step` without the text: the outputs carry token ids (and logprobs), ``text`` stays empty. For a
        caller that detokenises elsewhere (``AsyncEngine``'s output thread: it takes each request's
        `RequestText` with `detach_text` and ends a request whose stop string it finds with `finish`).
        on_dispatch: called once, as soon as the step's device calls are queued (at the latest on return), so
        that host work it releases (the previous step's outputs) runs while the device does, not before."""
        once = _once(on_dispatch)
        try:
            return self._step_tokens(once)
        finally:
            once()

    def _step_tokens(self, on_dispatch) -> list[RequestOutput]:
        self._ngram.clear()  # this step's n-gram proposals (`_speculative_tokens`) are found while scheduling it
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with unfinished requests")
            return []
        for helper in (self.draft, self.mtp):
            if helper is not None:  # after a failed call: a lost draft / MTP pool costs acceptance, never tokens
                helper.recover_pools()
        speculating = [s for s in sched.scheduled if s.num_spec]
        rest = [s for s in sched.scheduled if not s.num_spec]
        if speculating:  # the verify call is read back before the rest run: hand over now, not a call later
            on_dispatch()
        sampled = self._speculate(speculating) if speculating else StepResult()
        if self.draft is not None:
            self.draft.execute(rest)  # the draft pool mirrors every KV write of the target's
        plain = self.runner.execute(rest, self._bitmasks(rest), on_dispatch)
        sampled.update(plain)
        sampled.logprobs.update(plain.logprobs)
        for rid, scores in plain.prompt_logprobs.items():
            if rid in self._prompt_scores:
                self._prompt_scores[rid].update(scores)
        outs = self.scheduler.update(sampled)
        for o in outs:
            if o.request_id in self._prompt_scores:  # its first output: the prefill is complete
                o.prompt_logprobs = self._prompt_scores.pop(o.request_id).result()
            if o.request_id in self._matchers:
                self._advance_grammar(o)
            if o.request_id in sampled.logprobs:
                lp = sampled.logprobs[o.request_id]
                o.logprobs = (lp if isinstance(lp, list) else [lp])[:len(o.new_token_ids)]
            if o.finished:
                self._matchers.pop(o.request_id, None)
        return outs

    def detach_text(self, request_id: str) -> RequestText | None:
        """Hand the request's detokeniser to the caller (`step` no longer makes its text; `step_tokens` never
        does). None without a tokenizer."""
        return self._text.pop(request_id, None)

    def finish(self, request_id: str) -> bool:
        """End a request whose stop string was found ("stop"): its blocks are freed now. False if it is gone."""
        self._text.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._prompt_scores.pop(request_id, None)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def _bitmasks(self, scheduled) -> dict:
        """request id -> allowed-token bitmask [W] int32 for this step's sampling rows that have a grammar."""
        guided = [s.request_id for s in scheduled if s.sample and s.request_id in self._matchers]
        if not guided:
            return {}
        masks = self.grammar_vocab.fill([self._matchers[r] for r in guided])  # [n, W]
        return dict(zip(guided, masks))

    def _advance_grammar(self, o: RequestOutput) -> None:
        """Feed this step's tokens to the request's matcher; a complete grammar finishes the request ("stop").
        A token the grammar does not take was sampled from a mask with nothing the grammar takes (a state this
        vocabulary cannot continue): it is dropped and the request ends ("abort") with the matcher's reason."""
        matcher = self._matchers[o.request_id]
        for k, tok in enumerate(o.new_token_ids):  # a stop id ends it where the grammar may end (`advance`)
            try:
                matcher.advance(tok)
            except GrammarError as e:  # end the request rather than the engine
                log.warning("request %s: structured output stuck: %s", o.request_id, e)
                del o.new_token_ids[k:]
                if not o.finished:
                    self.scheduler.finish_request(o.request_id, RequestStatus.FINISHED_ABORTED)
                o.finished, o.finish_reason, o.error = True, "abort", f"structured output: {e}"
                return
        if matcher.finished:  # complete, also when its last token was the last one max_tokens allowed
            if not o.finished:
                self.scheduler.finish_request(o.request_id, RequestStatus.FINISHED_STOPPED)
            o.finished, o.finish_reason = True, "stop"

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, stop_token_ids=(), **sampling) -> list[list[int]]:
        """Run every prompt to completion; new token ids per prompt, in order (a stop id is kept)."""
        rids = [self.add_request(p, max_tokens, stop_token_ids, **sampling) for p in prompts]
        outs: dict[str, list[int]] = {r: [] for r in rids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in outs:
                    outs[o.request_id].extend(o.new_token_ids)
        return [outs[r] for r in rids]

    # ---- sleep mode (`serve.sleep`) --------------------------------------------------------------------------
    @property
    def runners(self) -> list[PagedRunner]:
        """The runners holding weights and pools: the target's, then the draft's."""
        return [self.runner] + ([self.draft] if self.draft is not None else [])

    @property
    def is_sleeping(self) -> bool:
        return self._slept is not None

    def sleep(self, level: int = 1) -> bool:
        """Move the weights to host memory and free the KV pool (vLLM's level 1) -> False if already asleep.
        Refused (`EngineBusyError`) while requests are in flight. The next request (or `wake_up`) wakes it."""
        if level != 1:
            raise ValueError(f"sleep level {level} is not supported: level 1 moves the weights to host memory and "
                             "frees the KV cache (level 2, discarding the weights, is not offered)")
        if self.mtp is not None:
            raise ValueError("sleep mode is not supported with MTP speculation (the head shares the model's "
                             "embedding and LM head)")
        if self.has_unfinished():
            raise EngineBusyError(f"cannot sleep with {len(self.scheduler.requests)} request(s) in flight")
        if self._slept is not None:
            return False
        self.kv.reset_prefix_cache()  # the cached blocks' KV goes with the pool
        self._slept = sleep_mode.put_to_sleep(self.runners, model=self.model)
        log.info("asleep: %.2f GiB of weights on the host, the KV pool freed", self._slept.host_bytes / 2**30)
        return True

    def wake_up(self) -> bool:
        """Weights back on the device, a fresh KV pool -> False if it was awake."""
        if self._slept is None:
            return False
        sleep_mode.wake_up(self._slept, self.runners, model=self.model)
        self._slept = None
        log.info("awake: weights back on the device, KV pool re-created")
        return True

    # ---- LoRA -------------------------------------------------------------------------------------------------
    def load_lora(self, name: str, path) -> None:
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.wake_up()  # the adapter is written into the model's device arrays
        try:
            self.lora.load(name, path)
        finally:  # the slot stacks written are new arrays (the old ones donated): the runner takes them, always
            self.runner.refresh_weights(self.model)

    def unload_lora(self, name: str) -> list[str]:
        """Unload an adapter; its running / waiting requests are aborted -> their ids."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.lora.slot(name)
        self.wake_up()
        aborted = [rid for rid, r in list(self.scheduler.requests.items()) if r.adapter == name]
        for rid in aborted:
            self.abort(rid)
        try:
            self.lora.unload(name)
        finally:
            self.runner.refresh_weights(self.model)
        self.kv.reset_prefix_cache()  # a new adapter under the same name must not hit the old one's blocks
        return aborted
