"""The server's two threads around the engine; the asyncio side talks to them through queues.

    HTTP handler (event loop)            engine thread                      output thread
    -------------------------            -------------                      -------------
    submit(...) -> Stream  -- "add" -->  engine.add_request  -- "open" -->  the request's RequestText
    abort / disconnect -- "abort" ---->  engine.abort (blocks freed) -----> an "abort" output
    await call(fn) ------ "call" ----->  fn(engine) between two steps
                                         engine.step_tokens() -- "step" --> detokenise, stop strings, metrics
    async for out in stream  <----------------- one call_soon_threadsafe per step (all the step's streams) ---
                                         engine.finish  <----- "finish" --  a stop string found after the fact

The engine thread does only what the device waits for: commands, scheduling, dispatch, the sampled ids' readback and
the scheduler's bookkeeping (`Engine.step_tokens`); it hands a step's token ids over once the next step is
dispatched (`_hand_over`), so that the output thread's and the event loop's Python, which share its GIL, run while
the device does instead of slowing the next call's preparation. The output thread turns them into text
(`detokenize.apply_text`, each request's `RequestText`, which the engine thread detaches at admission), updates the
metrics and delivers the whole step to the event loop in one ``call_soon_threadsafe``. A stop string it finds ends
the request with the same text, tokens and finish reason as in the engine's own `Engine.step`: the output is
truncated there, the engine is told to finish the request (its KV blocks are freed before the step after next at the
latest), and that request's outputs of any step already run are dropped. One FIFO carries everything to the output
thread, so a request's "open" comes before its outputs and its "abort" after them.

Bursts (`_wake_soon`, `_burst_hold_s`): a submit wakes the engine thread once the event loop has run the handlers
of the requests that reached it together (a few loop turns, no timer), and while two or more new prompts wait, more
than requests run, the last came under BURST_GAP_S ago and one step would not take them all anyway, the step is
held (at most BURST_WAIT_S after the first) for the rest of the burst. A lone request is never held. 64 users
sending at once on the 2-core dev CPU (benchmarks/serve_ttft_probe.py --device-ms 20,4: an H100's step times): the
first step starts 18 prompts (its whole budget) instead of 1 to 11, 4 prefill steps instead of 5; over four A/B pairs
of 8 bursts TTFT p50 81-105 ms against 98-118, p99 131-152 against 143-165.

Admission is bounded: at most max_num_seqs + max_queue requests in flight; beyond that `submit` raises
`QueueFullError`, and while draining (`set_draining`, `shutdown`) or after a thread died it raises
`EngineDrainingError` / `EngineDeadError`. Each carries `retry_after_s` (`serve.backpressure`: the queue in
front over the recent finish rate), which the HTTP layer sends as Retry-After with its 429 / 503.

The engine is only ever touched by its thread (the HTTP side reads counters for /metrics, which is safe to do
racily); the streams and the detokenisers only by the output thread. An exception in a step fails the requests
then in flight with that error, aborts them in the engine and the loop carries on: a bad request never kills
the server.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from surojax.serve.backpressure import FinishRate, retry_after_s
from surojax.serve.engine import Engine
from surojax.serve.metrics import ServeMetrics
from surojax.serve.detokenize import apply_text
from surojax.serve.scheduler import RequestOutput

log = logging.getLogger(__name__)


class Refused(RuntimeError):
    """A request not admitted; `retry_after_s`: whole seconds after which a retry is likely to be admitted."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(Refused):
    """Too many requests in flight (the HTTP layer answers 429)."""


class EngineDeadError(Refused):
    """The engine thread is not running (503)."""


class EngineDrainingError(Refused):
    """The server finishes what it has and admits nothing new (503)."""


@dataclass(eq=False)
class Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_prompt_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    finished: bool = False
    owner: "AsyncEngine | None" = None

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not self.finished and self.owner is not None:  # cancelled / client went away
                self.owner.abort(self)


WAKE_AFTER_QUIET_TURNS = 3  # event-loop turns without a new submit before the engine thread is woken (`_wake_soon`)
WAKE_DEFER_S = 0.002  # ... but no later than this after the first submit
BURST_GAP_S = 0.002  # a request this soon after the previous one continues a burst (`_burst_hold_s`)
BURST_WAIT_S = 0.005  # the longest a burst's first prompt is held for the ones behind it (0: never held)


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queue: int = 256, idle_wait_s: float = 0.05,
                 burst_wait_s: float = BURST_WAIT_S, burst_gap_s: float = BURST_GAP_S):
        """burst_wait_s / burst_gap_s: how a burst of new requests is gathered into one step (`_burst_hold_s`)."""
        self.engine = engine
        self.metrics = ServeMetrics()
        self.max_in_flight = engine.scheduler.max_num_seqs + max_queue
        self.finish_rate = FinishRate()
        self._draining = False
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()  # -> engine thread
        self._outs: queue.SimpleQueue = queue.SimpleQueue()  # engine thread -> output thread: lists of messages
        self._held: list = []  # engine thread only: messages not handed over yet (`_hand_over`)
        self._wake = threading.Event()
        self._open: dict[str, tuple[Stream, object]] = {}  # output thread only: request id -> (stream, RequestText)
        self._in_flight = 0  # event-loop side count (for 429)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._idle_wait_s = idle_wait_s
        self._burst_wait_s, self._burst_gap_s = burst_wait_s, burst_gap_s
        self._burst_first = self._burst_last = 0.0  # engine thread: when the waiting prompts' first / last came
        self._wake_pending = False  # event-loop side: a wake-up of the engine thread is scheduled (`_wake_soon`)
        self._wake_by = 0.0
        self._num_submits = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="surojax-engine", daemon=True)
        self._out_thread = threading.Thread(target=self._run_outputs, name="surojax-output", daemon=True)
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._out_thread.start()
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        self._draining = True
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self._outs.put(None)
        self._out_thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._out_thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    def set_draining(self, draining: bool) -> None:
        """While draining, requests in flight run to their end and `submit` refuses new ones (503)."""
        self._draining = draining

    def retry_after_s(self, ahead: int | None = None) -> int:
        """Seconds for `ahead` requests (default: all in flight) to finish at the recent rate."""
        return retry_after_s(self._in_flight if ahead is None else ahead, self.finish_rate.per_second())

    # ---- event-loop side --------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params, *, adapter: str | None = None,
               split_reasoning: bool = False, images=None) -> Stream:
        if not self.alive:
            raise EngineDeadError("the engine thread is not running", self.retry_after_s())
        if self._draining:
            raise EngineDrainingError("the server is draining: it finishes the requests in flight and admits no "
                                      "new ones", self.retry_after_s())
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                self.metrics.rejected += 1
                waiting = self._in_flight - self.engine.scheduler.max_num_seqs
                raise QueueFullError(f"{self._in_flight} requests in flight (limit {self.max_in_flight}); retry later",
                                     self.retry_after_s(max(waiting, 1)))
            self._in_flight += 1
        stream = Stream(f"req-{next(self._ids)}", asyncio.get_running_loop(), num_prompt_tokens=len(prompt_ids),
                        owner=self)
        self._cmds.put(("add", stream, (prompt_ids, params, adapter, split_reasoning, images)))
        self._wake_soon(stream.loop)
        return stream

    def _wake_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the engine thread once the event loop has gone `WAKE_AFTER_QUIET_TURNS` turns without a new submit
        (at most `WAKE_DEFER_S` after the first): the handlers of requests that have reached the server together
        (their bytes read in the same turns) submit first, so the engine thread finds them all queued and starts
        them in one step, instead of starting the first alone and the rest a step later. A lone request costs a
        few turns of an otherwise idle loop (microseconds); nothing sleeps."""
        self._num_submits += 1
        if not self._wake_pending:
            self._wake_pending = True
            self._wake_by = time.monotonic() + WAKE_DEFER_S
            loop.call_soon(self._wake_when_quiet, loop, self._num_submits, WAKE_AFTER_QUIET_TURNS)

    def _wake_when_quiet(self, loop: asyncio.AbstractEventLoop, seen: int, turns: int) -> None:
        quiet = turns - 1 if self._num_submits == seen else WAKE_AFTER_QUIET_TURNS
        if quiet > 0 and time.monotonic() < self._wake_by:
            loop.call_soon(self._wake_when_quiet, loop, self._num_submits, quiet)
            return
        self._wake_pending = False
        self._wake.set()

    def abort(self, stream: Stream) -> None:
        self._command("abort", stream, None)

    async def call(self, fn):
        """Run fn(engine) on the engine thread between steps -> its result (exceptions re-raised here)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._command("call", None, (fn, loop, fut))
        return await fut

    def _command(self, kind: str, stream: Stream | None, payload) -> None:
        self._cmds.put((kind, stream, payload))
        self._wake.set()

    def _release(self, stream: Stream) -> None:
        if not stream.finished:
            stream.finished = True
            with self._lock:
                self._in_flight -= 1

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _handle(self, kind, stream, payload) -> None:
        eng = self.engine
        if kind == "add":
            prompt_ids, params, adapter, split, images = payload
            now = time.monotonic()
            if not eng.scheduler.waiting:
                self._burst_first = now
            self._burst_last = now
            try:
                eng.add_request(prompt_ids, params, request_id=stream.request_id, adapter=adapter,
                                split_reasoning=split, images=images)
            except Exception as e:  # validated by the HTTP layer first; this is the last line
                self._held.append(("fail", stream, e))
                return
            self._held.append(("open", stream, eng.detach_text(stream.request_id)))
        elif kind == "abort":
            eng.abort(stream.request_id)
            self._held.append(("abort", stream, None))
        elif kind == "finish":  # a stop string, found by the output thread
            eng.finish(payload)
        elif kind == "call":
            fn, loop, fut = payload
            self._hand_over()  # fn may take a while (a LoRA load): the streams get what is ready first
            try:
                result, err = fn(eng), None
            except Exception as e:
                result, err = None, e
            if isinstance(result, list):  # ids of requests the call aborted (LoRA unload)
                self._held.append(("aborted", None, result))

            def done(result=result, err=err):
                if not fut.done():
                    fut.set_exception(err) if err is not None else fut.set_result(result)

            loop.call_soon_threadsafe(done)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            while True:
                try:
                    kind, stream, payload = self._cmds.get_nowait()
                except queue.Empty:
                    break
                self._handle(kind, stream, payload)
            if not eng.has_unfinished():
                self._hand_over()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            hold = self._burst_hold_s()
            if hold > 0:  # more of a burst's prompts are on their way: wait for them (a new command ends it early)
                self._hand_over()
                self._wake.wait(hold)
                self._wake.clear()
                continue
            started = time.monotonic()
            try:
                outs = eng.step_tokens(on_dispatch=self._hand_over)
            except Exception as e:  # fail what is in flight, keep serving
                log.exception("engine step failed; failing the requests in flight")
                for rid in list(eng.scheduler.requests):
                    eng.abort(rid)
                if eng.runner.recover_pools():
                    eng.kv.reset_prefix_cache()
                self._held.append(("failed", None, RuntimeError(f"engine step failed: {e}")))
                self._hand_over()
                continue
            self._held.append(("step", None, (outs, time.monotonic() - started)))
        self._hand_over()

    def _burst_hold_s(self) -> float:
        """Seconds to hold the next step while a burst of new requests is still arriving (0: step now), so that
        one step starts the burst's prompts together instead of the first few alone: a prefill call costs much
        the same for a few prompts as for the rows its shape bucket pads them to, and the prompts behind would
        wait for it. Held only while the prompts waiting outnumber the requests running (few decodes are delayed, and
        by at most `burst_wait_s`), at least two arrived (a lone request is never held), the last of them came
        less than `burst_gap_s` ago, the first less than `burst_wait_s` ago, and one step would not take them
        all anyway (seats, token budget)."""
        sched = self.engine.scheduler
        waiting = len(sched.waiting)
        if self._burst_wait_s <= 0 or waiting < 2 or waiting <= len(sched.running):
            return 0.0
        config = sched.config
        if waiting + len(sched.running) >= config.max_num_seqs or \
                sum(r.num_tokens for r in sched.waiting) >= config.max_num_batched_tokens:
            return 0.0
        now = time.monotonic()
        return max(0.0, min(self._burst_last + self._burst_gap_s, self._burst_first + self._burst_wait_s) - now)

    def _hand_over(self) -> None:
        """Pass what the engine thread holds to the output thread: once the next step is dispatched (or before
        the engine thread idles). The output thread's and the event loop's work on it (text, JSON, socket
        writes) then takes the GIL while the device runs, not while the engine thread prepares the next call."""
        if self._held:
            self._outs.put(self._held)
            self._held = []

    # ---- output thread ----------------------------------------------------------------------------------------
    def _run_outputs(self) -> None:
        """Everything after the step, one message at a time: text, stop strings, metrics, delivery."""
        while True:
            msgs = self._outs.get()
            if msgs is None:
                return
            for msg in msgs:
                try:
                    self._output(*msg)
                except Exception:  # a bug here must not leave the streams hanging: fail them, keep serving
                    log.exception("output processing failed; failing the requests in flight")
                    self._fail_open(RuntimeError("output processing failed"))

    def _output(self, kind: str, stream: Stream | None, payload) -> None:
        if kind == "step":
            self._deliver_step(*payload)
        elif kind == "open":
            self._open[stream.request_id] = (stream, payload)
            with self.metrics.lock:
                self.metrics.prompt_tokens += stream.num_prompt_tokens
        elif kind == "fail":
            self._deliver([(stream, payload)])
        elif kind == "abort":
            if self._open.pop(stream.request_id, None) is not None:
                self.metrics.finished("abort", time.monotonic() - stream.arrival)
                self._deliver([(stream, RequestOutput(stream.request_id, [], True, "abort"))])
        elif kind == "aborted":
            gone = [self._open.pop(r)[0] for r in payload if r in self._open]
            why = "its LoRA adapter was unloaded while it ran"
            self._deliver([(s, RequestOutput(s.request_id, [], True, "abort", error=why)) for s in gone])
        elif kind == "failed":
            self._fail_open(payload)

    def _fail_open(self, error: BaseException) -> None:
        failed = [s for s, _ in self._open.values()]
        self._open.clear()
        self._deliver([(s, error) for s in failed])

    def _deliver_step(self, outs: list[RequestOutput], step_s: float) -> None:
        now = time.monotonic()
        items, num_finished = [], 0
        with self.metrics.lock:
            for o in outs:
                entry = self._open.get(o.request_id)
                if entry is None:  # ended by a stop string in an earlier step, or aborted
                    continue
                stream, text = entry
                if text is not None and apply_text(o, text):
                    self._command("finish", None, o.request_id)
                self.metrics.generation_tokens += len(o.new_token_ids)
                if stream.last_token_at is None:
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last_token_at)
                stream.last_token_at = now
                if o.finished:
                    del self._open[o.request_id]
                    num_finished += 1
                    self.metrics.requests[o.finish_reason] = self.metrics.requests.get(o.finish_reason, 0) + 1
                    self.metrics.e2e.observe(now - stream.arrival)
                items.append((stream, o))
        self.finish_rate.record(step_s, num_finished)
        self._deliver(items)

    def _deliver(self, items: list[tuple[Stream, object]]) -> None:
        """One ``call_soon_threadsafe`` per event loop for all of ``items`` (normally: one loop, one call)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))

        def put(batch):
            for stream, item in batch:
                if isinstance(item, BaseException) or item.finished:
                    self._release(stream)
                stream.queue.put_nowait(item)

        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(put, batch)
            except RuntimeError:  # the loop is closed (server shutting down)
                pass
