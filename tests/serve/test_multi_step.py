"""Multi-step decode (``decode_steps`` K > 1): K decode steps per device call give the same tokens, logprobs and
texts as K = 1 (greedy and seeded rows, penalties, stop ids, stop strings, max_tokens not a multiple of K,
an abort between calls), and the scheduler reserves lookahead blocks without leaking or publishing them early."""
from pathlib import Path

import numpy as np
import pytest

from surojax.data.tokenizer import Tokenizer
from surojax.generation.sampling import SamplingParams
from surojax.serve.config import SchedulerConfig
from surojax.serve.engine import Engine
from surojax.serve.kv_cache import KVCacheManager
from surojax.serve.scheduler import Request, Scheduler
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, attention="xla")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIXTURE)


def engine(model, k, tokenizer=None, **kw):
    kw = dict(dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=96,
                   buckets=BUCKETS, decode_steps=k), **kw)
    return Engine(model, engine_config(**kw), tokenizer=tokenizer)


def run(eng, requests, abort_after=None):
    """requests: [(prompt, SamplingParams)] -> ({rid: ids}, {rid: logprobs}, {rid: text}, {rid: reason})."""
    rids = [eng.add_request(p, sp) for p, sp in requests]
    ids, lps, text, reason = *({r: [] for r in rids} for _ in range(3)), {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            ids[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.logprobs or []
            text[o.request_id] += [o.text]
            if o.finished:
                reason[o.request_id] = o.finish_reason
        steps += 1
        if abort_after is not None and steps == abort_after[1]:
            eng.abort(rids[abort_after[0]])
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # every block (lookahead ones too) came back
    return ([ids[r] for r in rids], [lps[r] for r in rids], ["".join(text[r]) for r in rids],
            [reason.get(r) for r in rids])


def test_mixed_batch_equals_single_steps(model):
    rng = np.random.default_rng(0)
    ps = [rng.integers(1, 500, size=n).tolist() for n in (9, 5, 13, 7)]
    single = engine(model, 1).generate([ps[0]], 11)[0]
    stop_id = single[4]  # a stop id the first row hits mid-call
    reqs = [(ps[0], SamplingParams(max_tokens=11, logprobs=True, top_logprobs=3)),
            (ps[1], SamplingParams(max_tokens=13, temperature=0.9, top_p=0.9, seed=3)),
            (ps[2], SamplingParams(max_tokens=7, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5,
                                   presence_penalty=0.2, seed=1)),
            (ps[3], SamplingParams(max_tokens=10, stop_token_ids=(stop_id,)))]
    ref = run(engine(model, 1), reqs)
    eng = engine(model, 4)
    got = run(eng, reqs)
    assert eng.scheduler.num_multi_steps > 0 and eng.runner.num_multi_calls > 0
    assert got[0] == ref[0] and got[3] == ref[3]
    for a, b in zip(got[1][0], ref[1][0]):  # logprobs of the greedy row, token by token
        assert abs(a[0] - b[0]) < 1e-5 and [i for i, _ in a[1]] == [i for i, _ in b[1]]
    assert len(got[0][0]) == 11 and len(got[0][2]) == 7  # max_tokens not a multiple of K
    # alone equals batched
    assert run(engine(model, 4), reqs[1:2])[0][0] == got[0][1]


def test_stop_strings_and_abort_mid_run(model, tok):
    p = tok.encode("hello world, the")
    full_ids = engine(model, 1).generate([p], 16)[0]
    full = tok.decode(full_ids, skip_special_tokens=True)
    stop = full[5:7]
    reqs = [(p, SamplingParams(max_tokens=16, stop=(stop,))), (p[1:], SamplingParams(max_tokens=16)),
            (p[2:], SamplingParams(max_tokens=16))]
    ref = run(engine(model, 1, tokenizer=tok), reqs)
    got = run(engine(model, 8, tokenizer=tok), reqs)
    assert got == ref
    assert got[2][0] == full[:full.index(stop)] and got[3][0] == "stop"
    assert len(got[0][0]) < 16  # the tokens past the stop string were dropped
    # abort the second request after the prefill step and one multi-step call: the others are unchanged
    ab = run(engine(model, 8, tokenizer=tok), reqs, abort_after=(1, 2))
    assert ab[0][0] == ref[0][0] and ab[0][2] == ref[0][2] and ab[3][1] is None
    assert ab[0][1] == ref[0][1][:len(ab[0][1])] and 0 < len(ab[0][1]) < 16


def test_lookahead_allocation_and_fallback():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24, decode_steps=8))
    a = Request("a", list(range(1, 8)), max_tokens=20)
    s.add_request(a)
    s.update({"a": 100})  # nothing scheduled yet: ignored
    assert s.schedule().scheduled[0].num_new_tokens == 7
    s.update({"a": 100})
    out = s.schedule()  # 8 tokens held (2 blocks) + 7 lookahead -> 4 blocks; the 8th token is not published
    assert out.scheduled[0].num_steps == 8 and len(kv.block_table("a")) == 4
    assert len(kv._seqs["a"].block_hashes) == 2
    s.update({"a": [101, 102, 103]})  # a row may stop early (here: as if it had hit a stop id on the device)
    assert a.num_computed_tokens == 10 and a.output_token_ids == [100, 101, 102, 103]
    b = Request("b", list(range(50, 59)), max_tokens=20)
    s.add_request(b)
    assert all(x.num_steps == 1 for x in s.schedule().scheduled)  # a request waits: single steps
    s.update({"a": 104, "b": 200})
    out = s.schedule()  # a needs 1 more block (11 + 8 slots), b 2 more (9 + 8): 8 - 4 - 3 < 3 -> fallback
    assert [x.num_steps for x in out.scheduled] == [1, 1]
    s.update({"a": 105, "b": 201})
    s.abort("b")
    out = s.schedule()  # now the free blocks cover a's lookahead
    assert [x.num_steps for x in out.scheduled] == [8] and kv.num_free_blocks == 3
    s.update({"a": list(range(110, 118))})  # KV now written for 20 tokens: 5 full blocks published
    assert a.num_computed_tokens == 20 and len(kv._seqs["a"].block_hashes) == 5
    with pytest.raises(ValueError, match="power of two"):
        Scheduler(kv, SchedulerConfig(max_model_len=24, decode_steps=3))


def test_cli_option():
    from surojax.cli.main import build_parser, load_command
    from surojax.cli.serve import serve_config

    parser = build_parser("serve", load_command("serve"))
    assert parser.parse_args(["serve", "m", "--decode-steps", "8"]).decode_steps == 8
    assert parser.parse_args(["serve", "m"]).decode_steps == "auto"
    assert serve_config(parser.parse_args(["serve", "m"])).engine.scheduler.decode_steps == 8
    spec = ["serve", "m", "--speculative-method", "draft", "--speculative-model", "d"]
    assert serve_config(parser.parse_args(spec)).engine.scheduler.decode_steps == 1  # the draft follows one a step
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--decode-steps", "3"])


def test_generated_blocks_are_prefix_cached_as_with_single_steps(model):
    hits = {}
    for k in (1, 8):
        eng = engine(model, k)
        p = list(range(1, 10))
        out = eng.generate([p], 16)[0]
        eng.generate([p + out + [5]], 1)  # a follow-up turn: prompt + answer + more
        hits[k] = eng.kv.prefix_cache_hits
    assert hits[1] == hits[8] == 24  # KV was written for 9 + 15 tokens: 6 full blocks of 4
