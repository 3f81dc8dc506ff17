"""Grammar engines for structured output, measured on the CPU: llguidance vs outlines-core (xgrammar needs torch).

    python benchmarks/campaigns/structured_output_mask.py [--tokenizer DIR_OR_tokenizer.json] [--build-150k OUT.json]

For each tokenizer (the 512-token fixture, and a ~150k byte-level BPE: pass one, or let ``--build-150k`` train one
from the Python sources of site-packages with `tokenizers`, deterministic), and each engine: the time to compile a
realistic JSON schema (nested objects, arrays, enum, $ref, anyOf, pattern, min/max) against the vocabulary, and
the per-token cost of the allowed-token bitmask while a valid instance is fed token by token (mask, then advance).
Then JSON-schema coverage: for each feature a small schema, whether the engine compiles it and whether it rejects
an instance that breaks it (a token outside the mask). Prints a table (docs/serving.md "Structured output").
"""
from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tokenizers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from surojax.data.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 100000},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "role", "address", "tags", "score", "active"],
    "additionalProperties": False,
    "$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["street", "city", "zip"], "additionalProperties": False}},
}
INSTANCE = {"id": 4211, "name": "Ada Lovelace", "email": "ada.l@example.org", "role": "editor",
            "address": {"street": "12 Analytical Engine Road", "city": "London", "zip": "10001"},
            "tags": ["math", "poetry", "engines"], "score": 0.93, "active": True}

# feature -> (schema, a valid instance, an invalid one)
COVERAGE = {
    "nested objects": ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}},
                                                              "required": ["b"]}}, "required": ["a"]},
                       {"a": {"b": 1}}, {"a": {"b": "x"}}),
    "arrays (min/maxItems)": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                              [1, 2], [1, 2, 3]),
    "enum": ({"enum": ["x", "y"]}, "x", "z"),
    "$ref": ({"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"v": {"$ref": "#/$defs/n"}},
              "required": ["v"]}, {"v": 3}, {"v": "3"}),
    "recursive $ref": ({"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array",
                                                                              "items": {"$ref": "#/$defs/t"}}},
                                        "required": ["c"]}}, "$ref": "#/$defs/t"},
                       {"c": [{"c": []}]}, {"c": [{"d": 1}]}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abc"),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}, "AB1", "ab1"),
    "minimum/maximum": ({"type": "integer", "minimum": 10, "maximum": 20}, 15, 25),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
}


def build_bpe(out: Path, vocab: int = 150_000, limit: int = 70_000_000) -> None:
    """A byte-level BPE of ``vocab`` tokens trained on the first ``limit`` characters of site-packages' sources."""
    files = sorted(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.py", recursive=True))
    files += sorted(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.md", recursive=True))

    def texts():
        n = 0
        for f in files:
            try:
                t = open(f, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            n += len(t)
            yield t
            if n > limit:
                return

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, show_progress=False, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(out))


def load(path: Path) -> Tokenizer:
    if path.is_dir():
        return Tokenizer.from_dir(path)
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), {"eos_token": "<|endoftext|>"}, source=str(path))


class Llg:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        import llguidance
        import llguidance.numpy
        self.llg, self.np = llguidance, llguidance.numpy
        self.vocab = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=tok.eos_token_id)
        self.n = tok.vocab_size

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False,
                                                                          "item_separator": ", ", "key_separator": ": "})
        m = self.llg.LLMatcher(self.vocab, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m, out):
        self.np.fill_next_token_bitmask(m, out[None])

    def advance(self, m, t):
        return m.consume_token(t)


class Outlines:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer):
        import outlines_core
        self.oc = outlines_core
        decoder = _byte_decoder()
        eos = tok.eos_token_id
        vocab: dict[bytes, list[int]] = {}
        for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
            if i == eos:
                continue
            b = s.encode() if i in tok.special_ids else bytes(decoder[c] for c in s)
            vocab.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, vocab)
        self.n = tok.vocab_size

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, g, out):
        g.write_mask_into(out.ctypes.data, out.size, 4)

    def advance(self, g, t):
        try:
            g.advance(t)
            return True
        except ValueError:
            return False


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def allowed(mask: np.ndarray, t: int) -> bool:
    return bool((int(mask[t >> 5]) >> (t & 31)) & 1)


def run(engine, tok: Tokenizer) -> dict:
    t0 = time.perf_counter()
    m = engine.compile(SCHEMA)
    compile_s = time.perf_counter() - t0
    ids = tok.encode(json.dumps(INSTANCE))
    mask = np.zeros((engine.n + 31) // 32, np.int32)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        engine.mask(m, mask)
        per.append(time.perf_counter() - t0)
        assert allowed(mask, t), f"{engine.name}: valid token {t} {tok.decode([t])!r} masked"
        assert engine.advance(m, t)
    cov = {}
    for feat, (schema, good, bad) in COVERAGE.items():
        try:
            engine.compile(schema)
        except Exception:
            cov[feat] = "no"
            continue
        cov[feat] = "yes" if follows(engine, tok, schema, good) and not follows(engine, tok, schema, bad) else "partly"
    return dict(compile_ms=1e3 * compile_s, mask_us_median=1e6 * statistics.median(per),
                mask_us_p90=1e6 * sorted(per)[int(0.9 * len(per))], tokens=len(ids), coverage=cov)


def follows(engine, tok, schema, instance) -> bool:
    """Every token of the instance's text is allowed by the mask in turn."""
    m = engine.compile(schema)
    mask = np.zeros((engine.n + 31) // 32, np.int32)
    for t in tok.encode(json.dumps(instance)):
        engine.mask(m, mask)
        if not allowed(mask, t) or not engine.advance(m, t):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, action="append", default=[])
    ap.add_argument("--build-150k", type=Path, help="train a 150k byte-level BPE here first (if missing)")
    args = ap.parse_args()
    paths = [ROOT / "tests/fixtures/models/qwen3"] + args.tokenizer
    if args.build_150k:
        if not args.build_150k.exists():
            build_bpe(args.build_150k)
        paths.append(args.build_150k)
    for path in paths:
        tok = load(path)
        for cls in (Llg, Outlines):
            t0 = time.perf_counter()
            engine = cls(tok)
            setup = time.perf_counter() - t0
            r = run(engine, tok)
            print(json.dumps(dict(tokenizer=path.name, vocab=tok.vocab_size, engine=engine.name,
                                  vocab_setup_ms=round(1e3 * setup, 1), **{k: round(v, 1) if isinstance(v, float) else v
                                                                           for k, v in r.items()})), flush=True)


if __name__ == "__main__":
    main()
