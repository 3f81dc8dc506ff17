"""Structured output: response_format (json_object, json_schema) and vLLM's guided_json / guided_regex /
guided_choice through the official `openai` client against a live server, plus the device mask and the batch, and
a vocabulary that cannot write the grammar (the fixture's tokenizer without `{`): a 400 that says why when the
request arrives, and a request that gets stuck anyway is an error, never finish_reason "abort".

The model is the qwen3 fixture with random weights: without the mask it writes garbage (checked), so output that
parses and validates against its schema shows that the mask on the device is what shaped it. Schemas are checked
with `jsonschema` (installed with the dev extras, through nbformat), an implementation independent of the grammar
engine.
"""
import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tests.serve.live_server import live_server  # noqa: E402
from surojax.data.tokenizer import Tokenizer  # noqa: E402
from surojax.generation.sampling import SamplingParams, apply_token_bitmask  # noqa: E402
from surojax.serve.config import RunnerBuckets  # noqa: E402
from surojax.serve.engine import Engine  # noqa: E402
from surojax.serve.guided import (GrammarVocab, grammar_from_choice, grammar_from_json_schema,  # noqa: E402
                                  grammar_from_regex)
from surojax.serve.writability import find_dead_end  # noqa: E402
from surojax.weights.hf_checkpoint import load_model  # noqa: E402
from tests.serve.configs import BUCKETS, engine_config  # noqa: E402

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"
NAME = "tiny"
CHAT = [{"role": "user", "content": "Describe a user."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,3}$"}},
}


@pytest.fixture(scope="module")
def server():
    argv = ["--served-model-name", NAME, "--max-num-seqs", "8", "--block-size", "4", "--num-kv-blocks", "256",
            "--max-model-len", "128", "--max-num-batched-tokens", "256"]
    buckets = RunnerBuckets(min_rows=8, min_prefill_rows=8, min_context=128, min_prefill=64)  # few CPU compiles
    with live_server(argv, buckets=buckets) as served:
        yield served


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def tokenizer_without(chars: str, folder: Path, model: Path = FIXTURE) -> Tokenizer:
    """`model`'s tokenizer with no token holding any of `chars` (and no merge making one); the other ids kept."""
    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.npz"))
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for token in [t for t in vocab if any(c in t for c in chars)]:
        del vocab[token]
    spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                               if not any(c in (m if isinstance(m, str) else "".join(m)) for c in chars)]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def no_brace(tmp_path_factory):
    return tokenizer_without("{", tmp_path_factory.mktemp("tok") / "no_brace")


def test_apply_token_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    V = 70  # not a multiple of 32: the last word is partly used
    logits = rng.normal(size=(3, V)).astype(np.float32)
    allowed = rng.random((3, V)) < 0.3
    allowed[2] = True  # a row of -1 words: everything allowed
    bits = np.zeros((3, 3), np.uint32)
    for r, i in zip(*np.nonzero(allowed)):
        bits[r, i // 32] |= np.uint32(1 << (i % 32))
    bits[2] = 0xFFFFFFFF
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bits.view(np.int32))))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


def test_json_schema_output_validates_greedy_and_sampled(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
    free = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=48, temperature=0)
    with pytest.raises(ValueError):  # the random model alone does not write JSON: the mask does below
        json.loads(free.choices[0].message.content)
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=64, temperature=temperature,
                                           seed=3, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_choice_and_regex(client):
    r = client.completions.create(model=NAME, prompt="data:", max_tokens=40, temperature=0.8, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    choices = ["red", "green", "blue sky"]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, temperature=1.0, seed=2,
                                       extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    pattern = r"[0-9]{3}-[a-z]{2}"
    r = client.completions.create(model=NAME, prompt="code:", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_invalid_grammar_is_a_400_naming_the_field(client):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
              "response_format"),
             ({"guided_regex": "a(b"}, "guided_regex"),
             ({"guided_json": "{not json"}, "guided_json"),
             ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, extra_body=body)
        assert e.value.param == param, (body, e.value.body)


def test_guided_row_leaves_its_batch_neighbours_unchanged():
    """One step holds a guided and a free row: the free row's tokens equal those it gets alone (its mask row
    is all ones), and the guided row ends at the grammar's end with "stop"."""
    model, tok = load_model(FIXTURE, attention="xla"), Tokenizer.from_dir(FIXTURE)
    eng = Engine(model, engine_config(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=128,
                                      max_model_len=96, buckets=BUCKETS, decode_steps=4), tokenizer=tok)
    prompt = tok.encode("hello there")
    alone = eng.generate([prompt], max_tokens=6)[0]
    guided = eng.add_request(prompt, SamplingParams(max_tokens=20, grammar=grammar_from_regex("(ab|cd)x")))
    free = eng.add_request(prompt, SamplingParams(max_tokens=6))
    outs = {guided: [], free: []}
    reasons = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert outs[free] == alone
    assert tok.decode(outs[guided]) in ("abx", "cdx") and reasons[guided] == "stop"


def test_what_a_vocabulary_cannot_write_is_found_up_front(no_brace):
    """The search (serve/writability.py) on the fixture's tokenizer without `{`: a JSON schema is refused at its
    first byte, a choice whose one way needs `{` after `b` names that place; grammars it can write pass. The whole
    tokenizer spells every byte (no search needed), and the search alone finds an output for the schema too."""
    vocab = GrammarVocab(no_brace, 512)
    assert not vocab.spells_all_text
    assert vocab.unwritable(grammar_from_json_schema(SCHEMA)) == (
        "this model's vocabulary cannot write it: at the start the output must go on with '{\"name\": \"', and no "
        "token of the model's vocabulary starts with '{'")
    assert vocab.unwritable(grammar_from_choice(["{a", "b{"])).endswith(
        "after 'b' the output must go on with '{', and no token of the model's vocabulary starts with '{'")
    for writable in (grammar_from_regex(r"[0-9]{3}-[a-z]{2}"), grammar_from_choice(["{a", "b"])):
        assert vocab.unwritable(writable) is None
    full = GrammarVocab(Tokenizer.from_dir(FIXTURE), 512)
    assert full.spells_all_text and full.unwritable(grammar_from_json_schema(SCHEMA)) is None
    assert find_dead_end(full.spelling, grammar_from_json_schema(SCHEMA)) is None


def test_unwritable_format_is_a_400_and_a_stuck_request_an_error_never_abort(server, client, no_brace, monkeypatch):
    """Serving with the `{`-less vocabulary's grammar view: response_format json_schema is a 400 naming the field
    and the missing `{` before anything runs. With the up-front answer taken away (a grammar the bounded search
    cannot judge), generation reaches the state no token continues: the response is an error saying where and why,
    streamed or not, never 200 with finish_reason "abort"."""
    engine = server[1].engine.engine
    monkeypatch.setitem(engine.__dict__, "grammar_vocab", GrammarVocab(no_brace, engine.model.cfg.vocab_size))
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, response_format=fmt)
    assert e.value.param == "response_format" and "starts with '{'" in e.value.message, e.value.message
    monkeypatch.setattr(GrammarVocab, "unwritable", lambda self, grammar: None)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, response_format=fmt)
    assert "structured output: at the start the output must go on with" in e.value.message and \
        "starts with '{'" in e.value.message, e.value.message
    with pytest.raises(openai.APIError) as e:  # the stream's error event
        list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, response_format=fmt,
                                            stream=True))
    assert "starts with '{'" in e.value.message
