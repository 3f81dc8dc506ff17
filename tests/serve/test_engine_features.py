"""Engine features the HTTP API needs: per-row sampling in one batched step, penalties, logprobs, stop strings,
abort, and multi-LoRA slots (each row's adapter equals the merged model)."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from surojax.data.tokenizer import Tokenizer
from surojax.peft.multi_lora import AdapterSlots
from surojax.serve.config import SpecMethod, SpeculativeConfig
from surojax.serve.engine import Engine
from surojax.generation.loop import generate
from surojax.generation.sampling import BatchMode, SamplingParams, SamplingParamsError, apply_penalties, filter_logits, \
    sample_batch, sorted_keep_mask
from surojax.weights.hf_checkpoint import load_model
from tests.serve.adapters import random_adapter
from tests.serve.configs import SMALL, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, attention="xla")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIXTURE)




def engine(model, tokenizer=None, lora=None, **kw):
    config = engine_config(**SMALL, **kw)
    return Engine(model, config, tokenizer=tokenizer, lora=lora)


def test_sorted_keep_mask_matches_filter_logits():
    logits = np.asarray(jax.random.normal(jax.random.key(0), (4, 50))) * 3
    params = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (10, 0.9, 0.1)]
    # each jitted (one program per filter setting) instead of compiled op by op
    order, _, keep = jax.jit(sorted_keep_mask)(logits, np.array([p[0] for p in params], np.int32),
                                               np.array([p[1] for p in params], np.float32),
                                               np.array([p[2] for p in params], np.float32))
    filt = jax.jit(filter_logits, static_argnames=("top_k", "top_p", "min_p"))
    for r, (k, p, m) in enumerate(params):
        ref = np.asarray(filt(logits[r:r + 1], top_k=k, top_p=p, min_p=m)[0]) > np.finfo(np.float32).min
        got = np.zeros(50, bool)
        got[np.asarray(order[r])[np.asarray(keep[r])]] = True
        assert (got == ref).all(), r


def test_penalties_match_numpy():
    logits = np.random.default_rng(0).normal(size=(2, 10)).astype(np.float32)
    ids = np.array([[1, 2, 2, 3], [4, 4, 0, 0]])
    valid = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    is_out = np.array([[0, 1, 1, 1], [1, 1, 0, 0]], bool)
    got = np.asarray(apply_penalties(jnp.asarray(logits), ids, valid, is_out, jnp.array([1.5, 1.0]),
                                     jnp.array([0.5, 0.2]), jnp.array([0.25, 1.0])))
    ref = logits.copy()
    for r in range(2):
        seen = set(ids[r][valid[r]].tolist())
        counts = np.bincount(ids[r][valid[r] & is_out[r]], minlength=10)
        for t in seen:
            ref[r, t] = ref[r, t] / [1.5, 1.0][r] if ref[r, t] > 0 else ref[r, t] * [1.5, 1.0][r]
        ref[r] -= [0.5, 0.2][r] * (counts > 0) + [0.25, 1.0][r] * counts
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_greedy_and_seeded_rows_do_not_depend_on_the_batch():
    """Greedy rows are argmax in any mode; a seeded row draws the same token alone or in a batch, and a row
    without top-k / top-p / min-p the same token whether its batch sorts for another row's filter or not."""
    logits = np.asarray(jax.random.normal(jax.random.key(1), (5, 64)))
    rows = dict(temperature=np.array([0.0, 1.0, 0.8, 0.0, 1.3], np.float32),
                top_k=np.array([0, 0, 8, 0, 0], np.int32),
                top_p=np.array([1.0, 0.9, 1.0, 1.0, 1.0], np.float32), min_p=np.zeros(5, np.float32),
                seed=np.array([0, 7, 9, 0, 11], np.uint32), step=np.array([3, 3, 5, 3, 4], np.int32))
    # jitted as the runner calls it: one program per (shape, mode) instead of every op compiled eagerly
    sample = jax.jit(sample_batch, static_argnames="mode")
    both = sample(logits, rows, mode=BatchMode(sample=True, filter=True, logprobs=True))
    greedy = sample(logits, rows, mode=BatchMode())
    assert int(both["ids"][0]) == int(greedy["ids"][0]) == logits[0].argmax()
    alone = sample(logits[1:2], {k: v[1:2] for k, v in rows.items()}, mode=BatchMode(sample=True, filter=True))
    assert int(alone["ids"][0]) == int(both["ids"][1])
    unfiltered = sample(logits[4:], {k: v[4:] for k, v in rows.items()}, mode=BatchMode(sample=True))
    assert int(unfiltered["ids"][0]) == int(both["ids"][4])
    z = logits - logits.max(-1, keepdims=True)  # numpy log-softmax
    log_softmax = z - np.log(np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(both["top_logprobs"])[:, 0], log_softmax.max(-1), rtol=1e-5)


def test_invalid_sampling_values():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(top_logprobs=21),
                dict(presence_penalty=3), dict(repetition_penalty=0), dict(min_p=2)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**bad).validate()
    with pytest.raises(SamplingParamsError) as e:  # each bad field its own message (the value, the range)
        SamplingParams(temperature=-1.0, top_p=2.0).validate()
    assert str(e.value) == "temperature must be >= 0 (0 = greedy), got -1.0; top_p must be in (0, 1] (1 = off), got 2.0"
    assert e.value.param == "temperature"


def test_mixed_batch_keeps_greedy_and_logprobs(model):
    rng = np.random.default_rng(0)
    ps = [rng.integers(1, 500, size=9).tolist() for _ in range(4)]
    ref = generate(model, ps, 6)  # one compilation; rows do not depend on each other
    eng = engine(model)
    rids = [eng.add_request(ps[0], SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3)),
            eng.add_request(ps[1], SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3)),
            eng.add_request(ps[2], SamplingParams(max_tokens=6)),
            eng.add_request(ps[3], SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.3,
                                                  frequency_penalty=0.5, seed=1))]
    outs = {r: [] for r in rids}
    lps = []
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
            if o.request_id == rids[0]:
                lps += o.logprobs
    assert outs[rids[0]] == ref[0] and outs[rids[2]] == ref[2]
    # the first token's logprob is the log-softmax of the prompt's last logits
    logits = nnx.jit(lambda m, x: m(x)[0, -1])(model, jnp.asarray([ps[0]]))  # one compile, not op by op
    want = jax.nn.log_softmax(logits)
    assert abs(lps[0][0] - float(want[ref[0][0]])) < 1e-4
    assert [i for i, _ in lps[0][1]] == np.argsort(-np.asarray(want))[:3].tolist()
    # a seeded sampled request gives the same tokens alone
    eng2 = engine(model)
    alone = eng2.generate([ps[3]], 6, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=1)[0]
    assert alone == outs[rids[3]]


def test_stop_string_cuts_text_and_frees_blocks(model, tok):
    p = tok.encode("hello world, the")
    ids = generate(model, [p], 12)[0]
    full = tok.decode(ids, skip_special_tokens=True)
    assert len(full) > 6
    stop = full[3:5]
    eng = engine(model, tokenizer=tok)
    eng.add_request(p, SamplingParams(max_tokens=12, stop=(stop,)))
    text, reasons = "", []
    while eng.has_unfinished():
        for o in eng.step():
            text += o.text
            reasons.append(o.finish_reason)
    assert text == full[:full.index(stop)]
    assert reasons[-1] == "stop"
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_abort_frees_blocks(model):
    eng = engine(model)
    rid = eng.add_request(list(range(1, 30)), SamplingParams(max_tokens=50))
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.num_blocks
    assert eng.abort(rid)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_unfinished()


def test_multi_lora_rows_equal_merged_models(model, tmp_path):
    merged = {name: random_adapter(model, tmp_path / name, seed, rank)
              for name, seed, rank in (("a", 1, 4), ("b", 2, 8))}
    rng = np.random.default_rng(3)
    ps = [[5, 6, 7] * 3] + [rng.integers(1, 500, size=9).tolist() for _ in range(2)]  # the first recurs (n-gram)
    adapters = ["a", None, "b"]
    ref = [generate(merged[a] if a else model, [p], 8)[0] for p, a in zip(ps, adapters)]  # same shapes: one compile
    assert ref[0] != generate(model, [ps[0]], 8)[0]  # the adapter changes the output
    ngram = SpeculativeConfig(SpecMethod.NGRAM, 3)
    draft = SpeculativeConfig(SpecMethod.DRAFT, 3, model="base")  # the base model drafts, each row's adapter verifies
    # 4: the adapters ride through the multi-step decode call; with speculation, through the verify call
    for decode_steps, spec in ((1, None), (4, None), (4, ngram), (1, draft)):
        served = nnx.clone(model)
        slots = AdapterSlots(served, max_loras=2, max_rank=8)
        eng = Engine(served, engine_config(**SMALL, decode_steps=decode_steps, speculative=spec), lora=slots,
                     draft_model=model if spec is draft else None)
        eng.load_lora("a", tmp_path / "a")
        eng.load_lora("b", tmp_path / "b")
        rids = [eng.add_request(p, SamplingParams(max_tokens=8), adapter=a) for p, a in zip(ps, adapters)]
        outs = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] += o.new_token_ids
        assert [outs[r] for r in rids] == ref, (decode_steps, spec)
        if spec is None:
            assert (eng.runner.num_multi_calls > 0) == (decode_steps > 1)
        else:
            assert eng.spec_stats.proposed > 0  # adapter rows were verified
    eng.unload_lora("a")
    with pytest.raises(ValueError, match="not loaded"):
        eng.add_request(ps[0], SamplingParams(max_tokens=2), adapter="a")


def test_multi_lora_rows_through_the_decode_gemv(model, tmp_path):
    """`surojax serve` lays the base out for the decode GEMV (auto on a GPU) before the LoRA slots wrap it: a
    request with an adapter decodes the merged model's greedy tokens through the kernel (interpret mode here)."""
    from surojax.kernel_settings import use_kernel_settings
    from surojax.quant.laid_out import decode_weights

    merged = random_adapter(model, tmp_path / "a", 1, 4)
    prompt = np.random.default_rng(5).integers(1, 500, size=9).tolist()
    want = generate(merged, [prompt], 8)[0]  # test_multi_lora_rows_equal_merged_models' shapes: its compile
    served = nnx.clone(model)
    with use_kernel_settings(decode_gemv="pallas"):
        assert decode_weights(served, join_projections=False)  # the plain kernels laid out [N, K]
        eng = engine(served, lora=AdapterSlots(served, max_loras=1, max_rank=4))
        eng.load_lora("a", tmp_path / "a")
        rid = eng.add_request(prompt, SamplingParams(max_tokens=8), adapter="a")
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert out == want


def test_decode_prologue_kernel_decodes_the_same_greedy_tokens(model, monkeypatch):
    """SUROJAX_DECODE_PROLOGUE=pallas: the served model (q / k / v joined, its norm scales StackedVectors read in
    place) runs its decode steps' qkv split, q / k norms, rope and pool write as the fused kernel (interpret mode
    here) and decodes the plain model's greedy tokens; every decode step of both layers took the kernel."""
    from surojax.kernel_settings import use_kernel_settings
    from surojax.models.fused_projections import fuse_projections
    from surojax.models.layers import attention
    from surojax.quant.laid_out import norms_in_place

    taken = []

    def spy(*args):
        out = fused(*args)
        taken.append(out is not None)
        return out

    fused = attention.fused_decode_prologue
    monkeypatch.setattr(attention, "fused_decode_prologue", spy)
    prompt = np.random.default_rng(5).integers(1, 500, size=9).tolist()
    want = generate(model, [prompt], 8)[0]  # test_multi_lora_rows_equal_merged_models' shapes: its compile
    served = nnx.clone(model)
    assert fuse_projections(served)
    assert norms_in_place(served) == {"norms_in_place": 4}  # the attention, q, k and MLP norms
    with use_kernel_settings(decode_prologue="pallas"):
        eng = engine(served)
        rid = eng.add_request(prompt, SamplingParams(max_tokens=8))
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert out == want
    assert any(taken)  # traced: the prefill's layers take the plain path, the decode's the kernel


def test_reasoning_split_and_streamed_stop_holdback(tok):
    from surojax.serve.detokenize import RequestText

    think = (tok.token_to_id("<think>"), tok.token_to_id("</think>"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    out = [think[0]] + tok.encode("\nlet me see\n") + [think[1]] + tok.encode("\n\nThe answer. END here") + [509]
    rt = RequestText(tok, prompt, stop=("END",), stop_token_ids=(509,), think_ids=think)
    content, reasoning, stopped = "", "", False
    for i, t in enumerate(out):
        c, r, stopped = rt.add([t], finished=i == len(out) - 1, finish_reason="stop" if i == len(out) - 1 else None)
        assert not (r and content), "reasoning after content"  # </think> releases the held-back reasoning
        content, reasoning = content + c, reasoning + r
        assert "EN" not in content or stopped  # a possible stop-string start is held back while streaming
        if stopped:
            break
    assert stopped and reasoning == "let me see\n" and content == "The answer. "


def test_kv_capacity_from_device_memory(model):
    from surojax.serve.capacity import KVCapacityError, kv_bytes_per_token, num_kv_blocks

    class Dev:
        def __init__(self, limit, used):
            self.stats = {"bytes_limit": limit, "bytes_in_use": used}

        def memory_stats(self):
            return self.stats

    per_token = kv_bytes_per_token(model.cfg, jnp.float32)
    assert per_token == 2 * 2 * 2 * 16 * 4
    blocks = num_kv_blocks(model.cfg, jnp.float32, 16, 64, device=Dev(10 * 2**20, 2**20))
    assert blocks == int((0.9 * 10 * 2**20 - 2**20) * 0.5) // (per_token * 16)
    with pytest.raises(KVCapacityError, match="max-model-len"):
        num_kv_blocks(model.cfg, jnp.float32, 16, 4096, device=Dev(2**20, 2**19))
    assert num_kv_blocks(model.cfg, jnp.float32, 16, 64) > 0  # CPU: the fixed default
