"""Reading just enough of a response for accounting, without touching what is forwarded.

`StreamMeter` follows a server-sent-event stream as it passes through: it frames events
(split on a blank line), counts the ones that carry generated output, and parses JSON only
for events that carry a `usage` object — one or two per stream. Bytes are forwarded as they
came, except when the gateway itself asked for usage (the client did not): then the usage
chunk (OpenAI's `"choices": []` chunk with a usage object) is cut out, and to do that cleanly
whole events are forwarded and an incomplete tail waits for the next read.

It also notes whether the stream ended as a stream ends (`ended`): OpenAI's `data: [DONE]`,
Anthropic's `message_stop`, or an error event the engine sent itself. One that stops without
it was cut (its engine died): the gateway then ends it with an error event of its own, so
the client's SDK raises instead of taking a cut answer for a whole one (issue 25).

`usage_of` does the same for a complete (non-streaming) JSON body. Both understand OpenAI's
usage (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`) and
Anthropic's (`input_tokens`, `output_tokens`, `cache_read_input_tokens`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_SEP = b"\n\n"
# A line of its own, so generated text (JSON-escaped: no raw newline) can never match.
_END = re.compile(rb"(?m)^(?:data: ?\[DONE\]|event: ?(?:message_stop|error))\s*$")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reported: bool = False  # the engine's own figures (else counted from events)

    def merge(self, usage: Any) -> None:
        """Fold one usage object in (Anthropic sends input and output in two events)."""
        if not isinstance(usage, dict):
            return
        self.reported = True
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        cached = usage.get("cache_read_input_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = details.get("cached_tokens", cached)
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
            if "input_tokens" in usage and isinstance(cached, int):
                self.prompt_tokens += cached  # Anthropic counts cache reads apart
        if isinstance(completion, int):
            self.completion_tokens = completion
        if isinstance(cached, int):
            self.cached_tokens = cached


def usage_of(body: bytes) -> Usage:
    """The usage of a complete JSON response (zeros if it has none)."""
    usage = Usage()
    if _USAGE.search(body):
        try:
            data = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return usage
        if isinstance(data, dict):
            usage.merge(data.get("usage"))
    return usage


class StreamMeter:
    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage = Usage()
        self.events = 0  # data events before [DONE]: generated chunks, roughly one per token
        self.ended = False  # the stream's own last event was seen
        self._tail = b""

    @property
    def partial_sent(self) -> bool:
        """Whether part of an event went out unfinished (only when not cutting: a cutting
        meter holds an incomplete tail back)."""
        return bool(self._tail) and not self.strip_usage

    def feed(self, chunk: bytes) -> bytes:
        """Account for `chunk`; returns the bytes to forward now."""
        if not self._tail and chunk.endswith(_SEP):  # whole events, the usual chunk
            if b'"usage"' not in chunk and b"[DONE]" not in chunk and b"event:" not in chunk:
                # a token's event (or a few): the per-token path, `_account`'s first branch
                self.events += chunk.count(b"data:")
                return chunk
            if self.strip_usage:
                return self._account(chunk, cut=True)
            self._account(chunk)
            return chunk
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(_SEP)
        if end < 0:
            self._tail = data
            return b"" if self.strip_usage else chunk
        complete, self._tail = data[:end + 2], data[end + 2:]
        if not self.strip_usage:
            self._account(complete)
            return chunk
        return self._account(complete, cut=True)

    def finish(self) -> bytes:
        """The end of the stream: account for an unterminated last event, and return what
        is still to be forwarded (only when cutting: otherwise it went out as it came)."""
        tail, self._tail = self._tail, b""
        if not tail:
            return b""
        kept = self._account(tail + _SEP, cut=self.strip_usage)
        if not self.strip_usage:
            return b""
        return kept[:-len(_SEP)] if kept.endswith(_SEP) else kept

    def _account(self, block: bytes, cut: bool = False) -> bytes:
        # The substring tests first: a block of tokens has neither, and `in` costs a tenth
        # of the regular expressions, which run only where they can match.
        done = b"[DONE]" in block
        if not self.ended and (done or b"event:" in block) and _END.search(block) is not None:
            self.ended = True
        if b'"usage"' not in block or _USAGE.search(block) is None:
            self.events += block.count(b"data:") - (block.count(b"data: [DONE]") if done else 0)
            return block
        kept = []
        for event in block.split(_SEP)[:-1]:
            if b"data:" not in event:
                kept.append(event)
                continue
            if _USAGE.search(event) is None:
                if b"[DONE]" not in event:
                    self.events += 1
                kept.append(event)
                continue
            payload = event[event.index(b"data:") + 5:]
            try:
                data = msgspec.json.decode(payload)
            except msgspec.DecodeError:
                kept.append(event)
                continue
            if isinstance(data, dict):
                self.usage.merge(data.get("usage") or
                                 (data.get("message") or {}).get("usage"))
            usage_only = _EMPTY_CHOICES.search(event) is not None
            if not usage_only:
                self.events += 1
            if not (cut and usage_only):
                kept.append(event)
        return b"".join(e + _SEP for e in kept)
