"""An ASGI middleware that refuses request bodies larger than a limit (`--max-request-bytes`) with 413.

A declared Content-Length over the limit is refused before a byte of the body is read; a body without one
(chunked) is read up to the limit and refused as soon as it passes it, so the server never buffers more than
`max_bytes` of one request. An admitted body is handed to the app in one piece, then `receive` goes back to the
server's own (the app still sees the client's disconnect). The limit applies to every path and before
authentication: an unauthenticated client cannot make the server buffer more than the limit either.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Reject = Callable[[int, str], Response]  # (status, message) -> the error response


class BodySizeLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, reject: Reject):
        self.app, self.max_bytes, self.reject = app, max_bytes, reject

    def _too_large(self, size: str) -> Response:
        return self.reject(413, f"the request body is {size} bytes, more than this server's limit of "
                                f"{self.max_bytes} bytes (--max-request-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                return await self.reject(400, "the Content-Length header is not a number")(scope, receive, send)
            if length > self.max_bytes:
                return await self._too_large(str(length))(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(f"over {self.max_bytes}")(scope, receive, send)
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


__all__ = ["BodySizeLimit"]
