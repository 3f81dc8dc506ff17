"""HF parity: tiny random models made by transformers (tests/fixtures, scripts/make_fixtures.py,
scripts/make_gemma3_fixtures.py, scripts/make_gemma4_fixtures.py) loaded by
surojax give the same fp32 logits (max abs diff <= 1e-4) alone, right-padded in a batch and packed in one
row, and the same 32 greedy tokens (in a padded batch).

Compilations: per family one jitted program computes every logits check (the longest sequence alone on the default
positions / segments path, and one [4, T] batch whose row 0 packs the three sequences and whose rows 1..3 hold each
sequence right-padded), then generate's prefill and decode step. Families of one structure (gpt_oss and its MXFP4
checkpoint, dequantised at load) share those programs."""
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import generate
from surojax.weights.hf_checkpoint import load_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss",
            "gpt_oss_mxfp4", "gemma3_text", "gemma3", "gemma4_text", "gemma4", "gemma4_text_moe", "gemma4_text_global", "gemma4_text_shared"]
WINDOW = {"mistral": 6, "mixtral": 6, "gemma3_text": 4, "gemma3": 4, "gemma4_text": 4, "gemma4": 4,
          "gemma4_text_moe": 4, "gemma4_text_global": 4, "gemma4_text_shared": 4}
# Gemma: scripts/make_gemma{3,4}_fixtures.py (gemma4_text_moe: gemma4_text with its MoE block beside the MLP;
# gemma4_text_global: its full layers wider, one kv head, keys as values: the `global_layers` stack;
# gemma4_text_shared: that plus per-layer input embeddings and 2 KV-shared layers with double-wide MLPs)
GEMMA4_TEXT = ("gemma4_text_moe", "gemma4_text_global", "gemma4_text_shared")
TIED = ("llama_tied", "gemma3_text", "gemma3", "gemma4_text", "gemma4", *GEMMA4_TEXT)
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "gpt_oss_mxfp4", "gemma4_text_moe")
TOL = 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(graphdef, state, alone, tokens, positions, segments):
    """model(alone) on the default positions / segments, and model(tokens, positions, segments)."""
    model = nnx.merge(graphdef, state)
    return model(alone), model(tokens, positions, segments)


def _batch(seqs):
    """Row 0: the sequences packed one after another (segment ids 1, 2, 3; positions restart) then padding; rows
    1..3: sequence i alone, right-padded (segment 0). Returns tokens, positions, segments [4, T] and the offsets."""
    T = sum(map(len, seqs)) + 3  # trailing padding in the packed row too
    tokens, seg = (np.zeros((1 + len(seqs), T), np.int32) for _ in range(2))
    pos = np.tile(np.arange(T, dtype=np.int32), (1 + len(seqs), 1))
    starts, at = [], 0
    for i, s in enumerate(seqs):
        tokens[0, at:at + len(s)], seg[0, at:at + len(s)], pos[0, at:at + len(s)] = s, i + 1, np.arange(len(s))
        tokens[1 + i, :len(s)], seg[1 + i, :len(s)] = s, 1
        starts.append(at)
        at += len(s)
    pos[0, at:] = 0
    return tokens, pos, seg, starts


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    d = FIXTURES / request.param
    exp = np.load(d / "expected.npz")
    seqs = [exp[f"tokens{i}"].tolist() for i in range(3)]
    logits = [exp[f"logits{i}"] for i in range(3)]
    model = load_model(d, dtype=jnp.float32, attention="xla")
    i = max(range(len(seqs)), key=lambda j: len(seqs[j]))
    tokens, pos, seg, starts = _batch(seqs)
    graphdef, state = nnx.split(model)
    alone, batch = _all_logits(graphdef, state, jnp.asarray([seqs[i]]), jnp.asarray(tokens), jnp.asarray(pos),
                               jnp.asarray(seg))
    got = dict(alone=(i, np.asarray(alone)[0]), batch=np.asarray(batch), starts=starts)
    return request.param, model, seqs, logits, exp, got


def test_family_is_the_one_in_config(case):
    name, model, *_ = case
    family = "gemma4_text" if name in GEMMA4_TEXT else name.removesuffix("_tied").removesuffix("_mxfp4")
    assert model.cfg.model_type == family
    assert model.cfg.tie_word_embeddings == (name in TIED)
    assert model.cfg.sliding_window == WINDOW.get(name, 4 if name.startswith("gpt_oss") else None)
    assert (model.cfg.moe is not None) == (name in MOE)
    assert model.cfg.moe_beside_mlp == (name == "gemma4_text_moe")
    assert bool(model.cfg.moe and model.cfg.moe.shared_expert_intermediate_size) == (name == "qwen2_moe")
    assert (model.cfg.global_attention is not None) == (name in ("gemma4_text_global", "gemma4_text_shared"))
    assert (model.cfg.kv_shared_layers, model.cfg.per_layer_input_size) == \
        ((2, 8) if name == "gemma4_text_shared" else (0, 0))


def test_a_sequence_alone(case):
    """The default positions / segments path on the longest sequence (past every sliding window). Each
    sequence's logits are checked again in the padded batch and the packed row below; another length alone
    would only compile the same path again."""
    _, _, seqs, logits, _, got = case
    i, alone = got["alone"]
    assert alone.shape == logits[i].shape and len(seqs[i]) == max(map(len, seqs))
    assert np.abs(alone - logits[i]).max() <= TOL


def test_right_padded_batch(case):
    _, _, seqs, logits, _, got = case
    for i, (s, ref) in enumerate(zip(seqs, logits)):
        assert np.abs(got["batch"][1 + i, :len(s)] - ref).max() <= TOL


def test_packed_row_equals_each_sequence_alone(case):
    _, _, seqs, logits, _, got = case
    for s, ref, at in zip(seqs, logits, got["starts"]):
        assert np.abs(got["batch"][0, at:at + len(s)] - ref).max() <= TOL


def test_greedy_tokens_in_a_batch(case):
    """transformers' 32 greedy tokens (its prompt run alone) come out of a row beside other (longer, shorter)
    prompts: surojax's greedy decode matches transformers and does not depend on the batch it runs in."""
    _, model, seqs, _, exp, _ = case
    prompt = exp["greedy_prompt"].tolist()
    assert len(seqs[0]) < len(prompt) < len(seqs[2])  # a shorter and a longer neighbour: the row is padded
    batch = generate(model, [seqs[2], prompt, seqs[0]], 32)
    assert batch[1] == exp["greedy_tokens"].tolist()
