"""The gateway's refusals, in the shape each client family parses.

Every refusal is a `GatewayError`: an HTTP status, a machine-readable code, a message that
names the cause and the next step, and optionally the offending parameter and a Retry-After.
`openai_body` renders OpenAI's `{"error": {...}}`; `anthropic_body` renders Anthropic's
`{"type": "error", "error": {...}}` for the `/v1/messages` routes, so each SDK raises its own
typed exception instead of a parse error. Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# OpenAI's error `type` per status, as its API and SDK use them.
OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 502: "server_error", 503: "server_error", 504: "timeout_error",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
    502: "api_error", 503: "overloaded_error", 504: "api_error",
}


@dataclass(frozen=True)
class GatewayError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None
    retry_after: int | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def openai_body(self) -> bytes:
        return json.dumps({"error": {
            "message": self.message, "type": OPENAI_TYPES.get(self.status, "invalid_request_error"),
            "param": self.param, "code": self.code}}).encode()

    def anthropic_body(self) -> bytes:
        return json.dumps({"type": "error", "error": {
            "type": ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
            "message": self.message}}).encode()

    def body(self, anthropic: bool) -> bytes:
        return self.anthropic_body() if anthropic else self.openai_body()

    def sse_event(self, anthropic: bool) -> bytes:
        """The error as the last event of a stream already under way (its 200 is sent): the
        OpenAI SDK raises APIError on a `data:` event holding `error`, Anthropic's on
        `event: error`."""
        if anthropic:
            return b"event: error\ndata: " + self.anthropic_body() + b"\n\n"
        return b"data: " + self.openai_body() + b"\n\n"

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(max(1, self.retry_after)).encode()))
        if self.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="appliance-gateway"'))
        return headers


def stream_cut(upstream: str, chunks: int) -> GatewayError:
    """What a stream cut short by its upstream ends with: how far it got, and what to do."""
    return GatewayError(502, "stream_interrupted",
                        f"{upstream} stopped this stream after {chunks} chunks, before its "
                        "end (an engine serving it stopped); the answer is incomplete: send "
                        "the request again", retry_after=5)


def rewrap_engine_error(status: int, body: bytes, anthropic: bool) -> GatewayError:
    """The engine's own error (SGLang answers OpenAI routes with a flat `{"object": "error",
    "message", "type", "param", "code"}`) as a GatewayError in the client's shape."""
    message, code = "", f"engine_{status}"
    param: str | None = None
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        inner: dict[str, object] = error if isinstance(error, dict) else data
        message = str(inner.get("message") or inner.get("detail") or "")
        found = inner.get("param")
        param = found if isinstance(found, str) else None
    if not message:
        message = body[:500].decode("utf-8", "replace") or f"the engine answered {status}"
    if status >= 500:
        code = "engine_error"
    elif "context length" in message or "longer than the model" in message:
        code = "context_length_exceeded"
    return GatewayError(status, code, message, param)
