"""What a chat answer is made of, token by token: the engine emulator's stand-in for a model's
output after SGLang's reasoning and tool-call parsers have split it. A test and demo instrument
(`appliance.testing.fake_sglang`). Pure.

An answer is a `Script`: first `reasoning` tokens of reasoning, then (when `tools.plan_call`
gives one) a tool call of `call.tokens` tokens, then text words (`core.word`) for as long as
the request runs. Each generated token is one `Piece`; the OpenAI and Anthropic renderers
turn pieces into their wire shapes, so a stream and a non-stream answer always agree.

Reasoning rule (K3's switch is `chat_template_kwargs.thinking`): a request reasons when the
server runs a `--reasoning-parser` (the appliance passes `kimi_k3`), its `separate_reasoning`
is not false, and either `chat_template_kwargs.thinking` is true, or `reasoning_effort` is set
(not "none") and `thinking` is not false. It then reasons for 4-8 tokens (a hash of the
prompt picks how many) before answering; they appear as `reasoning_content` and count in
`completion_tokens` and in usage `reasoning_tokens`. With `separate_reasoning: false` the
emulator simply does not reason (real SGLang would leave the thinking inside `content`).

A call that does not fit in `max_tokens` is not made: the answer is then text, cut at
`max_tokens` ("length"), so no stream ever carries half a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from appliance.testing.fake_sglang.core import Request, natural_length, word
from appliance.testing.fake_sglang.tools import Call

REASONING_WORDS = (
    "emulated", "reasoning", "from", "fake_sglang", "no", "model", "is", "thinking", "here",
    "the", "answer", "follows", "a", "fixed", "rule",
)
Kind = Literal["reasoning", "call", "arguments", "content", "none"]


def reasoning_word(seed: int, index: int) -> str:
    text = REASONING_WORDS[(seed + index * 4) % len(REASONING_WORDS)]
    return text if index == 0 else " " + text


def reasoning_tokens(body: dict[str, Any], parser: str | None, seed: int) -> int:
    """How many reasoning tokens this request gets under the rule above."""
    if not parser or body.get("separate_reasoning") is False:
        return 0
    kwargs = body.get("chat_template_kwargs")
    thinking = kwargs.get("thinking") if isinstance(kwargs, dict) else None
    effort = body.get("reasoning_effort")
    if thinking is True or (thinking is None and effort not in (None, "none")):
        return 4 + seed % 5
    return 0


@dataclass(frozen=True)
class Piece:
    """One generated token's share of the answer. `call` is the token that completes the
    function name (the call's first delta); `none` is a marker token that shows nothing."""

    kind: Kind
    text: str = ""


@dataclass(frozen=True)
class Script:
    reasoning: int = 0
    call: Call | None = None

    @property
    def call_end(self) -> int:
        """The index of the first token after the reasoning and the call."""
        return self.reasoning + (self.call.tokens if self.call else 0)

    def natural(self, seed: int) -> int:
        """The answer's length when nothing cuts it: a call ends the turn."""
        return self.call_end if self.call else self.reasoning + natural_length(seed)

    def piece(self, seed: int, index: int) -> Piece:
        if index < self.reasoning:
            return Piece("reasoning", reasoning_word(seed, index))
        if self.call is not None and index < self.call_end:
            at = index - self.reasoning
            if at == 1:
                return Piece("call")
            fragments = self.call.fragments
            if 2 <= at < 2 + len(fragments):
                return Piece("arguments", fragments[at - 2])
            return Piece("none")
        return Piece("content", word(seed, index - self.call_end))

    # -- a finished (or cut) answer, for the non-stream shapes --------------------------
    def reasoning_text(self, req: Request) -> str:
        return "".join(reasoning_word(req.seed, i) for i in range(min(req.generated,
                                                                       self.reasoning)))

    def content_text(self, req: Request) -> str:
        return "".join(word(req.seed, i) for i in range(max(0, req.generated - self.call_end)))

    def made_call(self, req: Request) -> Call | None:
        return self.call if self.call is not None and req.generated >= self.call_end else None

    def finish_reason(self, req: Request) -> str:
        """SGLang's: "tool_calls" when a call was made and the model stopped by itself."""
        if req.finish_reason == "stop" and self.made_call(req) is not None:
            return "tool_calls"
        return req.finish_reason
