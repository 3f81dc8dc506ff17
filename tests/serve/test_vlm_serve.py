"""Serving a vision-language model (serve/request_images.py): greedy output with an image equals transformers'
Qwen3VLForConditionalGeneration.generate (tests/fixtures/models/qwen3_vl_chat/expected.json, made by
scripts/make_vlm_serve_fixtures.py), in the engine (chunked prefill splitting an image, multi-step decode,
n-gram speculation beside an image request) and through the official openai client (data URL and file image
parts, streaming; the Responses API's input_image) and anthropic client (the Messages API's image block); the prefix cache keys image blocks by the pixels (same ids + other image: no image block
shared, other output; the same image as a file and as a data URL: every full block hit); runtime LoRA slots with
an image request. Two images in one prompt
(Qwen3-VL) and a hybrid Qwen3.5 MoE with its tower: greedy ids equal transformers' (tests/fixtures/vlm/
generate.json)."""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import anthropic
import openai
import pytest
from flax import nnx

from surojax.data.tokenizer import Tokenizer
from surojax.data.vision_data import model_vision
from surojax.generation.loop import generate
from surojax.peft.lora import apply_lora, lora_modules, merge_lora
from surojax.peft.multi_lora import AdapterSlots
from surojax.peft.peft_io import save_peft_adapter
from surojax.serve.config import SpecMethod, SpeculativeConfig
from surojax.serve.engine import Engine
from surojax.models.config import ModelConfig
from surojax.models.vision.mrope import mrope_positions
from surojax.serve.image_prompt import ImagePrompt, prompt_with_images
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config
from tests.serve.live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures" / "models" / "qwen3_vl_chat"
IMAGES = {"img_a.png": ROOT / "tests" / "fixtures" / "vision_chat", "img_b.png": ROOT / "tests" / "fixtures" /
          "vision_chat", "img_c.png": MODEL}
EXPECTED = json.loads((MODEL / "expected.json").read_text())
BLOCK = 4
# one engine shape for the engine tests (their compiled programs shared): 26 blocks of 4 tokens hold two of the
# fixture's requests but not three; chunks of 8 split every image; multi-step decode of 4
SMALL = dict(num_blocks=26, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=8, decode_steps=4,
             max_model_len=96, buckets=BUCKETS)


def image_path(name: str) -> Path:
    return IMAGES[name] / name


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(image_path(name).read_bytes()).decode()


def messages(case: str, url: str) -> list[dict]:
    """The case's messages as an OpenAI client sends them: the processor's {"type": "image"} part as an
    image_url part with `url`."""
    out = json.loads(json.dumps(EXPECTED[case]["messages"]))
    for m in out:
        if isinstance(m["content"], list):
            for part in m["content"]:
                if part["type"] == "image":
                    part.clear()
                    part.update(type="image_url", image_url={"url": url})
    return out


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, dtype=jnp.float32, attention="xla")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(MODEL)


def run(engine, prompt) -> list[int]:
    rid = engine.add_request(prompt.ids, max_tokens=8, images=prompt)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


def test_engine_greedy_equals_transformers_and_prefix_cache_keys_pixels(model, tok):
    """chunk_size 8 splits each image over chunks (the tower runs per chunk, its rows sliced); decode_steps 4."""
    vision = model_vision(MODEL)
    engine = Engine(model, engine_config(**SMALL), tokenizer=tok)
    prompts = {case: prompt_with_images(messages(case, str(image_path(EXPECTED[case]["image"]))), tok, vision)
               for case in EXPECTED}
    for case, prompt in prompts.items():
        assert prompt.ids == EXPECTED[case]["input_ids"]
    a, c = prompts["a"], prompts["c"]
    assert a.ids == c.ids and a.image_hashes != c.image_hashes  # same ids, other pixels
    first_image_token = a.image_spans[0][0]

    hits = engine.kv.prefix_cache_hits
    assert run(engine, a) == EXPECTED["a"]["new_ids"]
    hits, before = engine.kv.prefix_cache_hits, hits
    assert run(engine, c) == EXPECTED["c"]["new_ids"]  # a's image blocks would give a's KV
    hits, before = engine.kv.prefix_cache_hits, hits
    assert hits - before == first_image_token // BLOCK * BLOCK  # only the text blocks before the image
    # the same image as a data URL: the same pixel hash, every full block of the prompt (but the last token) hit
    again = prompt_with_images(messages("a", data_url("img_a.png")), tok, vision)
    assert again.image_hashes == a.image_hashes
    assert run(engine, again) == EXPECTED["a"]["new_ids"]
    hits, before = engine.kv.prefix_cache_hits, hits
    assert hits - before == (len(a.ids) - 1) // BLOCK * BLOCK
    assert run(engine, prompts["b"]) == EXPECTED["b"]["new_ids"]
    assert engine.scheduler.num_multi_steps > 0


def test_image_requests_batched_with_preemption(model, tok):
    """Three image requests and a text one at once (rows of one call with their own images; the text row takes
    1-D positions on all three M-RoPE axes) in a pool too small for all: one is preempted and recomputed; every
    image request's greedy output equals transformers', the text one the plain-cache generate's (1-D rope)."""
    vision = model_vision(MODEL)
    engine = Engine(model, engine_config(**SMALL), tokenizer=tok)
    text = tok.apply_chat_template([{"role": "user", "content": "What is in it?"}], add_generation_prompt=True)
    rids = {engine.add_request(text, max_tokens=8): "text"}
    rids |= {engine.add_request(p.ids, max_tokens=8, images=p): case for case, p in
             ((c, prompt_with_images(messages(c, str(image_path(EXPECTED[c]["image"]))), tok, vision))
              for c in EXPECTED)}
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    want = {c: e["new_ids"] for c, e in EXPECTED.items()} | {"text": generate(model, [text], 8)[0]}
    assert {c: outs[r] for r, c in rids.items()} == want
    assert engine.scheduler.num_preemptions > 0


def test_image_request_beside_speculation_and_refused_on_a_text_model(model, tok):
    """Under n-gram speculation an image request decodes plainly (not proposed for), same greedy ids."""
    vision = model_vision(MODEL)
    prompt = prompt_with_images(messages("b", data_url("img_b.png")), tok, vision)
    engine = Engine(model, engine_config(num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                                         max_model_len=96, buckets=BUCKETS,
                                         speculative=SpeculativeConfig(SpecMethod.NGRAM, num_tokens=2)),
                    tokenizer=tok)
    text = engine.add_request(tok.encode("abab abab abab"), max_tokens=8)
    assert run(engine, prompt) == EXPECTED["b"]["new_ids"]
    assert text not in engine.scheduler.requests and engine.spec_stats is not None
    text_model = load_model(ROOT / "tests" / "fixtures" / "models" / "qwen3", attention="xla")
    plain = Engine(text_model, engine_config(num_blocks=64, block_size=BLOCK, max_model_len=96, buckets=BUCKETS))
    with pytest.raises(ValueError, match="no vision tower"):
        plain.add_request(prompt.ids, max_tokens=2, images=prompt)


def test_served_with_the_openai_client(tok):
    """One server: a data-URL image (greedy text = transformers'), the other image with the same text as a file
    (its own output, not a's), and a streamed request equal to the whole answer."""
    argv = ["--served-model-name", "vlm", "--max-num-seqs", "4", "--block-size", str(BLOCK), "--num-kv-blocks",
            "128", "--max-model-len", "96", "--max-num-batched-tokens", "64"]

    def want(case):
        return tok.decode(EXPECTED[case]["new_ids"], skip_special_tokens=True)

    with live_server(argv, buckets=BUCKETS, model=MODEL) as (url, state):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        ask = dict(model="vlm", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        got = client.chat.completions.create(messages=messages("a", data_url("img_a.png")), **ask)
        assert got.choices[0].message.content == want("a") and got.usage.completion_tokens == 8
        assert got.usage.prompt_tokens == len(EXPECTED["a"]["input_ids"])
        got = client.chat.completions.create(messages=messages("c", image_path("img_c.png").as_uri()), **ask)
        assert got.choices[0].message.content == want("c") != want("a")
        stream = client.chat.completions.create(messages=messages("b", data_url("img_b.png")), stream=True, **ask)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want("b")
        # the Responses API's input_image and the Messages API's image block take the same image path
        b64 = data_url("img_a.png").split(",", 1)[1]
        parts = [{"type": "input_image", "image_url": data_url("img_a.png"), "detail": "auto"},
                 {"type": "input_text", "text": "What is in it?"}]
        asked = dict(model="vlm", temperature=0, extra_body={"ignore_eos": True})
        got = client.responses.create(input=[{"role": "user", "content": parts}], max_output_tokens=8, **asked)
        assert got.output_text == want("a") and got.usage.input_tokens == len(EXPECTED["a"]["input_ids"])
        count = client.responses.input_tokens.count(model="vlm", input=[{"role": "user", "content": parts}])
        assert count.input_tokens == len(EXPECTED["a"]["input_ids"])
        blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                  {"type": "text", "text": "What is in it?"}]
        ac = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        got = ac.messages.create(model="vlm", messages=[{"role": "user", "content": blocks}], max_tokens=8,
                                 extra_body={"ignore_eos": True, "temperature": 0})  # no temperature argument
        assert got.content[0].text == want("a") and got.usage.input_tokens == len(EXPECTED["a"]["input_ids"])


VLM_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def fixture_prompt(case) -> ImagePrompt:
    """An ImagePrompt of a tests/fixtures/vlm case (ids with image tokens 250, pixel rows, grids)."""
    ids, grids = case["ids"], case["grid"]
    runs = np.flatnonzero(np.diff(np.r_[0, (ids == 250).astype(int), 0]))
    spans = tuple((int(a), int(b - a)) for a, b in zip(runs[::2], runs[1::2]))
    pos, delta = mrope_positions(ids[None], grids, image_token_id=250, video_token_id=251, vision_start_token_id=252,
                                 spatial_merge_size=2)
    cuts = np.r_[0, np.cumsum(np.prod(grids, axis=1))]
    hashes = tuple(hashlib.sha256(case["pixels"][a:b].tobytes()).hexdigest() for a, b in zip(cuts, cuts[1:]))
    return ImagePrompt(ids.tolist(), case["pixels"], grids, spans, hashes, pos[:, 0], int(delta[0]))


@pytest.mark.parametrize("name,chunk", [("qwen3_vl", 8), ("qwen3_5_moe", None)])
def test_decoder_fixtures_greedy_equals_transformers(name, chunk):
    """qwen3_vl: two images in one prompt (deepstack), prefilled in chunks of 8; qwen3_5_moe: linear-attention
    state slots beside the attention pool (no prefix cache), one prefill chunk (fewer CPU compiles)."""
    folder = ROOT / "tests" / "fixtures" / "models" / name
    want = json.loads((ROOT / "tests" / "fixtures" / "vlm" / "generate.json").read_text())[name]
    data = np.load(ROOT / "tests" / "fixtures" / "vlm" / f"{name}.npz")
    case = {k: data[f"{want['case']}_{k}"] for k in ("ids", "grid", "pixels")}
    hf = json.loads((folder / "config.json").read_text()) | VLM_TOKENS
    vlm = load_model(folder, cfg=ModelConfig.from_hf(hf), attention="xla")
    engine = Engine(vlm, engine_config(num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                                       chunk_size=chunk, max_model_len=96, buckets=BUCKETS))
    assert run(engine, fixture_prompt(case)) == want["new_ids"]


def test_image_requests_with_lora_slots(model, tok, tmp_path):
    """Runtime LoRA (AdapterSlots) on the VLM: an image request with an adapter equals the plain-cache generate of
    the merged model with the same image; without one, transformers' tokens."""
    m = nnx.clone(model)
    apply_lora(m, targets=("q_proj", "v_proj", "down_proj"), rank=4, alpha=8, rngs=nnx.Rngs(1))
    for i, mod in enumerate(lora_modules(m).values()):
        mod.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(10 + i), mod.lora_b.get_value().shape))
    save_peft_adapter(m, tmp_path / "a", None)
    merged = merge_lora(m)
    prompt = prompt_with_images(messages("a", data_url("img_a.png")), tok, model_vision(MODEL))
    ref = generate(merged, [prompt.ids], 8, pixel_values=[prompt.pixel_values],
                   image_grid_thw=[prompt.image_grid_thw])[0]
    assert ref != EXPECTED["a"]["new_ids"]  # the adapter changes the output
    served = nnx.clone(model)
    engine = Engine(served, engine_config(num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=96, buckets=BUCKETS), tokenizer=tok,
                    lora=AdapterSlots(served, max_loras=1, max_rank=4))
    engine.load_lora("a", tmp_path / "a")
    rids = {engine.add_request(prompt.ids, max_tokens=8, images=prompt, adapter=a): a for a in ("a", None)}
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    assert {rids[r]: v for r, v in outs.items()} == {"a": ref, None: EXPECTED["a"]["new_ids"]}
