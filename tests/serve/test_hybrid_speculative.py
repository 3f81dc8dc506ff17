"""Speculative decoding on hybrid models (Qwen3.5's Gated DeltaNet `linear_layers`, LFM2's short-convolution
`conv_layers`): the verify step keeps each sequence's state after its last ACCEPTED token
(surojax/serve/state_slots.py, kv_paged.verify_step).

Greedy (LFM2-MoE with dense leading layers: conv stacks of both kinds): the proposals come from an oracle in place
of prompt lookup that proposes transformers' own greedy continuation (tests/fixtures/models/<name>/serve_greedy.npz)
with one token corrupted at a place that moves from step to step, so the verify step accepts 0 .. K proposals and
rejects the rest (asserted); the output must equal transformers' greedy tokens, which it cannot if a slot kept the
state after a rejected proposal.
Sampled (Qwen3.5; seeded, temperature 1 with top-k 1: the sampling branch of the acceptance rule, whose target
distribution is then a point mass on the greedy token; the same oracle): the output equals transformers' greedy
tokens, and after every step each running sequence's state slot holds the state a plain engine computes by
prefilling the same tokens (the rule itself, at any temperature, is tested in test_speculative.py). A hybrid
DRAFT model is refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.serve import engine as engine_module
from surojax.serve.config import SpecMethod, SpeculativeConfig
from surojax.serve.engine import Engine, HybridServingError
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config
from tests.serve.test_hybrid_serve import FIXTURES, _greedy, _model

SERVE = dict(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64,
             buckets=BUCKETS)
K = 3


def oracle(prompts, want, vocab):
    """An `ngram_propose` stand-in: the reference greedy continuation of the sequence (none once it left that
    path), with the token at offset len(tokens) % (k + 1) replaced (no corruption when that offset is k)."""
    def propose(tokens, k, n_max=3, n_min=1):
        for p, w in zip(prompts, want):
            full = p + w
            if tokens == full[:len(tokens)] and len(tokens) >= len(p):
                out = full[len(tokens):len(tokens) + k]
                bad = len(tokens) % (k + 1)
                if bad < len(out):
                    out[bad] = (out[bad] + 1) % vocab
                return out
        return []

    return propose


def spec_engine(model, **kw):
    return Engine(model, engine_config(**SERVE, speculative=SpeculativeConfig(SpecMethod.NGRAM, K), **kw))


def test_greedy_with_partly_rejected_proposals_equals_transformers(monkeypatch):
    """LFM2-MoE with dense leading layers (conv windows, in a conv stack of each kind: its dense leading layers in
    stacks of their own sharing their kind's state cache; plain LFM2's conv layers run the same verify step on one
    conv stack, no case of their own); Qwen3.5's Gated DeltaNet: the sampled test below, which also asserts greedy's
    tokens."""
    name = "lfm2_moe_dense"
    prompts, want = _greedy(name)
    model = _model(name)
    monkeypatch.setattr(engine_module, "ngram_propose", oracle(prompts, want, model.cfg.vocab_size))
    engine = spec_engine(model)
    assert engine.generate(prompts, max_tokens=len(want[0])) == want
    st = engine.spec_stats
    assert 0 < st.accepted < st.proposed  # some proposals accepted, some rejected
    assert engine.scheduler.state_slots.num_free == SERVE["max_num_seqs"]


def _slot_states(engine, slot):
    return [np.asarray(x[:, slot]) for x in jax.tree.leaves(engine.runner.state_pool)]


def test_sampled_speculation_keeps_the_state_of_the_accepted_tokens(monkeypatch):
    """Seeded sampling through the rejection rule (top-k 1): greedy's tokens, and after each step the slot of
    every running sequence equals a plain engine's after prefilling that sequence's tokens with KV."""
    name = "qwen3_5_text"
    prompts, want = _greedy(name)
    model = _model(name)
    monkeypatch.setattr(engine_module, "ngram_propose", oracle(prompts, want, model.cfg.vocab_size))
    engine = spec_engine(model)
    plain = Engine(model, engine_config(**SERVE))
    rids = [engine.add_request(p, max_tokens=len(want[0]), temperature=1.0, top_k=1, seed=3) for p in prompts[:3]]
    got_ids = {r: [] for r in rids}
    checked = 0
    while engine.has_unfinished():
        for o in engine.step():
            got_ids[o.request_id] += o.new_token_ids
        for req in engine.scheduler.running:
            if req.num_computed_tokens != req.num_tokens - 1 or not req.output_token_ids:
                continue  # still prefilling
            done = req.all_token_ids[:req.num_computed_tokens]
            rid = plain.add_request(done, max_tokens=2)
            plain.step()  # the prefill: the slot holds the state after `done`
            ref = _slot_states(plain, plain.scheduler.state_slots.slot(rid))
            plain.abort(rid)
            got = _slot_states(engine, engine.scheduler.state_slots.slot(req.request_id))
            for a, b in zip(got, ref):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            checked += 1
    st = engine.spec_stats
    assert [got_ids[r] for r in rids] == want[:3]
    assert checked >= 10 and 0 < st.accepted < st.proposed


def test_a_hybrid_draft_model_is_refused():
    target = load_model(FIXTURES / "qwen3", dtype=jnp.float32, attention="xla")
    spec = SpeculativeConfig(SpecMethod.DRAFT, K, model="d")
    for name, kind in [("qwen3_5_text", "linear-attention"), ("lfm2", "short-convolution")]:
        with pytest.raises(HybridServingError, match=f"the draft model \\({name}\\): a hybrid model cannot be the "
                                                     f"speculative draft: the {kind} layers' states"):
            Engine(target, engine_config(**SERVE, speculative=spec), draft_model=_model(name))
