"""Request parsing and response shapes for the engine emulator's OpenAI and native endpoints.
A test and demo instrument (`appliance.testing.fake_sglang`). Pure.

Shapes follow SGLang 0.5.23's `srt/entrypoints/openai/protocol.py` (ChatCompletionResponse,
ChatCompletionStreamResponse, CompletionResponse, UsageInfo, ErrorResponse, ModelCard) so a
client cannot tell them apart from the real engine's, except by the `x-emulator` header.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from appliance.testing.fake_sglang.core import Request


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def error_body(message: str, code: int = 400, kind: str = "BadRequestError",
               param: str | None = None) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _optional_int(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"{name} must be a non-negative integer", name)
        return value
    return None


def sampling(body: dict[str, Any], *, native: bool = False) -> Sampling:
    params = body.get("sampling_params") if native else body
    if not isinstance(params, dict):
        params = {}
    names = ("max_new_tokens",) if native else ("max_completion_tokens", "max_tokens")
    max_tokens = _optional_int(params, *names)
    min_tokens = _optional_int(params, "min_new_tokens" if native else "min_tokens") or 0
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return Sampling(max_tokens=max_tokens, min_tokens=min_tokens,
                    ignore_eos=params.get("ignore_eos") is True,
                    stream=body.get("stream") is True, include_usage=include_usage)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content
                        if isinstance(part, dict) and part.get("type") == "text")
    return ""


def chat_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """The prompt text (what the answer is derived from) and its token count."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    parts, tokens = [], 2
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message needs a role", "messages")
        text = _text_of(message.get("content"))
        parts.append(f"{message['role']}: {text}")
        tokens += 4 + len(text.split())
    return "\n".join(parts), tokens


def completion_prompt(body: dict[str, Any], key: str = "prompt") -> tuple[str, int]:
    prompt = body.get(key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, max(1, len(prompt.split()))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return json.dumps(prompt), len(prompt)
    raise BadRequest(f"{key} must be a string or a list of token ids", key)


def usage(req: Request) -> dict[str, Any]:
    return {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + req.generated,
            "completion_tokens": req.generated, "prompt_tokens_details": None,
            "reasoning_tokens": 0}


def chat_response(req: Request, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": req.text,
                                 "reasoning_content": None},
                     "logprobs": None, "finish_reason": req.finish_reason,
                     "matched_stop": None}],
        "usage": usage(req), "metadata": None,
    }


def chat_chunk(req: Request, model: str, created: int, *, role: str | None = None,
               content: str | None = None, finish: bool = False,
               with_usage: bool = False) -> str:
    choices: list[dict[str, Any]] = []
    if not with_usage:
        choices = [{"index": 0,
                    "delta": {"role": role, "content": content, "reasoning_content": None},
                    "logprobs": None, "finish_reason": req.finish_reason if finish else None,
                    "matched_stop": None}]
    chunk = {"id": f"chatcmpl-{req.rid}", "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": choices, "usage": usage(req) if with_usage else None}
    return f"data: {json.dumps(chunk)}\n\n"


def completion_response(req: Request, model: str) -> dict[str, Any]:
    return {
        "id": f"cmpl-{req.rid}", "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": req.text, "logprobs": None,
                     "finish_reason": req.finish_reason, "matched_stop": None}],
        "usage": usage(req), "metadata": None,
    }


def completion_chunk(req: Request, model: str, created: int, *, text: str = "",
                     finish: bool = False, with_usage: bool = False) -> str:
    choices: list[dict[str, Any]] = []
    if not with_usage:
        choices = [{"index": 0, "text": text, "logprobs": None,
                    "finish_reason": req.finish_reason if finish else None,
                    "matched_stop": None}]
    chunk = {"id": f"cmpl-{req.rid}", "object": "text_completion", "created": created,
             "model": model, "choices": choices, "usage": usage(req) if with_usage else None}
    return f"data: {json.dumps(chunk)}\n\n"


def generate_response(req: Request, started: float) -> dict[str, Any]:
    """The native `/generate` answer (text, output ids, meta_info)."""
    return {
        "text": req.text,
        "output_ids": [(req.seed + i * 7) % 163840 for i in range(req.generated)],
        "meta_info": {
            "id": req.rid,
            "finish_reason": {"type": req.finish_reason, "length": req.generated}
            if req.finish_reason == "length" else {"type": "stop", "matched": 163586},
            "prompt_tokens": req.prompt_tokens, "completion_tokens": req.generated,
            "cached_tokens": 0, "e2e_latency": round(time.monotonic() - started, 4),
        },
    }


def model_card(name: str, context_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": context_len}
