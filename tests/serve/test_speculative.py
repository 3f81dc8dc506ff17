"""Speculative decoding (serve.speculative, serve.draft, the runner's verify step): greedy output with n-gram and
with draft-model speculation equals plain greedy decoding, token for token (mixed with requests that decode
plainly; n-gram also beside multi-step decode); rejection sampling draws from the target's distribution (a chi-square test against numpy's softmax of
the published formula); rejected positions are rolled back and their blocks freed; the flags are read or
refused; through the HTTP server, one greedy request with speculation equals plain greedy.

Target: the qwen3 fixture; draft: the llama fixture (same 512-token vocabulary, different weights) or the target
itself (every proposal accepted)."""
import dataclasses
import socket
import threading
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.generation.sampling import SamplingParams
from surojax.serve.config import EngineConfig, SchedulerConfig, SpecMethod, SpeculativeConfig
from surojax.serve.engine import Engine
from surojax.serve.kv_cache import KVCacheManager
from surojax.serve.scheduler import Request, Scheduler
from surojax.serve.speculative import accept, ngram_propose
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config

MODELS = Path(__file__).parent.parent / "fixtures" / "models"
TARGET, DRAFT = MODELS / "qwen3", MODELS / "llama"
SIZES = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=96,
             buckets=BUCKETS)
REPETITIVE = [5, 6, 7, 8, 9] * 4 + [5, 6]
PROMPTS = [REPETITIVE, [11, 12, 13, 14, 15, 16, 17, 18, 19], [100, 200, 300]]
MAX_TOKENS = 16
# a plain-decoded row in the same batch: requests with logprobs (or penalties) are never speculated
PLAIN = [([40, 41, 42, 43], SamplingParams(max_tokens=MAX_TOKENS, logprobs=True))]


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, attention="xla")


def run(eng, requests):
    """requests: [(prompt, SamplingParams)] -> [new ids] in order; every block is free afterwards."""
    rids = [eng.add_request(p, sp) for p, sp in requests]
    ids = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            ids[o.request_id] += o.new_token_ids
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [ids[r] for r in rids]


def requests(max_tokens=MAX_TOKENS):
    return [(p, SamplingParams(max_tokens=max_tokens)) for p in PROMPTS] + PLAIN


@pytest.fixture(scope="module")
def plain(target):
    return run(Engine(target, engine_config(**SIZES)), requests())


def spec_engine(target, method, k=3, draft=None, decode_steps=1):
    spec = SpeculativeConfig(method, k, model="draft" if draft is not None else None)
    return Engine(target, engine_config(speculative=spec, decode_steps=decode_steps, **SIZES), draft_model=draft)


def test_ngram_greedy_equals_plain_and_seeds_are_batch_independent(target, plain):
    eng = spec_engine(target, SpecMethod.NGRAM)
    assert run(eng, requests()) == plain
    assert eng.spec_stats.acceptance_rate > 0 and eng.spec_stats.accepted > 0  # the repetitive prompt
    # with multi-step decode: the steps where no request has proposals decode 4 tokens a call
    multi = spec_engine(target, SpecMethod.NGRAM, decode_steps=4)
    assert run(multi, requests()) == plain
    assert multi.runner.num_multi_calls > 0 and multi.spec_stats.accepted > 0
    # a seeded sampled request gives the same tokens alone and in a batch
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=7)
    alone = run(spec_engine(target, SpecMethod.NGRAM), [(REPETITIVE, sp)])[0]
    batched = run(spec_engine(target, SpecMethod.NGRAM), [(REPETITIVE, sp)] + requests()[1:3])[0]
    assert alone == batched and len(alone) == 12


def test_ngram_is_off_in_steps_with_more_running_requests_than_disable_by_batch_size(target, plain):
    """vLLM's disable_by_batch_size: with 4 requests running and the bound at 3 nothing is speculated (the same
    tokens); the repetitive prompt alone, under the bound, is."""
    spec = SpeculativeConfig(SpecMethod.NGRAM, 3, disable_by_batch_size=3)
    eng = Engine(target, engine_config(speculative=spec, **SIZES))
    assert run(eng, requests()) == plain and eng.spec_stats.row_steps == 0
    alone = Engine(target, engine_config(speculative=spec, **SIZES))
    assert run(alone, requests()[:1]) == plain[:1] and alone.spec_stats.accepted > 0


def test_draft_greedy_equals_plain(target, plain):
    eng = spec_engine(target, SpecMethod.DRAFT, draft=load_model(DRAFT, attention="xla"))
    assert run(eng, requests()) == plain
    assert eng.spec_stats.proposed > 0
    same = spec_engine(target, SpecMethod.DRAFT, draft=target)  # the target as its own draft: all accepted
    assert run(same, requests()) == plain
    assert same.spec_stats.acceptance_rate == 1.0 and same.spec_stats.mean_accepted_length > 2


def _softmax_filtered(logits, temperature, top_k):
    """numpy reference: softmax(logits / T) over the top-k tokens (the published definition)."""
    z = logits / temperature
    z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


def _chi2(counts, probs):
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0  # a token the target excludes was never emitted
    return float(((counts[keep] - n * probs[keep]) ** 2 / (n * probs[keep])).sum())


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_rejection_sampling_follows_the_target(draft):
    """One row per seed; the target's logits do not depend on context, so the first emitted token must follow
    p_0 and the second (when emitted) p_1, whatever the draft's q. chi-square, 7 dof: 24.3 at p = 0.001."""
    R, K, V, T, top_k = 20000, 2, 8, 0.8, 7
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(K + 1, V)).astype(np.float32) * 1.5
    p = np.stack([_softmax_filtered(l, T, top_k) for l in logits])
    if draft == "model":
        q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)  # a different distribution
        proposals = np.stack([rng.choice(V, size=R, p=q[i] / q[i].sum()) for i in range(K)], 1).astype(np.int32)
        q_rows = jnp.broadcast_to(q, (R, K, V))
    else:  # prompt lookup proposes the same tokens every time: a point mass
        proposals, q_rows = np.tile(np.argsort(p[:K], axis=1)[:, -2], (R, 1)).astype(np.int32), None
    rows = dict(temperature=np.full(R, T, np.float32), top_k=np.full(R, top_k, np.int32),
                top_p=np.ones(R, np.float32), min_p=np.zeros(R, np.float32), seed=np.arange(R, dtype=np.uint32))
    out = jax.jit(accept, static_argnames="sample")(jnp.broadcast_to(logits, (R, K + 1, V)), proposals,
                                                    np.full(R, K, np.int32), q_rows, rows,
                                                    np.full(R, 10, np.int32), sample=True)
    ids, count = np.asarray(out["ids"]), np.asarray(out["count"])
    first = np.bincount(ids[:, 0], minlength=V)
    second = np.bincount(ids[count >= 2, 1], minlength=V)
    assert _chi2(first, p[0]) < 24.3 and _chi2(second, p[1]) < 24.3
    assert 0 < (count > 1).mean() < 1  # some proposals accepted, some rejected
    if draft == "model":  # the test has power: the draft's own tokens do not pass as the target's
        assert np.abs(np.bincount(proposals[:, 0], minlength=V) / R - p[0]).sum() / 2 > 0.1  # total variation


def test_ngram_proposal():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # the latest occurrence
    assert ngram_propose([4, 5, 6, 4], 2) == [5, 6]  # falls back to n = 1
    assert ngram_propose([5] * 6, 3) == [5, 5, 5]  # the latest occurrence that k tokens follow
    assert ngram_propose([1, 2, 1, 2, 1], 3) == [2, 1]  # none has k: the latest one
    assert ngram_propose([1, 2, 3], 2) == []


def test_rejected_positions_are_rolled_back():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                  speculative_tokens=lambda req: 6)
    a = Request("a", list(range(1, 8)), max_tokens=20)
    s.add_request(a)
    s.schedule()
    s.update({"a": 100})  # 8 tokens, 7 with KV
    out = s.schedule().scheduled[0]
    assert (out.num_new_tokens, out.start, out.num_spec) == (1, 7, 6)
    assert len(kv.block_table("a")) == 4  # slots for positions 0 .. 13
    s.update({"a": [101, 102]})  # one proposal accepted + the target's token: KV kept for positions 0 .. 8
    assert a.num_computed_tokens == 9 and a.output_token_ids == [100, 101, 102]
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 13  # the block of rejected tokens only
    out = s.schedule().scheduled[0]
    assert (out.start, out.num_spec, out.token_ids) == (9, 6, [102])
    with pytest.raises(ValueError, match="proposals"):
        s.update({"a": list(range(8))})  # more than num_spec + 1 tokens


@pytest.mark.parametrize("proposals", [0, 2])
def test_multi_step_runs_only_when_no_request_has_proposals(proposals):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, decode_steps=4),
                  speculative_tokens=lambda req: proposals if req.request_id == "a" else 0)
    for rid in "ab":
        s.add_request(Request(rid, [1, 2, 3], max_tokens=20))
    s.schedule()
    s.update({"a": 7, "b": 8})
    out = {x.request_id: (x.num_steps, x.num_spec) for x in s.schedule().scheduled}
    assert out == ({"a": (1, 2), "b": (1, 0)} if proposals else {"a": (4, 0), "b": (4, 0)})


def test_settings_are_read_or_refused():
    from surojax.cli.main import build_parser, load_command
    from surojax.cli.serve import ServeOptionError, serve_config

    parser = build_parser("serve", load_command("serve"))

    def config(*flags):
        return serve_config(parser.parse_args(["serve", "m", *flags]))

    spec = config("--speculative-method", "draft", "--speculative-model", "d", "--num-speculative-tokens", "5")
    assert spec.engine.speculative == SpeculativeConfig(SpecMethod.DRAFT, 5, model="d")
    assert config().engine.speculative is None
    for flags, msg in [(("--speculative-method", "draft"), "needs a draft model"),
                       (("--speculative-method", "ngram", "--speculative-model", "d"), "only read by"),
                       (("--num-speculative-tokens", "3"), "need --speculative-method"),
                       (("--speculative-disable-by-batch-size", "4"), "need --speculative-method"),
                       (("--speculative-method", "draft", "--speculative-model", "d",
                         "--speculative-disable-by-batch-size", "4"), "only read by --speculative-method ngram"),
                       (("--speculative-method", "mtp", "--enable-lora"), "enable-lora"),
                       (("--speculative-method", "draft", "--speculative-model", "d", "--decode-steps", "4"),
                        "decode-steps"),
                       (("--speculative-method", "ngram", "--kv-path", "reference"), "paged")]:
        with pytest.raises(ServeOptionError, match=msg):
            config(*flags)
    assert config("--speculative-method", "ngram", "--speculative-disable-by-batch-size", "4").engine.speculative == \
        SpeculativeConfig(SpecMethod.NGRAM, disable_by_batch_size=4)
    ngram = config("--speculative-method", "ngram", "--enable-lora")  # n-gram: multi-step and LoRA rows too
    assert ngram.engine.scheduler.decode_steps == 8 and ngram.lora is not None
    assert config("--speculative-method", "draft", "--speculative-model", "d").engine.scheduler.decode_steps == 1
    with pytest.raises(ValueError, match="multi-step"):
        EngineConfig(scheduler=SchedulerConfig(decode_steps=2), speculative=SpeculativeConfig(SpecMethod.DRAFT, model="d"))


def test_server_greedy_with_draft_speculation_equals_plain(plain):
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from surojax.cli.main import build_parser, load_command
    from surojax.cli.serve import serve_config
    from surojax.data.tokenizer import Tokenizer
    from surojax.serve.launch import build_server
    from surojax.serve.metrics import parse_metrics

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = build_parser("serve", load_command("serve")).parse_args(
        ["serve", str(TARGET), "--served-model-name", "tiny", "--block-size", "4", "--num-kv-blocks", "64",
         "--max-model-len", "96", "--dtype", "float32", "--speculative-method", "draft", "--speculative-model", str(DRAFT),
         "--num-speculative-tokens", "3"])
    config = serve_config(args)
    app, state = build_server(dataclasses.replace(config, engine=dataclasses.replace(config.engine, buckets=BUCKETS)))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        tok = Tokenizer.from_dir(TARGET)
        r = client.completions.create(model="tiny", prompt=REPETITIVE, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == tok.decode(plain[0], skip_special_tokens=True)
        assert r.usage.completion_tokens == MAX_TOKENS
        m = parse_metrics(httpx.get(url + "/metrics").text)
        assert m["surojax_spec_decode_proposed_tokens_total"] > 0
        assert m["surojax_spec_decode_verify_steps_total"] > 0
    finally:
        srv.should_exit = True
        thread.join(10)
        state.engine.shutdown()
