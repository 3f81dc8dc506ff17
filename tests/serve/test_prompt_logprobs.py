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
    run(eng, [(prompt, SamplingParams(max_tokens=2))])  # the prompt's full blocks are now cached (not qwen3_5)
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
