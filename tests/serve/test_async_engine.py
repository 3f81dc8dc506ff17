"""AsyncEngine: detokenisation runs on the output thread, never the engine thread, and a stop string found
there after the fact gives exactly the engine's own output (text cut at the stop, tokens and logprobs after it
dropped, finish "stop"), frees the request's KV and drops the outputs of steps already run past it."""
import asyncio
import sys
import threading
import time
from pathlib import Path


from surojax.data.tokenizer import Tokenizer
from surojax.generation.sampling import SamplingParams
from surojax.serve import async_engine
from surojax.serve.async_engine import AsyncEngine
from surojax.serve.engine import Engine
from surojax.weights.hf_checkpoint import load_model
from tests.serve.configs import BUCKETS, engine_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "models" / "qwen3"


def make_engine(model, tok):
    return Engine(model, engine_config(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                       max_model_len=64, buckets=BUCKETS), tokenizer=tok)


def test_detokenisation_off_the_engine_thread_and_stop_strings_exact(monkeypatch):
    model, tok = load_model(FIXTURE, attention="xla"), Tokenizer.from_dir(FIXTURE)
    prompt = tok.encode("hello world, the")
    full = tok.decode(make_engine(model, tok).generate([prompt], 12)[0], skip_special_tokens=True)
    stop = full[4:6]
    reqs = [(prompt, SamplingParams(max_tokens=12, stop=(stop,), logprobs=True, top_logprobs=2)),
            (prompt[1:], SamplingParams(max_tokens=12))]

    ref = make_engine(model, tok)  # the engine's own step: text made in-step
    rids = [ref.add_request(p, sp) for p, sp in reqs]
    want = {r: ([], "", [], None) for r in rids}
    while ref.has_unfinished():
        for o in ref.step():
            ids, text, lps, _ = want[o.request_id]
            want[o.request_id] = (ids + o.new_token_ids, text + o.text, lps + (o.logprobs or []), o.finish_reason)
    assert want[rids[0]][1] == full[:full.index(stop)] and want[rids[0]][3] == "stop"

    threads = []
    apply_text = async_engine.apply_text
    monkeypatch.setattr(async_engine, "apply_text",
                        lambda o, t: threads.append(threading.current_thread().name) or apply_text(o, t))
    eng = make_engine(model, tok)
    ae = AsyncEngine(eng).start()

    async def collect(p, sp):
        ids, text, lps, reason = [], "", [], None
        async for o in ae.submit(p, sp):
            ids, text, lps, reason = ids + o.new_token_ids, text + o.text, lps + (o.logprobs or []), o.finish_reason
        return ids, text, lps, reason

    async def main():
        return await asyncio.gather(*(collect(p, sp) for p, sp in reqs))

    try:
        got = asyncio.run(main())
        time.sleep(0.2)  # the "finish" command reaches the engine thread
    finally:
        ae.shutdown()
    assert got == [want[r] for r in rids]
    assert threads and set(threads) == {"surojax-output"}  # never "surojax-engine"
    assert not eng.has_unfinished() and eng.kv.usage == 0  # the stopped request's blocks were freed


def test_a_steps_outputs_reach_the_output_thread_once_the_next_step_is_dispatched():
    """The output thread and the event loop (which share the engine thread's GIL) work on a step's outputs while
    the device runs the next step, not while the engine thread prepares that step: call k hands over step k - 1."""
    model, tok = load_model(FIXTURE, attention="xla"), Tokenizer.from_dir(FIXTURE)
    eng = make_engine(model, tok)
    ae = AsyncEngine(eng)
    delivered, at_dispatch = [], []
    deliver, execute = ae._deliver_step, eng.runner.execute
    ae._deliver_step = lambda *a: delivered.append(a) or deliver(*a)

    def slow_dispatch(scheduled, bitmasks=None, on_dispatch=None):
        def dispatched():
            time.sleep(0.05)  # an output thread given the last step's outputs before this would have delivered them
            at_dispatch.append(len(delivered))
            on_dispatch()
        return execute(scheduled, bitmasks, dispatched)

    eng.runner.execute = slow_dispatch
    ae.start()

    async def main():
        return [o async for o in ae.submit(tok.encode("hello"), SamplingParams(max_tokens=4))]

    try:
        outs = asyncio.run(main())
    finally:
        ae.shutdown()
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    assert at_dispatch == [0, 0, 1, 2]  # a prefill, then three decode calls


def _first_step_prompts(eng) -> list[int]:
    """Records, per engine step, how many prompts it started."""
    started, schedule = [], eng.scheduler.schedule

    def record():
        out = schedule()
        started.append(sum(s.start == 0 for s in out.scheduled))
        return out

    eng.scheduler.schedule = record
    return started


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_requests_handled_in_one_event_loop_turn_start_in_one_step():
    """The engine thread is woken once the loop has run the handlers of requests that arrived together, not by the
    first submit (which would start that prompt alone while the others' handlers still run)."""
    model, tok = load_model(FIXTURE, attention="xla"), Tokenizer.from_dir(FIXTURE)
    eng = make_engine(model, tok)
    started = _first_step_prompts(eng)
    # no burst hold: this is the wake-up's doing; no idle timeout (it would wake the engine thread mid-turn)
    ae = AsyncEngine(eng, burst_wait_s=0, idle_wait_s=10).start()
    prompts = [tok.encode(w) for w in ("one two", "three four", "five six", "seven eight")]

    async def handler(p):
        _busy(0.002)  # a handler's work before its submit (validation, the prompt), without yielding
        return [o async for o in ae.submit(p, SamplingParams(max_tokens=2))]

    async def main():
        return await asyncio.gather(*(handler(p) for p in prompts))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # as the server sets it: the engine thread gets the GIL soon after a wake-up
    try:
        outs = asyncio.run(main())
    finally:
        sys.setswitchinterval(switch)
        ae.shutdown()
    assert started[0] == 4 and all(sum(len(o.new_token_ids) for o in r) == 2 for r in outs)


def test_a_burst_arriving_over_a_few_ms_is_held_for_one_step():
    """Two prompts in one loop turn, two more 1 ms apart: the step waits for them (the seats then being full),
    so all four start together."""
    model, tok = load_model(FIXTURE, attention="xla"), Tokenizer.from_dir(FIXTURE)
    eng = make_engine(model, tok)
    started = _first_step_prompts(eng)
    ae = AsyncEngine(eng, burst_wait_s=0.05, burst_gap_s=0.02, idle_wait_s=10).start()  # bounds >> the gaps
    prompts = [tok.encode(w) for w in ("one two", "three four", "five six", "seven eight")]

    async def main():
        streams = [ae.submit(p, SamplingParams(max_tokens=2)) for p in prompts[:2]]
        for p in prompts[2:]:
            await asyncio.sleep(0.001)
            streams.append(ae.submit(p, SamplingParams(max_tokens=2)))
        return [[o async for o in s] for s in streams]

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
    assert started[0] == 4


def test_burst_hold_policy():
    """Held only for two or more new prompts that outnumber the running requests, within the gap and the wait
    bounds, while one step would not take them all; a lone request is never held."""
    model, tok = load_model(FIXTURE, attention="xla"), Tokenizer.from_dir(FIXTURE)
    eng = make_engine(model, tok)  # 4 seats, 64 tokens a step
    ae = AsyncEngine(eng, burst_wait_s=0.005, burst_gap_s=0.002)  # not started: its state is set by hand
    now = time.monotonic()
    ae._burst_first = ae._burst_last = now
    eng.add_request([5, 6, 7], max_tokens=2)
    assert ae._burst_hold_s() == 0  # one request
    eng.add_request([8, 9, 10], max_tokens=2)
    assert 0 < ae._burst_hold_s() <= 0.002  # two, the last just now: up to the gap
    ae._burst_first = now - 0.005
    assert ae._burst_hold_s() == 0  # the first has waited burst_wait_s
    ae._burst_first = now
    eng.step()  # both running now
    eng.add_request([11, 12], max_tokens=2)
    eng.add_request([13, 14], max_tokens=2)
    ae._burst_last = time.monotonic()
    assert ae._burst_hold_s() == 0  # as many running as waiting (and the seats are full)
    eng2 = make_engine(model, tok)
    ae2 = AsyncEngine(eng2, burst_wait_s=0.005, burst_gap_s=0.002)
    ae2._burst_first = ae2._burst_last = time.monotonic()
    for k in range(2):
        eng2.add_request(list(range(10 + k, 42 + k)), max_tokens=2)  # 2 x 32 tokens: the step's whole budget
    assert ae2._burst_hold_s() == 0
