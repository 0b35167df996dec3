"""Anthropic Messages requests in the engine emulator: validation and translation to a chat
completions request, as SGLang 0.5.23's `srt/entrypoints/anthropic/serving.py` does before it
hands the request to its OpenAI chat path. A test and demo instrument
(`appliance.testing.fake_sglang`). Pure. (Responses and streams: `anthropic_serving.py`.)

What SGLang's pydantic models refuse is refused here with the same 400 and a `loc: msg`
digest (`max_tokens: Field required`); errors use Anthropic's envelope
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
Translation: `system` becomes a system message; text blocks become content; `tool_use`
blocks become the assistant's `tool_calls`; a user's `tool_result` blocks become `tool`
messages; custom tools become function tools (server tools such as `web_search_*` are
dropped); `tool_choice` auto/any/tool/none becomes auto/required/named/none; `thinking`
enabled or adaptive sets `chat_template_kwargs.thinking` (refused without a
`--reasoning-parser`, as SGLang does); `output_config.effort` becomes `reasoning_effort`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from appliance.testing.fake_sglang import protocol as oai

SERVER_TOOL = re.compile(r"^(web_search|computer|bash|text_editor)_\d{8}$")
ROLES = ("user", "assistant", "system")


class AnthropicError(Exception):
    """A request refused with Anthropic's error envelope."""

    def __init__(self, message: str, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.kind, self.message)


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


# The `error.type` SGLang gives an upstream status (serving.py ERROR_TYPE_MAP).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "request_timeout_error",
               429: "rate_limit_error", 500: "api_error", 502: "api_error",
               503: "overloaded_error", 504: "api_error"}


def scrubbed(message: str, status: int) -> str:
    """SGLang's `_scrub_error_message`: a 5xx says only "Internal server error"; a 4xx keeps
    its words, less traceback lines, cut at 500 characters."""
    if status >= 500:
        return "Internal server error"
    kept = "\n".join(line for line in message.splitlines()
                     if not line.startswith("Traceback") and 'File "/' not in line).strip()
    if len(kept) > 500:
        kept = kept[:500] + "\u2026"
    return kept or "Request failed"


def validate(body: dict[str, Any], *, count_only: bool = False) -> None:
    """The fields AnthropicMessagesRequest (or the count_tokens request) requires."""
    problems = []
    if not isinstance(body.get("model"), str):
        problems.append("model: Field required" if "model" not in body
                        else "model: Input should be a valid string")
    messages = body.get("messages")
    if not isinstance(messages, list):
        problems.append("messages: Field required" if messages is None
                        else "messages: Input should be a valid list")
    else:
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                problems.append(f"messages.{i}.role: Input should be 'user', 'assistant' or "
                                f"'system'")
            elif not isinstance(message.get("content"), str | list):
                problems.append(f"messages.{i}.content: Field required")
    if not count_only:
        limit = body.get("max_tokens")
        if "max_tokens" not in body:
            problems.append("max_tokens: Field required")
        elif not isinstance(limit, int) or isinstance(limit, bool):
            problems.append("max_tokens: Input should be a valid integer")
        elif limit <= 0:
            problems.append("max_tokens: Value error, max_tokens must be positive")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in (
            "enabled", "disabled", "adaptive")):
        problems.append("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    elif isinstance(thinking, dict) and thinking["type"] == "enabled" and not isinstance(
            thinking.get("budget_tokens"), int):
        problems.append("thinking: Value error, thinking.budget_tokens is required when "
                        "thinking.type is 'enabled'")
    if problems:
        raise AnthropicError("; ".join(problems)[:500])


def text_of(content: Any) -> str:
    """Anthropic's text blocks, one per line."""
    return oai.text_of(content, "\n")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = text_of(body.get("system")).strip()
    if system:
        out.append({"role": "system", "content": system})
    for message in body["messages"]:
        role, content = message["role"], message["content"]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"),
                    "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if texts:  # text before the result stays before it
                    out.append({"role": "user", "content": " ".join(texts)})
                    texts = []
                out.append({"role": "tool", "content": text_of(block.get("content")),
                            "tool_call_id": block.get("tool_use_id") or block.get("id") or ""})
            elif kind == "tool_result":
                texts.append(f"Tool result: {text_of(block.get('content'))}")
        if texts or calls or role == "assistant":
            chat: dict[str, Any] = {"role": role, "content": " ".join(texts)}
            if calls:
                chat["tool_calls"] = calls
            out.append(chat)
    return out


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise AnthropicError("tools: Input should be a valid list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise AnthropicError(f"tools.{i}: Input should be a valid dictionary")
        if SERVER_TOOL.match(str(tool.get("type") or "")):
            continue  # Anthropic's own server tools: no schema to forward
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"),
                                                                     dict):
            raise AnthropicError(f"tools.{i}.custom.input_schema: Field required")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": {"type": "object", **tool["input_schema"]},
            "strict": tool.get("strict") is True}})
    return out


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise AnthropicError("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
    if kind == "none":
        return "none"
    if not tools:
        if kind in ("any", "tool"):
            raise AnthropicError(
                f"tool_choice={kind!r} requires at least one custom tool; all supplied tools "
                f"were server-side Anthropic built-ins which the OpenAI-compatible backend "
                f"cannot invoke")
        return None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    name = choice.get("name")
    if not any(t["function"]["name"] == name for t in tools):
        raise AnthropicError(f"tool_choice references tool {name!r} but it is not in the "
                             f"forwarded tools list (server-side Anthropic tools cannot be "
                             f"selected)")
    return {"type": "function", "function": {"name": name}}


def chat_body(body: dict[str, Any], reasoning_parser: str | None) -> dict[str, Any]:
    """The chat completions request SGLang builds from a (validated) Messages request."""
    chat: dict[str, Any] = {"model": body["model"], "messages": chat_messages(body),
                            "max_tokens": body.get("max_tokens", 1),
                            "stream": body.get("stream") is True}
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = "auto"
    if body.get("tool_choice") is not None:
        choice = chat_tool_choice(body["tool_choice"], tools)
        if choice is not None:
            chat["tool_choice"] = choice
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        enabled = thinking["type"] != "disabled"
        if not reasoning_parser and enabled:
            raise AnthropicError("Anthropic thinking is not supported for models without a "
                                 "reasoning parser")
        if reasoning_parser:
            chat["chat_template_kwargs"] = {"thinking": enabled}
    effort = body.get("output_config", {}).get("effort") if isinstance(
        body.get("output_config"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = "max" if effort == "xhigh" else effort
    return chat
