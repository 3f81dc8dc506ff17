"""EventStream (the server's SSE response): its chunks in order under text/event-stream, and a client disconnect
ends it quietly, cancelling the body where it waits (whose finally then aborts the engine requests)."""
import asyncio

from surojax.serve.event_stream import EventStream


def _serve(body, client_leaves_after: int | None = None):
    """Run EventStream(body) on a fake ASGI connection -> (messages sent, whether the response task was cancelled
    from outside). The client disconnects once it has `client_leaves_after` body messages (None: never)."""
    sent, left = [], asyncio.Event()

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        bodies = sum(m["type"] == "http.response.body" for m in sent)
        if client_leaves_after is not None and bodies >= client_leaves_after:
            left.set()

    async def main():
        task = asyncio.ensure_future(EventStream(body)({"type": "http"}, receive, send))
        await asyncio.wait_for(task, 5)
        return task.cancelling()

    return sent, asyncio.run(main())


def test_chunks_in_order_as_text_event_stream():
    async def body():
        yield "data: 1\n\n"
        yield "data: é\n\n"

    sent, cancelling = _serve(body())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", "data: é\n\n".encode(), b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False] and cancelling == 0


def test_disconnect_cancels_the_body_where_it_waits():
    ended = []

    async def body():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(30)  # an engine step that the client does not wait for
            yield "data: 2\n\n"
        finally:
            ended.append("finally")  # the server's streams abort their engine requests here

    sent, cancelling = _serve(body(), client_leaves_after=1)
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]  # nothing after the disconnect, no error
    assert ended == ["finally"] and cancelling == 0  # ended quietly: the cancellation was the response's own
