"""A service class's priority in the request the gateway forwards (issue 24). Pure.

With the engine launched with SGLang's priority scheduling (`appliance.engine.priority`), each
forwarded request carries its key's class priority in the field SGLang 0.5.23 reads: a
top-level integer `priority` on `/v1/chat/completions` and `/v1/completions`
(entrypoints/openai/protocol.py: `ChatCompletionRequest.priority`, `CompletionRequest.priority`)
and on `/generate` (managers/io_struct.py: `GenerateReqInput.priority`). A larger value is
scheduled first (schedule_policy.py sorts by `priority * -1`, then arrival), which is the
classes' convention too (`ServiceClass.priority`, larger first).

The Anthropic `/v1/messages` body cannot carry it: SGLang 0.5.23's `AnthropicMessagesRequest`
(entrypoints/anthropic/protocol.py) has no `priority` and ignores unknown fields, and
`AnthropicServing._convert_to_chat_completion_request` (serving.py) builds the internal
`ChatCompletionRequest` from the fields it knows, so a `priority` in the body is dropped. The
one way in is a header: `OpenAIServingChat._convert_to_internal_request`, which the Anthropic
path calls with the raw request, applies `apply_header_overrides`
(entrypoints/request_headers.py) when the engine runs with
`SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1` (srt/environ.py, off by default), and
`x-override-priority: N` then sets `GenerateReqInput.priority` (a value that is no integer is
SGLang's 400). `priority_headers` gives that header and `engine_env` the variable; without
both, such a request runs at the engine's `--default-priority-value` (the interactive
class's priority). The variable also lets the engine's callers override `rid`, the PD
bootstrap fields, `conversation_id` and the DP ranks (`OVERRIDE_HEADERS`), so a client's
header of that name must never reach the engine: the gateway forwards only the headers it
names (`appliance.gateway.forward.FORWARDED_HEADERS`), none of them.

Invariants: the result is the same JSON object with exactly one `priority` key, the class's;
a client's own `priority` is replaced, never kept (a key must not lift itself above its
class). When the body has no `priority` yet, the rest of it is kept byte for byte (the field
is spliced in before the closing brace), so a large prompt is not decoded and encoded again.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from appliance.gateway.classes import ServiceClass, effective

PRIORITY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
HEADER_PATHS = frozenset({"/v1/messages"})  # no body field: the priority goes in a header
FIELD = b'"priority"'
PRIORITY_HEADER = "x-override-priority"
# The engine honours PRIORITY_HEADER only with this set (the launch spec's env, engine_env).
HEADER_OVERRIDES_ENV = "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES"
# Every header SGLang 0.5.23 reads as an override once HEADER_OVERRIDES_ENV is on
# (request_headers.py `_HEADER_OVERRIDES`): none may pass from a client to the engine.
OVERRIDE_HEADERS = frozenset({
    "x-override-rid", "x-override-bootstrap-host", "x-override-bootstrap-port",
    "x-override-bootstrap-room", "x-override-conversation-id", "x-override-routed-dp-rank",
    "x-override-disagg-prefill-dp-rank", PRIORITY_HEADER})


def priority_on(configured: Mapping[str, ServiceClass]) -> bool:
    """Whether the engine runs with priority scheduling (`appliance.engine.priority`) and so
    the gateway adds priorities: classes configured (`config.gateway.classes` not empty) and
    more than one distinct priority among the classes in force."""
    if not configured:
        return False
    return len({c.priority for c in effective(configured).values()}) > 1


def request_priority(configured: Mapping[str, ServiceClass], cls: ServiceClass) -> int | None:
    """The `priority` a request of `cls` carries to the engine; None when priority
    scheduling is off (the request is forwarded as it came)."""
    return cls.priority if priority_on(configured) else None


def with_priority(body: bytes, path: str, priority: int | None) -> bytes:
    """`body` (a JSON object, as the gateway's validation left it) for `path`, carrying
    `priority`; unchanged when `priority` is None (priority scheduling is off) or the path
    has no such field."""
    if priority is None or path not in PRIORITY_PATHS:
        return body
    if FIELD in body:  # perhaps the client's own key (or only text in a prompt): decode
        data = msgspec.json.decode(body)
        if isinstance(data, dict):
            data["priority"] = priority
            return msgspec.json.encode(data)
    end = body.rstrip()
    start = body.lstrip()
    if not (start.startswith(b"{") and end.endswith(b"}")):
        raise ValueError("a request body must be a JSON object to carry a priority")
    inner = end[body.index(b"{") + 1:-1]
    comma = b"," if inner.strip() else b""
    return end[:-1] + comma + b'"priority":' + str(int(priority)).encode() + b"}"


def priority_headers(path: str, priority: int | None) -> dict[str, str]:
    """The headers that carry `priority` to the engine on `path` when its body has no field
    for it (`HEADER_PATHS`: SGLang's Anthropic endpoint); empty when `priority` is None
    (priority scheduling off) or the body carries it (`with_priority`). The engine reads
    the header only when launched with `engine_env`'s variable."""
    if priority is None or path not in HEADER_PATHS:
        return {}
    return {PRIORITY_HEADER: str(int(priority))}


def engine_env(configured: Mapping[str, ServiceClass]) -> tuple[tuple[str, str], ...]:
    """The engine's environment for the classes' priorities to reach every path: SGLang's
    header overrides on (`HEADER_OVERRIDES_ENV`) exactly when the gateway adds priorities
    (`priority_on`), so a box without classes keeps its spec. The launch spec takes it
    (`appliance.engine.args.inputs_from_config`, after the cell role's variables, before the
    operator's `engine.extra_env`)."""
    return ((HEADER_OVERRIDES_ENV, "1"),) if priority_on(configured) else ()
