"""The serving engine: scheduler (continuous batching, prefix caching, preemption) + paged runner.

    engine = Engine(model, num_blocks=..., block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                    max_model_len=4096)
    rid = engine.add_request(prompt_ids, max_tokens=32, stop_token_ids=(eos,), temperature=0.0)
    while engine.has_unfinished():
        for out in engine.step(): ...        # RequestOutput(request_id, new_token_ids, finished, finish_reason)
    engine.generate([prompt, ...], max_tokens=32) -> [[new ids], ...]   # run to completion, in prompt order

Greedy results do not depend on the batch: every row attends only to its own context.
"""
from __future__ import annotations

import itertools

from surojax.models.decoder import Decoder
from surojax.serve.kv_cache import KVCacheManager
from surojax.serve.runner import PagedRunner, SamplingParams
from surojax.serve.scheduler import Request, RequestOutput, Scheduler


class Engine:
    def __init__(self, model: Decoder, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 4096, chunk_size: int | None = None,
                 enable_prefix_caching: bool = True, kv_dtype=None):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len, chunk_size=chunk_size)
        self.runner = PagedRunner(model, num_blocks=num_blocks, block_size=block_size, kv_dtype=kv_dtype)
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], max_tokens: int = 16, stop_token_ids=(), temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                    request_id: str | None = None, adapter: str | None = None) -> str:
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        self.scheduler.add_request(Request(rid, [int(t) for t in prompt_ids], max_tokens=max_tokens,
                                           stop_token_ids=frozenset(int(t) for t in stop_token_ids),
                                           sampling_params=params, adapter=adapter))
        return rid

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward (writing KV into the pool), sample, advance. -> outputs of this step."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with unfinished requests")
            return []
        sampled = self.runner.execute(sched.scheduled)
        return self.scheduler.update(sampled)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, stop_token_ids=(), **sampling) -> list[list[int]]:
        """Run every prompt to completion; new token ids per prompt, in order (a stop id is kept)."""
        rids = [self.add_request(p, max_tokens, stop_token_ids, **sampling) for p in prompts]
        outs: dict[str, list[int]] = {r: [] for r in rids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in outs:
                    outs[o.request_id].extend(o.new_token_ids)
        return [outs[r] for r in rids]
