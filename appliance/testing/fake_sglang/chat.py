"""Chat completions in the engine emulator: planning a request (prompt, reasoning, tool call,
length) and SGLang 0.5.23's chat response and stream-chunk shapes. A test and demo instrument
(`appliance.testing.fake_sglang`). Pure but for the request id.

Shapes, from `serving_chat.py`, `sse_utils.py` and `protocol.py`:

- non-stream `choices[0].message`: `{"role": "assistant", "content": str,
  "reasoning_content": str|null}` plus `"tool_calls": [{"id", "index": 0, "type": "function",
  "function": {"name", "arguments": "<JSON text>"}}]` when a call was made (its `content` is
  then "", as SGLang writes it), `finish_reason` "stop" | "length" | "tool_calls";
- stream (`build_sse_content`, msgspec, null fields left out of `delta`): the role chunk
  `delta {"reasoning_content": null, "role": "assistant", "content": ""}` with the first
  token, then `delta {"reasoning_content": "..."}` or `delta {"reasoning_content": null,
  "content": "..."}` per token, tool-call chunks (pydantic: every delta field present) with
  `delta.tool_calls[0] = {"id", "index": 0, "type": "function", "function": {"name",
  "arguments": ""}}` first and then `{"id": null, ..., "function": {"name": null,
  "arguments": "<fragment>"}}`, a separate finish chunk `delta {"reasoning_content": null}`
  with `finish_reason`, then (include_usage) `{"choices": [], "usage": {...}}` and
  `data: [DONE]`. With `continuous_usage_stats` every reasoning, content and tool-call chunk
  carries the usage so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from appliance.testing.fake_sglang import protocol as oai
from appliance.testing.fake_sglang.answer import Piece, Script, reasoning_tokens
from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.core import Core, Prompt, Request, seed_of
from appliance.testing.fake_sglang.tools import Call, plan_call


@dataclass(frozen=True)
class ChatPlan:
    prompt: Prompt
    params: oai.Sampling
    script: Script
    req: Request
    model: str


def plan_chat(body: dict[str, Any], args: ServeArgs, context_len: int, core: Core) -> ChatPlan:
    """Parse and plan one chat request; `oai.BadRequest` for what SGLang refuses."""
    prompt = oai.chat_prompt(body)
    params = oai.sampling(body)
    too_long = oai.context_error(prompt, context_len)
    if too_long:
        raise oai.BadRequest(too_long)
    seed = seed_of(prompt.text)
    script = Script(reasoning=reasoning_tokens(body, args.reasoning_parser, seed),
                    call=plan_call(body, args.tool_call_parser, seed))

    def plan(script: Script) -> Request:
        return core.plan(prompt, params.max_tokens, params.min_tokens, params.ignore_eos,
                         natural=script.natural(seed), reasoning=script.reasoning)

    req = plan(script)
    if script.call is not None and req.completion_tokens < script.call_end:
        script = replace(script, call=None)  # a call that does not fit is not made
        req = plan(script)
    model = str(body.get("model") or args.served_model_name)
    return ChatPlan(prompt, params, script, req, model)


def tool_call(call: Call, arguments: str | None = None, *, head: bool = True) -> dict[str, Any]:
    """SGLang's ToolCall: whole (non-stream), or a stream delta (`head`: id and name, else
    nulls; `arguments`: this delta's fragment)."""
    return {"id": call.id if head else None, "index": 0, "type": "function",
            "function": {"name": call.name if head else None,
                         "arguments": call.arguments if arguments is None else arguments}}


def chat_response(plan: ChatPlan, cache_report: bool) -> dict[str, Any]:
    req, script = plan.req, plan.script
    call = script.made_call(req)
    message: dict[str, Any] = {"role": "assistant", "content": script.content_text(req),
                               "reasoning_content": script.reasoning_text(req) or None}
    if call is not None:
        message["tool_calls"] = [tool_call(call)]
    finish = script.finish_reason(req)
    return {
        "id": req.rid, "object": "chat.completion", "created": int(time.time()),
        "model": plan.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                     "matched_stop": oai.matched_stop(req) if finish == "stop" else None}],
        "usage": oai.usage(req, cache_report=cache_report),
        "metadata": oai.weight_metadata(req),
    }


class ChatChunks:
    """The SSE frames of one streamed chat answer."""

    def __init__(self, plan: ChatPlan, cache_report: bool) -> None:
        self.plan, self.cache_report = plan, cache_report
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None, *, pydantic: bool = False) -> str:
        chunk: dict[str, Any] = {"id": self.plan.req.rid,
                                 "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.plan.model, "choices": choices}
        if usage is not None or pydantic:
            chunk["usage"] = usage
        return oai.sse(chunk)

    @staticmethod
    def _choice(delta: dict[str, Any], finish: str | None = None,
                matched: int | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                "matched_stop": matched}

    def _usage_now(self) -> dict[str, Any] | None:
        if not self.plan.params.continuous_usage:
            return None
        return oai.usage(self.plan.req, cache_report=self.cache_report)

    def role(self) -> str:
        return self._chunk([self._choice(
            {"reasoning_content": None, "role": "assistant", "content": ""})])

    def piece(self, piece: Piece) -> str | None:
        """The frame for one generated token, or None for a token that shows nothing."""
        call = self.plan.script.call
        if piece.kind == "reasoning":
            return self._chunk([self._choice({"reasoning_content": piece.text})],
                               self._usage_now())
        if piece.kind == "content":
            return self._chunk([self._choice({"reasoning_content": None,
                                              "content": piece.text})], self._usage_now())
        if call is None or piece.kind == "none":
            return None
        delta = {"role": None, "content": None, "reasoning_content": None,
                 "tool_calls": [tool_call(call, piece.text, head=piece.kind == "call")]}
        return self._chunk([self._choice(delta)], self._usage_now(), pydantic=True)

    def finish(self) -> str:
        req = self.plan.req
        return self._chunk([self._choice({"reasoning_content": None},
                                         self.plan.script.finish_reason(req),
                                         oai.matched_stop(req))])

    def usage(self) -> str:
        return self._chunk([], oai.usage(self.plan.req, cache_report=self.cache_report),
                           pydantic=True)
