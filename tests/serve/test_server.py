"""The HTTP server, live on loopback (uvicorn in a thread, started once for the module), driven by the official
`openai` client and raw httpx: chat + completions, streaming and not; 32 concurrent requests = one at a time;
LoRA per request = the merged model; auth; bad input; 429; disconnect frees blocks; prefix-cache hits.

The model is the qwen3 fixture (tiny, random weights, with a ChatML tokenizer), served in fp32 on CPU.
"""
import asyncio
import base64
import json
import time
from pathlib import Path

import httpx
import jax
import pytest
from flax import nnx

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tests.serve.live_server import live_server  # noqa: E402
from surojax.cli.main import build_parser, load_command  # noqa: E402
from surojax.cli.serve import serve_config  # noqa: E402
from surojax.data.tokenizer import Tokenizer  # noqa: E402
from surojax.generation.loop import generate  # noqa: E402
from surojax.peft.lora import apply_lora, lora_modules, merge_lora  # noqa: E402
from surojax.peft.peft_io import save_peft_adapter  # noqa: E402
from surojax.serve.config import RunnerBuckets  # noqa: E402
from surojax.serve.metrics import parse_metrics  # noqa: E402
from surojax.weights.hf_checkpoint import load_model  # noqa: E402

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"
KEY = "test-key"
NAME = "tiny"


def make_adapter(model, path, seed=1, rank=4):
    """A PEFT folder with non-zero B (a fresh adapter is a no-op) -> the merged model."""
    m = nnx.clone(model)
    apply_lora(m, targets=("q_proj", "v_proj", "down_proj"), rank=rank, alpha=2 * rank, rngs=nnx.Rngs(seed))
    for i, mod in enumerate(lora_modules(m).values()):
        mod.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(seed * 10 + i), mod.lora_b.get_value().shape))
    save_peft_adapter(m, path, None)
    return merge_lora(m)


@pytest.fixture(scope="module")
def base():
    return load_model(FIXTURE, attention="xla")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIXTURE)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "ad"
    return path, make_adapter(base, path)


@pytest.fixture(scope="module")
def server(adapter, tmp_path_factory):
    argv = ["--served-model-name", NAME, "--api-key", KEY, "--max-num-seqs", "32", "--block-size", "4",
            "--num-kv-blocks", "512", "--max-model-len", "128", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"ad={adapter[0]}", "--max-num-batched-tokens", "512",
            "--allow-runtime-lora", "--lora-root", str(tmp_path_factory.getbasetemp())]
    buckets = RunnerBuckets(min_rows=8, min_prefill_rows=8, min_context=128, min_prefill=64)  # few CPU compiles
    with live_server(argv, buckets=buckets) as served:
        yield served


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def metrics(url):
    return parse_metrics(httpx.get(url + "/metrics").text)


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
_REFS = {}


def reference_prompts(tok):
    """Every prompt this module checks against the plain-cache generate."""
    return [tok.apply_chat_template(CHAT, add_generation_prompt=True), tok.encode("The quick brown fox"),
            tok.encode("hello there, general")]


def reference_ids(model, tok):
    """Greedy ids (10 tokens) of every reference prompt, in one batch: greedy rows do not depend on the batch they
    run in, so one prefill and one decode compilation serve every model of the fixture's structure (base, merged
    adapters, the GGUF copy) instead of one pair per prompt."""
    if id(model) not in _REFS:
        _REFS[id(model)] = (model, generate(model, reference_prompts(tok), 10))  # holds the model: ids stay unique
    return _REFS[id(model)][1]


def reference(model, tok, ids, n):
    """Greedy text of n tokens of the reference prompt `ids`, from the plain-cache generate."""
    out = reference_ids(model, tok)[reference_prompts(tok).index(list(ids))]
    return tok.decode(out[:n], skip_special_tokens=True)


def test_health_models_tokenize(server):
    url, _ = server
    assert httpx.get(url + "/health").status_code == 200  # open without the key
    h = {"Authorization": f"Bearer {KEY}"}
    ids = [m["id"] for m in httpx.get(url + "/v1/models", headers=h).json()["data"]]
    assert ids == [NAME, "ad"]
    assert httpx.get(url + "/v1/models/ad", headers=h).json()["parent"] == NAME  # the openai client's retrieve
    gone = httpx.get(url + "/v1/models/nope", headers=h)
    assert gone.status_code == 404 and "nope" in gone.json()["error"]["message"]
    t = httpx.post(url + "/tokenize", json={"prompt": "hello world"}, headers=h).json()
    assert t["count"] == len(t["tokens"]) > 0
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}, headers=h).json()["prompt"] == "hello world"


def test_chat_stream_and_not_match_reference(client, base, tok):
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    want = reference(base, tok, ids, 8)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_stream_logprobs(client, base, tok):
    prompt = "The quick brown fox"
    want = reference(base, tok, tok.encode(prompt), 6)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    assert r.choices[0].text == want
    lp = r.choices[0].logprobs
    # the token itself + the top 2 (OpenAI: up to logprobs + 1); same-text tokens merge
    assert len(lp.token_logprobs) == 6 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(tk in t for tk, t in zip(lp.tokens, lp.top_logprobs))
    assert all(max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=tok.encode(prompt), max_tokens=6, temperature=0, stream=True))
    assert text == want


def test_32_concurrent_equal_one_at_a_time(server):
    url, _ = server
    prompts = [f"story {i}: once upon a time" + " again" * (i % 7) for i in range(32)]
    sync = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    alone = [sync.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]

    async def together():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        rs = await asyncio.gather(*(c.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0)
                                    for p in prompts))
        await c.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(together()) == alone


def test_lora_per_request_equals_merged(server, adapter, base, tok):
    url, _ = server
    merged = adapter[1]
    prompt = "hello there, general"
    ids = tok.encode(prompt)
    want_lora, want_base = reference(merged, tok, ids, 8), reference(base, tok, ids, 8)
    assert want_lora != want_base

    async def both():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        rs = await asyncio.gather(*(c.completions.create(model=m, prompt=prompt, max_tokens=8, temperature=0)
                                    for m in ("ad", NAME, "ad")))
        await c.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(both()) == [want_lora, want_base, want_lora]
    # runtime load / unload under another name
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": str(adapter[0])}, headers=h)
    assert r.status_code == 200, r.text
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert c.completions.create(model="ad2", prompt=prompt, max_tokens=8, temperature=0).choices[0].text == want_lora
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad2"}, headers=h).status_code == 200
    with pytest.raises(openai.NotFoundError):  # unloaded: no longer a served name
        c.completions.create(model="ad2", prompt=prompt, max_tokens=2)
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"}, headers=h)
    assert bad.status_code == 400 and "/nope" in bad.json()["error"]["message"]


def test_auth(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/metrics").status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"model": "nope", "prompt": "x"}, "model"),
    ({"model": NAME, "prompt": "x " * 200}, "prompt"),  # too long
    ({"model": NAME, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 2}, "top_p"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "n": 0}, "n"),
    ({"model": NAME, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": NAME, "prompt": [1, 2, 100000]}, "prompt"),  # a token id out of the vocabulary
    ({"model": NAME, "prompt": [-1, 2]}, "prompt"),  # a negative one
    ({"model": NAME, "prompt": [[1, 2], "x"]}, "prompt"),  # neither a string nor token ids
    ({"model": NAME}, "prompt"),  # missing
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature"),  # wrong type
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == (404 if body["model"] == "nope" else 400), (param, r.text)  # unknown model: 404
    assert r.json()["error"]["message"]
    assert r.json()["error"]["param"] == param, r.text


def test_bad_json_and_chat_errors(server):
    url, _ = server
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None  # as OpenAI: no field to name (not the character offset)
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "wizard", "content": "x"}]},
                   headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"] == ("messages[0] has the unknown role 'wizard' (a message's role is one of "
                                            "system, developer, user, assistant, tool)")  # refused before the template
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(url + path, json={"model": NAME, "messages": [{"content": "x"}]}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["message"] == "messages[0] has no 'role'", r.text
    # developer: the template does not name it, so it is rendered as the system message
    tokens = [httpx.post(url + "/tokenize", json={"model": NAME, "messages": [{"role": role, "content": "Be brief."},
                                                                            {"role": "user", "content": "hi"}]},
                         headers=h).json()["tokens"] for role in ("developer", "system")]
    assert tokens[0] == tokens[1]
    assert httpx.get(url + "/health").status_code == 200  # still alive


def test_prompt_longer_than_the_context_names_both_lengths(client):
    """The rule `surojax generate` shares (surojax.generation.context): --max-model-len 128 counts prompt +
    completion, so a 128-token prompt is refused, naming the field it came from."""
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x " * 200}])
    assert chat.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=NAME, prompt=[1] * 128, max_tokens=1)
    assert completion.value.param == "prompt"
    assert "maximum context length is 128 tokens; the prompt has 128 tokens" in completion.value.message


def test_image_parts_to_a_text_model_are_a_400_naming_it(client):
    """The official client's image_url part (a data URL) on the text-only qwen3 fixture: a 400 saying why, before
    any engine work (serve/image_prompt.py)."""
    png = (FIXTURE.parents[1] / "vision_chat" / "img_b.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert e.value.param == "messages" and "has images but" in e.value.message
    assert "is a text model (model_type 'qwen3', no vision_config" in e.value.message


def test_queue_full_is_429(server, client):
    url, state = server
    old = state.engine.max_in_flight
    state.engine.max_in_flight = state.engine.num_in_flight
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt="x", max_tokens=2)
    finally:
        state.engine.max_in_flight = old
    assert metrics(url)["surojax_requests_rejected_total"] >= 1


def test_disconnect_cancels_and_frees_blocks(server):
    url, state = server
    before = metrics(url).get('surojax_requests_total{finish_reason="abort"}', 0)
    body = {"model": NAME, "prompt": "tell me a long story", "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.time() + 20
    while True:
        m = metrics(url)
        if (m.get('surojax_requests_total{finish_reason="abort"}', 0) > before and m["surojax_num_requests_running"] == 0
                and m["surojax_kv_cache_free_blocks"] == m["surojax_kv_cache_blocks"]):
            break
        assert time.time() < deadline, m
        time.sleep(0.1)
    assert m["surojax_generation_tokens_total"] > 0


def test_prefix_cache_hit_for_repeated_system_prompt(server, client):
    url, _ = server
    # 54 / 57 prompt tokens: the prefill shape (<= 64 tokens) the other tests compiled
    system = {"role": "system", "content": "You are a helpful assistant who answers in one short line. "}
    before = metrics(url)["surojax_prefix_cache_hits_total"]
    for q in ("What is 2+2?", "Name a colour."):
        client.chat.completions.create(model=NAME, messages=[system, {"role": "user", "content": q}], max_tokens=2,
                                       temperature=0)  # greedy: the programs the other tests compiled
    hits = metrics(url)["surojax_prefix_cache_hits_total"] - before
    assert hits >= 24  # the second request reuses the system prompt's full blocks
    m = metrics(url)
    assert m["surojax_time_to_first_token_seconds_count"] > 0 and m["surojax_inter_token_latency_seconds_count"] > 0


def test_stop_string_and_sse_format(server, base, tok):
    url, _ = server
    prompt = "The quick brown fox"
    full = reference(base, tok, tok.encode(prompt), 10)
    stop = full[4:6]
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": [stop], "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=h) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:full.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_failed_engine_step_fails_only_its_requests(server, client):
    _, state = server
    runner = state.engine.engine.runner
    real = runner.execute

    def boom(scheduled, *rest):
        runner.execute = real
        raise RuntimeError("injected failure")

    runner.execute = boom
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        client.completions.create(model=NAME, prompt="hello", max_tokens=2, temperature=0)
    assert client.completions.create(model=NAME, prompt="hello", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2  # greedy: programs compiled before


def test_gguf_file_is_served(tmp_path, base, tok):
    """A GGUF file (issue 5's writer and loader) is served like a folder: same greedy text as the HF folder."""
    pytest.importorskip("gguf")  # the writer's package (the GPU image lacks it)
    from surojax.weights import gguf_checkpoint as gguf
    from surojax.serve.launch import load_for_serving

    path = tmp_path / "tiny.gguf"
    gguf.save_gguf(base, path, "f32", tokenizer_dir=FIXTURE)
    args = build_parser("serve", load_command("serve")).parse_args(["serve", str(path)])
    model, served_tok, _, name = load_for_serving(serve_config(args))
    assert served_tok.encode("The quick brown fox") == tok.encode("The quick brown fox")
    assert name == "tiny"
    assert generate(model, reference_prompts(tok), 10) == reference_ids(base, tok)  # reference()'s shapes


def test_a_trained_adapter_is_served_at_run_time(server, base, tok, tmp_path):
    """The training issue's output served: a LoRA adapter trained by the Trainer (its `adapter/` folder) is loaded
    into the running server with POST /v1/load_lora_adapter and answers exactly as the base with that adapter
    merged in."""
    from surojax.config import config_from_dict
    from surojax.peft.stacked import load_adapter_into
    from surojax.train.trainer import Trainer
    from tests.train.conftest import write_instruction_data

    cfg = config_from_dict(dict(
        model=str(FIXTURE), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="full", lora=True,
        lora_rank=4, lora_alpha=8, datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl", n=16)),
                                              "type": "instruction"}], sequence_len=64,
        per_device_train_batch_size=2, learning_rate=5e-2, max_steps=3))
    Trainer(cfg).train()
    folder = tmp_path / "out" / "adapter"
    merged = merge_lora(load_adapter_into(load_model(FIXTURE, attention="xla"), folder, trainable=True))
    prompt = "hello there, general"
    ids = tok.encode(prompt)
    want = reference(merged, tok, ids, 8)
    assert want != reference(base, tok, ids, 8)  # the trained adapter changes the answer
    url, _ = server
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "trained", "lora_path": str(folder)}, headers=h)
    assert r.status_code == 200, r.text
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        got = c.completions.create(model="trained", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        assert got == want
    finally:
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "trained"}, headers=h)
