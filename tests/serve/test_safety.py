"""The server under misuse and load (issue 18 item 6), live on loopback: runtime LoRA loading off by default and
confined to --lora-root (paths outside, `..`, symlinks out, non-adapters refused without echoing contents); 429 /
503 with Retry-After; a disconnect frees the request's KV blocks; a body over --max-request-bytes is 413; 10x
the server's capacity of concurrent requests mixed with malformed, oversized and invalid ones leaves it
answering with every KV block free.

One server for the module: the qwen3 fixture (tiny, random weights), capacity max-num-seqs 4 + max-queue 4.
"""
import asyncio
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from flax import nnx

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tests.serve.live_server import live_server  # noqa: E402
from surojax.cli.main import build_parser, load_command  # noqa: E402
from surojax.peft.lora import apply_lora  # noqa: E402
from surojax.peft.peft_io import save_peft_adapter  # noqa: E402
from surojax.cli.serve import ServeOptionError, serve_config  # noqa: E402
from surojax.serve.api_server import build_app  # noqa: E402
from surojax.serve.backpressure import MAX_S, FinishRate, retry_after_s  # noqa: E402
from surojax.serve.config import RunnerBuckets  # noqa: E402
from surojax.weights.hf_checkpoint import load_model  # noqa: E402

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"
KEY = "k"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
SEQS, QUEUE, BODY_LIMIT = 4, 4, 16384
SECRET = "TOP-SECRET-3141592653"


def parse(argv):
    return serve_config(build_parser("serve", load_command("serve")).parse_args(["serve", str(FIXTURE), *argv]))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """root/: a valid adapter `good`, a plain folder, a secret file, symlinks out; outside/: an adapter + a secret."""
    model = load_model(FIXTURE, attention="xla")
    apply_lora(model, targets=("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(0))
    root, outside = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("outside")
    save_peft_adapter(model, root / "good", None)
    shutil.copytree(root / "good", outside / "ad")
    (outside / "secret.txt").write_text(SECRET)
    (root / "secret.txt").write_text(SECRET)
    (root / "plain").mkdir()
    (root / "plain" / "notes.txt").write_text(SECRET)
    (root / "link_out").symlink_to(outside / "ad")  # a folder symlink leaving the root
    (root / "sneaky").mkdir()  # an adapter folder whose config is a symlink to a file outside
    (root / "sneaky" / "adapter_config.json").symlink_to(outside / "secret.txt")
    os.link(root / "good" / "adapter_model.safetensors", root / "sneaky" / "adapter_model.safetensors")
    (root / "garbage").mkdir()  # the right file names, contents that are not an adapter
    (root / "garbage" / "adapter_config.json").write_text("{" + SECRET)
    (root / "garbage" / "adapter_model.safetensors").write_text(SECRET)
    return root, outside


@pytest.fixture(scope="module")
def server(dirs):
    root, outside = dirs
    argv = ["--served-model-name", NAME, "--api-key", KEY, "--max-num-seqs", str(SEQS), "--max-queue", str(QUEUE),
            "--block-size", "4", "--num-kv-blocks", "96", "--max-model-len", "64", "--max-num-batched-tokens", "256",
            "--max-request-bytes", str(BODY_LIMIT), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"boot={outside / 'ad'}", "--allow-runtime-lora", "--lora-root", str(root)]
    buckets = RunnerBuckets(min_rows=4, min_prefill_rows=4, min_context=64, min_prefill=32)  # few CPU compiles
    with live_server(argv, buckets=buckets, backlog=512) as (url, state):
        assert complete(url).status_code == 200  # compiles the steps here, not inside a test
        yield url, state


def complete(url, **body):
    return httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **body},
                      headers=AUTH, timeout=30)


def wait_all_blocks_free(state, deadline_s=10.0) -> float:
    """Seconds until the pool is whole again and nothing is in flight (fails past the deadline)."""
    eng, t0 = state.engine.engine, time.monotonic()
    while not (eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_unfinished()
               and state.engine.num_in_flight == 0):
        assert time.monotonic() - t0 < deadline_s, (eng.kv.num_free_blocks, eng.kv.num_blocks,
                                                    state.engine.num_in_flight)
        time.sleep(0.01)
    return time.monotonic() - t0


# ---- options --------------------------------------------------------------------------------------------------

def test_runtime_lora_is_opt_in_and_needs_a_root(tmp_path):
    assert not parse(["--enable-lora"]).lora.allow_runtime  # the default: off
    with pytest.raises(ServeOptionError, match="go together"):
        parse(["--enable-lora", "--allow-runtime-lora"])
    with pytest.raises(ServeOptionError, match="go together"):
        parse(["--enable-lora", "--lora-root", str(tmp_path)])
    with pytest.raises(ServeOptionError, match="not a directory"):
        parse(["--enable-lora", "--allow-runtime-lora", "--lora-root", str(tmp_path / "missing")])
    with pytest.raises(ServeOptionError, match="need --enable-lora"):
        parse(["--allow-runtime-lora", "--lora-root", str(tmp_path)])
    config = parse(["--enable-lora", "--allow-runtime-lora", "--lora-root", str(tmp_path)])
    assert config.lora.allow_runtime and config.lora.root == str(tmp_path)
    assert parse([]).max_request_bytes == 4 * 2**20


def test_retry_after_is_the_queue_over_the_recent_finish_rate():
    now = [100.0]
    rate = FinishRate(window_s=10, clock=lambda: now[0])
    assert rate.per_second() is None and retry_after_s(5, None) == 1
    rate.record(0.5, 3)
    now[0] += 1
    rate.record(1.5, 1)  # 4 finished in 2 busy seconds: 2 per second
    assert rate.per_second() == pytest.approx(2.0)
    assert retry_after_s(9, rate.per_second()) == 5  # ceil(9 / 2)
    assert retry_after_s(10_000, rate.per_second()) == MAX_S
    now[0] += 9.5  # the first step leaves the window: 1 finished in 1.5 s
    assert rate.per_second() == pytest.approx(1 / 1.5)
    now[0] += 20
    assert rate.per_second() is None
    rate.record(4.0, 0)  # nothing finished yet: at most one per busy time
    assert retry_after_s(2, rate.per_second()) == 8


# ---- runtime LoRA ---------------------------------------------------------------------------------------------

def test_runtime_lora_off_answers_403(server):
    _, state = server
    off = build_app(dataclasses.replace(state, lora_root=None))  # same engine, runtime loading off

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=off), base_url="http://t", headers=AUTH) as c:
            return (await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "good"}),
                    await c.post("/v1/unload_lora_adapter", json={"lora_name": "boot"}))

    for r in asyncio.run(go()):
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"], r.text
    assert "boot" in state.engine.engine.lora.slots  # the start-up adapter stays


@pytest.mark.parametrize("path, says", [
    ("{outside}/ad", "outside the --lora-root"),  # absolute, outside
    ("../{outside_name}/ad", "outside the --lora-root"),  # a `..` escape
    ("good/../../{outside_name}/ad", "outside the --lora-root"),
    ("link_out", "outside the --lora-root"),  # a symlink leaving the root
    ("sneaky", "adapter_config.json resolves outside"),  # a config symlinked to a secret
    ("secret.txt", "not an adapter folder"),  # a file
    ("plain", "not a PEFT LoRA adapter folder"),  # a folder without adapter files
    ("missing", "not an adapter folder"),
    ("garbage", "cannot load the LoRA adapter"),  # adapter file names, non-adapter contents
    ("/etc/passwd", "outside the --lora-root"),
])
def test_runtime_lora_path_is_refused_without_echoing_contents(server, dirs, path, says):
    url, state = server
    root, outside = dirs
    given = path.format(outside=outside, outside_name=outside.name)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": given}, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and repr(given) in err["message"] and err["param"] == "lora_path"
    assert SECRET not in r.text and str(root) not in err["message"]  # no contents, no resolved root
    assert "evil" not in state.engine.engine.lora.slots


def test_runtime_lora_inside_the_root_loads_and_serves(server, dirs):
    url, _ = server
    root, _ = dirs
    for name, path in (("rel", "good"), ("abs", str(root / "good"))):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert complete(url, model=name).status_code == 200
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH).status_code == 200
    assert complete(url, model="boot").status_code == 200  # the start-up adapter, outside the root, still serves


# ---- back-pressure --------------------------------------------------------------------------------------------

def test_queue_full_is_429_and_draining_503_with_retry_after(server):
    url, state = server
    eng = state.engine
    old = eng.max_in_flight
    eng.max_in_flight = eng.num_in_flight
    try:
        r = complete(url)
    finally:
        eng.max_in_flight = old
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= MAX_S
    eng.set_draining(True)
    try:
        r, health = complete(url), httpx.get(url + "/health")
    finally:
        eng.set_draining(False)
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
    assert int(r.headers["retry-after"]) >= 1
    assert httpx.get(url + "/health").status_code == 200 and complete(url).status_code == 200


# ---- disconnects ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream, prompts", [(True, 1), (False, 1), (False, 3)])
def test_disconnect_mid_request_frees_its_blocks(server, stream, prompts):
    url, state = server
    kv = state.engine.engine.kv
    wait_all_blocks_free(state)
    aborts = state.engine.metrics.requests.get("abort", 0)
    prompt = "tell me a long story" if prompts == 1 else [f"tell me story {i}" for i in range(prompts)]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 50,
            "ignore_eos": True, "stream": stream}

    async def go():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
            task = asyncio.ensure_future(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 20
            while kv.num_free_blocks == kv.num_blocks:  # until the request holds blocks
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.005)
            task.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    wait_all_blocks_free(state)
    assert state.engine.metrics.requests.get("abort", 0) == aborts + prompts  # aborted, not run to their end


# ---- body size and load ---------------------------------------------------------------------------------------

def test_body_over_the_limit_is_413(server):
    url, _ = server
    big = {"model": NAME, "prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=big, headers=AUTH)  # with a Content-Length
    assert r.status_code == 413 and f"limit of {BODY_LIMIT} bytes" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", json=big).status_code == 413  # before authentication

    def chunked():  # no Content-Length: read up to the limit, then refused
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    r = httpx.post(url + "/v1/completions", content=chunked(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert complete(url).status_code == 200


def test_ten_times_capacity_with_garbage_leaves_it_answering_with_no_leaked_blocks(server):
    url, state = server
    capacity = SEQS + QUEUE
    good = [{"model": NAME, "prompt": f"request {i} says", "max_tokens": 2}
            for i in range(10 * capacity)]
    good += [{"model": NAME, "prompt": ["a b", "c d", "e f"], "max_tokens": 2}] * 4  # several streams per request
    bad = [{"model": NAME, "prompt": "x", "temperature": -1}, {"model": NAME, "prompt": "x", "max_tokens": 0},
           {"model": "nope", "prompt": "x"}, {"model": NAME, "prompt": [1, 2, 10**9]}] * 3

    async def go():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60, limits=limits) as c:
            post = lambda **kw: c.post("/v1/completions", **kw)  # noqa: E731
            jobs = [("good", post(json=b)) for b in good] + [("bad", post(json=b)) for b in bad]
            jobs += [("json", post(content=b'{"model": "tiny", "prompt": ', headers={"content-type":
                                                                                    "application/json"}))] * 8
            jobs += [("big", post(json={"model": NAME, "prompt": "y" * 2 * BODY_LIMIT}))] * 8
            rs = await asyncio.gather(*(j for _, j in jobs))
            return [(kind, r) for (kind, _), r in zip(jobs, rs)]

    results = asyncio.run(go())
    codes = {}
    for kind, r in results:
        codes.setdefault(kind, []).append(r.status_code)
        assert r.status_code < 500, (kind, r.status_code, r.text)
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
    assert set(codes["good"]) <= {200, 429} and codes["good"].count(200) >= capacity // 3, codes["good"]
    assert 429 in codes["good"]  # 10x capacity at once: some were refused, not queued without bound
    assert set(codes["bad"]) == {400, 404} and set(codes["json"]) == {400} and set(codes["big"]) == {413}
    wait_all_blocks_free(state)
    assert httpx.get(url + "/health").status_code == 200
    r = complete(url, max_tokens=3)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_all_blocks_free(state)
