"""Scheduler + paged KV manager, driven by a fake model over a simulated paged KV cache.

The fake runner writes (adapter, token) into the slots of each step's block table and reads the whole sequence
back through the block table before "sampling": if the scheduler or the prefix cache ever pointed a sequence at a
block holding other content, the read-back differs and the test fails.
"""
import random

import pytest

from surojax.serve.config import SchedulerConfig
from surojax.serve.kv_cache import KVCacheManager, hash_block
from surojax.serve.scheduler import Request, Scheduler


def fake_next(tokens, adapter=None):
    h = 17 + (len(adapter) if adapter else 0)
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return h % 97 + 3  # tokens 3..99; 0..2 free for stop ids


class FakeRunner:
    def __init__(self, sched):
        self.sched = sched
        self.kv_slots = {}  # slot -> (adapter, token)
        self.steps = []
        self.outs = {}  # request id -> every token returned by update()

    def step(self):
        out = self.sched.schedule()
        self.steps.append(out)
        bs = self.sched.kv.block_size
        sampled = {}
        for s in out.scheduled:
            req = self.sched.requests[s.request_id]
            for j, t in enumerate(s.token_ids):
                p = s.start + j
                slot = s.block_table[p // bs] * bs + p % bs
                self.kv_slots[slot] = (s.adapter, t)
            if s.sample:
                end = s.start + s.num_new_tokens
                seen = [self.kv_slots.get(s.block_table[p // bs] * bs + p % bs) for p in range(end)]
                assert seen == [(s.adapter, t) for t in req.all_token_ids[:end]], s.request_id
                sampled[s.request_id] = fake_next(req.all_token_ids, s.adapter)
        ro = self.sched.update(sampled)
        for o in ro:
            self.outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, ro

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return self.outs
            self.step()
        raise AssertionError("did not finish")


def reference(prompt, max_tokens, adapter=None, stop=(), max_model_len=10**9):
    toks, out = list(prompt), []
    while True:
        t = fake_next(toks, adapter)
        out.append(t)
        toks.append(t)
        if t in stop or len(out) >= max_tokens or len(toks) >= max_model_len:
            return out


def make(num_blocks=64, block_size=4, **kw):
    kw.setdefault("max_model_len", min(num_blocks * block_size, 256))
    return Scheduler(KVCacheManager(num_blocks, block_size), SchedulerConfig(**kw))


def test_single_request_matches_reference():
    s = make()
    s.add_request(Request("a", [5, 6, 7, 8, 9], max_tokens=7))
    outs = FakeRunner(s).run()
    assert outs["a"] == reference([5, 6, 7, 8, 9], 7)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_stop_token_and_max_model_len():
    prompt = [1, 2, 3]
    ref = reference(prompt, 50)
    stop = ref[4]
    s = make(max_model_len=64)
    s.add_request(Request("stop", prompt, max_tokens=50, stop_token_ids={stop}))
    s.add_request(Request("len", [9] * 60, max_tokens=50))
    outs = FakeRunner(s).run()
    assert outs["stop"] == ref[:ref.index(stop) + 1]
    assert len(outs["len"]) == 4  # 60 + 4 == max_model_len
    with pytest.raises(ValueError):
        s.add_request(Request("long", [1] * 64))


def test_prefix_cache_hit_for_repeated_system_prompt():
    system = list(range(10, 30))  # 20 tokens = 5 full blocks of 4
    s = make()
    r = FakeRunner(s)
    s.add_request(Request("first", system + [40, 41], max_tokens=3))
    r.run()
    s.add_request(Request("second", system + [50, 51, 52], max_tokens=3))
    out, _ = r.step()
    (sch,) = out.scheduled
    assert sch.start == 20 and sch.num_new_tokens == 3  # only the uncached suffix is computed
    assert s.kv.prefix_cache_hits == 20
    outs = r.run()
    assert outs["second"] == reference(system + [50, 51, 52], 3)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_whole_prompt_cached_still_computes_last_token():
    p = list(range(8))  # exactly 2 blocks
    s = make()
    r = FakeRunner(s)
    s.add_request(Request("a", p, max_tokens=2))
    r.run()
    s.add_request(Request("b", p, max_tokens=2))
    out, _ = r.step()
    assert out.scheduled[0].start == 4 and out.scheduled[0].num_new_tokens == 4
    assert r.run()["b"] == reference(p, 2)


def test_no_prefix_sharing_across_adapters():
    system = list(range(10, 30))
    s = make()
    r = FakeRunner(s)
    s.add_request(Request("base", system + [1], max_tokens=2))
    r.run()
    s.add_request(Request("lora", system + [1], max_tokens=2, adapter="math"))
    out, _ = r.step()
    assert out.scheduled[0].start == 0
    assert s.kv.prefix_cache_hits == 0
    outs = r.run()
    assert outs["lora"] == reference(system + [1], 2, adapter="math")
    assert hash_block(None, [1, 2], "a") != hash_block(None, [1, 2], "b") != hash_block(None, [1, 2])


def test_freed_cached_blocks_are_evicted_lru():
    kv = KVCacheManager(4, 2)
    s = Scheduler(kv, SchedulerConfig(max_model_len=8))
    r = FakeRunner(s)
    s.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=1))
    r.run()
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2
    s.add_request(Request("b", [7, 7, 7, 7, 7, 7, 7], max_tokens=1))  # needs all 4 blocks: evicts the cache
    r.run()
    s.add_request(Request("c", [1, 2, 3, 4, 5], max_tokens=1))
    out, _ = r.step()
    assert out.scheduled[0].start == 0


def test_chunked_prefill_respects_token_budget():
    s = make(num_blocks=128, max_num_batched_tokens=16, chunk_size=6, max_model_len=256)
    r = FakeRunner(s)
    for i in range(4):
        s.add_request(Request(f"r{i}", [i + 1] * 25, max_tokens=5))
    outs = r.run()
    for out in r.steps:
        assert out.total_num_scheduled_tokens <= 16
        assert all(x.num_new_tokens <= 6 for x in out.scheduled)
    assert any(len(out.scheduled) > 1 for out in r.steps)  # decodes batched with prefill chunks
    for i in range(4):
        assert outs[f"r{i}"] == reference([i + 1] * 25, 5)


def test_a_prompt_is_not_started_with_a_chunk_the_budget_cuts_short_beside_other_prefills():
    s = make(num_blocks=128, max_num_batched_tokens=20, max_model_len=256)
    for i in range(3):
        s.add_request(Request(f"r{i}", [i + 1] * 8, max_tokens=4))
    first = s.schedule()  # r0, r1 whole (16 tokens); r2's 4-token head would pad the call to 3 x 8 rows: it waits
    assert [(x.request_id, x.num_new_tokens) for x in first.scheduled] == [("r0", 8), ("r1", 8)]
    s.update({"r0": 50, "r1": 51})
    second = s.schedule()  # beside decodes alone it starts, whole
    assert [(x.request_id, x.num_new_tokens) for x in second.scheduled] == [("r0", 1), ("r1", 1), ("r2", 8)]
    long = make(num_blocks=128, max_num_batched_tokens=20, max_model_len=256)
    long.add_request(Request("a", [1] * 3, max_tokens=4))
    long.schedule()
    long.update({"a": 9})
    long.add_request(Request("b", [2] * 50, max_tokens=4))  # longer than the budget: chunked beside the decode
    assert [(x.request_id, x.num_new_tokens) for x in long.schedule().scheduled] == [("a", 1), ("b", 19)]


def test_max_num_seqs_respected():
    s = make(max_num_seqs=3)
    r = FakeRunner(s)
    for i in range(8):
        s.add_request(Request(f"r{i}", [i, i + 1, i + 2], max_tokens=4))
    outs = r.run()
    assert all(len(o.scheduled) <= 3 for o in r.steps)
    assert max(len(o.scheduled) for o in r.steps) == 3
    assert outs == {f"r{i}": reference([i, i + 1, i + 2], 4) for i in range(8)}


def test_preemption_by_recompute_completes_with_same_tokens():
    # 3 requests x (8 prompt + 12 new) = 20 tokens = 5 blocks each, pool of 10 blocks
    s = make(num_blocks=10, block_size=4, max_model_len=40)
    r = FakeRunner(s)
    prompts = {f"r{i}": [i + 1, i + 2] * 4 for i in range(3)}
    for rid, p in prompts.items():
        s.add_request(Request(rid, p, max_tokens=12))
    outs = r.run()
    assert s.num_preemptions > 0
    preempted = [rid for o in r.steps for rid in o.preempted_request_ids]
    assert preempted[0] == "r2"  # the most recently admitted goes first
    for rid, p in prompts.items():
        assert outs[rid] == reference(p, 12)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_frees_blocks():
    s = make(num_blocks=16)
    r = FakeRunner(s)
    s.add_request(Request("a", list(range(10)), max_tokens=100))
    s.add_request(Request("w", list(range(10)), max_tokens=100))
    r.step()
    r.step()
    assert s.kv.num_free_blocks < 16
    assert s.abort("a") and s.abort("w")
    assert not s.abort("a")
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished()
    out = s.schedule()
    assert set(out.finished_request_ids) == {"a", "w"}


def test_abort_between_schedule_and_update_is_ignored():
    s = make()
    s.add_request(Request("a", [1, 2, 3], max_tokens=5))
    s.schedule()
    s.abort("a")
    assert s.update({"a": 7}) == []
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(3, 4)
    a = Request("a", list(range(9)))
    assert not kv.allocate(a, 13)  # needs 4 blocks
    assert kv.num_free_blocks == 3 and kv.block_table("a") == []
    assert kv.allocate(a, 9) and kv.num_free_blocks == 0 and kv.usage == 1.0
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 3


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_never_leaks(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(64 // bs, 128 // bs)  # small pool: preemption happens
    s = Scheduler(KVCacheManager(num_blocks, bs), SchedulerConfig(max_num_seqs=rng.randint(1, 8),
                  max_num_batched_tokens=rng.randint(8, 64), chunk_size=rng.randint(1, 32),
                  max_model_len=64))
    r = FakeRunner(s)
    systems = [[rng.randint(3, 99) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    expect, aborted, n = {}, set(), 0
    for _ in range(300):
        if rng.random() < 0.3 and n < 40:
            p = rng.choice(systems) + [rng.randint(3, 99) for _ in range(rng.randint(1, 20))]
            ad = rng.choice([None, None, "x", "yy"])
            mt = rng.randint(1, 20)
            s.add_request(Request(f"q{n}", p, max_tokens=mt, stop_token_ids={0}, adapter=ad))
            expect[f"q{n}"] = reference(p, mt, ad, max_model_len=64)
            n += 1
        if rng.random() < 0.05 and s.requests:
            rid = rng.choice(sorted(s.requests))
            s.abort(rid)
            aborted.add(rid)
        if s.has_unfinished():
            r.step()
        used = sum(len(s.kv.block_table(q.request_id)) for q in s.running)
        assert s.kv.num_free_blocks >= num_blocks - used
        assert len(s.running) <= s.max_num_seqs
    got = r.run()
    for rid, ref in expect.items():
        if rid in aborted:
            assert ref[:len(got.get(rid, []))] == got.get(rid, [])
        else:
            assert got[rid] == ref, rid
    assert s.kv.num_free_blocks == num_blocks
    assert s.kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in s.kv.blocks)


def test_multi_step_keeps_running_while_waiting_requests_have_no_seat():
    """A request that waits for a seat cannot be admitted this step: multi-step decode goes on (K tokens each);
    once a seat frees, the waiting request makes the next step a single one that admits it."""
    s = make(max_num_seqs=2, decode_steps=4)
    for i in range(3):
        s.add_request(Request(f"r{i}", [i + 3, i + 4, i + 5], max_tokens=3))
    assert [x.request_id for x in s.schedule().scheduled] == ["r0", "r1"]  # prefills; r2 has no seat
    s.update({"r0": 7, "r1": 7})
    multi = s.schedule().scheduled
    assert [(x.request_id, x.num_steps) for x in multi] == [("r0", 2), ("r1", 2)]  # max_tokens 3 - 1 left
    outs = s.update({"r0": [8, 9], "r1": [8, 9]})
    assert all(o.finished for o in outs)
    admit = s.schedule().scheduled
    assert [(x.request_id, x.num_steps) for x in admit] == [("r2", 1)]
