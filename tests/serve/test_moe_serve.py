"""MoE decode through the serving engine: the continuous-batching engine (paged pool and the dense reference
path, prefix cache hits, a batch of requests, multi-step decode) gives, for a tiny random qwen3_moe model, the
greedy tokens of plain argmax over a full recomputation of the sequence. One user's decode runs the gathered expert
form (surojax/models/layers/moe.py: only the routed experts' weights), the recomputation the grouped GEMMs.
(`surojax generate` on every MoE family against transformers' greedy tokens: tests/cli/test_generate.py; the MoE
layer is one code path for all families.)"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layers import moe
from surojax.serve.config import KVPath
from surojax.serve.engine import Engine
from tests.serve.configs import BUCKETS, engine_config
from tests.train.conftest import ROOT

BASE = dict(vocab_size=512, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=256)
QWEN3_MOE = dict(BASE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 norm_topk_prob=True)
PROMPTS = [[3, 17, 101, 44, 9, 250, 7, 33, 12], [5, 6], [3, 17, 101, 44, 9, 250, 7, 33, 40, 41, 42]]


@pytest.fixture(scope="module")
def model():
    m = Decoder(ModelConfig.from_hf(QWEN3_MOE), attention="xla", rngs=nnx.Rngs(7))
    # scale the embeddings up so the random logits are well separated (no argmax near-ties)
    m.embed.embedding[...] = m.embed.embedding[...] * 8
    return m


@nnx.jit
def _last_logits(model, tokens, length):
    """Logits at position length - 1 of one right-padded row (padding: segment 0, attended by nothing real)."""
    T = tokens.shape[1]
    seg = (jnp.arange(T) < length).astype(jnp.int32)[None]
    return model(tokens, jnp.arange(T, dtype=jnp.int32)[None], seg)[0, length - 1]


def recompute_greedy(model: Decoder, prompt: list[int], n: int, width: int = 32) -> list[int]:
    """The independent reference: each token is the argmax of a full forward over the whole sequence so far (one
    compiled forward over a right-padded row of `width`)."""
    ids = list(prompt)
    for _ in range(n):
        row = np.zeros((1, width), np.int32)  # built on the host: no scatter program compiled per length
        row[0, :len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(_last_logits(model, jnp.asarray(row), len(ids))))))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def expected(model):
    return [recompute_greedy(model, p, 6) for p in PROMPTS]


def engine(model, **kw) -> Engine:
    return Engine(model, engine_config(**{**dict(num_blocks=32, block_size=4, max_num_seqs=4,
                                                 max_num_batched_tokens=64, max_model_len=64, buckets=BUCKETS), **kw}))


@pytest.mark.parametrize("kv_path", [KVPath.PAGED, KVPath.REFERENCE])
def test_engine_batch_with_prefix_hits_equals_recompute(model, expected, kv_path):
    """Three requests in one batch; the third shares the first's two full blocks: run once more, both hit."""
    e = engine(model, kv_path=kv_path)
    assert e.generate(PROMPTS, max_tokens=6) == expected
    hits = e.kv.prefix_cache_hits
    assert e.generate([PROMPTS[2], PROMPTS[0]], max_tokens=6) == [expected[2], expected[0]]
    assert e.kv.prefix_cache_hits >= hits + 16  # both hit the two cached full blocks of 4 tokens


def test_multi_step_decode_equals_recompute(model, expected):
    e = engine(model, kv_path=KVPath.PAGED, decode_steps=4)
    assert e.generate(PROMPTS, max_tokens=6) == expected
    assert e.runner.num_multi_calls > 0


def _gpt_oss() -> Decoder:
    """The gpt_oss fixture's widths, two layers (sliding + full), random weights with nonzero expert biases."""
    hf = json.loads((ROOT / "tests/fixtures/models/gpt_oss/config.json").read_text())
    hf.update(num_hidden_layers=2, layer_types=hf["layer_types"][:2])
    m = Decoder(ModelConfig.from_hf(hf), attention="xla", rngs=nnx.Rngs(3))
    m.embed.embedding[...] = m.embed.embedding[...] * 8
    for lin in (m.layers.mlp.experts.gate_up_proj, m.layers.mlp.experts.down_proj):
        lin.bias[...] = 0.5 * jax.random.normal(jax.random.key(4), lin.bias[...].shape)
    return m


def _qwen3_5_moe() -> Decoder:
    """The Qwen3.5 MoE hybrid fixture's widths, two layers (Gated DeltaNet + gated attention, each with the routed
    experts and the shared expert), random weights."""
    hf = json.loads((ROOT / "tests/fixtures/models/qwen3_5_moe_text/config.json").read_text())
    hf.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    m = Decoder(ModelConfig.from_hf(hf), attention="xla", rngs=nnx.Rngs(5))
    m.embed.embedding[...] = m.embed.embedding[...] * 8
    return m


FAMILIES = {"gpt_oss": _gpt_oss, "qwen3_5_moe_text": _qwen3_5_moe}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_5_moe_text"])
def test_one_user_decode_gathers_the_routed_experts(model, expected, family, monkeypatch):
    """One request, decode rows bucketed from 1 (the server's default): the decode step takes the gathered expert
    form (traced; the prefill and the recomputation the grouped GEMMs) and its greedy tokens equal the
    recomputation's; gpt_oss with expert biases and sliding windows, the hybrid with its shared expert."""
    traced = []
    gathered = moe.Experts.gathered
    monkeypatch.setattr(moe.Experts, "gathered", lambda self, rows, ids: traced.append(rows.shape) or
                        gathered(self, rows, ids))
    m = model if family == "qwen3_moe" else FAMILIES[family]()
    want = expected[0] if family == "qwen3_moe" else recompute_greedy(m, PROMPTS[0], 6)
    e = engine(m, kv_path=KVPath.PAGED, buckets=dataclasses.replace(BUCKETS, min_rows=1))
    assert e.generate([PROMPTS[0]], max_tokens=6) == [want]
    assert (2, m.cfg.hidden_size) in traced  # one decode row x k = 2 assignments: the gathered form ran


def test_gather_kernel_reads_the_served_expert_stacks_in_place(model, expected, monkeypatch):
    """SUROJAX_MOE_GATHER_KERNEL=pallas with the choice forced as on a GPU: `decode_weights` makes each layer
    stack's experts an ExpertStack, the layer scan hands it whole with the layer index, and the gathered form
    (forced: the engine pads one user's decode to a bucket of rows past this tiny model's crossover) runs the
    gathered GEMV kernel on it (interpret mode here; called with the layer): the greedy tokens of the
    recomputation. Then under auto the prefill and decode take the grouped GEMM on the layer's slice: the same."""
    import pallas_kernels.gathered_gemv.api as gemv_api
    import pallas_kernels.grouped_matmul.gathered as gathered
    from surojax.kernel_settings import use_kernel_settings
    from surojax.quant.expert_stack import ExpertStack
    from surojax.quant.laid_out import decode_weights

    layers = []
    monkeypatch.setattr(gemv_api, "on_gpu", lambda: True)
    monkeypatch.setattr(gathered, "gathered_gemv", lambda *a, layer=None, **kw: layers.append(layer) or
                        gemv_api.gathered_gemv(*a, layer=layer, interpret=True, **kw))
    served = nnx.clone(model)
    with use_kernel_settings(moe_gather_kernel="pallas"):
        assert decode_weights(served, join_projections=False) == {"experts_in_place:float32": 2}
        assert isinstance(served.layers.mlp.experts.down_proj.kernel[...], ExpertStack)
        with use_kernel_settings(moe_decode="gather"):
            assert engine(served).generate([PROMPTS[1]], max_tokens=6) == [expected[1]]
        assert layers and all(layer is not None for layer in layers)  # the stack read at its layer, not a slice
        n = len(layers)
        assert engine(served).generate([PROMPTS[1]], max_tokens=6) == [expected[1]]
        assert len(layers) == n  # auto: the grouped GEMM, through ExpertStack.grouped_matmul


def test_quantised_experts_laid_out_for_the_kernel_serve_the_same_tokens(monkeypatch):
    """Q4_K experts (a model wide enough for the kernel layout: K = 256): `decode_weights` under
    SUROJAX_MOE_GATHER_KERNEL=pallas, the choice forced as on a GPU, lays each expert stack out once
    (LaidOutExperts), the layer scan hands it whole with the layer index, and the forced gathered form runs the
    gathered quantised GEMV (interpret mode here) at that layer: the greedy tokens of the recomputation over the
    native Q4_K blocks. Under auto the grouped GEMM dequantises the layer's layout: the same tokens."""
    import pallas_kernels.gathered_gemv.api as gemv_api
    from surojax.kernel_settings import use_kernel_settings
    from surojax.quant.expert_layout import LaidOutExperts
    from surojax.quant.laid_out import decode_weights
    from surojax.quant.transform import quantize_kernel

    hf = dict(QWEN3_MOE, hidden_size=256, moe_intermediate_size=256, head_dim=64, num_experts=4)
    m = Decoder(ModelConfig.from_hf(hf), attention="xla", rngs=nnx.Rngs(3))
    m.embed.embedding[...] = m.embed.embedding[...] * 8
    for lin in (m.layers.mlp.experts.gate_up_proj, m.layers.mlp.experts.down_proj):
        quantize_kernel(lin, "q4_k")
    want = recompute_greedy(m, PROMPTS[1], 5)
    calls = []
    monkeypatch.setattr(gemv_api, "on_gpu", lambda: True)
    kernel = gemv_api.gathered_quant_kernel
    monkeypatch.setattr(gemv_api, "gathered_quant_kernel", lambda *a, **kw: calls.append(a[3]) or
                        kernel(*a, **{**kw, "interpret": True}))
    with use_kernel_settings(moe_gather_kernel="pallas"):
        assert decode_weights(m, join_projections=False) == {"experts_in_place:q4_k": 2}
        down = m.layers.mlp.experts.down_proj.kernel[...]
        assert isinstance(down, LaidOutExperts) and down.data.shape[:2] == (2, 4)
        with use_kernel_settings(moe_decode="gather"):
            assert engine(m).generate([PROMPTS[1]], max_tokens=5) == [want]
        assert calls  # the kernel ran, at a layer's base in the stack
        n = len(calls)
        assert engine(m).generate([PROMPTS[1]], max_tokens=5) == [want]
        assert len(calls) == n  # auto on this tiny model: the grouped GEMM over the dequantised layout
