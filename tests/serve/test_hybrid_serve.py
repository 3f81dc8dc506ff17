"""The paged engine serves hybrid models (Qwen3.5: Gated DeltaNet layers beside gated attention; LFM2: short
convolutions beside GQA attention) through per-sequence state slots (surojax/serve/state_slots.py), checked against
transformers' greedy generation on the tiny fixtures (tests/fixtures/models/qwen3_5*_text/serve_greedy.npz:
scripts/make_qwen3_5_serve_fixtures.py; lfm2/serve_greedy.npz: scripts/make_lfm2_fixtures.py; lfm2_moe_dense:
scripts/make_lfm2_moe_fixtures.py, its dense leading layers in stacks of their own sharing their kind's KV / state
cache; float64).

One engine run per case serves five prompts of 3 .. 41 tokens with 3 seats, a 16-token step budget (the 26- and
41-token prompts are prefilled in two and three chunks, while the other rows decode) and a pool small enough to
preempt: the later requests take the state slots of finished (or preempted) ones, so a slot that were not zeroed
for its new sequence would change their tokens. Prefix caching is off for hybrids (and said so); runtime LoRA
slots wrap both stacks (a row with an adapter = the merged model). Speculative decoding: test_hybrid_speculative.py."""
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.generation.loop import generate
from surojax.kernel_settings import use_kernel_settings
from surojax.models.layers.linear import Linear
from surojax.models.targets import model_targets, site_stack
from surojax.peft.multi_lora import AdapterSlots, LoRASlotError
from surojax.quant.gemv_weight import GemvWeight
from surojax.quant.laid_out import decode_weights
from surojax.serve.config import KVPath
from surojax.serve.engine import Engine
from surojax.serve.state_slots import PREFIX_CACHING_OFF, PREFIX_CACHING_OFF_CONV, StateSlots
from surojax.weights.hf_checkpoint import load_model
from tests.serve.adapters import forward_with_rows, random_adapter, serve_with_adapters
from tests.serve.configs import BUCKETS, engine_config

FIXTURES = Path(__file__).parent.parent / "fixtures" / "models"
SERVE = dict(num_blocks=16, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
             buckets=BUCKETS)


def _model(name):
    return load_model(FIXTURES / name, dtype=jnp.float32, attention="xla")


def _greedy(name):
    exp = np.load(FIXTURES / name / "serve_greedy.npz")
    n = len([k for k in exp.files if k.startswith("prompt")])
    return [exp[f"prompt{i}"].tolist() for i in range(n)], [exp[f"greedy{i}"].tolist() for i in range(n)]


def _serve_the_fixture(engine, name):
    """Five concurrent requests of 3 .. 41 tokens with 3 seats: transformers' greedy tokens, with chunked prefill,
    preemption (recompute from a zeroed slot) and multi-step decode; every state slot given back."""
    prompts, want = _greedy(name)
    assert max(map(len, prompts)) > 2 * SERVE["max_num_batched_tokens"]  # a prompt of three chunks
    assert engine.generate(prompts, max_tokens=len(want[0])) == want, f"{name}: served greedy != transformers"
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_multi_steps > 0
    assert engine.scheduler.state_slots.num_free == SERVE["max_num_seqs"]  # every slot given back


# qwen3_5_text and lfm2 on the paged path: test_runtime_lora_over_both_stacks_equals_the_merged_model, whose engine
# (LoRA slots, every row of these requests on slot 0: the base model) serves the same requests
@pytest.mark.parametrize("name, kv_path", [("qwen3_5_moe_text", KVPath.REFERENCE), ("lfm2_moe_dense", KVPath.PAGED)])
def test_served_greedy_equals_transformers(name, kv_path):
    """Concurrent requests of different lengths, chunked prefill, slot reuse and preemption (recompute from a
    zeroed slot), on both KV paths. Decode is single-step while requests wait (prefill chunks of the later
    prompts run beside the decode rows) and multi-step once every running request decodes (the states ride in
    the loop)."""
    _serve_the_fixture(Engine(_model(name), engine_config(**SERVE, kv_path=kv_path, decode_steps=4)), name)


def _laid_out_for_the_decode_gemv(name):
    """The fixture with `decode_weights` run (decode GEMV on), each stack's plain Linears checked to be laid out."""
    model = _model(name)
    decode_weights(model, join_projections=False)
    for stack_name, stack in model.stacks.items():
        kinds = {"/".join(map(str, path)): type(mod.kernel.get_value()).__name__
                 for path, mod in nnx.iter_graph(stack) if isinstance(mod, Linear)}
        for path, kind in kinds.items():  # the fixtures' down_proj (K = 112 / 48) is off the kernel's tiles
            assert kind == "GemvWeight" or path.endswith("down_proj"), f"{stack_name}.{path} left {kind}"
    assert isinstance(model.stacks[model.state_stack].mlp.gate_proj.kernel.get_value(), GemvWeight)
    return model


@pytest.mark.parametrize("name", ["lfm2", "qwen3_5_text"])
def test_decode_gemv_takes_every_stack(name):
    """`decode_weights` lays out the plain Linears of every layer stack for the decode GEMV, the short conv's /
    DeltaNet's stack too: a stack left out keeps [L, K, N] kernels, which the scan copies out of the stack layer by
    layer for an XLA GEMM every token (LFM2-1.2B: the slice fusions of its decode step)."""
    with use_kernel_settings(decode_gemv="pallas"):
        _laid_out_for_the_decode_gemv(name)


def test_served_greedy_through_the_decode_gemv_equals_transformers():
    """LFM2 with both stacks' kernels laid out serves transformers' greedy tokens through the decode GEMV (pallas,
    interpret here)."""
    with use_kernel_settings(decode_gemv="pallas"):
        model = _laid_out_for_the_decode_gemv("lfm2")
        _serve_the_fixture(Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, decode_steps=4)), "lfm2")


def test_state_slots_follow_the_sequence():
    """A slot is taken at admission and given back on finish, abort and preemption; the lowest free one first."""
    slots = StateSlots(2)
    assert (slots.allocate("a"), slots.allocate("b")) == (0, 1)
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.allocate("c")
    slots.free("a")
    slots.free("never-admitted")  # aborted while waiting: holds none
    assert slots.allocate("c") == 0 and slots.slot("b") == 1 and slots.num_free == 0


@pytest.mark.parametrize("name, why", [("qwen3_5_text", PREFIX_CACHING_OFF), ("lfm2", PREFIX_CACHING_OFF_CONV)])
def test_prefix_caching_is_off_for_hybrids(name, why, caplog):
    with caplog.at_level(logging.INFO, logger="surojax.serve.engine"):
        engine = Engine(_model(name), engine_config(**SERVE, enable_prefix_caching=True))
    assert not engine.config.enable_prefix_caching and not engine.kv.enable_prefix_caching
    assert f"{name}: {why}" in caplog.messages


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2"])
def test_runtime_lora_over_both_stacks_equals_the_merged_model(name, tmp_path):
    """Runtime LoRA slots wrap every Linear of both stacks (the attention, both stacks' MLPs, the DeltaNet's / short
    conv's projections: `all-linear`, each stack's slots over its own layers). One paged engine with the slots
    (multi-step decode) serves (1) the fixture's five requests on the base model (slot 0): transformers' greedy
    tokens through chunked prefill, preemption, slot reuse and multi-step decode (test_served_greedy_equals_
    transformers' checks, on this engine); (2) an adapter on all of them, written under PEFT's model.layers.{i}
    names and loaded into a slot (layer i to its stack's row: the fixtures' layer patterns are irregular), decodes
    the merged model's greedy tokens, and a row without it the base's, in one batch, through prefill and decode."""
    model = _model(name)
    merged = random_adapter(model, tmp_path / "a", seed=1, targets="all-linear")
    prompts = np.random.default_rng(0).integers(1, model.cfg.vocab_size, size=(2, 12)).tolist()
    adapted, base = generate(merged, prompts, 8), generate(model, prompts, 8)  # one compile: same shapes
    assert adapted[0] != base[0]  # the adapter changes the answer
    slots = AdapterSlots(model, max_loras=1, max_rank=4)
    assert {site_stack(k) for k in slots.modules} == set(model.stacks) == {"layers", model.state_stack}
    assert set(slots.modules) == set(model_targets(model))  # every Linear target of every stack
    engine = Engine(model, engine_config(**SERVE, kv_path=KVPath.PAGED, decode_steps=4), lora=slots)
    _serve_the_fixture(engine, name)
    engine.load_lora("a", tmp_path / "a")
    steps = engine.scheduler.num_multi_steps
    assert serve_with_adapters(engine, prompts, ["a", None], 8) == [adapted[0], base[1]], "adapter rows != merged"
    assert engine.scheduler.num_multi_steps > steps  # the adapter rows in the multi-step call


def test_runtime_lora_on_a_moe_hybrid_leaves_the_experts_to_merging(tmp_path):
    """lfm2_moe with dense leading layers (in stacks of their own): the slots wrap the attention, the short conv and
    the dense layers' MLP in every stack; a row with an adapter on them gives the merged model's logits. The routed
    experts are not wrapped (grouped GEMMs): an adapter on them is refused by name."""
    model = _model("lfm2_moe_dense")
    random_adapter(model, tmp_path / "experts", seed=2, targets=("q_proj", "experts"))
    merged = random_adapter(model, tmp_path / "a", seed=1, targets=("q_proj", "in_proj", "out_proj", "w1", "w2"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, model.cfg.vocab_size, size=(2, 12)))
    forward = nnx.jit(lambda m, x: m(x))
    want = np.concatenate([np.asarray(forward(merged, tokens[:1])), np.asarray(forward(model, tokens[1:]))])
    assert not np.allclose(want[:1], forward(model, tokens[:1]), atol=1e-3)  # the adapter changes the logits
    slots = AdapterSlots(model, max_loras=1, max_rank=4)
    assert {site_stack(k) for k in slots.modules} == set(model.stacks) and len(model.stacks) > 2
    assert not [k for k in slots.modules if "experts" in k]
    refused = r"adapter targets \[.*experts\.gate_up_proj.*which the server does not wrap"
    with pytest.raises(LoRASlotError, match=refused):
        slots.load("experts", tmp_path / "experts")
    slots.load("a", tmp_path / "a")
    rows = jnp.asarray([slots.slot("a"), 0])
    np.testing.assert_allclose(np.asarray(forward_with_rows(model, tokens, rows)), want, atol=1e-4, rtol=1e-4)


def test_peft_adapter_in_a_slot_gives_peft_logits():
    """PEFT's own adapter (transformers + peft, all-linear on qwen3_5_text: the DeltaNet projections, attention and
    both stacks' MLPs; tests/fixtures/peft/qwen3_5, scripts/make_peft_fixtures.py) loaded into a runtime slot gives
    PEFT's logits."""
    peft = FIXTURES.parent / "peft" / "qwen3_5"
    expected = np.load(peft / "expected.npz")
    model = _model("qwen3_5_text")
    slots = AdapterSlots(model, max_loras=2, max_rank=8)
    slots.load("peft", peft / "adapter")
    tokens = jnp.asarray(expected["tokens"])
    got = forward_with_rows(model, tokens, jnp.asarray([slots.slot("peft")]))
    np.testing.assert_allclose(np.asarray(got), expected["logits"], rtol=0, atol=1e-4)
    base = forward_with_rows(model, tokens, jnp.asarray([0]))  # slot 0: the base model
    assert not np.allclose(np.asarray(base), expected["logits"], atol=1e-3)
