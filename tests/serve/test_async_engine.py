"""AsyncEngine: detokenisation runs on the output thread, never the engine thread, and a stop string found
there after the fact gives exactly the engine's own output (text cut at the stop, tokens and logprobs after it
dropped, finish "stop"), frees the request's KV and drops the outputs of steps already run past it."""
import asyncio
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
