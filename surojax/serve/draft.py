"""The draft model of speculative decoding: a `PagedRunner` over its own pool that mirrors the target's.

The draft pool has the target pool's geometry in blocks (same num_blocks, same block_size; its own layers, KV
heads and head size) and is addressed by the SAME block tables the scheduler hands the target. Every token
whose KV the target writes, the draft writes at the same slot: the engine runs the draft over every prefill
chunk and plain decode row (``execute``, its samples ignored), and ``propose`` writes [last, d_1 .. d_k] at
positions n - 1 .. n - 1 + k, the very tokens the verify step then writes into the target pool. So the draft's
KV of a sequence is valid wherever the target's is (prefix-cache hits included); rolled-back positions are
rewritten before they are read, in both pools alike.

``propose``: k + 1 one-token draft forwards per row in one jitted call (``kv_paged.draft_propose_paged``, the
paged path's ``KVAccess.propose``): forward i feeds the token at position start + i and draws d_{i+1} (greedy
rows: argmax; sampled rows: from the row's filtered distribution q, keyed ``fold_in(fold_in(key(seed),
position), DRAFT)``); the last forward only writes d_k's KV.
"""
from __future__ import annotations

import numpy as np

from surojax.generation.sampling import BatchMode, SamplingParams
from surojax.serve.input_batch import InputBatch
from surojax.serve.kv_paged import draft_propose_paged
from surojax.serve.runner import PagedRunner
from surojax.serve.scheduler import ScheduledRequest
from surojax.serve.speculative import sampling_arrays


class DraftRunner(PagedRunner):
    """The draft model's runner: ``execute`` mirrors the target's prefill / plain decode writes, ``propose``
    drafts the speculative rows' tokens."""

    scores_prompts = False  # prompt logprobs are the target's

    def propose(self, group: list[ScheduledRequest], num_tokens: int, R: int, S: int):
        """group: the rows to speculate for (decoding; ``num_spec`` proposals each); R, S: the verify call's
        shape (``verify_shape``). -> (proposals [R, K] device int32, num_proposed [R] int32 host, q [R, K, V]
        device or None)."""
        last = np.zeros(R, np.int32)
        start = np.zeros(R, np.int32)
        limit = np.full(R, -1, np.int32)
        params = []
        for r, s in enumerate(group):
            last[r], start[r], limit[r] = s.token_ids[0], s.start, s.num_spec
            params.append(s.sampling_params if isinstance(s.sampling_params, SamplingParams) else SamplingParams())
        rows = sampling_arrays(params, R)
        batch = InputBatch(tokens=last, start=start, sampling=rows, limit=limit, **self._address(group, R, S))
        mode = BatchMode(sample=bool((rows["temperature"] > 0).any()))
        ids, q = self._device_call(self.access.propose, batch, self.settings.for_call(mode, num_tokens))
        return ids, limit, q


__all__ = ["DraftRunner", "draft_propose_paged"]
