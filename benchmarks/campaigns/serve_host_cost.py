"""The HTTP server's host (Python) cost per streamed token, with the device made a fixed sleep.

The real `surojax serve` code path (`build_server`: scheduler, engine thread, output thread, FastAPI under
uvicorn, SSE) serves the debug shape, but the runner's `execute` is replaced by a fake device: --dispatch-ms of
Python (the real runner's inputs and dispatch, GIL held), then a sleep of --device-ms (--prefill-ms with a prompt
chunk; the GIL released, as a readback releases it), then K tokens per running request (``num_steps``, as a
multi-step decode gives). So the numbers depend only on the Python around the model: what
`serve_load.py --modes engine,server` measures on a GPU, without one.

    python benchmarks/campaigns/serve_host_cost.py                     # 64 users, K = 8, device 35 ms per call
    python benchmarks/campaigns/serve_host_cost.py --users 1,16,64 --decode-steps 1 --device-ms 6

Per users: the engine alone (`Engine.step` with the fake device, no HTTP) and the server (the load client of
serve_load.py in a child process) -> decode tok/s of each, their ratio (serve_load's server/engine figure; on this
harness it also moves with how the requests' prefills fall into steps, a few %), the host time between device
calls, and each server thread's CPU time per generated token in µs (engine thread, output thread, event loop =
uvicorn's thread), read from /proc over the measured run. CPU time of a pure-Python thread is about its GIL time.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_load  # noqa: E402  (the load client, the bench tokenizer, engine_config)


def python_work(seconds: float):
    """A function that runs about ``seconds`` of pure Python (the GIL held, switchable like any bytecode)."""
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    loops = int(n * seconds / (time.perf_counter() - t0))

    def work():
        for _ in range(loops):
            pass

    return work


def fake_device(runner, a):
    """Replace ``runner.execute``: --dispatch-ms of Python (the real runner's inputs and dispatch), then sleep
    --device-ms (--prefill-ms for a call with a prompt chunk; the GIL released, as a readback releases it),
    then one token per sampling row (K for a K-step row). ``runner.host_s`` sums the time between calls."""
    from surojax.serve.runner import StepResult

    dispatch = python_work(a.dispatch_ms / 1e3)

    def execute(scheduled, bitmasks=None, on_dispatch=None):
        start = time.perf_counter()
        if runner.last_end is not None:
            runner.host_s += start - runner.last_end
        dispatch()
        if on_dispatch is not None:
            on_dispatch()
        decode = all(s.num_new_tokens == 1 for s in scheduled)
        time.sleep((a.device_ms if decode else a.prefill_ms) / 1e3)
        out = StepResult()
        for s in scheduled:
            if s.num_new_tokens > 0 and s.sample:
                ids = [10 + (s.start + i) % 400 for i in range(s.num_steps)]
                out[s.request_id] = ids if s.num_steps > 1 else ids[0]
        runner.num_calls += 1
        runner.last_end = time.perf_counter()
        return out

    runner.execute = execute
    runner.host_s, runner.last_end = 0.0, None


def thread_cpu_s(native_id: int) -> float:
    """utime + stime of one thread of this process (Linux /proc), seconds."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_engine(a, model, users: int, k: int) -> float:
    """Decode tok/s of the bare engine over the fake device (serve_load's engine mode)."""
    from surojax.generation.sampling import SamplingParams
    from surojax.serve.engine import Engine

    eng = Engine(model, serve_load.engine_config(a, users, k))
    fake_device(eng.runner, a)
    records = []
    for r in range(a.rounds):
        t0 = time.perf_counter()
        ts = {eng.add_request([10 + (r * users + u) % 400] * a.prompt_len, SamplingParams(max_tokens=a.max_tokens)): []
              for u in range(users)}
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                ts[o.request_id] += [now] * len(o.new_token_ids)
        records += [(t0, v) for v in ts.values()]
    print(f"#   engine: {eng.runner.num_calls} calls, host {1e3 * eng.runner.host_s / eng.runner.num_calls:.2f} ms "
          "between calls", flush=True)
    return serve_load.summarize("engine", users, records, 1.0)["decode_tok_s"]


def run_server(a, model, users: int, k: int) -> tuple[float, dict[str, float]]:
    """-> (decode tok/s through HTTP, {thread: CPU µs per generated token})."""
    import uvicorn

    from surojax.cli.main import build_parser, load_command
    from surojax.cli.serve import serve_config
    from surojax.serve.launch import build_server, freeze_heap

    engine = serve_load.engine_config(a, users, k)
    args = build_parser("serve", load_command("serve")).parse_args(
        ["serve", "random", "--served-model-name", "bench", "--max-num-seqs", str(users), "--decode-steps", str(k),
         "--log-level", "warning"])
    app, state = build_server(dataclasses.replace(serve_config(args), engine=engine), model=model,
                              tokenizer=serve_load.IdTokenizer())
    fake_device(state.engine.engine.runner, a)
    freeze_heap()  # as `surojax serve` does
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, name="event-loop", daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    threads = {"engine thread": state.engine._thread, "output thread": state.engine._out_thread, "event loop": th}
    url = f"http://127.0.0.1:{port}"
    try:
        serve_load.run_client_process(a, url, users, 4, 1000 + users, "warmup")
        before = {n: thread_cpu_s(t.native_id) for n, t in threads.items()}
        gen_before = state.engine.metrics.generation_tokens
        runner = state.engine.engine.runner
        runner.host_s, runner.last_end, calls = 0.0, None, runner.num_calls
        r = serve_load.run_client_process(a, url, users, a.max_tokens, users, "server")
        tokens = state.engine.metrics.generation_tokens - gen_before
        cpu = {n: 1e6 * (thread_cpu_s(t.native_id) - before[n]) / tokens for n, t in threads.items()}
        calls = runner.num_calls - calls
        print(f"#   server: {calls} calls, host {1e3 * runner.host_s / calls:.2f} ms between calls", flush=True)
    finally:
        srv.should_exit = True
        th.join(10)
        state.engine.shutdown()
        gc.unfreeze()
    return r["decode_tok_s"], cpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", default="64")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--device-ms", type=float, default=35.0, help="the fake device's time per call")
    p.add_argument("--prefill-ms", type=float, default=20.0, help="... per call with a prompt chunk")
    p.add_argument("--dispatch-ms", type=float, default=2.0,
                   help="Python per call before the device runs (the runner's inputs and dispatch)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="engine,server")
    a = p.parse_args(argv)
    # what serve_load's engine_config / run_client_process read
    a.block_size, a.num_kv_blocks, a.prefills_per_step, a.unroll_layers = 16, 0, 16, False
    a.kv_cache_dtype, a.vocab = "auto", 400

    from flax import nnx

    from surojax.bench.shapes import model_config
    from surojax.models.decoder import Decoder

    model = Decoder(model_config("debug"), attention="xla", rngs=nnx.Rngs(0))
    for users in [int(u) for u in a.users.split(",")]:
        eng = run_engine(a, model, users, a.decode_steps) if "engine" in a.modes else float("nan")
        line = f"users {users} K {a.decode_steps} device {a.device_ms} ms: engine {eng:.0f} tok/s"
        if "server" in a.modes:
            srv, cpu = run_server(a, model, users, a.decode_steps)
            line += f", server {srv:.0f} tok/s, server/engine {srv / eng:.3f}; CPU µs per token: " + ", ".join(
                f"{n} {v:.1f}" for n, v in cpu.items())
        print(line, flush=True)


if __name__ == "__main__":
    main()
