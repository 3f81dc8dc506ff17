"""Where a streamed request's time to first token goes in our HTTP server: N users send one prompt each at once
(serve_load's smoke setup by default: debug shape, CPU), and every request is timed at each hand-off on its way
to its first token. One clock for all (CLOCK_MONOTONIC: time.perf_counter in both processes).

    client send -> http     the ASGI app sees the request (connection, uvicorn's parsing, the event loop's queue)
    http -> submit          the handler: validation, prompt, params, AsyncEngine.submit (event loop, one at a time)
    submit -> add           the engine thread takes the "add" command (Engine.add_request)
    add -> scheduled        waiting for a step that prefills it
    scheduled -> out        that step (and the next one's dispatch: `AsyncEngine._hand_over`) until the output
                            thread has its token
    out -> put              the event loop puts it on the request's queue
    put -> client           the chunk is encoded, written, read by the client

Also per burst: the CPU time of each server thread (the event loop's is uvicorn's), and per engine step its start
and how many prompts it started. Prints p50 / p90 / max per phase and the steps; `--json` writes every record.
`--device-ms PREFILL,DECODE` models a GPU's step time on the CPU (each step's readback waits that long after its
dispatch, the GIL released), so that a prefill step costs what the benchmark's padded buckets make it cost on an
H100; `--hold N` (an experiment) keeps the engine from stepping until N requests wait: what gathering a burst's
admission could give at most.

    python benchmarks/serve_ttft_probe.py --users 64 --repeat 6                   # debug shape on the CPU
    python benchmarks/serve_ttft_probe.py --users 64 --repeat 6 --device-ms 20,4  # steps as long as an H100's
    python benchmarks/serve_ttft_probe.py --users 1 --repeat 20                   # one user's TTFT, 20 times
    python benchmarks/serve_ttft_probe.py --shape qwen3-0.6b --dtype bfloat16 --prompt-len 512 --max-tokens 128  # GPU
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_load  # noqa: E402

PHASES = ["send", "http", "submit", "add", "scheduled", "out", "put", "client"]


def client(url: str, users: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list[dict]:
    """Every user sends one streamed prompt at once -> per user {id, send, client (first token), end}."""
    import random
    from urllib.parse import urlparse

    rng = random.Random(seed)
    u = urlparse(url)

    async def user(i):
        conn = serve_load._Conn(u.hostname, u.port)
        conn.reader, conn.writer = await asyncio.open_connection(u.hostname, u.port)
        await ready.wait()
        prompt = [rng.randrange(10, vocab - 10) for _ in range(prompt_len)]
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        rec = {"id": i, "send": time.perf_counter(), "client": None}
        async for _, line in conn.post_stream("/v1/completions", body, {"X-Probe": str(i)}):
            if rec["client"] is None and line.startswith("data: {"):
                rec["client"] = time.perf_counter()
        rec["end"] = time.perf_counter()
        conn.writer.close()
        return rec

    async def main():
        tasks = [asyncio.create_task(user(i)) for i in range(users)]
        await asyncio.sleep(0.2)  # every connection open first: the burst is the requests, not the handshakes
        ready.set()
        return await asyncio.gather(*tasks)

    ready = asyncio.Event()
    return asyncio.run(main())


class Probe:
    """Timestamps per request (by X-Probe header) and per engine step, from hooks on the server's hand-offs."""

    def __init__(self):
        self.recs: dict[str, dict] = {}  # probe id -> phase times
        self.by_rid: dict[str, dict] = {}  # engine request id -> the same dict
        self.steps: list[dict] = []
        self.current: contextvars.ContextVar = contextvars.ContextVar("probe", default=None)

    def install(self, app, state):
        from surojax.serve import async_engine as ae_mod
        from surojax.serve.scheduler import Scheduler

        probe, now = self, time.perf_counter
        inner = app.build_middleware_stack()

        async def asgi(scope, receive, send):
            if scope["type"] == "http":
                pid = dict(scope["headers"]).get(b"x-probe")
                if pid is not None:
                    rec = probe.recs.setdefault(pid.decode(), {})
                    rec["http"] = now()
                    probe.current.set(rec)
            await inner(scope, receive, send)

        app.middleware_stack = asgi
        aeng = state.engine
        submit = aeng.submit

        def submit_probe(*a, **k):
            stream = submit(*a, **k)
            rec = probe.current.get()
            if rec is not None:
                rec["submit"] = now()
                probe.by_rid[stream.request_id] = rec
            return stream

        aeng.submit = submit_probe
        handle = aeng._handle

        def handle_probe(kind, stream, payload):
            if kind == "add" and stream.request_id in probe.by_rid:
                probe.by_rid[stream.request_id]["add"] = now()
            return handle(kind, stream, payload)

        aeng._handle = handle_probe
        schedule = Scheduler.schedule

        def schedule_probe(sched):
            t = now()
            out = schedule(sched)
            started = [s.request_id for s in out.scheduled if s.start == 0]
            for rid in started:
                if rid in probe.by_rid:
                    probe.by_rid[rid]["scheduled"] = t
            probe.steps.append({"t": t, "prefills": len(started), "rows": len(out.scheduled)})
            return out

        aeng.engine.scheduler.schedule = schedule_probe.__get__(aeng.engine.scheduler)
        deliver_step = aeng._deliver_step

        def deliver_step_probe(outs, step_s):
            t = now()
            for o in outs:
                rec = probe.by_rid.get(o.request_id)
                if rec is not None and "out" not in rec:
                    rec["out"] = t
            return deliver_step(outs, step_s)

        aeng._deliver_step = deliver_step_probe
        deliver = aeng._deliver

        def deliver_probe(items):
            deliver(items)
            recs = [probe.by_rid.get(s.request_id) for s, _ in items]

            def put_times(t=None):
                t = now()
                for rec in recs:
                    if rec is not None and "put" not in rec:
                        rec["put"] = t

            for loop in {s.loop for s, _ in items}:
                try:
                    loop.call_soon_threadsafe(put_times)
                except RuntimeError:
                    pass

        aeng._deliver = deliver_probe
        del ae_mod


def device_time(runner, prefill_s: float, decode_s: float) -> None:
    """Each `PagedRunner.execute` returns no sooner than its modelled device time after its calls were dispatched."""
    execute = runner.execute

    def timed(scheduled, bitmasks=None, on_dispatch=None):
        dispatched = []

        def at_dispatch():
            dispatched.append(time.perf_counter())
            if on_dispatch is not None:
                on_dispatch()

        out = execute(scheduled, bitmasks, at_dispatch)
        prefill = any(s.num_new_tokens > 1 for s in scheduled)
        cost = prefill_s if prefill else decode_s * max([s.num_steps for s in scheduled] or [1])
        left = (dispatched[0] if dispatched else time.perf_counter()) + cost - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return out

    runner.execute = timed


def hold(eng, n: int) -> None:
    """The engine idles until n requests wait (at most 300 ms after the first): what batching a burst's admission
    could give at most."""
    has_unfinished, first = eng.has_unfinished, [None]

    def held():
        if eng.scheduler.running or not eng.scheduler.waiting:
            first[0] = None
            return has_unfinished()
        first[0] = first[0] or time.perf_counter()
        return len(eng.scheduler.waiting) >= n or time.perf_counter() - first[0] > 0.3

    eng.has_unfinished = held


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def report(recs: list[dict], steps: list[dict], t0: float) -> dict:
    rows = {}
    for a, b in zip(PHASES, PHASES[1:]):
        d = [1e3 * (r[b] - r[a]) for r in recs if r.get(a) is not None and r.get(b) is not None]
        rows[f"{a}->{b}"] = (pct(d, 50), pct(d, 90), max(d) if d else float("nan"))
    ttft = [1e3 * (r["client"] - r["send"]) for r in recs if r.get("client")]
    arrivals = sorted(1e3 * (r["http"] - t0) for r in recs if "http" in r)
    submits = sorted(1e3 * (r["submit"] - t0) for r in recs if "submit" in r)
    sends = sorted(1e3 * (r["send"] - t0) for r in recs)
    print(f"  TTFT ms p50 {pct(ttft, 50):.1f}  p90 {pct(ttft, 90):.1f}  p99 {pct(ttft, 99):.1f}  max {max(ttft):.1f}")
    print(f"  sends over {sends[-1]:.1f} ms, http arrivals over {arrivals[-1] - arrivals[0]:.1f} ms, "
          f"submits over {submits[-1] - submits[0]:.1f} ms "
          f"(first submit at +{submits[0]:.1f} ms from the first send)")
    for k, (p50, p90, mx) in rows.items():
        print(f"  {k:20s} p50 {p50:7.2f}  p90 {p90:7.2f}  max {mx:7.2f} ms")
    first = [s for s in steps if s["t"] >= t0]
    print("  steps (start ms from the first send: prompts started / rows): "
          + ", ".join(f"+{1e3 * (s['t'] - t0):.1f}: {s['prefills']}/{s['rows']}" for s in first[:12]))
    return {"ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "phases": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="bursts measured (after two warm-up bursts)")
    p.add_argument("--shape", default="debug", help="a surojax.bench.shapes name (on a GPU: qwen3-0.6b)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--decode-steps", default="auto")
    p.add_argument("--json", default=None, help="write every record here")
    p.add_argument("--device-ms", default=None,
                   help="PREFILL,DECODE: model a GPU's step time on the CPU: each step's readback waits until "
                        "this many ms after its dispatch (a prefill step: PREFILL, flat as the benchmark's padded "
                        "prefill rows make it; a decode step: DECODE per token), the GIL released as a device wait "
                        "releases it")
    p.add_argument("--burst-wait-ms", type=float, default=None, help="experiment: AsyncEngine's burst_wait_s (ms)")
    p.add_argument("--hold", type=int, default=0,
                   help="experiment: the engine starts no step before this many requests wait (or 300 ms passed)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # child: URL to send the burst to
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.client:
        print(json.dumps(client(a.client, a.users, a.prompt_len, a.max_tokens, a.vocab, a.seed)))
        return 0
    a.quant, a.attention, a.separate_projections, a.unroll_layers = None, None, False, False
    a.block_size, a.num_kv_blocks, a.prefills_per_step, a.kv_cache_dtype = 16, 0, 16, "auto"
    from surojax.serve.config import ServeConfig
    a.attention = ServeConfig.attention
    k = serve_load.serve_decode_steps() if a.decode_steps == "auto" else int(a.decode_steps)
    model = serve_load.build_model(a)

    import uvicorn

    from surojax.cli.main import build_parser, load_command
    from surojax.cli.serve import serve_config
    from surojax.serve.launch import build_server, freeze_heap

    engine = serve_load.engine_config(a, a.users, k, True, True, "auto")
    args = build_parser("serve", load_command("serve")).parse_args(
        ["serve", "random", "--served-model-name", "bench", "--max-num-seqs", str(a.users), "--num-kv-blocks",
         str(engine.num_blocks), "--block-size", "16", "--max-model-len", str(engine.scheduler.max_model_len),
         "--max-num-batched-tokens", str(serve_load.step_budget(a, a.users)), "--decode-steps", str(k),
         "--log-level", "warning"])
    app, state = build_server(dataclasses.replace(serve_config(args), engine=engine), model=model,
                              tokenizer=serve_load.IdTokenizer())
    probe = Probe()
    freeze_heap()  # as `surojax serve` does
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    probe.install(app, state)
    if a.burst_wait_ms is not None and hasattr(state.engine, "_burst_wait_s"):
        state.engine._burst_wait_s = a.burst_wait_ms / 1e3
    if a.hold:
        hold(state.engine.engine, a.hold)
    if a.device_ms:
        device_time(state.engine.engine.runner, *(float(x) / 1e3 for x in a.device_ms.split(",")))
    url = f"http://127.0.0.1:{port}"
    out = []
    try:
        for i in range(a.repeat + 2):
            probe.recs.clear()
            probe.steps.clear()
            cpu0 = thread_cpu()
            cmd = [sys.executable, __file__, "--client", url, "--users", str(a.users), "--prompt-len",
                   str(a.prompt_len), "--max-tokens", str(a.max_tokens), "--vocab", str(model.cfg.vocab_size),
                   "--seed", str(i)]  # new prompts each burst: no prefix-cache hits
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
            if res.returncode:
                raise RuntimeError(res.stderr[-2000:])
            recs = []
            for c in json.loads(res.stdout.strip().splitlines()[-1]):
                recs.append({**probe.recs.get(str(c["id"]), {}), **c})
            if i < 2:
                continue  # warm-up: compiles (the second burst's steps may take other shapes than the first's)
            t0 = min(r["send"] for r in recs)
            cpu = {k: 1e3 * (v - cpu0.get(k, 0.0)) for k, v in thread_cpu().items()}
            print(f"burst {i}: {a.users} users; CPU ms by thread: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0.5))
            out.append({"summary": report(recs, probe.steps, t0), "recs": recs, "steps": list(probe.steps)})
            time.sleep(0.3)
    finally:
        srv.should_exit = True
        th.join(10)
        state.engine.shutdown()
    p50 = sorted(o["summary"]["ttft_p50_ms"] for o in out)
    print(f"TTFT p50 over bursts: median {p50[len(p50) // 2]:.1f} ms ({', '.join(f'{x:.1f}' for x in p50)})")
    if a.json:
        Path(a.json).write_text(json.dumps(out))
    return 0


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's Python threads (the event loop's is uvicorn's thread)."""
    out = {}
    for t in threading.enumerate():
        try:
            out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):
            pass
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
