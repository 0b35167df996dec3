"""Request validation before anything reaches the engine. Pure.

`parse` takes the raw body of a generation request and either refuses it with a
`GatewayError` (a clear 4xx, in the client's error shape) or returns a `Parsed` request: what
admission and accounting need, and the bytes to forward. The body is forwarded untouched,
except that a streaming OpenAI request that did not ask for usage gets
`stream_options.include_usage` added, so the engine reports the tokens; the gateway strips
that extra chunk from the stream again (`appliance.gateway.sse`).

Types are checked as OpenAI checks them: a number sent as a string (`"max_tokens": "5"`,
`"temperature": "0.7"`) is a 400 `invalid_type` naming the field, never passed on for the
engine's lax parser to coerce. A key's `max_tokens` cap binds every request: one that asks
for more is refused, and one that asks for nothing (the field absent or null) gets the cap
written into the forwarded body, so an uncapped generation cannot slip past it.

There is no tokenizer in the gateway. A prompt is refused as too long only when its size
proves it: more than `MAX_CHARS_PER_TOKEN` characters per token would be needed for it to fit
the context. Anything closer is forwarded, and the engine's own 400 comes back in the same
shape and is counted as `context_length_exceeded`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from appliance.gateway.errors import GatewayError

MAX_CHARS_PER_TOKEN = 8  # no tokenizer merges more than this on real text
MAX_MESSAGES = 10_000
MAX_N = 8
_decoder = msgspec.json.Decoder()


@dataclass(frozen=True)
class Endpoint:
    name: str  # "chat", "completions", "messages", "count_tokens"
    path: str
    anthropic: bool
    generates: bool  # takes an admission slot and is metered


ENDPOINTS = {e.path: e for e in (
    Endpoint("chat", "/v1/chat/completions", False, True),
    Endpoint("completions", "/v1/completions", False, True),
    Endpoint("messages", "/v1/messages", True, True),
    Endpoint("count_tokens", "/v1/messages/count_tokens", True, False),
)}


@dataclass(frozen=True)
class Parsed:
    endpoint: Endpoint
    model: str
    stream: bool
    wants_usage: bool  # the client asked for the usage chunk itself
    max_tokens: int | None
    n: int
    messages: Sequence[Mapping[str, Any]] | None
    body: bytes  # what is forwarded


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, code, message, param)


def decode(body: bytes) -> dict[str, Any]:
    """The JSON object in `body`, or a 400 that says what is wrong with it."""
    try:
        data = _decoder.decode(body)
    except RecursionError:
        raise _bad("the JSON body is nested too deeply", code="invalid_json") from None
    except msgspec.DecodeError as exc:
        raise _bad(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise _bad("the body must be a JSON object", code="invalid_json")
    return data


# Sampling parameters whose JSON type is checked (null is allowed: it means "not set"). The
# token limits and `n` are checked by `_int` with their minimum. `logprobs` is a boolean on
# chat and an integer on completions, as in OpenAI's API.
NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_p")
INTEGERS = ("seed", "top_k", "top_logprobs", "best_of", "min_tokens")
BOOLEANS = ("echo", "ignore_eos", "parallel_tool_calls", "skip_special_tokens")
_JSON_TYPES = {str: "a string", bool: "a boolean", list: "an array", dict: "an object",
               float: "a number", int: "an integer"}


def _type_error(name: str, expected: str, value: Any) -> GatewayError:
    """OpenAI's own wording and code for a mistyped parameter."""
    got = _JSON_TYPES.get(type(value), "another type")
    return _bad(f"Invalid type for '{name}': expected {expected}, but got {got} instead.",
                name, "invalid_type")


def _check_types(endpoint: Endpoint, data: Mapping[str, Any]) -> None:
    logprobs_int = endpoint.name == "completions"
    for name in NUMBERS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or
                                  not isinstance(value, int | float)):
            raise _type_error(name, "a number", value)
    for name in (*INTEGERS, *(("logprobs",) if logprobs_int else ())):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _type_error(name, "an integer", value)
    for name in (*BOOLEANS, *(() if logprobs_int else ("logprobs",))):
        value = data.get(name)
        if value is not None and not isinstance(value, bool):
            raise _type_error(name, "a boolean", value)


def _int(data: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type_error(name, "an integer", value)
    if value < minimum:
        raise _bad(f"{name} must be an integer of at least {minimum}", name)
    return value


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def _messages(data: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], int]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"{len(messages)} messages is more than the {MAX_MESSAGES} this gateway "
                   "accepts in one request; trim the conversation", "messages")
    chars = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{index}] must be an object with a string role", "messages")
        chars += _text_chars(message.get("content"))
    system = data.get("system")  # Anthropic's top-level system prompt
    chars += _text_chars(system)
    return messages, chars


def _prompt(data: Mapping[str, Any]) -> tuple[int, int]:
    """(characters, exact token count or 0) of a completions prompt."""
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return 0, len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt), 0
    raise _bad("prompt must be a string, a list of strings or a list of token ids", "prompt")


def parse(endpoint: Endpoint, body: bytes, *, served: frozenset[str], context_len: int | None,
          key_max_tokens: int | None) -> Parsed:
    data = decode(body)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required (GET /v1/models lists it)", "model")
    if model not in served:
        raise GatewayError(404, "model_not_found",
                           f"the model {model!r} does not exist here; this box serves "
                           f"{', '.join(sorted(served))}", "model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    # SGLang takes `max_completion_tokens or max_tokens` on chat (serving_chat.py); both are
    # read, and each is held to the key's cap below.
    names = ("max_completion_tokens", "max_tokens") if endpoint.name == "chat" else \
        ("max_tokens",)
    asked = {name: _int(data, name, 1) for name in names}
    max_tokens = next((value for value in asked.values() if value is not None), None)
    if endpoint.name == "messages" and max_tokens is None:
        raise _bad("max_tokens is required", "max_tokens")
    _check_types(endpoint, data)
    n = _int(data, "n", 1) or 1
    if n > MAX_N:
        raise _bad(f"n is at most {MAX_N} here; send separate requests for more", "n")
    messages: list[Mapping[str, Any]] | None = None
    exact = 0
    if endpoint.name == "completions":
        chars, exact = _prompt(data)
    else:
        messages, chars = _messages(data)
    for name, value in asked.items():
        if key_max_tokens is not None and value is not None and value > key_max_tokens:
            raise _bad(f"{name} {value} is over this key's cap of {key_max_tokens}",
                       name, "max_tokens_over_key_cap")
    if context_len:
        if max_tokens is not None and max_tokens >= context_len:
            raise _bad(f"max_tokens {max_tokens} does not fit the model's context length of "
                       f"{context_len} tokens", "max_tokens", "context_length_exceeded")
        if exact >= context_len or chars > context_len * MAX_CHARS_PER_TOKEN:
            size = f"{exact} tokens" if exact else f"{chars} characters"
            raise _bad(f"the prompt ({size}) is longer than the model's context length of "
                       f"{context_len} tokens", "messages" if messages else "prompt",
                       "context_length_exceeded")
    options = data.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    changes: dict[str, Any] = {}
    if stream and not wants_usage and not endpoint.anthropic and endpoint.generates:
        extra = dict(options) if isinstance(options, dict) else {}
        extra["include_usage"] = True
        changes["stream_options"] = extra
    if key_max_tokens is not None and max_tokens is None and endpoint.generates and not (
            context_len and key_max_tokens >= context_len):
        # Nothing asked: the cap is the limit (a cap the context cannot reach binds anyway).
        max_tokens = changes[names[0]] = key_max_tokens
    forward = msgspec.json.encode({**data, **changes}) if changes else body
    return Parsed(endpoint, model, stream, wants_usage or endpoint.anthropic, max_tokens, n,
                  messages, forward)
