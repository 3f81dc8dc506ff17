"""Serving load benchmark: N concurrent users, fixed prompt / output lengths, fixed seed, greedy, ignore-eos.

Modes (`--modes`, run in this order, each in its own process so torch and JAX never share the GPU):
  hf       the anchor: HF transformers `generate` batched (N prompts at once, 128 new tokens, greedy), random
           init of the same shape in bf16 on CUDA; skipped cleanly without torch / transformers / a GPU
  engine   our Engine in-process, no HTTP: the engine's own ceiling
  server   our HTTP server in-process (uvicorn thread) + this script as a streaming client in a child process
           (plain asyncio streams: no openai / httpx package): what a user of `surojax serve` sees
  client   only the client, against --url (any OpenAI-compatible server, e.g. vLLM for comparison)

Reports per (mode, users): aggregate decode tok/s (sum over users of (tokens - 1) / (last - first token)
time), output tok/s (all output tokens / wall time), TTFT p50/p99 and inter-token latency p50/p99 in ms.
Prints one JSON line per measurement (`RESULT {...}`) and a table last. Every user sends --rounds requests
back to back (prompts differ: no prefix-cache hits); a warm-up pass with 4-token outputs compiles the shapes
first and is not measured. The model is random-init (throughput does not depend on the values) with the shape
of `surojax.bench.shapes` (default qwen3-0.6b, bf16); prompts are token ids, so no tokenizer is needed.

    python benchmarks/serve_load.py                      # H200: hf, engine, server at users 1, 16, 64
    python benchmarks/serve_load.py --smoke              # CPU: debug shape, tiny lengths, engine + server
    python benchmarks/serve_load.py --smoke --shape debug-lfm2   # the same on a CPU-sized LFM2 (or debug-gemma3)
    python benchmarks/serve_load.py --shape gemma3-1b --modes engine,server   # issue 40's rows (or lfm2-1.2b)
    python benchmarks/serve_load.py --modes engine,server --decode-steps 1,8   # A/B multi-step decode

`--decode-steps` (comma list of powers of two or auto, the default: the server's own default) runs engine and
server once per value: K decode tokens per
device call when nothing waits (the engine's ``decode_steps``). With K > 1 tokens reach a user in bursts of
K, so inter-token p50 drops towards 0 and p99 is about one K-step call; decode tok/s is the figure to compare.
`--kv-in-place 0,1` (default 1) likewise A/Bs the runner's ``kv_in_place`` (the decoder updates its cache in the layer scan's
carry instead of copying every layer's view in and out of the scan). `--unroll-layers` inlines the layer loop.
`--quant FMT` serves a quantised base (every Linear of the layers random FMT codes, as a GGUF / QLoRA base would
be held; `q4_k_m` / `q5_k_m`: typed layer by layer as llama.cpp types such a file, the anchor's Q4_K_M); run it under `SUROJAX_QUANT_MATMUL=xla` and `=pallas` (or auto) to A/B the fused decode GEMV against
XLA's dequantise-then-GEMV. The model's weights go through `decode_weights` as `surojax serve` does.
`--profile` (engine mode) adds a run per row under jax.profiler and prints the GPU kernels per output token by category
(decode GEMV, attention, matmuls, copies, fusions) and the top kernels: where a one-user token's time goes.
`--paged-attention 0,1` (default 1, the engine's default) A/Bs the runner's ``paged_attention``: 1 = no dense
view, the decoder reads and writes the paged pool in place through the block tables (``kv_in_place`` does not
apply, so with 1 each K runs once); 0 = the reference gather/scatter path. `--paged-kernel gather,reduce,pallas`
(default gather) A/Bs how the paged path's decode attention reads the pool: a per-layer gather then dots, that
gather fed to multiply + reduce (fusible), or the Pallas paged decode-attention kernel (``paged_kernel``).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


GGUF_FILE_TYPES = ("q4_k_m", "q5_k_m")  # --quant values typed per layer (surojax.bench.quant_base.randomize_gguf_mix)


# ---- statistics ---------------------------------------------------------------------------------------------

def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(mode, users, records, wall, extra=None):
    """records: per request (t_send, [token arrival times]) -> one result dict."""
    ttft = [ts[0] - t0 for t0, ts in records if ts]
    itl = [b - a for _, ts in records for a, b in zip(ts, ts[1:])]
    rates = [(len(ts) - 1) / (ts[-1] - ts[0]) for _, ts in records if len(ts) > 1 and ts[-1] > ts[0]]
    rounds = max(1, len(records) // max(users, 1))
    out_tokens = sum(len(ts) for _, ts in records)
    r = {"mode": mode, "users": users, "requests": len(records), "output_tokens": out_tokens,
         "decode_tok_s": sum(rates) / rounds if rates else 0.0, "output_tok_s": out_tokens / wall if wall else 0.0,
         "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
         "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99), "wall_s": wall}
    r.update(extra or {})
    return r


def emit(r):
    print("RESULT " + json.dumps(r), flush=True)


# ---- the client (plain asyncio streams: no HTTP package needed) --------------------------------------------

class _Conn:
    """One keep-alive HTTP/1.1 connection; POST a JSON body, iterate the SSE lines of a chunked response."""

    def __init__(self, host, port):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post_stream(self, path, body: dict, headers: dict):
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json",
                f"Content-Length: {len(data)}", "Accept: text/event-stream"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await self.writer.drain()
        status = (await self.reader.readline()).decode()
        hdrs = {}
        while (line := (await self.reader.readline()).decode().strip()):
            k, _, v = line.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        code = int(status.split()[1])
        if hdrs.get("transfer-encoding") != "chunked":
            text = await self.reader.readexactly(int(hdrs.get("content-length", 0)))
            raise RuntimeError(f"HTTP {code}: {text[:300]!r}")
        buf = b""
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = (await self.reader.readexactly(size + 2))[:-2]  # data + CRLF
            if size == 0:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for ln in lines:
                if ln.strip():
                    yield code, ln.decode().strip()
        if code != 200:
            raise RuntimeError(f"HTTP {code}")


async def _one(conn, model, prompt, max_tokens, headers, id_text=False):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, ts = time.perf_counter(), []
    async for code, line in conn.post_stream("/v1/completions", body, headers):
        if code != 200:
            raise RuntimeError(f"HTTP {code}: {line[:300]}")
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        if chunk["choices"] and chunk["choices"][0].get("text"):
            # one arrival time per token: a multi-step decode sends several tokens in one chunk (the bench
            # server's tokenizer writes each id as "<id>"; another server's chunk counts as one token)
            text = chunk["choices"][0]["text"]
            ts += [time.perf_counter()] * (text.count("<") if id_text else 1)
    return t0, ts


async def run_clients(url, model, users, rounds, prompt_len, max_tokens, seed, vocab, api_key=None, id_text=False):
    import random
    from urllib.parse import urlparse

    rng = random.Random(seed)
    prompts = [[[rng.randrange(10, vocab - 10) for _ in range(prompt_len)] for _ in range(rounds)]
               for _ in range(users)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    u = urlparse(url)

    async def user(i):
        conn = _Conn(u.hostname, u.port or 80)
        try:
            return [await _one(conn, model, prompts[i][k], max_tokens, headers, id_text) for k in range(rounds)]
        finally:
            if conn.writer is not None:
                conn.writer.close()

    t0 = time.perf_counter()
    per_user = await asyncio.gather(*(user(i) for i in range(users)))
    wall = time.perf_counter() - t0
    return [r for rs in per_user for r in rs], wall


def client_main(a):
    for users in a.users_list:
        records, wall = asyncio.run(run_clients(a.url, a.model_name, users, a.rounds, a.prompt_len, a.max_tokens,
                                                a.seed, a.vocab, a.api_key, a.id_text))
        emit(summarize(a.label, users, records, wall))


def run_client_process(a, url, users, max_tokens, seed, label):
    cmd = [sys.executable, __file__, "--modes", "client", "--url", url, "--users", str(users), "--rounds",
           str(a.rounds if label != "warmup" else 1), "--prompt-len", str(a.prompt_len), "--max-tokens",
           str(max_tokens), "--seed", str(seed), "--vocab", str(a.vocab), "--label", label, "--model-name", "bench", "--id-text"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"client failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1][7:])


# ---- ours: engine and server --------------------------------------------------------------------------------

def build_model(a):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from surojax.bench.shapes import model_config
    from surojax.models.decoder import Decoder

    from surojax.bench.quant_base import randomize_base, randomize_gguf_mix
    from surojax.parallel import init_sharded, make_mesh
    from surojax.quant.laid_out import decode_weights

    cfg = model_config(a.shape)
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    # built inside one jit (init_sharded on a one-device mesh): each weight's fp32 random draw fuses into its cast,
    # where an eager build materialises it whole (a 30B MoE's stacked experts: a 72 GiB fp32 buffer)
    def build():
        model = Decoder(cfg, dtype=dtype, param_dtype=dtype, attention=a.attention, rngs=nnx.Rngs(0))
        if a.quant and a.quant not in GGUF_FILE_TYPES:  # every Linear in the format: random codes, in the same jit
            randomize_base(model, a.quant, jax.random.key(1))
        return model

    model = init_sharded(build, make_mesh({"data": 1}, jax.devices()[:1]))
    if a.quant in GGUF_FILE_TYPES:  # typed per layer as llama.cpp's file type (mixed stacks: GGUFMixed)
        randomize_gguf_mix(model, a.quant, jax.random.key(1))
    # what build_server does: the weights the decode kernel takes in its layout, q / k / v and gate / up joined
    laid = decode_weights(model, join_projections=not a.separate_projections)
    print(f"# model {a.shape} {a.dtype}{' base ' + a.quant if a.quant else ''} on {jax.devices()[0].device_kind}; "
          f"decode kernel layouts: {laid or 'none'} (SUROJAX_QUANT_MATMUL={os.environ.get('SUROJAX_QUANT_MATMUL', 'auto')})",
          flush=True)
    return model


def kv_path(paged: bool, kernel: str):
    """The bench's --paged-attention / --paged-kernel pair as the engine's `KVPath`."""
    from surojax.serve.config import KVPath

    if not paged:
        return KVPath.REFERENCE
    return {"auto": KVPath.AUTO, "gather": KVPath.PAGED, "reduce": KVPath.REDUCE, "pallas": KVPath.PALLAS}[kernel]


def engine_config(a, users, k=1, in_place=True, paged=True, kernel="auto"):
    """The `EngineConfig` of one measured variant."""
    from surojax.serve.config import EngineConfig, KVCacheDtype, SchedulerConfig

    blocks_per_seq = -(-(a.prompt_len + a.max_tokens + k) // a.block_size)
    scheduler = SchedulerConfig(max_num_seqs=users, max_num_batched_tokens=step_budget(a, users),
                                max_model_len=a.prompt_len + a.max_tokens + a.block_size, decode_steps=k)
    return EngineConfig(scheduler=scheduler, num_blocks=max(a.num_kv_blocks, users * blocks_per_seq + 8),
                        block_size=a.block_size, buckets=bench_buckets(a, users, k), kv_in_place=in_place,
                        unroll_layers=a.unroll_layers, kv_path=kv_path(paged, kernel),
                        kv_cache_dtype=KVCacheDtype(a.kv_cache_dtype))


def step_budget(a, users):
    """Tokens per engine step: every decode plus whole prompts (never a chunked one: a chunk's remainder
    would be a new shape to compile while measuring)."""
    return users + a.prefills_per_step * a.prompt_len


def warmup_tokens(k):
    """Output length of the warm-up: enough for one full K-step call (compiles the measured shapes)."""
    return max(4, k + 1)


def bench_buckets(a, users, k=1):
    """One decode shape (R = users, S = the longest context) and one prefill shape (T = the prompt, R = the
    prompts one step's token budget holds), so the warm-up compiles everything and nothing compiles while
    measuring. Costs some padding (a chunked prompt's remainder is padded to a full prompt)."""
    from surojax.serve.config import RunnerBuckets

    return RunnerBuckets(min_rows=users, min_prefill_rows=min(users, a.prefills_per_step), min_prefill=a.prompt_len,
                         min_context=a.prompt_len + a.max_tokens + k)


def run_engine(a, model, users, max_tokens, seed, label, k=1, in_place=False, paged=True, kernel="auto"):
    import numpy as np

    from surojax.generation.sampling import SamplingParams
    from surojax.serve.engine import Engine

    eng = Engine(model, engine_config(a, users, k, in_place, paged, kernel))
    compiled_before = _num_compiled()
    rng = np.random.default_rng(seed)
    records = []
    t_start = time.perf_counter()
    for _ in range(a.rounds if label != "warmup" else 1):
        prompts = rng.integers(10, a.vocab - 10, size=(users, a.prompt_len)).tolist()
        t0 = time.perf_counter()
        ts = {eng.add_request(p, SamplingParams(max_tokens=max_tokens)): [] for p in prompts}
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                ts[o.request_id] += [now] * len(o.new_token_ids)  # one arrival time per token
        records += [(t0, v) for v in ts.values()]
    wall = time.perf_counter() - t_start
    return summarize(label, users, records, wall, {"base": a.quant or a.dtype, "decode_steps": k, "kv_in_place": int(in_place),
                                                   "paged_attention": int(paged),
                                                   "paged_kernel": eng.config.kv_path.value,
                                                   "kv_dtype": str(eng.runner.k_pool.dtype),
                                                   "steps": eng.runner.num_calls,
                                                   "multi_step_calls": eng.runner.num_multi_calls,
                                                   "compiled_while_measuring": _num_compiled() - compiled_before})


PROFILE_CATEGORIES = [  # first match wins, by substring of the kernel name (lower case)
    ("decode GEMV (Pallas)", ("gemv",)),
    ("attention", ("paged", "attention", "attn", "cudnn", "flash", "fmha")),
    ("quantised matmul", ("q4_k", "q5_k", "q6_k", "q8_0", "nf4", "dequant", "quant")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "triton_gemm", "matmul", "wgmma")),
    ("copy / scatter", ("copy", "transpose", "memcpy", "memset", "dynamic_update_slice", "dynamic_slice", "scatter")),
    ("reduce / sampling", ("reduce", "sort", "topk", "argmax")),
    ("fusion (elementwise)", ("fusion", "loop_", "input_")),
]


def profile_engine(a, model, users, k, in_place, paged, kernel) -> None:
    """One more measured engine run under jax.profiler (after the timed one, so the trace does not slow the figure):
    the GPU kernels per output token by category and the top kernels, against the run's wall time per token."""
    import tempfile

    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernel_categories import category
    from trace_summary import gpu_kernels, kernel_sums, trace_file

    trace_dir = tempfile.mkdtemp(prefix="surojax-serve-trace-", dir=a.profile_dir)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        r = run_engine(a, model, users, a.max_tokens, users, "profile", k, in_place, paged, kernel)
    path = trace_file(trace_dir)
    if path is None:
        print(f"# profile: no trace under {trace_dir}", flush=True)
        return
    tokens = max(r["output_tokens"], 1)
    kernels, _, _ = gpu_kernels(path)
    by_name, by_cat, total, _ = kernel_sums(kernels, divide=tokens, category=lambda n: category(n, PROFILE_CATEGORIES))
    wall_us = r["wall_s"] / tokens * 1e6
    print(f"# profile users {users} decode_steps {k}: {tokens} output tokens (prefills included), wall {wall_us:.1f} "
          f"us a token, GPU kernels {total:.1f} us a token ({len(kernels)} kernels, {len(kernels) / tokens:.0f} a token)",
          flush=True)
    for cat, d in by_cat.most_common():
        print(f"#   {cat:24s} {d:8.1f} us  {100 * d / max(total, 1e-9):5.1f}%")
    print("PROFILE " + json.dumps({"users": users, "decode_steps": k, "wall_us_per_token": wall_us,
                                   "kernel_us_per_token": total, "kernels_per_token": len(kernels) / tokens,
                                   "categories_us": dict(by_cat)}), flush=True)
    for name, d in by_name.most_common(40):
        print(f"#   {d:8.2f} us  {name[:140]}")


def _num_compiled() -> int:
    """Compiled variants of the runner's step (a private jax API: -1 where it is missing)."""
    from surojax.serve import kv_reference, multi_step, runner

    try:
        return sum(f._cache_size() for f in (kv_reference.reference_step, runner.paged_step,
                                             kv_reference.reference_multi_step_decode,
                                             multi_step.multi_step_decode_paged))
    except Exception:
        return -1


def ours_main(a):
    import gc

    model = build_model(a)
    a.vocab = model.cfg.vocab_size
    results = []
    if "engine" in a.modes:
        for users in a.users_list:
            for k, ip, pa, kern in a.variants:
                run_engine(a, model, users, warmup_tokens(k), 1000 + users, "warmup", k, ip, pa, kern)
                r = run_engine(a, model, users, a.max_tokens, users, "engine", k, ip, pa, kern)
                emit(r)
                results.append(r)
                if a.profile:
                    profile_engine(a, model, users, k, ip, pa, kern)
                gc.collect()
    if "server" in a.modes:
        try:
            import uvicorn

            from surojax.cli.main import build_parser, load_command
            from surojax.cli.serve import serve_config
            from surojax.serve.launch import build_server, freeze_heap
        except ImportError as e:
            print(f"# server mode skipped: {e} (needs fastapi, starlette, uvicorn, anyio, h11, click, pydantic)",
                  flush=True)
            return results
        for users, k, ip, pa, kern in [(u, *v) for u in a.users_list for v in a.variants]:
            engine = engine_config(a, users, k, ip, pa, kern)
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            args = build_parser("serve", load_command("serve")).parse_args(
                ["serve", "random", "--served-model-name", "bench", "--max-num-seqs", str(users),
                 "--num-kv-blocks", str(engine.num_blocks), "--block-size", str(a.block_size),
                 "--max-model-len", str(engine.scheduler.max_model_len), "--max-num-batched-tokens",
                 str(step_budget(a, users)), "--decode-steps", str(k), "--log-level", "warning"]
                + (["--unroll-layers"] if a.unroll_layers else []))
            config = serve_config(args)
            app, state = build_server(dataclasses.replace(config, engine=engine), model=model,
                                      tokenizer=IdTokenizer())
            kern = state.engine.engine.config.kv_path.value  # AUTO: what the server resolved
            freeze_heap()  # as `surojax serve` does; undone below, so that this server can be collected
            srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            th = threading.Thread(target=srv.run, daemon=True)
            th.start()
            while not srv.started:
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            try:
                run_client_process(a, url, users, warmup_tokens(k), 1000 + users, "warmup")
                before = _num_compiled()
                r = run_client_process(a, url, users, a.max_tokens, users, "server")
                r["compiled_while_measuring"] = _num_compiled() - before
                r["decode_steps"], r["kv_in_place"], r["paged_attention"] = k, int(ip), int(pa)
                r["paged_kernel"] = kern
            finally:
                srv.should_exit = True
                th.join(10)
                state.engine.shutdown()
                gc.unfreeze()
            emit(r)
            results.append(r)
            del app, state
            gc.collect()
    return results


class IdTokenizer:
    """Enough of a tokenizer for a random-weight model: every id decodes to a short non-empty string."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{int(i)}>" for i in ids)

    def encode(self, text, add_special_tokens=False):
        raise ValueError("the benchmark sends token ids")

    def token_to_id(self, token):
        return None

    def get_chat_template(self, *a, **k):
        raise ValueError("no chat template")


# ---- the HF anchor ------------------------------------------------------------------------------------------

def hf_main(a):
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        print(f"# hf anchor skipped: {e}", flush=True)
        return []
    if not torch.cuda.is_available():
        print("# hf anchor skipped: no CUDA device", flush=True)
        return []
    from surojax.bench.shapes import shape_hf_config

    kw = shape_hf_config(a.shape)
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    results = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for users in a.users_list:
        ids = torch.randint(10, cfg.vocab_size - 10, (users, a.prompt_len), generator=g).cuda()
        mask = torch.ones_like(ids)

        def gen(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, out.shape[1] - ids.shape[1]

        gen(4)  # warm-up
        t_first, _ = gen(1)  # prefill + one token: the TTFT of every row
        wall, n = gen(a.max_tokens)
        decode = users * (n - 1) / max(wall - t_first, 1e-9)
        r = {"mode": "hf", "users": users, "requests": users, "output_tokens": users * n, "decode_tok_s": decode,
             "output_tok_s": users * n / wall, "ttft_p50_ms": 1e3 * t_first, "ttft_p99_ms": 1e3 * t_first,
             "itl_p50_ms": 1e3 * (wall - t_first) / max(n - 1, 1), "itl_p99_ms": float("nan"), "wall_s": wall}
        emit(r)
        results.append(r)
    return results


# ---- driver -------------------------------------------------------------------------------------------------

def serve_decode_steps() -> int:
    """`surojax serve`'s default decode steps per device call (what --decode-steps auto gives a user)."""
    from surojax.serve.config import SERVE_DECODE_STEPS

    return SERVE_DECODE_STEPS


def server_engine_ratios(results) -> list[str]:
    """One line per (users, variant) measured in both modes: the server's decode tok/s over the engine's (the
    HTTP path's cost; issue 18's goal: >= 0.90 at 64 users)."""
    key = lambda r: (r["users"], r.get("decode_steps"), r.get("kv_in_place"), r.get("paged_attention"),
                     r.get("paged_kernel"))
    engine = {key(r): r for r in results if r["mode"] == "engine"}
    lines = []
    for r in results:
        e = engine.get(key(r)) if r["mode"] == "server" else None
        if e is not None and e["decode_tok_s"]:
            lines.append(f"server/engine users {r['users']} decode_steps {r.get('decode_steps')}: decode tok/s "
                         f"{r['decode_tok_s'] / e['decode_tok_s']:.3f}, output tok/s "
                         f"{r['output_tok_s'] / max(e['output_tok_s'], 1e-9):.3f}")
    return lines


def table(results):
    cols = ["mode", "users", "decode_steps", "kv_in_place", "paged_attention", "paged_kernel", "decode_tok_s",
            "output_tok_s",
            "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(results, key=lambda r: (r["users"], r["mode"], r.get("decode_steps", 1), r.get("kv_in_place", 0),
                                              r.get("paged_attention", 0), r.get("paged_kernel", ""))):
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_child(a, modes):
    cmd = [sys.executable, __file__, "--modes", ",".join(modes), "--child", *a.passthrough]
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(p.stderr[-4000:] if p.returncode else "")
    for ln in p.stdout.splitlines():
        print(ln, flush=True)
    if p.returncode:
        print(f"# {','.join(modes)} failed with exit code {p.returncode}", flush=True)
    return [json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="hf,engine,server", help="comma list of hf, engine, server, client")
    p.add_argument("--users", default="1,16,64", help="comma list of concurrent users")
    p.add_argument("--rounds", type=int, default=2, help="requests per user, back to back")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--shape", default=None,
                   help="a surojax.bench.shapes name (default qwen3-0.6b; debug with --smoke), e.g. gemma3-1b, "
                        "lfm2-1.2b, qwen3.5-0.8b; CPU-sized: debug, debug-gemma3, debug-lfm2, debug-qwen3.5")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quant", default=None, choices=["q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nvfp4", "fp8"]
                   + list(GGUF_FILE_TYPES),
                   help="a quantised base: every Linear of the layers in this format (random codes), or typed layer "
                        "by layer as a llama.cpp file of that type (q4_k_m, q5_k_m); the embedding and head as "
                        "--dtype; decode takes the fused kernel where SUROJAX_QUANT_MATMUL says")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks (default: what the users need)")
    p.add_argument("--attention", default=None, help="attention backend as `surojax serve --attention` spells it "
                   "(default: the server's default, ServeConfig.attention)")
    p.add_argument("--prefills-per-step", type=int, default=16,
                   help="whole prompts one engine step may prefill (token budget = users + this x prompt-len; "
                        "16 x 512 ~ `surojax serve`'s default --max-num-batched-tokens 8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="engine mode: one more run per row under jax.profiler, GPU kernels per output token by category")
    p.add_argument("--profile-dir", default=None, help="--profile: keep the traces under this folder (default: a "
                   "temporary one)")
    p.add_argument("--decode-steps", default="auto",
                   help="comma list of decode steps per device call (powers of two) to run engine/server with; "
                        "auto = the server's default (SERVE_DECODE_STEPS)")
    p.add_argument("--kv-in-place", default="1", help="comma list of 0/1: the runner's kv_in_place setting")
    p.add_argument("--paged-attention", default="1",
                   help="comma list of 0/1: the runner's paged_attention (1 = in-pool decoder, 0 = reference)")
    p.add_argument("--paged-kernel", default="auto",
                   help="comma list of auto / gather / reduce / pallas: the paged path's decode attention "
                        "(paged_kernel; auto = the engine's default: pallas on a GPU)")
    p.add_argument("--unroll-layers", action="store_true", help="the runner's unroll_layers (engine and server)")
    p.add_argument("--separate-projections", action="store_true",
                   help="engine only: keep q / k / v and gate / up as separate GEMMs (the server joins them)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the KV pool's dtype (engine and server): auto = the model's, fp8 = float8_e4m3fn")
    p.add_argument("--smoke", action="store_true", help="CPU: debug shape, short lengths, users 1,4")
    p.add_argument("--url", default=None, help="client mode: the server's base URL")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab", type=int, default=151936, help="client mode: prompt ids are drawn below this")
    p.add_argument("--model-name", default="bench")
    p.add_argument("--label", default="client")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--id-text", action="store_true", help=argparse.SUPPRESS)  # client: count "<id>" tokens
    a = p.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    a.passthrough = [x for i, x in enumerate(raw) if x != "--modes" and (i == 0 or raw[i - 1] != "--modes")]
    if a.smoke:  # a --shape given with it is kept (a CPU-sized one)
        a.shape, a.dtype, a.prompt_len, a.max_tokens, a.rounds = a.shape or "debug", "float32", 24, 8, 1
        if a.users == "1,16,64":
            a.users = "1,4"
        if a.modes == "hf,engine,server":
            a.modes = "engine,server"
    a.shape = a.shape or "qwen3-0.6b"
    from surojax.models.layers.attention_backend import parse_attention_backend
    from surojax.serve.config import ServeConfig

    a.attention = (parse_attention_backend(a.attention, key="--attention") if a.attention is not None
                   else ServeConfig.attention)
    if a.separate_projections and "server" in a.modes.split(","):
        p.error("--separate-projections is for the engine alone: `surojax serve` joins q / k / v and gate / up")
    a.users_list = [int(u) for u in a.users.split(",")]
    a.decode_steps_list = [serve_decode_steps() if k.strip() == "auto" else int(k) for k in a.decode_steps.split(",")]
    if any(k < 1 or k & (k - 1) for k in a.decode_steps_list):
        p.error(f"--decode-steps takes powers of two, got {a.decode_steps}")
    ips = [bool(int(ip)) for ip in a.kv_in_place.split(",")]
    pas = [bool(int(x)) for x in a.paged_attention.split(",")]
    kernels = [x.strip() for x in a.paged_kernel.split(",")]
    if any(x not in ("auto", "gather", "reduce", "pallas") for x in kernels):
        p.error(f"--paged-kernel takes auto, gather, reduce and/or pallas, got {a.paged_kernel}")
    # kv_in_place applies to the reference path only, the kernel to the paged path only
    a.variants = [(k, ip, pa, kern) for k in a.decode_steps_list for pa in pas
                  for ip in (ips[:1] if pa else ips) for kern in (kernels if pa else ["gather"])]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.modes = modes
    if "client" in modes:
        client_main(a)
        return 0
    if a.child:
        results = hf_main(a) if modes == ["hf"] else ours_main(a)
        return 0 if results or "hf" in modes else 1
    results = []
    if "hf" in modes:
        results += run_child(a, ["hf"])
    ours = [m for m in modes if m in ("engine", "server")]
    if ours:
        results += run_child(a, ours)
    print()
    print(table(results))
    for line in server_engine_ratios(results):
        print(line)
    want = len(a.users_list) * len(ours) * len(a.variants)
    got = sum(1 for r in results if r["mode"] in ours)
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
