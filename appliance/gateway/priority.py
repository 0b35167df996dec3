"""A service class's priority in the request the gateway forwards (issue 24). Pure.

With the engine launched with SGLang's priority scheduling (`appliance.engine.priority`), each
forwarded request carries its key's class priority in the field SGLang 0.5.23 reads: a
top-level integer `priority` on `/v1/chat/completions` and `/v1/completions`
(entrypoints/openai/protocol.py: `ChatCompletionRequest.priority`, `CompletionRequest.priority`)
and on `/generate` (managers/io_struct.py: `GenerateReqInput.priority`). A larger value is
scheduled first (schedule_policy.py sorts by `priority * -1`, then arrival), which is the
classes' convention too (`ServiceClass.priority`, larger first).

Other paths get the body unchanged: SGLang's Anthropic `/v1/messages` model has no priority
field, so such a request runs at the engine's `--default-priority-value` (the interactive
class's priority).

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
FIELD = b'"priority"'


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
