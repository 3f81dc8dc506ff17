"""MTP speculation (surojax/models/mtp.py, weights/mtp_checkpoint.py, serve/mtp.py) on tiny Qwen3.5 models.

The fixtures are the transformers-made tiny Qwen3.5 checkpoints (tests/fixtures/models/qwen3_5_text,
qwen3_5_moe_text) extended here with random `mtp.*` tensors as vLLM's Qwen3_5MTP reads them: `mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` and `mtp.layers.0.*` named and shaped as the
model's own full-attention layer (dense or MoE), with `mtp_num_hidden_layers: 1` in config.json.

(a) the head's logits equal a numpy reference written here from vLLM's definition (norm the embedding and the
hidden state, concatenate, fc, one gated full-attention layer with partial rope and (1 + w) norms, mtp.norm, the
model's head); (b) served greedy output with `mtp` equals greedy output without speculation (transformers'
greedy tokens of the fixture, serve_greedy.npz, which plain serving equals: test_hybrid_serve.py; chunked
prefill, concurrent rows), and every first proposal equals the head's argmax over the whole sequence; (c) sampled rows (the
high temperature makes proposals accepted) draw their first proposal from the distribution the whole-sequence head
gives, so the head's KV and pending hidden state are right after accepted runs too; (d) refusals by name.
"""
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.models.mtp import full_sequence_logits
from surojax.serve.config import SpecMethod, SpeculativeConfig
from surojax.serve.engine import Engine
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.mtp_checkpoint import MTPError, load_mtp
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors
from tests.serve.configs import BUCKETS, engine_config
from tests.serve.test_hybrid_serve import FIXTURES, _greedy

SERVE = dict(num_blocks=48, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64,
             buckets=BUCKETS)
K = 3
CASES = (1, 3, 0)  # serve_greedy.npz's prompts of 7, 26 (two prefill chunks) and 3 tokens


def greedy_cases(name):
    """Prompts and transformers' greedy continuations (which plain serving equals: test_hybrid_serve.py)."""
    prompts, want = _greedy(name)
    return [prompts[i] for i in CASES], [want[i] for i in CASES]


def with_mtp(name: str, dst, seed: int = 0):
    """The fixture `name` copied to `dst` with a random MTP head: mtp.layers.0.* shaped as its full-attention
    layer's tensors, the fc [D, 2D] and three norms [D] ((1 + w) norms: small random w)."""
    src = FIXTURES / name
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    full = cfg["layer_types"].index("full_attention")
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {n: f.get(n) for n in f.names()}
    rng = np.random.default_rng(seed)
    D = cfg["hidden_size"]
    layer = f"model.layers.{full}."
    for n, t in list(tensors.items()):
        if n.startswith(layer):
            scale = 0.2 if n.endswith("norm.weight") or "layernorm" in n else 0.15
            tensors["mtp.layers.0." + n[len(layer):]] = (scale * rng.standard_normal(t.shape)).astype(t.dtype)
    tensors["mtp.fc.weight"] = (0.15 * rng.standard_normal((D, 2 * D))).astype(np.float32)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{n}.weight"] = (0.2 * rng.standard_normal(D)).astype(np.float32)
    write_safetensors(dst / "model.safetensors", tensors)
    cfg["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = with_mtp("qwen3_5_text", tmp_path_factory.mktemp("mtp") / "qwen3_5_text")
    model = load_model(d, dtype=jnp.float32, attention="xla")
    return d, model, load_mtp(d, model, attention="xla")


# ---- (a) the head against a numpy reference of vLLM's definition ----------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, pos, rot, theta):
    """Partial rotary (rotate_half) on the first `rot` dims of x [T, N, H]."""
    inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    xr = x[..., :rot]
    half = np.concatenate([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return np.concatenate([xr * cos + half * sin, x[..., rot:]], -1)


def reference_mtp_logits(w: dict, cfg: dict, tokens, hidden):
    """vLLM's Qwen3_5MultiTokenPredictor + the shared head, dense MLP, one sequence: tokens [T] (t_{p+1}), hidden
    [T, D] (h_p) at positions 0 .. T - 1 -> logits [T, V]."""
    eps, N, KV, H = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    T = len(tokens)
    L = "mtp.layers.0."
    e = _rms(w["model.embed_tokens.weight"][tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], -1) @ w["mtp.fc.weight"].T
    y = _rms(x, w[L + "input_layernorm.weight"], eps)
    qg = (y @ w[L + "self_attn.q_proj.weight"].T).reshape(T, N, 2 * H)
    q, gate = qg[..., :H], qg[..., H:]
    k = (y @ w[L + "self_attn.k_proj.weight"].T).reshape(T, KV, H)
    v = (y @ w[L + "self_attn.v_proj.weight"].T).reshape(T, KV, H)
    q, k = _rms(q, w[L + "self_attn.q_norm.weight"], eps), _rms(k, w[L + "self_attn.k_norm.weight"], eps)
    pos = np.arange(T, dtype=np.float64)
    rot = int(H * cfg["partial_rotary_factor"])
    theta = cfg["rope_parameters"]["rope_theta"]
    q, k = _rope(q, pos, rot, theta), _rope(k, pos, rot, theta)
    k, v = np.repeat(k, N // KV, axis=1), np.repeat(v, N // KV, axis=1)
    s = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.einsum("nqk,knh->qnh", p, v) * (1 / (1 + np.exp(-gate)))
    x = x + a.reshape(T, N * H) @ w[L + "self_attn.o_proj.weight"].T
    y = _rms(x, w[L + "post_attention_layernorm.weight"], eps)
    g_, u = y @ w[L + "mlp.gate_proj.weight"].T, y @ w[L + "mlp.up_proj.weight"].T
    x = x + (g_ / (1 + np.exp(-g_)) * u) @ w[L + "mlp.down_proj.weight"].T
    return _rms(x, w["mtp.norm.weight"], eps) @ w["lm_head.weight"].T


def test_head_equals_the_reference(dense):
    d, model, mtp = dense
    f = SafetensorsFile(d / "model.safetensors")
    w = {n: f.get(n).astype(np.float64) for n in f.names()}
    cfg = json.loads((d / "config.json").read_text())
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg["vocab_size"], 12)
    hidden = rng.standard_normal((12, cfg["hidden_size"]))
    got = full_sequence_logits(mtp, jnp.asarray(tokens[None], jnp.int32), jnp.asarray(hidden[None], jnp.float32))
    want = reference_mtp_logits(w, cfg, tokens[1:], hidden[:-1])
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=2e-4, atol=2e-4)


# ---- (b), (c) served ------------------------------------------------------------------------------------------

def _record_proposals(engine):
    """Wrap the engine's MTP propose: -> list of (request index, the row's token count, its first proposal, the
    distribution q it was drawn from or None)."""
    seen = []
    propose = engine.mtp.propose

    def recording(group, num_tokens, R, S):
        ids, limit, q = propose(group, num_tokens, R, S)
        ids_h, q_h = np.asarray(ids), None if q is None else np.asarray(q)
        for r, s in enumerate(group):
            seen.append((int(s.request_id.split("-")[1]), s.request.num_tokens, int(ids_h[r, 0]),
                         None if q_h is None else q_h[r, 0]))
        return ids, limit, q

    engine.mtp.propose = recording
    return seen


@functools.partial(jax.jit, static_argnames="graphdefs")
def _head_over(graphdefs, states, tokens):
    model, mtp = (nnx.merge(g, s) for g, s in zip(graphdefs, states))
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return full_sequence_logits(mtp, tokens, model.hidden_states(tokens, pos, jnp.ones_like(pos)).hidden)


def _whole_sequence_head(model, mtp, seq):
    """The head's logits over a whole finished sequence, no cache: row m - 1 is what the proposal after the first
    m + 1 tokens (the last at position m) must come from (the forward is causal: a prefix's rows are its own, and
    the padding to one length, for one compile, comes after them)."""
    tokens = np.zeros((1, SERVE["max_model_len"]), np.int32)
    tokens[0, :len(seq)] = seq
    (g1, s1), (g2, s2) = nnx.split(model), nnx.split(mtp)
    return np.asarray(_head_over((g1, g2), (s1, s2), jnp.asarray(tokens))[0, :len(seq) - 1])


def test_served_greedy_equals_plain_greedy(dense):
    _, model, mtp = dense
    prompts, plain = greedy_cases("qwen3_5_text")
    engine = Engine(model, engine_config(**SERVE, speculative=SpeculativeConfig(SpecMethod.MTP, K)), mtp_head=mtp)
    seen = _record_proposals(engine)
    assert engine.generate(prompts, max_tokens=len(plain[0])) == plain
    st = engine.spec_stats
    assert st.row_steps > 0 and st.proposed > 0
    heads = [_whole_sequence_head(model, mtp, p + out) for p, out in zip(prompts, plain)]
    assert len(seen) >= 10
    assert [int(np.argmax(heads[i][n - 2])) for i, n, _, _ in seen] == [d1 for _, _, d1, _ in seen]
    assert engine.scheduler.state_slots.num_free == SERVE["max_num_seqs"]


def test_sampled_first_proposal_follows_the_whole_sequence_head(dense):
    _, model, mtp = dense
    engine = Engine(model, engine_config(**SERVE, speculative=SpeculativeConfig(SpecMethod.MTP, K)), mtp_head=mtp)
    seen = _record_proposals(engine)
    temperature = 4.0
    # the 7- and 3-token prompts, prefilled in one call: the head's KV after a continuing chunk and after plain decode
    # steps beside it is the greedy test's (the mirror does not sample); here they cost two more target compiles
    prompts = [greedy_cases("qwen3_5_text")[0][i] for i in (0, 2)]
    outs = engine.generate(prompts, max_tokens=16, temperature=temperature, seed=3)
    assert engine.spec_stats.accepted > 0  # accepted runs: the mirror then keeps several tokens per verify
    heads = [_whole_sequence_head(model, mtp, p + out) / temperature for p, out in zip(prompts, outs)]
    assert len(seen) >= 4
    for i, n, _, q in seen:
        want = np.exp(heads[i][n - 2] - heads[i][n - 2].max())
        np.testing.assert_allclose(q, want / want.sum(), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the dense tests' path on the MoE layer (the decoder's MoE code; the loader's expert rows)
def test_moe_head_loads_and_serves(tmp_path):
    d = with_mtp("qwen3_5_moe_text", tmp_path / "moe")
    model = load_model(d, dtype=jnp.float32, attention="xla")
    mtp = load_mtp(d, model, attention="xla")
    assert mtp.cfg.moe is not None and mtp.cfg.num_layers == 1
    prompts, plain = greedy_cases("qwen3_5_moe_text")
    # the 7- and 3-token prompts: each prefilled in one chunk (continuing chunks: the dense greedy test's), so the
    # engine compiles no continuing-chunk programs for this second model
    engine = Engine(model, engine_config(**SERVE, speculative=SpeculativeConfig(SpecMethod.MTP, 2)), mtp_head=mtp)
    assert engine.generate([prompts[0], prompts[2]], max_tokens=6) == [plain[0][:6], plain[2][:6]]
    assert engine.spec_stats.proposed > 0


# ---- (d) refusals ---------------------------------------------------------------------------------------------

def test_refusals_name_what_is_missing(dense, tmp_path):
    d, model, mtp = dense
    plain_model = load_model(FIXTURES / "qwen3_5_text", dtype=jnp.float32, attention="xla")
    with pytest.raises(MTPError, match="mtp_num_hidden_layers"):
        load_mtp(FIXTURES / "qwen3_5_text", plain_model)
    # the config key without the tensors: the missing ones are named
    bare = tmp_path / "bare"
    shutil.copytree(FIXTURES / "qwen3_5_text", bare)
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(dict(cfg, mtp_num_hidden_layers=1)))
    with pytest.raises(MTPError, match=r"missing tensors .*mtp\.fc\.weight"):
        load_mtp(bare, load_model(bare, dtype=jnp.float32, attention="xla"))
    llama = load_model(FIXTURES / "llama", dtype=jnp.float32, attention="xla")
    with pytest.raises(MTPError, match="llama: MTP speculation runs the MTP heads of the Qwen3.5"):
        load_mtp(FIXTURES / "llama", llama)
    spec = SpeculativeConfig(SpecMethod.MTP, K)
    with pytest.raises(ValueError, match="pass mtp_head exactly when the speculative method is 'mtp'"):
        Engine(model, engine_config(**SERVE, speculative=spec))
    with pytest.raises(ValueError, match="only read by --speculative-method draft"):
        SpeculativeConfig(SpecMethod.MTP, K, model="some/draft")
    engine = Engine(model, engine_config(**SERVE, speculative=spec), mtp_head=mtp)
    with pytest.raises(ValueError, match="sleep mode is not supported with MTP"):
        engine.sleep()


def test_serve_flags_load_the_head(dense):
    """`surojax serve DIR --speculative-method mtp`: the launch reads the head from the served folder (and from
    nothing else); the other methods load none."""
    from surojax.cli.main import build_parser, load_command
    from surojax.cli.serve import serve_config
    from surojax.models.mtp import MTPDecoder
    from surojax.serve.launch import load_mtp_head

    d, model, _ = dense

    def config(*flags):
        return serve_config(build_parser("serve", load_command("serve")).parse_args(
            ["serve", str(d), "--dtype", "float32", *flags]))

    mtp = config("--speculative-method", "mtp", "--num-speculative-tokens", "2")
    assert mtp.engine.speculative.method is SpecMethod.MTP and mtp.engine.speculative.num_tokens == 2
    head = load_mtp_head(mtp, model, d)
    assert isinstance(head, MTPDecoder) and head.embed is model.embed
    with pytest.raises(MTPError, match="not loaded from one"):
        load_mtp_head(mtp, model, None)
    assert load_mtp_head(config("--speculative-method", "ngram"), model, d) is None
