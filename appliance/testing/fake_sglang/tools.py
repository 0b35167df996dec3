"""Tool calls in the engine emulator: whether a chat request gets one, to which tool, with what
arguments and under which id. A test and demo instrument (`appliance.testing.fake_sglang`).
Pure, except the random id SGLang gives calls under parsers other than Kimi's.

The rule (deterministic, no model): a request gets exactly one call when the server runs a
`--tool-call-parser` (SGLang parses no calls without one; the appliance passes `kimi_k3`), the
request has `tools`, its `tool_choice` is not "none" (absent means "auto"), and its last
message is a `user` message. The tool is the one `tool_choice` names
(`{"type": "function", "function": {"name": ...}}`), else the first tool ("auto",
"required"). Its arguments hold the schema's `required` properties: a string gets a word (the
first `enum` value when there is one), a number or integer 1, a boolean true, anything else
null. When the last message is a `tool` result (or an assistant turn) the answer is text.

Validation follows SGLang's `OpenAIServingChat._validate_request` (same messages, 400).
Call ids follow `_process_tool_call_id`: `{name}:{n}` under `kimi_k3`,
`functions.{name}:{n}` under `kimi_k2` (n counts the calls already in the conversation),
`call_<24 hex>` otherwise.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from appliance.testing.fake_sglang.core import WORDS
from appliance.testing.fake_sglang.protocol import BadRequest

CALL_OVERHEAD = 3  # begin marker + function name, then the arguments, then the end marker


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as SGLang's parsers produce it

    @property
    def fragments(self) -> tuple[str, ...]:
        """The arguments as they stream: one fragment per token, joined they are exact."""
        return tuple(re.findall(r"\s*\S+", self.arguments)) or (self.arguments,)

    @property
    def tokens(self) -> int:
        return len(self.fragments) + CALL_OVERHEAD


def function_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `tools` as function specs (`{"name", "parameters", ...}`)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of function tools", "tools")
    specs = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest("each tool needs a function with a name", "tools")
        specs.append(function)
    return specs


def check_choice(body: dict[str, Any], specs: list[dict[str, Any]]) -> str | None:
    """The named tool of `tool_choice`, if any; refuses what SGLang refuses."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        if not specs:
            raise BadRequest("Tools cannot be empty if tool choice is set to required.",
                            "tool_choice")
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise BadRequest("tool_choice must be 'auto', 'required', 'none' or "
                        '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if not specs:
        raise BadRequest("Tools cannot be empty if tool choice is set to a specific tool.",
                        "tool_choice")
    if not any(spec["name"] == name for spec in specs):
        raise BadRequest(f"Tool '{name}' not found in tools list.", "tool_choice")
    return name


def argument_value(schema: Any, seed: int, index: int) -> Any:
    if not isinstance(schema, dict):
        return None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return WORDS[(seed + index * 5) % len(WORDS)]
    if kind in ("number", "integer"):
        return 1
    if kind == "boolean":
        return True
    return None


def arguments(parameters: Any, seed: int) -> str:
    """The arguments JSON for a tool's `parameters` schema: its required properties only."""
    if not isinstance(parameters, dict):
        return "{}"
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = parameters.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    values = {name: argument_value(properties.get(name), seed, i) for i, name in enumerate(names)}
    return json.dumps(values, ensure_ascii=False)


def history_calls(messages: list[Any]) -> int:
    """Calls already made in the conversation (Kimi's ids count on from them)."""
    return sum(len(m.get("tool_calls") or []) for m in messages
               if isinstance(m, dict) and m.get("role") == "assistant")


def call_id(parser: str, name: str, history: int) -> str:
    if parser == "kimi_k3":
        return f"{name}:{history}"
    if parser == "kimi_k2":
        return f"functions.{name}:{history}"
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_call(body: dict[str, Any], parser: str | None, seed: int) -> Call | None:
    """The call this request gets under the rule above, or None for a text answer. Validates
    `tools` and `tool_choice` whatever the parser (as SGLang does)."""
    specs = function_tools(body)
    named = check_choice(body, specs)
    messages = body.get("messages") or []
    if not parser or not specs or body.get("tool_choice") == "none":
        return None
    if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
        return None
    spec = next((s for s in specs if s["name"] == named), specs[0])
    return Call(id=call_id(parser, spec["name"], history_calls(messages)), name=spec["name"],
                arguments=arguments(spec.get("parameters"), seed))
