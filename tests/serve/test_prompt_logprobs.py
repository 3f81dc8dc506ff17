"""Prompt logprobs (`serve.prompt_logprobs`): the engine's scores of a prompt equal log_softmax of transformers'
logits (the fixtures' expected.npz) with chunked prefill (a prompt over several chunks), after the prompt's blocks
are in the prefix cache, on both KV paths and for the dense, MoE and Gated DeltaNet hybrid families."""
from pathlib import Path

import jax
import numpy as np
import pytest

from surojax.generation.sampling import SamplingParams
from surojax.serve.config import KVPath
from surojax.serve.engine import Engine
from surojax.serve.prompt_logprobs import score_prompt
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import SMALL, engine_config

MODELS = Path(__file__).parent.parent / "fixtures" / "models"


def log_softmax(x):
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def run(eng: Engine, requests) -> dict:
    rids = [eng.add_request(p, sp) for p, sp in requests]
    outs = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].append(o)
    return [outs[r] for r in rids]


@pytest.mark.parametrize("name,kv_path", [("qwen3", KVPath.PAGED), ("qwen3", KVPath.REFERENCE),
                                          ("qwen3_moe", KVPath.PAGED), ("qwen3_5_text", KVPath.PAGED)])
def test_prompt_logprobs_equal_transformers(name, kv_path):
    model = load_model(MODELS / name, attention="xla")
    expected = np.load(MODELS / name / "expected.npz")
    prompt, ref = expected["tokens2"].tolist(), log_softmax(expected["logits2"])  # 12 (20 for qwen3_5) tokens
    eng = Engine(model, engine_config(**dict(SMALL, chunk_size=5), kv_path=kv_path))  # 3 or 4 prefill chunks
    if eng.config.enable_prefix_caching:  # not qwen3_5 (a hybrid): its run would only compile two more prefills
        run(eng, [(prompt, SamplingParams(max_tokens=2))])  # the prompt's full blocks are now cached
        assert eng.kv.prefix_cache_hits == 0 and eng.kv.num_cached_blocks > 0
    only, decoded = run(eng, [(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3)),
                              (prompt, SamplingParams(max_tokens=3, prompt_logprobs=0))])
    assert len(only) == 1 and only[0].new_token_ids == [] and only[0].finish_reason == "length"
    assert [len(o.new_token_ids) for o in decoded] == [1, 1, 1] and decoded[1].prompt_logprobs is None
    for scores, k in ((only[0].prompt_logprobs, 3), (decoded[0].prompt_logprobs, 0)):
        assert len(scores) == len(prompt) and scores[0] is None
        for i, s in enumerate(scores[1:], 1):
            row = ref[i - 1]
            assert s.logprob == pytest.approx(row[prompt[i]], abs=1e-4)
            assert s.rank == 1 + int((row > row[prompt[i]]).sum())
            assert [t for t, _ in s.top] == np.argsort(-row)[:k].tolist()
            np.testing.assert_allclose([v for _, v in s.top], np.sort(row)[::-1][:k], atol=1e-4)


def test_score_prompt_in_blocks_equals_at_once():
    model = load_model(MODELS / "qwen3", attention="xla")
    h = jax.random.normal(jax.random.key(0), (2, 16, model.cfg.hidden_size))
    targets = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), -1, model.cfg.vocab_size), np.int32)
    at_once = jax.jit(lambda h, t: score_prompt(model, h, t))(h, targets)
    blocks = jax.jit(lambda h, t: score_prompt(model, h, t, block=4))(h, targets)
    for key, v in at_once.items():
        np.testing.assert_allclose(np.asarray(blocks[key]), np.asarray(v), rtol=1e-6, atol=1e-6, err_msg=key)
    logp = log_softmax(np.asarray(model.logits(h)))
    ok = targets >= 0
    np.testing.assert_allclose(np.asarray(blocks["prompt_logprob"])[ok],
                               np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0][ok], atol=1e-5)


# ---- through the server: the openai client's legacy logprobs, vLLM's prompt_logprobs, lm-evaluation-harness ------

NAME = "tiny"


@pytest.fixture(scope="module")
def server():
    from surojax.serve.config import RunnerBuckets
    from tests.serve.live_server import live_server

    # a 16-token step budget: the prompts here (12 to ~30 tokens) are prefilled in chunks
    argv = ["--served-model-name", NAME, "--max-num-seqs", "8", "--block-size", "4", "--num-kv-blocks", "256",
            "--max-model-len", "128", "--max-num-batched-tokens", "16"]
    with live_server(argv, buckets=RunnerBuckets(min_rows=8, min_prefill_rows=8, min_context=128,
                                                 min_prefill=16)) as served:
        yield served


@pytest.fixture(scope="module")
def qwen3():
    return load_model(MODELS / "qwen3", attention="xla")


def full_forward_logprobs(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """log_softmax of the model's logits over each whole sequence [T, V], from one forward without a cache (the
    sequences padded at the end: causal attention keeps the padding out of every real position)."""
    width = max(map(len, seqs))
    batch = np.asarray([s + [0] * (width - len(s)) for s in seqs], np.int32)
    logp = log_softmax(np.asarray(model(batch)))
    return [row[:len(s)] for row, s in zip(logp, seqs)]


def test_completions_echo_logprobs_and_prompt_logprobs(server):
    import openai

    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
    tok = server[1].tokenizer
    expected = np.load(MODELS / "qwen3" / "expected.npz")
    prompt, ref = expected["tokens2"].tolist(), log_softmax(expected["logits2"])  # transformers' logits
    texts = [tok.decode([t]) for t in prompt]

    only = client.completions.create(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    c = only.choices[0]
    assert c.text == tok.decode(prompt) and c.finish_reason == "length" and only.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == texts and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [ref[i - 1, prompt[i]] for i in range(1, len(prompt))],
                               atol=1e-4)
    assert lp.text_offset == np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist()
    for i, top in enumerate(lp.top_logprobs[1:], 1):  # the token itself + the most likely one (OpenAI: <= N + 1)
        assert 1 <= len(top) <= 2 and texts[i] in top
        assert max(top.values()) == pytest.approx(ref[i - 1].max(), abs=1e-4)

    plain = client.completions.create(model=NAME, prompt=prompt, logprobs=2, max_tokens=3, temperature=0)
    echoed = client.completions.create(model=NAME, prompt=prompt, logprobs=2, max_tokens=3, temperature=0, echo=True,
                                       extra_body={"prompt_logprobs": 3})
    streamed = list(client.completions.create(model=NAME, prompt=prompt, logprobs=2, max_tokens=3, temperature=0,
                                              echo=True, stream=True))
    e = echoed.choices[0]
    assert e.text == c.text + plain.choices[0].text
    # plain reads the prompt's blocks from the prefix cache, echoed (prompt logprobs: no prefix hits) prefills
    # fresh (self-attention over its own tokens, kv/paged.py): the same values up to float rounding
    np.testing.assert_allclose(e.logprobs.token_logprobs[len(prompt):], plain.choices[0].logprobs.token_logprobs,
                               rtol=1e-5, atol=1e-5)
    assert e.logprobs.token_logprobs[:len(prompt)] == lp.token_logprobs
    assert "".join(s.choices[0].text for s in streamed) == e.text
    assert [x for s in streamed if s.choices[0].logprobs for x in s.choices[0].logprobs.token_logprobs] == \
        e.logprobs.token_logprobs
    assert [x for s in streamed if s.choices[0].logprobs for x in s.choices[0].logprobs.text_offset] == \
        e.logprobs.text_offset

    pl = e.model_extra["prompt_logprobs"]  # vLLM's: None, then {token id: {logprob, rank, decoded_token}}
    assert len(pl) == len(prompt) and pl[0] is None
    for i, d in enumerate(pl[1:], 1):
        row = ref[i - 1]
        mine = d[str(prompt[i])]
        assert mine["logprob"] == pytest.approx(row[prompt[i]], abs=1e-4) and mine["decoded_token"] == texts[i]
        assert mine["rank"] == 1 + int((row > row[prompt[i]]).sum())
        top = [int(k) for k, v in d.items() if k != str(prompt[i]) or v["rank"] <= 3]
        assert set(top) >= set(np.argsort(-row)[:3].tolist()) and len(d) <= 4

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    assert bad.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="served on /v1/completions") as bad:  # not silently dropped
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 1})
    assert bad.value.body["param"] == "prompt_logprobs"


# lm-eval runs in a child process: its native dependencies (scipy, scikit-learn, lxml) stay out of the test
# worker, which runs XLA for the rest of the suite (workers that had loaded them crashed inside XLA later, session
# 21); the server it talks to is this process's live server.
LM_EVAL_CHILD = """
import json, sys
import yaml
from lm_eval import simple_evaluate
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager
url, name, task_yaml, data = sys.argv[1:5]
task = yaml.safe_load(open(task_yaml).read())
task["dataset_kwargs"]["data_files"]["test"] = data
lm = LocalCompletionsAPI(base_url=url, model=name, batch_size=4, max_length=128)
out = simple_evaluate(model=lm, tasks=[task], log_samples=True, task_manager=TaskManager(include_defaults=False))
samples = out["samples"]["surojax_tiny_mc"]
pairs = [[list(args), list(resp)] for s in samples for args, (resp,) in zip(s["arguments"], s["resps"])]
print("RESULT " + json.dumps({"backend": lm.tokenizer_backend, "samples": len(samples), "pairs": pairs,
                              "acc": out["results"]["surojax_tiny_mc"]["acc,none"]}))
"""


def test_lm_eval_loglikelihoods_equal_the_reference(server, qwen3):
    import json
    import os
    import subprocess
    import sys

    import importlib.util

    for name in ("lm_eval", "tenacity"):  # found, not imported here (lm-eval[api]: tenacity for its API models)
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (the dev extras' lm_eval[api])")
    task_dir = Path(__file__).parent.parent / "fixtures" / "lm_eval"
    done = subprocess.run([sys.executable, "-c", LM_EVAL_CHILD, server[0] + "/v1/completions", NAME,
                           str(task_dir / "surojax_tiny_mc.yaml"), str(task_dir / "tiny_mc.jsonl")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"})
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["backend"] == "remote"  # found /tokenizer_info + /tokenize: no local tokenizer needed
    tok = server[1].tokenizer
    pairs = out["pairs"]
    assert out["samples"] == 4 and len(pairs) == 12
    seqs = [(tok.encode(context + continuation), len(tok.encode(context))) for (context, continuation), _ in pairs]
    for (ids, n_ctx), logp, (_, (ll, greedy)) in zip(seqs, full_forward_logprobs(qwen3, [s for s, _ in seqs]), pairs):
        assert ll == pytest.approx(sum(logp[i - 1, ids[i]] for i in range(n_ctx, len(ids))), abs=1e-4)
        assert greedy == all(logp[i - 1].argmax() == ids[i] for i in range(n_ctx, len(ids)))
    assert 0 <= out["acc"] <= 1
