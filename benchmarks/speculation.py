"""Speculative decoding benchmark: engine decode tok/s with speculation off / ngram / draft / mtp, per workload and
users.

What runs: our Engine in-process (no HTTP), greedy, ignore-eos, one round of `--users` concurrent requests per
(workload, method), after a warm-up that is the same run untimed (compiles every call it makes). The engine helpers (model
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
sequence per verify step), and a speed-up should be read against it.

The draft (`--draft random`, the default) is an independent random model of the target's vocabulary
(--draft-layers layers of qwen3-0.6b's widths, tied). On random weights no cheap draft follows the target, so the
draft row's acceptance is ~0 BY CONSTRUCTION and the row measures what a draft costs, not what it gains. Measured
on the CPU (qwen3-0.6b shapes, bf16, a 48-token chat prompt and 8 greedy tokens, 2026-12-06): the 28-layer tied
target settles on repeating one token, but the 2-layer random draft walks its own random map (acceptance 0.0,
as on the H100); the target's own first n layers with its final norm and head (`--draft first-layers`, an
early-exit draft) agree with the target's argmax at 0.00 of 56 positions for n = 2, 8, 14, 0.05 for 20 and 0.57
for 27 (each random layer reshuffles the argmax), so that does not help either. What the row does give:
`break_even` = (1 + accepted/step) / speed-up - 1, the accepted proposals per step at which the method's step
would cost what the off baseline's tokens cost (the verify and the k + 1 draft forwards cost about the same at any
acceptance): the acceptance a trained draft must reach to pay. A hybrid target's draft is always the random dense
one (its own layers would make a hybrid draft, which is refused).

The `off` baseline is what a user of `surojax serve` gets: the server's default decode steps per device call
(`SERVE_DECODE_STEPS`, 8; `--off-decode-steps` to change it). Until 2026-12-06 the off row ran the engine's
library default of one token per call (396 tok/s for one user on qwen3-0.6b vs serve_load's 627 at the server's
default on the same H100; serve_load's engine mode differs from that off row only in the decode steps and its
2 rounds per user, so the steps are taken to be the gap, not yet confirmed on the GPU), which overstated every
speed-up by ~1.6x. Speculation verifies its own K + 1 tokens
per call; n-gram runs with the off row's decode steps (a step where no request has proposals is a multi-step
decode, as in the server since 2026-12-07), a draft / MTP head with decode_steps 1 (the server refuses more).

Checked: greedy output with speculation against without, token for token, per request. Two different paths
compute the same argmax: the decode step (one row per sequence; on a GPU the decode GEMV kernel up to 8 rows, the
paged decode attention) and the verify step (K + 1 rows per sequence through the prefill-shaped attention and,
past 8 rows, XLA's GEMMs). In float32 (dots at "highest" precision: fp32, not a GPU's default TF32) they agree
to fp32 rounding, and the outputs must be EXACTLY equal (a flip needs a tie to ~1e-6 of the logits). In bfloat16
their activations round differently, so an argmax whose top two logits are within that noise can flip, and from
there the two continuations differ (the random-weight model's logits are flat: near-ties are common). So where an
output differs the bench finds the first differing token and, in a third forward (the whole sequence at once, no
cache), its margin logit(off's token) - logit(spec's token). For scale, in units of the logits' standard deviation
over the vocabulary (sd): bf16 rounding after 28 layers moves a logit by a few hundredths of an sd; the gap
between a random model's top two logits over a 151k vocabulary is ~0.1 sd (median; so a flip somewhere in 128
flat-logit tokens is expected); a wrong token from a position / KV bug is ~4.5 sd below the top one. The `greedy
equal` cell says `True`, or `near-ties: n/N differ, first divergence at a margin <= X logits (Y sd)`, or
`NO: ...` when a margin exceeds --near-tie logit sds (a real difference, not rounding). The exit status is 1 when
float32 differs at all or bfloat16 beyond near-ties.

Evidence (CPU, 2026-12-06): bf16 vs fp32 logits of the qwen3-0.6b-shaped random model on one prompt differ by
0.009 sd (median), 0.035 (p99), 0.077 (max); its top-two gap is 0.10 sd (median) and a random token 4.5 sd
below the top: so the bf16 argmax flips wherever two paths round differently at a near-tie (hence the default
--near-tie of 0.1 sd). With the GPU's decode
GEMV in interpret mode (SUROJAX_DECODE_GEMV=pallas, --smoke --untie --dtype bfloat16 --users 1,2) the 2-user chat
rows diverge at a margin of 0.00012 logits (0.0007 sd); in float32 with the decode GEMV and the Pallas paged
attention (both interpreted), 8 users sharing prompt blocks through the prefix cache, n-gram and draft (k = 4,
acceptance 0 and 1): exactly equal. No position / KV / roll-back / prefix-cache difference was found.

What to expect on an H100 (qwen3-0.6b bf16, one user): a decode step is ~2.2-2.5 ms, bound by kernel launches
rather than bytes, so a verify forward over k + 1 tokens costs about the same as one decode step; with
acceptance rate a of k = 4 proposals the step emits ~1 + 4a tokens, but per-step host work (n-gram lookup, the
scheduler's roll-back) and the verify's larger attention add some: expect roughly (1 + a)x one-user tok/s for
n-gram (>= 1.5x on `repeat` needs a >~ 0.5), ~1x on `chat`; at 16 users the step is less launch-bound and the
gain smaller. `draft` pays k + 1 draft forwards per step (each ~ a small model's launch-bound step), so it pays
only with a trained draft's acceptance.

    python benchmarks/speculation.py                          # GPU: qwen3-0.6b, users 1,16; then qwen3.5-0.8b
    python benchmarks/speculation.py --untie --workloads chat # GPU: the cost of failed proposals
    python benchmarks/speculation.py --smoke                  # CPU: debug shapes, short lengths, float32
    python benchmarks/speculation.py --dtype float32          # GPU: the exact-equality check (must be True)
    python benchmarks/speculation.py --shapes qwen3-0.6b --methods off,ngram --workloads repeat --users 1

`mtp` (hybrid Qwen3.5 shapes only; skipped with a line on the others): the checkpoint's multi-token-prediction head
(models/mtp.py, serve/mtp.py), here a RANDOM one (`MTPDecoder` of the target's config, the target's embedding and
head shared): its acceptance is ~0 by construction and the row measures what the head costs per step (k one-layer
forwards + the mirror of every target call into its one-layer KV pool); `break_even` is then the acceptance a
trained head must reach to pay (published Qwen3.5 heads are reported to accept well over half their first
proposals: measure with the real checkpoint through `surojax serve --speculative-method mtp`).

A hybrid target (qwen3.5-0.8b: Gated DeltaNet layers) speculates too: its verify call runs the delta rule as
k + 1 one-token steps, keeps the layers' inputs and replays each row's state to its last accepted token
(serve/state_slots.py), a cost the dense target does not pay; its draft is the independent dense qwen3 draft of
the same vocabulary (a hybrid draft is refused).
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

from benchmarks.serve_load import (_num_compiled, bench_buckets, emit, engine_config, serve_decode_steps,  # noqa: E402
                                   summarize)

WORKLOADS = ("repeat", "code", "chat")
METHODS = ("off", "ngram", "draft", "mtp")
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

def random_model(a, hf: dict, seed: int):
    """A random-weight model of HF config fields `hf` in --dtype (plain layout: `lay_out` makes the serving one)."""
    import jax.numpy as jnp
    from flax import nnx

    from surojax.models.config import ModelConfig
    from surojax.models.decoder import Decoder

    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    return Decoder(ModelConfig.from_hf(hf), dtype=dtype, param_dtype=dtype, attention="xla", rngs=nnx.Rngs(seed))


def lay_out(a, model, hf: dict, role: str):
    """The model's weights in the decode kernel's layout (q / k / v and gate / up joined: what `surojax serve`
    does, `quant.laid_out.decode_weights`), in place -> the model."""
    import jax

    from surojax.quant.laid_out import decode_weights

    laid = decode_weights(model, join_projections=True)
    print(f"# {role} {hf['model_type']} {hf['num_hidden_layers']} layers, tied {hf.get('tie_word_embeddings')}, "
          f"{a.dtype} on {jax.devices()[0].device_kind}; decode kernel layouts: {laid or 'none'}", flush=True)
    return model


def random_mtp_head(a, target, seed: int = 11):
    """A random MTP head for a hybrid Qwen3.5 target (its embedding and head shared), laid out for decode; None for
    another target (the `mtp` rows are then skipped)."""
    import jax.numpy as jnp
    from flax import nnx

    from surojax.models.mtp import MTP_FAMILIES, MTPDecoder, share_target_weights

    if target.cfg.model_type not in MTP_FAMILIES:
        return None
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    head = MTPDecoder(target.cfg, dtype=dtype, param_dtype=dtype, attention="xla", rngs=nnx.Rngs(seed))
    return lay_out(a, share_target_weights(head, target), {"model_type": "mtp head", "num_hidden_layers": 1,
                                                            "tie_word_embeddings": target.lm_head is None},
                   "MTP head (random)")


def build_models(a, with_draft: bool):
    """-> (target, draft or None). The target: --shape's config (a random lm_head under --untie). The draft
    (--draft random, the default, and always for a hybrid target: its layers would make a hybrid draft, which is
    refused): an independent random dense model of qwen3-0.6b's widths (debug's under --smoke), --draft-layers
    layers, tied, of the target's vocabulary; --draft first-layers: the target's embedding, first --draft-layers
    layers, final norm and head (an early-exit draft)."""
    import jax
    from flax import nnx

    from surojax.bench.shapes import shape_hf_config
    from surojax.serve.state_slots import is_hybrid

    hf = shape_hf_config(a.shape)
    if a.untie:
        hf["tie_word_embeddings"] = False
    target = random_model(a, hf, 0)
    draft = None
    if with_draft and a.draft == "first-layers" and not is_hybrid(target):
        dhf = dict(hf, num_hidden_layers=a.draft_layers)
        draft = random_model(a, dhf, 7)
        n = a.draft_layers
        nnx.update(draft, jax.tree_util.tree_map_with_path(
            lambda path, x: x[:n] if getattr(path[0], "key", None) == "layers" else x, nnx.state(target)))
        draft = lay_out(a, draft, dhf, "draft (the target's first layers and head)")
    elif with_draft:
        dhf = dict(shape_hf_config("debug" if a.smoke else "qwen3-0.6b"), num_hidden_layers=a.draft_layers,
                   vocab_size=target.cfg.vocab_size)
        draft = lay_out(a, random_model(a, dhf, 7), dhf, "draft (independent random)")
    return lay_out(a, target, hf, "target"), draft


# ---- one measured run ---------------------------------------------------------------------------------------

def run(a, model, draft, method: str, workload: str, users: int, max_tokens: int, seed: int, label: str,
        mtp=None):
    """One round of `users` concurrent requests -> (result dict, the prompts, their output ids), in order. The off
    method decodes --off-decode-steps tokens per call (the server's default), a speculating one verifies per step."""
    import dataclasses

    import numpy as np

    from surojax.generation.sampling import SamplingParams
    from surojax.serve.config import SpecMethod, SpeculativeConfig
    from surojax.serve.engine import Engine

    config = engine_config(a, users, k=a.off_decode_steps)
    if method != "off":
        spec = SpeculativeConfig(SpecMethod(method), a.num_spec, model="bench-draft" if method == "draft" else None)
        # n-gram keeps the server's multi-step default (its steps without proposals decode that many tokens a
        # call); a draft model / MTP head follows the target one token a step (decode_steps 1, as the server does)
        steps = a.off_decode_steps if method == "ngram" else 1
        config = dataclasses.replace(config, speculative=spec,
                                     buckets=bench_buckets(a, users, max(a.num_spec + 1, steps)),
                                     scheduler=dataclasses.replace(config.scheduler, decode_steps=steps))
    eng = Engine(model, config, draft_model=draft if method == "draft" else None,
                 mtp_head=mtp if method == "mtp" else None)
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
    extra["decode_steps"] = eng.config.scheduler.decode_steps
    r = summarize(label, users, [(t0, ts[r]) for r in rids], wall, extra)
    return r, prompts, [ids[r] for r in rids]


def num_compiled() -> int:
    """Compiled variants of the runner's calls, the verify and draft calls included (-1 where jax's private
    cache-size API is missing): 0 while measuring, or the run timed a compile."""
    from surojax.serve import kv_paged, mtp

    try:
        return (_num_compiled() + kv_paged.verify_step._cache_size() + kv_paged.draft_propose_paged._cache_size()
                + mtp.mtp_propose_paged._cache_size() + mtp.mtp_mirror_paged._cache_size())
    except Exception:
        return -1


# ---- the greedy check ---------------------------------------------------------------------------------------

def reference_logits(model, length: int):
    """A third path, neither the decode step's nor the verify step's: one plain causal forward of the whole sequence
    (no cache), padded to `length` -> f(ids) -> fp32 logits [len(ids), V] (one compile per target)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])

    def logits(ids):
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :len(ids)] = ids
        return np.asarray(forward(state, jnp.asarray(tokens)))[:len(ids)]

    return logits


def first_divergence(logits_fn, prompt, want, got) -> dict | None:
    """Greedy outputs `want` (speculation off) and `got` (on) of one prompt -> None when equal, else where they
    first differ and, in the reference forward's logits for that token (`reference_logits`), the margin
    logit(want) - logit(got) (a near-tie: small next to the logits' spread `logit_sd`) and the top-2 margin."""
    if want == got:
        return None
    at = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
    if at == min(len(want), len(got)):  # one is a prefix of the other: a length difference, no token to compare
        return dict(at=at, margin=float("inf"), top2=float("nan"), logit_sd=float("nan"))
    row = logits_fn(list(prompt) + list(want[:at]))[-1]
    top = sorted(row, reverse=True)[:2]
    return dict(at=at, margin=float(row[want[at]] - row[got[at]]), top2=float(top[0] - top[1]),
                logit_sd=float(row.std()))


def greedy_check(divergences: list[dict | None], dtype: str, near_tie: float) -> dict:
    """The per-row verdict: exact equality; where unequal, the largest first-divergence margin |logit(off's token)
    - logit(spec's token)| over the requests, in logits and in units of the logits' spread. `greedy_ok`: exact
    equality in float32 (where the two paths differ only by fp32 rounding a flip needs a tie to ~1e-6); in bfloat16,
    every divergence a near-tie (|margin| <= near_tie * logit sd: rounding noise of bf16 activations, different
    between the verify step's K + 1-row kernels and the decode step's one-row kernels, can flip such an argmax)."""
    diverged = [d for d in divergences if d is not None]
    out = dict(greedy_equal=not diverged, diverged=len(diverged))
    if diverged:
        worst = max(diverged, key=lambda d: abs(d["margin"]) / max(d["logit_sd"], 1e-30))
        out.update(divergence_margin=round(abs(worst["margin"]), 5),
                   divergence_margin_sd=round(abs(worst["margin"]) / worst["logit_sd"], 5),
                   divergence_at=worst["at"], divergence_top2=round(worst["top2"], 5))
    out["greedy_ok"] = not diverged or (dtype == "bfloat16" and out["divergence_margin_sd"] <= near_tie)
    return out


def break_even(r: dict) -> float | None:
    """The accepted proposals per sequence per step at which a speculating row's step (its verify, plus a draft's
    forwards) costs what the off baseline's tokens cost: (1 + accepted/step) / speed-up - 1 (module docstring)."""
    if not r.get("speedup") or r["accepted_per_step"] is None:
        return None
    return round((1 + r["accepted_per_step"]) / r["speedup"] - 1, 3)


def verdict(r: dict) -> str:
    """The table's `greedy equal` cell."""
    if "greedy_equal" not in r:
        return ""
    if r["greedy_equal"]:
        return "True"
    kind = "near-ties" if r["greedy_ok"] else "NO"
    return (f"{kind}: {r['diverged']}/{r['requests']} differ, first divergence at a margin <= "
            f"{r['divergence_margin']:.3g} logits ({r['divergence_margin_sd']:.3g} sd)")


def bench_shape(a, shape: str) -> tuple[list[dict], bool]:
    """Every (users, workload, method) of one target shape -> (results, every greedy check ok)."""
    from surojax.serve.engine import HybridServingError

    a.shape = SMOKE_SHAPES.get(shape, shape) if a.smoke else shape
    model, draft = build_models(a, "draft" in a.methods_list)
    head = random_mtp_head(a, model) if "mtp" in a.methods_list else None
    a.vocab = model.cfg.vocab_size
    logits_fn = reference_logits(model, a.prompt_len + a.max_tokens)
    results, all_ok = [], True
    for users in a.users_list:
        for workload in a.workloads_list:
            baseline = None
            for method in a.methods_list:
                seed = 1000 * users + WORKLOADS.index(workload)
                if method == "mtp" and head is None:
                    print(f"# {a.shape} mtp: skipped: the shape has no MTP head (hybrid Qwen3.5 shapes only)",
                          flush=True)
                    continue
                try:
                    # the warm-up is the measured run itself, untimed: greedy decoding repeats its calls exactly,
                    # so every shape it meets (verify, multi-step, prefill) is compiled before the timed run; a
                    # shorter or other warm-up can miss one (session 27: the verify call compiled while measuring)
                    run(a, model, draft, method, workload, users, a.max_tokens, seed, "warmup", head)
                except HybridServingError as e:
                    print(f"# {a.shape} {method}: skipped: {e}", flush=True)
                    continue
                r, prompts, out = run(a, model, draft, method, workload, users, a.max_tokens, seed, "engine", head)
                if method == "off":
                    baseline = out
                elif baseline is not None:
                    r.update(greedy_check([first_divergence(logits_fn, p, want, got)
                                           for p, want, got in zip(prompts, baseline, out)], a.dtype, a.near_tie))
                    all_ok &= r["greedy_ok"]
                    base = next(x for x in results if x["users"] == users and x["workload"] == workload
                                and x["method"] == "off" and x["shape"] == r["shape"])
                    r["speedup"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3) if base["decode_tok_s"] else None
                    r["break_even"] = break_even(r)
                emit(r)
                results.append(r)
                gc.collect()
    return results, all_ok


def table(results) -> str:
    head = ("| shape | users | workload | method | decode tok/s | speed-up | acceptance | accepted/step | break-even "
            "accepted/step | greedy equal |")
    rows = [head, "|" + "---|" * 10]
    for r in results:
        rows.append(f"| {r['shape']} | {r['users']} | {r['workload']} | {r['method']} | {r['decode_tok_s']:.1f} | "
                    f"{r.get('speedup', '') or ''} | {'' if r['acceptance'] is None else r['acceptance']} | "
                    f"{'' if r['accepted_per_step'] is None else r['accepted_per_step']} | "
                    f"{'' if r.get('break_even') is None else r['break_even']} | {verdict(r)} |")
    return "\n".join(rows)


def matmul_precision(dtype: str):
    """float32: dots at "highest" precision (fp32, not TF32, a GPU's default): the exact check needs fp32 rounding."""
    import contextlib

    import jax

    return jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3.5-0.8b", help="comma list of target shapes")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of off, ngram, draft, mtp (off first)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--users", default="1,16", help="comma list of concurrent users")
    p.add_argument("--num-spec", type=int, default=4, help="proposals per sequence per step (K)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--passage-len", type=int, default=160, help="repeat: the passage's length in tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=None, help="the draft's layers (2; 1 under --smoke)")
    p.add_argument("--draft", default="random", choices=["random", "first-layers"],
                   help="the draft: an independent random model, or the target's first --draft-layers layers and head")
    p.add_argument("--untie", action="store_true", help="the target with a random lm_head (acceptance ~0)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="bfloat16 (float32 under --smoke); float32's greedy outputs must be exactly equal")
    p.add_argument("--near-tie", type=float, default=0.1,
                   help="bfloat16: a divergence whose margin is at most this many logit sds counts as a near-tie")
    p.add_argument("--off-decode-steps", default="auto",
                   help="the off baseline's decode steps per device call: auto = `surojax serve`'s default")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="CPU: debug shapes, short lengths, users 1,2")
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("float32" if a.smoke else "bfloat16")
    a.draft_layers = a.draft_layers or (1 if a.smoke else 2)
    a.off_decode_steps = serve_decode_steps() if a.off_decode_steps == "auto" else int(a.off_decode_steps)
    if a.smoke:
        a.prompt_len, a.passage_len, a.max_tokens = 48, 16, 24
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
    results, all_ok = [], True
    with matmul_precision(a.dtype):
        for shape in a.shapes.split(","):
            r, ok = bench_shape(a, shape.strip())
            results += r
            all_ok &= ok
    print()
    print(table(results))
    checked = [r for r in results if "greedy_equal" in r]
    all_equal = all(r["greedy_equal"] for r in checked)
    print(f"# greedy output with speculation equals without, token for token ({a.dtype}): {all_equal}"
          + ("" if all_equal or not all_ok else f"; equal up to near-ties (<= {a.near_tie} logit sd)"))
    compiled = [r for r in results if r["compiled_while_measuring"]]
    if compiled:
        print(f"# WARNING: {len(compiled)} measured runs compiled (their tok/s include a compile)")
    print("SUMMARY " + json.dumps({"greedy_equal": all_equal, "greedy_ok": all_ok, "dtype": a.dtype,
                                   "runs": len(results)}), flush=True)
    return 0 if all_ok and results else 1


if __name__ == "__main__":
    sys.exit(main())
