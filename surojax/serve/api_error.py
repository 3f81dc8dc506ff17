"""`ApiError`: a request the server refuses or cannot serve, as every HTTP API of `surojax serve` raises it.

It carries the HTTP status, the message, OpenAI's error ``type`` and ``param`` (the request field at fault), and
extra headers (Retry-After). Each API writes it in its own error shape: OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` (api_server, responses_api) or Anthropic's ``{"type": "error", "error": {"type", "message"}}``
(anthropic_api). `ClientGone`: the client left before its answer (nothing is sent).
"""
from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


class ClientGone(Exception):
    pass
