"""HF parity: tiny random models made by transformers (tests/fixtures, scripts/make_fixtures.py) loaded by
surojax give the same fp32 logits (max abs diff <= 1e-4) alone, right-padded in a batch and packed in one
row, and the same 32 greedy tokens (in a padded batch)."""
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from surojax.generation.loop import generate
from surojax.weights.hf_checkpoint import load_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4"]
WINDOW = {"mistral": 6, "mixtral": 6}
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    d = FIXTURES / request.param
    exp = np.load(d / "expected.npz")
    seqs = [exp[f"tokens{i}"].tolist() for i in range(3)]
    logits = [exp[f"logits{i}"] for i in range(3)]
    return request.param, load_model(d, dtype=jnp.float32, attention="xla"), seqs, logits, exp


def test_family_is_the_one_in_config(case):
    name, model, *_ = case
    assert model.cfg.model_type == name.removesuffix("_tied").removesuffix("_mxfp4")
    assert model.cfg.tie_word_embeddings == (name == "llama_tied")
    assert model.cfg.sliding_window == WINDOW.get(name, 4 if name.startswith("gpt_oss") else None)
    assert (model.cfg.moe is not None) == (name in ("qwen3_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4"))


def test_a_sequence_alone(case):
    """The default positions / segments path on the longest sequence (past every sliding window). Each
    sequence's logits are checked again in the padded batch and the packed row below; another length alone
    would only compile the same path again."""
    _, model, seqs, logits, _ = case
    i = max(range(len(seqs)), key=lambda j: len(seqs[j]))
    got = np.asarray(model(jnp.asarray([seqs[i]])))[0]
    assert np.abs(got - logits[i]).max() <= TOL


def test_right_padded_batch(case):
    _, model, seqs, logits, _ = case
    T = max(map(len, seqs))
    tokens = np.zeros((3, T), np.int32)
    seg = np.zeros((3, T), np.int32)
    pos = np.tile(np.arange(T, dtype=np.int32), (3, 1))
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], seg[i, :len(s)] = s, 1
    got = np.asarray(model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))
    for i, (s, ref) in enumerate(zip(seqs, logits)):
        assert np.abs(got[i, :len(s)] - ref).max() <= TOL


def test_packed_row_equals_each_sequence_alone(case):
    _, model, seqs, logits, _ = case
    T = sum(map(len, seqs)) + 3  # trailing padding too
    tokens, seg, pos = (np.zeros((1, T), np.int32) for _ in range(3))
    at = 0
    for i, s in enumerate(seqs):
        tokens[0, at:at + len(s)], seg[0, at:at + len(s)], pos[0, at:at + len(s)] = s, i + 1, np.arange(len(s))
        at += len(s)
    got = np.asarray(model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))[0]
    at = 0
    for s, ref in zip(seqs, logits):
        assert np.abs(got[at:at + len(s)] - ref).max() <= TOL
        at += len(s)


def test_greedy_tokens_in_a_batch(case):
    """transformers' 32 greedy tokens (its prompt run alone) come out of a row beside other (longer, shorter)
    prompts: surojax's greedy decode matches transformers and does not depend on the batch it runs in."""
    _, model, seqs, _, exp = case
    prompt = exp["greedy_prompt"].tolist()
    assert len(seqs[0]) < len(prompt) < len(seqs[2])  # a shorter and a longer neighbour: the row is padded
    batch = generate(model, [seqs[2], prompt, seqs[0]], 32)
    assert batch[1] == exp["greedy_tokens"].tolist()
