"""Several models in one server (serve config YAML -> `MultiServeConfig` -> `model_router`) and sleep mode
(`serve.sleep`): two tiny fixture models served together answer as each served alone; an unknown model is a
404 naming the served ones; a sleeping model's device buffers are deleted and the next request wakes it with
the same greedy answer; an idle model falls asleep by itself; the YAML is checked before anything loads."""
import dataclasses
import time
from pathlib import Path

import httpx
import jax
import openai
import pytest

from surojax.cli.serve import default_options, serve_config
from surojax.cli.serve_file import ModelEntry, _served, read_serve_file
from surojax.config.errors import ConfigError
from surojax.quant.laid_out import decode_weights
from surojax.serve.engine import Engine
from surojax.serve.launch import build_multi_server, load_for_serving
from tests.serve.configs import BUCKETS
from tests.serve.live_server import serving

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
SMALL = "max_num_seqs: 4\n    max_num_batched_tokens: 64\n    max_model_len: 64\n    num_kv_blocks: 32\n    " \
        "block_size: 4\n    dtype: float32\n    decode_steps: 1"
YAML = f"""
enable_sleep_mode: true
models:
  - model: {FIXTURES / "qwen3"}
    served_model_name: qwen
    {SMALL}
  - model: {FIXTURES / "llama"}
    served_model_name: llama
    sleep_after_idle_s: 0.5
    {SMALL}
"""


def _read(tmp_path, text: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return read_serve_file(str(path), default_options, serve_config)


CONFIG = None  # the server's MultiServeConfig (set by the fixture)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    global CONFIG
    config = _read(tmp_path_factory.mktemp("multi"), YAML)
    CONFIG = config
    config = dataclasses.replace(config, models=tuple(
        dataclasses.replace(m, serve=dataclasses.replace(m.serve, engine=dataclasses.replace(m.serve.engine,
                                                                                             buckets=BUCKETS)))
        for m in config.models))
    app, table = build_multi_server(config)
    try:
        with serving(app) as url:
            yield url, table
    finally:
        for m in table.models:
            m.state.engine.shutdown()


def _greedy(client, model, prompt="The quick brown fox"):
    return client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text


def _alone(served_model, prompt="The quick brown fox") -> str:
    """The model's greedy answer served alone: loaded as `build_server` loads it, on an engine of its own."""
    config = served_model.serve
    model, tok, _, _ = load_for_serving(config)
    decode_weights(model, join_projections=config.lora is None)
    engine = Engine(model, dataclasses.replace(config.engine, buckets=BUCKETS), tokenizer=tok)
    return tok.decode(engine.generate([tok.encode(prompt)], max_tokens=6)[0])


def test_two_models_answer_as_each_alone_and_unknown_is_404(server):
    url, table = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["qwen", "llama"]
    assert client.models.retrieve("llama").id == "llama"
    answers = {name: _greedy(client, name) for name in ("qwen", "llama")}
    assert answers == {m.name: _alone(m) for m in CONFIG.models}
    assert answers["qwen"] != answers["llama"]
    with pytest.raises(openai.NotFoundError) as e:
        _greedy(client, "gpt-4")
    assert "gpt-4" in e.value.message and "qwen" in e.value.message and "llama" in e.value.message
    metrics = httpx.get(url + "/metrics").text
    assert 'surojax_generation_tokens_total{model_name="qwen"}' in metrics
    assert 'surojax_generation_tokens_total{model_name="llama"}' in metrics
    assert metrics.count("# TYPE surojax_generation_tokens_total counter") == 1


def test_sleep_frees_the_device_and_a_request_wakes_it(server):
    url, table = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    before = _greedy(client, "qwen")
    engine = table.by_name["qwen"].state.engine.engine
    weights = jax.tree.leaves(engine.runner.state) + [engine.runner.k_pool, engine.runner.v_pool]
    assert httpx.get(url + "/is_sleeping", params={"model": "qwen"}).json() == {"is_sleeping": False}
    assert httpx.post(url + "/sleep", params={"level": 1, "model": "qwen"}).status_code == 200
    assert httpx.get(url + "/is_sleeping", params={"model": "qwen"}).json() == {"is_sleeping": True}
    assert all(x.is_deleted() for x in weights)  # the device buffers are gone, not just unreferenced
    assert engine.runner.state is None and engine.runner.k_pool is None
    assert httpx.post(url + "/sleep", params={"level": 2}).status_code == 400
    assert _greedy(client, "qwen") == before  # woken by the request, same greedy answer
    assert httpx.get(url + "/is_sleeping", params={"model": "qwen"}).json() == {"is_sleeping": False}
    assert httpx.post(url + "/sleep", params={"model": "nope"}).status_code == 404


def test_an_idle_model_falls_asleep(server):
    url, table = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    before = _greedy(client, "llama")
    deadline = time.time() + 20
    while not httpx.get(url + "/is_sleeping", params={"model": "llama"}).json()["is_sleeping"]:
        assert time.time() < deadline, "llama (sleep_after_idle_s 0.5) did not fall asleep"
        time.sleep(0.1)
    assert not table.by_name["qwen"].state.engine.engine.is_sleeping  # no idle timer: stays awake
    assert _greedy(client, "llama") == before


def test_every_model_key_is_read():
    """Each model key is a `surojax serve` option (read by serve_config) or one the file reads itself."""
    options = vars(default_options("m"))
    own = {"model", "lora_modules", "enable_prefix_caching", "sleep_after_idle_s"}
    assert set(ModelEntry.model_fields) - own <= set(options)
    entry = ModelEntry(model="m", max_num_seqs=3, enable_prefix_caching=False, lora_modules={"a": "/x"},
                       enable_lora=True, kv_capacity=64, block_size=8)
    c = _served(entry, None, False, default_options, serve_config).serve
    assert c.engine.scheduler.max_num_seqs == 3 and not c.engine.enable_prefix_caching
    assert c.lora.modules == (("a", "/x"),) and c.engine.num_blocks == 8


@pytest.mark.parametrize("text, key, said", [
    (YAML.replace("served_model_name: llama", "served_model_name: qwen"), "models", "used twice"),
    (YAML.replace("served_model_name: llama", "served_model_name: llama\n    max_num_seq: 3"),
     "models[1].max_num_seq", "max_num_seqs"),
    (YAML.replace("num_kv_blocks: 32", "gpu_memory_utilization: 0.6"), "models", "sum to 1.2"),
    (YAML.replace("enable_sleep_mode: true", ""), "models", "enable_sleep_mode"),
    (YAML.replace("    served_model_name: llama\n", ""), "models[1]", "served_model_name is required"),
])
def test_bad_serve_files_are_refused_before_loading(tmp_path, text, key, said):
    with pytest.raises(ConfigError) as e:
        _read(tmp_path, text)
    assert key in e.value.keys and said in str(e.value), str(e.value)
