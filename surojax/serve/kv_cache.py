"""Paged KV-cache block manager with prefix caching (pure Python; no arrays live here).

Architecture choices (after vLLM v1's ``kv_cache_manager.py`` / ``block_pool.py``):

* The device KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots each. This module only
  does the bookkeeping: which block ids a sequence owns (its *block table*, in token order) and which blocks are
  free. The jitted runner turns the block table into slot indices ``block_table[t // bs] * bs + t % bs``.
* Prefix caching: every FULL block of a sequence gets a hash that chains the parent block's hash with the block's
  token ids and an ``extra_key`` (the LoRA adapter name; for a block holding image tokens also the images'
  content hashes: ``block_cache_key`` of a sequence that has one), so a different prefix, a different adapter or
  other pixels behind the same image tokens never share KV. A new sequence whose tokens start with cached full blocks takes them (ref-counted; a cached block is
  never written again) and only computes the rest.
* Freed blocks go to an LRU free queue but keep their hash, so they can still be hit until the pool runs out and
  they are evicted (least recently freed first; blocks without a hash are handed out before cached ones).
* ``allocate`` is all-or-nothing: it either reserves every block the step needs or changes nothing.

Pitfalls, named:
* A cache hit is capped at ``len(tokens) - 1``: the last token must always be computed to get logits.
* Blocks are hashed and published at ``allocate`` time, i.e. *before* the runner has written their KV. This is
  safe only if the runner executes every scheduled step (write KV for the layer, then attend) before the next
  ``schedule()``; a sequence admitted in the same step that hits such a block reads KV written in that same
  forward pass, which a write-then-attend layer guarantees.
* Two sequences computing the same new block concurrently both get a private copy; only the first is published.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence


class Sequence_(Protocol):
    """What the manager needs to know about a sequence (``scheduler.Request`` satisfies it)."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def cache_key(self) -> Hashable: ...  # extra hash key, e.g. the LoRA adapter name (None for the base model)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: Hashable = None) -> bytes:
    """Chained hash of one full block: (parent hash, token ids, extra key) -> 16 bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"root")
    h.update(repr((tuple(int(t) for t in token_ids), extra_key)).encode())
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and published to the prefix cache


@dataclass
class _SeqState:
    blocks: list[KVBlock] = field(default_factory=list)  # block table, in token order
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks computed so far
    num_cached_blocks: int = 0  # leading blocks already published (or taken from) the prefix cache


class KVCacheManager:
    """Block pool + per-sequence block tables + prefix cache. Keys sequences by ``request_id``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)  # front = evict first
        self._cached: dict[bytes, KVBlock] = {}  # block hash -> block (in use or free-but-reusable)
        self._seqs: dict[str, _SeqState] = {}
        # counters for /metrics (in tokens)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- pool state -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (free-but-cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_table(self, request_id: str) -> list[int]:
        st = self._seqs.get(request_id)
        return [b.block_id for b in st.blocks] if st else []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence_, num_tokens: int, start: list[bytes]) -> list[bytes]:
        """Extend ``start`` (hashes of the first blocks) to cover every full block in ``tokens[:num_tokens]``."""
        hashes = list(start)
        toks = seq.all_token_ids
        bs = self.block_size
        key = getattr(seq, "block_cache_key", None)  # per block (images); else the sequence's key
        for i in range(len(hashes), num_tokens // bs):
            extra = key(i * bs, (i + 1) * bs) if key is not None else seq.cache_key
            hashes.append(hash_block(hashes[-1] if hashes else None, toks[i * bs:(i + 1) * bs], extra))
        return hashes

    def get_computed_blocks(self, seq: Sequence_) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of a NEW sequence's tokens -> (blocks, num tokens).

        No side effects; pass the blocks to ``allocate`` to take them, then ``record_prefix_query`` once admitted.
        """
        if not self.enable_prefix_caching:
            return [], 0
        n = len(seq.all_token_ids)
        hashes = self._full_block_hashes(seq, n - 1, [])  # cap: the last token is always computed
        hit: list[KVBlock] = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * self.block_size

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocate / free --------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence_, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Reserve blocks so that ``num_computed_tokens + num_new_tokens`` tokens have slots. All-or-nothing.

        ``computed_blocks`` (from ``get_computed_blocks``, new sequences only) are taken as the start of the
        block table; ``seq.num_computed_tokens`` must not yet count them.
        """
        st = self._seqs.get(seq.request_id)
        if computed_blocks and st is not None and st.blocks:
            raise ValueError("computed_blocks are only for a sequence without blocks")
        num_have = (len(st.blocks) if st else 0) + len(computed_blocks)
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - num_have)
        # taking a free cached block also removes it from the free pool
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > len(self._free):
            return False
        if st is None:
            st = self._seqs[seq.request_id] = _SeqState()
        for b in computed_blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1
            st.blocks.append(b)
            st.block_hashes.append(b.block_hash)
        if computed_blocks:  # (only then: resetting it on every call would skip the blocks filled since)
            st.num_cached_blocks = len(st.blocks)
        for _ in range(num_new_blocks):
            st.blocks.append(self._pop_free())
        if self.enable_prefix_caching:
            self._publish(seq, st, total)
        return True

    def _pop_free(self) -> KVBlock:
        _, b = self._free.popitem(last=False)
        if b.block_hash is not None:  # evict from the prefix cache (LRU)
            if self._cached.get(b.block_hash) is b:
                del self._cached[b.block_hash]
            b.block_hash = None
        b.ref_cnt = 1
        return b

    def _publish(self, seq: Sequence_, st: _SeqState, num_tokens: int) -> None:
        """Hash the blocks that become full within ``tokens[:num_tokens]`` and publish them to the prefix cache.

        Capped at the tokens that exist: a multi-step decode allocates slots ahead for tokens not sampled yet;
        their blocks are published by a later ``allocate`` once the tokens are known."""
        num_tokens = min(num_tokens, len(seq.all_token_ids))
        st.block_hashes = self._full_block_hashes(seq, num_tokens, st.block_hashes)
        for i in range(st.num_cached_blocks, len(st.block_hashes)):
            b, h = st.blocks[i], st.block_hashes[i]
            if h not in self._cached:  # else another sequence published the same content first: keep ours private
                b.block_hash = h
                self._cached[h] = b
        st.num_cached_blocks = len(st.block_hashes)

    def publish(self, seq: Sequence_, num_tokens: int) -> None:
        """Publish the blocks that are full within ``tokens[:num_tokens]`` (their KV written): after a multi-step
        decode, whose tokens were not known when its blocks were allocated."""
        st = self._seqs.get(seq.request_id)
        if st is not None and self.enable_prefix_caching:
            self._publish(seq, st, num_tokens)

    def free_tail(self, seq: Sequence_, num_tokens: int) -> None:
        """Release the blocks past the first ``blocks_needed(num_tokens)`` of a sequence: after a speculative
        step rolled its length back, the blocks that held only rejected tokens (never published: their tokens
        were not the sequence's when allocated)."""
        st = self._seqs.get(seq.request_id)
        if st is None:
            return
        keep = self.blocks_needed(num_tokens)
        for b in reversed(st.blocks[keep:]):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b
                if b.block_hash is None:
                    self._free.move_to_end(b.block_id, last=False)
        del st.blocks[keep:]

    def free(self, seq_or_id: Sequence_ | str) -> None:
        """Release a sequence's blocks (finish, abort or preemption). Idempotent."""
        rid = seq_or_id if isinstance(seq_or_id, str) else seq_or_id.request_id
        st = self._seqs.pop(rid, None)
        if st is None:
            return
        # reverse order: the tail of a sequence is the least likely to be shared, so it is evicted first
        for b in reversed(st.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b
                if b.block_hash is None:
                    self._free.move_to_end(b.block_id, last=False)  # nothing to reuse: hand out first

    def reset_prefix_cache(self) -> None:
        """Drop every free cached block's hash (e.g. after unloading a LoRA adapter)."""
        for b in self._free.values():
            if b.block_hash is not None:
                self._cached.pop(b.block_hash, None)
                b.block_hash = None
