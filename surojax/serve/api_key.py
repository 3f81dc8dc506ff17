"""An ASGI middleware that refuses requests without the server's key (``--api-key``) with 401.

The key comes as OpenAI's ``Authorization: Bearer KEY`` or as Anthropic's ``x-api-key: KEY`` header (either one
on any path). ``reject(path)`` writes the 401 in the shape of the API the path belongs to.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``, which pipes every response body through an in-memory
stream and two tasks: per SSE chunk, that cost as much as sending it). Paths in ``open_paths`` (health,
metrics) and servers without a key let everything through. The token is compared in constant time.
"""
from __future__ import annotations

import hmac
from typing import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, *, api_key: Callable[[], str | None], open_paths: tuple[str, ...],
                 reject: Callable[[str], Response]):
        """api_key: the current key (None: no authentication); reject: request path -> the 401 response."""
        self.app, self.api_key, self.open_paths, self.reject = app, api_key, open_paths, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.api_key() if scope["type"] == "http" else None
        if key and scope["path"] not in self.open_paths:
            bearer = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            x_api_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
            # both compared, always: the time taken does not say which header came close
            ok = hmac.compare_digest(bearer, f"Bearer {key}".encode()) | hmac.compare_digest(x_api_key, key.encode())
            if not ok:
                return await self.reject(scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)
