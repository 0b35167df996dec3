"""Request parsing, usage and the completion and native response shapes for the engine
emulator. A test and demo instrument (`appliance.testing.fake_sglang`). Pure. (Chat shapes:
`chat.py`; Anthropic's: `anthropic.py`.)

Shapes follow SGLang 0.5.23's `srt/entrypoints/openai/protocol.py` (CompletionResponse,
UsageInfo, ErrorResponse, ModelCard) and `usage_processor.py`, so a client cannot tell them
apart from the real engine's, except by the `x-emulator` header.

Prompt tokens: a completion prompt is its words (or its token ids); a chat prompt is each
message's words plus 4 template tokens (`<|im_{role}|>`, `<|im_middle|>`, `<|im_content|>`
before, `<|im_end|>` after), an assistant message's tool calls as words, the request's
`tools` (as JSON words, in one leading system block), and a 2-token generation prompt. The
prefix cache (`prefixcache.py`) compares exactly these tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from appliance.testing.fake_sglang.asgi import validation_message
from appliance.testing.fake_sglang.core import Prompt, Request

GENERATION_PROMPT = ("<|im_assistant|>", "<|im_middle|>")
EOS_TOKEN_ID = 163586


# The `type` of a request FastAPI refused before SGLang's handler ran (bad JSON, a missing
# field, the wrong content type); a handler's own refusal says "BadRequestError".
VALIDATION = "Bad Request"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.kind = kind


def missing(field: str) -> BadRequest:
    """A required field absent: pydantic's refusal, before SGLang's handler (no `param`)."""
    return BadRequest(validation_message({"type": "missing", "loc": ("body", field),
                                          "msg": "Field required"}), None, VALIDATION)


def error_body(message: str, code: int = 400, kind: str = "BadRequestError",
               param: str | None = None) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": param, "code": code}


def sse(payload: dict[str, Any]) -> str:
    """One `data:` frame, compact JSON as pydantic and msgspec write it."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False


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
    options = options if isinstance(options, dict) else {}
    return Sampling(max_tokens=max_tokens, min_tokens=min_tokens,
                    ignore_eos=params.get("ignore_eos") is True,
                    stream=body.get("stream") is True,
                    include_usage=options.get("include_usage") is True,
                    continuous_usage=options.get("continuous_usage_stats") is True)


def text_of(content: Any, sep: str = " ") -> str:
    """The text of a message's content: a string, or its text parts joined by `sep`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return sep.join(str(part.get("text", "")) for part in content
                        if isinstance(part, dict) and part.get("type") == "text")
    return ""


def _calls_text(message: dict[str, Any]) -> str:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    words = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            words.append(f"{function.get('name', '')} {function.get('arguments', '')}")
    return " ".join(words)


def block(role: str, text: str) -> list[str]:
    """One message's tokens as the emulated chat template lays them out."""
    return [f"<|im_{role}|>", "<|im_middle|>", "<|im_content|>", *text.split(), "<|im_end|>"]


def chat_prompt(body: dict[str, Any]) -> Prompt:
    """The prompt text (what the answer is derived from) and its tokens."""
    messages = body.get("messages")
    if messages is None:
        raise missing("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("Messages cannot be empty.")  # serving_chat.py _validate_request
    parts: list[str] = []
    ids: list[str] = []
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        ids += block("system", json.dumps(tools, ensure_ascii=False))
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message needs a role", "messages")
        text = " ".join(t for t in (text_of(message.get("content")), _calls_text(message)) if t)
        parts.append(f"{message['role']}: {text}")
        ids += block(message["role"], text)
    return Prompt("\n".join(parts), (*ids, *GENERATION_PROMPT))


def completion_prompt(body: dict[str, Any], key: str = "prompt") -> Prompt:
    prompt = body.get(key)
    if prompt is None and key == "prompt":
        raise missing("prompt")
    if prompt == "" or prompt == []:
        raise BadRequest("Prompt cannot be empty")  # serving_completions.py _validate_request
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Prompt(prompt, tuple(prompt.split()) or ("",))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return Prompt(json.dumps(prompt), tuple(str(t) for t in prompt))
    raise BadRequest(f"{key} must be a string or a list of token ids", key)


def context_error(prompt: Prompt, context_len: int) -> str | None:
    if prompt.tokens < context_len:
        return None
    return (f"The input ({prompt.tokens} tokens) is longer than the model's context length "
            f"({context_len} tokens).")


def usage(req: Request, *, cache_report: bool = False) -> dict[str, Any]:
    """SGLang's UsageInfo: cached tokens only with --enable-cache-report, reasoning tokens
    also under `completion_tokens_details` when there are some."""
    reasoning = min(req.generated, req.reasoning)
    return {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + req.generated,
            "completion_tokens": req.generated,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens} if cache_report
            else None,
            "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None}


def weight_metadata(req: Request) -> dict[str, Any]:
    """A whole response's `metadata` (utils/weight_versions.py): the weights' version, and
    which output tokens it produced (here all of them: the emulator never swaps weights)."""
    return {"weight_version": "default",
            "weight_versions": [{"version": "default", "start": 0, "end": req.generated}]}


def matched_stop(req: Request) -> int | None:
    return EOS_TOKEN_ID if req.finish_reason == "stop" else None


def completion_response(req: Request, model: str, cache_report: bool) -> dict[str, Any]:
    return {
        "id": req.rid, "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": req.text, "logprobs": None,
                     "finish_reason": req.finish_reason, "matched_stop": matched_stop(req)}],
        "usage": usage(req, cache_report=cache_report), "metadata": weight_metadata(req),
    }


def completion_chunk(req: Request, model: str, created: int, *, text: str = "",
                     finish: bool = False, continuous_usage: bool = False) -> str:
    """A text chunk (serving_completions: the finish reason rides on the last one; continuous
    usage stats carry no cached-token details there)."""
    choice = {"index": 0, "text": text, "logprobs": None,
              "finish_reason": req.finish_reason if finish else None,
              "matched_stop": matched_stop(req) if finish else None}
    return sse({"id": req.rid, "object": "text_completion", "created": created,
                "model": model, "choices": [choice],
                "usage": usage(req) if continuous_usage else None})


def completion_usage_chunk(req: Request, model: str, created: int, cache_report: bool) -> str:
    """The final usage chunk, dumped with exclude_none as SGLang does."""
    body = {key: value for key, value in usage(req, cache_report=cache_report).items()
            if value is not None}
    return sse({"id": req.rid, "object": "text_completion", "created": created,
                "model": model, "choices": [], "usage": body})


def generate_response(req: Request, started: float) -> dict[str, Any]:
    """The native `/generate` answer (text, output ids, meta_info). `cached_tokens` is the
    prefix cache's figure whatever --enable-cache-report says, as in SGLang."""
    return {
        "text": req.text,
        "output_ids": [(req.seed + i * 7) % 163840 for i in range(req.generated)],
        "meta_info": {
            "id": req.rid,
            "finish_reason": {"type": req.finish_reason, "length": req.generated}
            if req.finish_reason == "length" else {"type": "stop", "matched": EOS_TOKEN_ID},
            "prompt_tokens": req.prompt_tokens, "completion_tokens": req.generated,
            "cached_tokens": req.cached_tokens,
            "e2e_latency": round(time.monotonic() - started, 4),
        },
    }


def model_card(name: str, context_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": context_len}
