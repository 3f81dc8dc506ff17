"""Speculative decoding benchmark: engine decode tok/s with speculation off / ngram / draft, per workload and users.

What runs: our Engine in-process (no HTTP), greedy, ignore-eos, one round of `--users` concurrent requests per
(workload, method), after a warm-up run of the same shapes (compiles; not measured). The engine helpers (model
build, `EngineConfig`, buckets, statistics) are benchmarks/serve_load.py's. Weights are random, so prompts are
token ids built to make the workloads' structure visible to prompt lookup:

  repeat  "repeat / edit this text": a random passage P (--passage-len tokens), a separator, then P again with a
          few tokens edited, then the first tokens of P once more: the continuation a real model writes is P's
          rest, which n-gram lookup proposes exactly
  code    code with repeated identifiers: lines drawn from a few templates over a small set of identifier
          tokens (the same 3-grams recur many times)
  chat    plain chat-like prompts: random tokens, nothing recurs (n-gram lookup finds little in the prompt)

With random weights the model does not copy its prompt. A random model with TIED embeddings (qwen3-0.6b's,
qwen3.5-0.8b's) mostly repeats its last token (the residual stream stays close to the token's embedding, whose
dot product with itself wins the argmax), so every workload decodes a repetitive tail and n-gram acceptance is
high (a trained model on `repeat` behaves alike: it copies); `--untie` gives the target a random lm_head (its
greedy output then walks a random map over the vocabulary and hardly ever repeats within 128 tokens): acceptance
~0, which measures what a failed speculation costs. The two runs bracket the range; the acceptance rate is
REPORTED per row (`acceptance`: accepted / proposed tokens; `accepted_per_step`: accepted proposals per
sequence per verify step), and a speed-up should be read against it. The draft is a smaller random model of the
target's vocabulary (`--draft-layers` layers of qwen3-0.6b's widths, tied): with a tied target it proposes the
same repeated token (acceptance ~1: the upper bound of a draft), with an untied one ~0.

Checked and printed: greedy output with speculation equals greedy output without, token for token, for every
request (`greedy_equal`; the exit status is 1 when any differs).

What to expect on an H100 (qwen3-0.6b bf16, one user): a decode step is ~2.2-2.5 ms, bound by kernel launches
rather than bytes, so a verify forward over k + 1 tokens costs about the same as one decode step; with
acceptance rate a of k = 4 proposals the step emits ~1 + 4a tokens, but per-step host work (n-gram lookup, the
scheduler's roll-back) and the verify's larger attention add some: expect roughly (1 + a)x one-user tok/s for
n-gram (>= 1.5x on `repeat` needs a >~ 0.5), ~1x on `chat`; at 16 users the step is less launch-bound and the
gain smaller. `draft` pays k + 1 draft forwards per step (each ~ a small model's launch-bound step), so it pays
only with a trained draft's acceptance.

    python benchmarks/speculation.py                          # GPU: qwen3-0.6b, users 1,16; then qwen3.5-0.8b
    python benchmarks/speculation.py --untie --workloads chat # GPU: the cost of failed proposals
    python benchmarks/speculation.py --smoke                  # CPU: debug shapes, short lengths
    python benchmarks/speculation.py --shapes qwen3-0.6b --methods off,ngram --workloads repeat --users 1

A hybrid target (qwen3.5-0.8b: Gated DeltaNet layers) speculates too: its verify call runs the delta rule as
k + 1 one-token steps, keeps the layers' inputs and replays each row's state to its last accepted token
(serve/state_slots.py), a cost the dense target does not pay; its draft is the dense qwen3 draft of the same vocabulary (a hybrid draft is refused).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import _num_compiled, bench_buckets, emit, engine_config, summarize  # noqa: E402

WORKLOADS = ("repeat", "code", "chat")
METHODS = ("off", "ngram", "draft")
SMOKE_SHAPES = {"qwen3-0.6b": "debug", "qwen3.5-0.8b": "debug-qwen3.5"}


# ---- the workloads: token-id prompts ------------------------------------------------------------------------

def repeat_prompt(rng, a) -> list[int]:
    """An instruction, a passage P, P again with ~5% of its tokens edited, then P's first tokens again."""
    v = a.vocab
    passage = rng.integers(10, v - 10, a.passage_len)
    edited = passage.copy()
    at = rng.choice(len(edited), max(1, len(edited) // 20), replace=False)
    edited[at] = rng.integers(10, v - 10, len(at))
    instruction = rng.integers(10, v - 10, 8)
    sep = [1, 2, 3]
    ids = [*instruction, *passage, *sep, *edited, *sep, *passage[:8]]
    return [int(t) for t in ids][-a.prompt_len:]


def code_prompt(rng, a) -> list[int]:
    """Lines from 4 templates over 6 identifier tokens and 8 keyword / punctuation tokens."""
    v = a.vocab
    names = rng.integers(10, v - 10, 6)
    syms = rng.integers(10, v - 10, 8)
    templates = [lambda x, y: [syms[0], x, syms[1], y, syms[2]],  # x = y;
                 lambda x, y: [syms[3], x, syms[4], x, syms[5], y, syms[6]],  # if x < y: x
                 lambda x, y: [x, syms[7], y, syms[1], x, syms[2]],
                 lambda x, y: [syms[3], y, syms[2]]]
    ids: list[int] = []
    while len(ids) < a.prompt_len:
        x, y = rng.choice(names, 2, replace=False)
        ids += templates[int(rng.integers(len(templates)))](x, y)
    return [int(t) for t in ids[:a.prompt_len]]


def chat_prompt(rng, a) -> list[int]:
    return [int(t) for t in rng.integers(10, a.vocab - 10, a.prompt_len)]


PROMPTS = {"repeat": repeat_prompt, "code": code_prompt, "chat": chat_prompt}


# ---- models -------------------------------------------------------------------------------------------------

def build_random(a, hf: dict, seed: int):
    """A random-weight model of HF config fields `hf` in --dtype, its weights in the decode kernel's layout (q / k /
    v and gate / up joined: what `surojax serve` does, `quant.laid_out.decode_weights`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from surojax.models.config import ModelConfig
    from surojax.models.decoder import Decoder
    from surojax.quant.laid_out import decode_weights

    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    model = Decoder(ModelConfig.from_hf(hf), dtype=dtype, param_dtype=dtype, attention="xla", rngs=nnx.Rngs(seed))
    laid = decode_weights(model, join_projections=True)
    print(f"# model {hf['model_type']} {hf['num_hidden_layers']} layers, tied {hf.get('tie_word_embeddings')}, "
          f"{a.dtype} on {jax.devices()[0].device_kind}; decode kernel layouts: {laid or 'none'}", flush=True)
    return model


def build_target(a):
    """The target: --shape's config (with a random lm_head under --untie)."""
    from surojax.bench.shapes import shape_hf_config

    hf = shape_hf_config(a.shape)
    if a.untie:
        hf["tie_word_embeddings"] = False
    return build_random(a, hf, 0)


def build_draft(a, vocab: int):
    """A smaller random model of the target's vocabulary: qwen3-0.6b's widths (debug's for --smoke),
    --draft-layers layers."""
    from surojax.bench.shapes import shape_hf_config

    hf = dict(shape_hf_config("debug" if a.smoke else "qwen3-0.6b"), num_hidden_layers=a.draft_layers,
              vocab_size=vocab)
    return build_random(a, hf, 7)


# ---- one measured run ---------------------------------------------------------------------------------------

def run(a, model, draft, method: str, workload: str, users: int, max_tokens: int, seed: int, label: str):
    """One round of `users` concurrent requests -> (result dict, {prompt index: output ids})."""
    import dataclasses

    import numpy as np

    from surojax.generation.sampling import SamplingParams
    from surojax.serve.config import SpecMethod, SpeculativeConfig
    from surojax.serve.engine import Engine

    config = engine_config(a, users)
    if method != "off":
        spec = SpeculativeConfig(SpecMethod(method), a.num_spec, model="bench-draft" if method == "draft" else None)
        config = dataclasses.replace(config, speculative=spec, buckets=bench_buckets(a, users, a.num_spec + 1))
    eng = Engine(model, config, draft_model=draft if method == "draft" else None)
    compiled_before = num_compiled()
    rng = np.random.default_rng(seed)
    prompts = [PROMPTS[workload](rng, a) for _ in range(users)]
    t0 = time.perf_counter()
    rids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    ts = {r: [] for r in rids}
    ids = {r: [] for r in rids}
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            ts[o.request_id] += [now] * len(o.new_token_ids)
            ids[o.request_id] += o.new_token_ids
    wall = time.perf_counter() - t0
    st = eng.spec_stats
    extra = {"shape": a.shape + ("-untied" if a.untie else ""), "workload": workload, "method": method, "num_spec": a.num_spec if st else 0,
             "steps": eng.runner.num_calls,
             "acceptance": round(st.acceptance_rate, 4) if st else None,
             "accepted_per_step": round(st.mean_accepted_length, 4) if st else None,
             "proposed_per_step": round(st.proposed / st.row_steps, 4) if st and st.row_steps else None,
             "compiled_while_measuring": num_compiled() - compiled_before}
    r = summarize(label, users, [(t0, ts[r]) for r in rids], wall, extra)
    return r, [ids[r] for r in rids]


def num_compiled() -> int:
    """Compiled variants of the runner's calls, the verify and draft calls included (-1 where jax's private
    cache-size API is missing): 0 while measuring, or the run timed a compile."""
    from surojax.serve import kv_paged

    try:
        return _num_compiled() + kv_paged.verify_step._cache_size() + kv_paged.draft_propose_paged._cache_size()
    except Exception:
        return -1


def bench_shape(a, shape: str) -> tuple[list[dict], bool]:
    """Every (users, workload, method) of one target shape -> (results, greedy outputs all equal)."""
    from surojax.serve.engine import HybridServingError

    a.shape = SMOKE_SHAPES.get(shape, shape) if a.smoke else shape
    model = build_target(a)
    a.vocab = model.cfg.vocab_size
    draft = build_draft(a, a.vocab) if "draft" in a.methods_list else None
    results, all_equal = [], True
    for users in a.users_list:
        for workload in a.workloads_list:
            baseline = None
            for method in a.methods_list:
                seed = 1000 * users + WORKLOADS.index(workload)
                try:
                    run(a, model, draft, method, workload, users, a.num_spec + 4, seed + 1, "warmup")
                except HybridServingError as e:
                    print(f"# {a.shape} {method}: skipped: {e}", flush=True)
                    continue
                r, out = run(a, model, draft, method, workload, users, a.max_tokens, seed, "engine")
                if method == "off":
                    baseline = out
                elif baseline is not None:
                    r["greedy_equal"] = out == baseline
                    all_equal &= r["greedy_equal"]
                    base = next(x for x in results if x["users"] == users and x["workload"] == workload
                                and x["method"] == "off" and x["shape"] == r["shape"])
                    r["speedup"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3) if base["decode_tok_s"] else None
                emit(r)
                results.append(r)
                gc.collect()
    return results, all_equal


def table(results) -> str:
    head = "| shape | users | workload | method | decode tok/s | speed-up | acceptance | accepted/step | greedy equal |"
    rows = [head, "|" + "---|" * 9]
    for r in results:
        rows.append(f"| {r['shape']} | {r['users']} | {r['workload']} | {r['method']} | {r['decode_tok_s']:.1f} | "
                    f"{r.get('speedup', '') or ''} | {'' if r['acceptance'] is None else r['acceptance']} | "
                    f"{'' if r['accepted_per_step'] is None else r['accepted_per_step']} | "
                    f"{r.get('greedy_equal', '')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3.5-0.8b", help="comma list of target shapes")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of off, ngram, draft (off first)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--users", default="1,16", help="comma list of concurrent users")
    p.add_argument("--num-spec", type=int, default=4, help="proposals per sequence per step (K)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--passage-len", type=int, default=160, help="repeat: the passage's length in tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--untie", action="store_true", help="the target with a random lm_head (acceptance ~0)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="CPU: debug shapes, short lengths, users 1,2")
    a = p.parse_args(argv)
    if a.smoke:
        a.dtype, a.prompt_len, a.passage_len, a.max_tokens = "float32", 48, 16, 24
        if a.users == "1,16":
            a.users = "1,2"
    # what serve_load's engine helpers read
    a.num_kv_blocks, a.prefills_per_step = 0, 16
    a.unroll_layers, a.kv_cache_dtype = False, "auto"
    a.users_list = [int(u) for u in a.users.split(",")]
    a.methods_list = [m.strip() for m in a.methods.split(",")]
    a.workloads_list = [w.strip() for w in a.workloads.split(",")]
    if a.methods_list[0] != "off" or any(m not in METHODS for m in a.methods_list):
        p.error(f"--methods: a comma list of {', '.join(METHODS)} starting with off, got {a.methods}")
    if any(w not in WORKLOADS for w in a.workloads_list):
        p.error(f"--workloads: a comma list of {', '.join(WORKLOADS)}, got {a.workloads}")
    results, all_equal = [], True
    for shape in a.shapes.split(","):
        r, eq = bench_shape(a, shape.strip())
        results += r
        all_equal &= eq
    print()
    print(table(results))
    print(f"# greedy output with speculation equals without: {all_equal}")
    compiled = [r for r in results if r["compiled_while_measuring"]]
    if compiled:
        print(f"# WARNING: {len(compiled)} measured runs compiled (their tok/s include a compile)")
    print("SUMMARY " + json.dumps({"greedy_equal": all_equal, "runs": len(results)}), flush=True)
    return 0 if all_equal and results else 1


if __name__ == "__main__":
    sys.exit(main())
