"""The stream meter: bytes forwarded exactly once, usage found however the stream is cut
into reads, the gateway's own usage chunk removed only when the gateway asked for it."""

from __future__ import annotations

import pytest

from appliance.gateway.sse import StreamMeter, usage_of


def event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


TOKENS = [event('{"choices":[{"delta":{"content":"a"}}],"usage":null}'),
          event('{"choices":[{"delta":{"content":"b"}}],"usage":null}')]
USAGE = event('{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
              '"prompt_tokens_details":{"cached_tokens":3}}}')
DONE = b"data: [DONE]\n\n"


def pump(meter: StreamMeter, raw: bytes, size: int) -> bytes:
    out = b"".join(meter.feed(raw[i:i + size]) for i in range(0, len(raw), size))
    return out + meter.finish()


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
@pytest.mark.parametrize("terminated", [True, False])
def test_passthrough_forwards_every_byte_once(size: int, terminated: bool) -> None:
    raw = b"".join([*TOKENS, USAGE, DONE])
    if not terminated:  # an engine that ends without the last blank line
        raw = raw[:-2]
    meter = StreamMeter(strip_usage=False)
    assert pump(meter, raw, size) == raw
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens,
            meter.usage.cached_tokens, meter.events) == (5, 2, 3, 2)


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
@pytest.mark.parametrize("usage_last", [True, False])
def test_the_gateways_own_usage_chunk_is_cut_out(size: int, usage_last: bool) -> None:
    raw = b"".join([*TOKENS, USAGE, DONE]) if not usage_last else \
        b"".join([*TOKENS, USAGE])[:-2]  # the usage chunk unterminated at the very end
    meter = StreamMeter(strip_usage=True)
    expected = b"".join(TOKENS) + (b"" if usage_last else DONE)
    assert pump(meter, raw, size) == expected
    assert meter.usage.reported and meter.usage.completion_tokens == 2


def test_anthropic_usage_comes_in_two_events_and_cache_reads_count_in_the_prompt() -> None:
    raw = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
           b'{"input_tokens":2,"output_tokens":0,"cache_read_input_tokens":6}}}\n\n'
           b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
           b'event: message_delta\ndata: {"type":"message_delta","usage":'
           b'{"output_tokens":9}}\n\n')
    meter = StreamMeter(strip_usage=False)
    assert pump(meter, raw, 5) == raw
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens,
            meter.usage.cached_tokens) == (8, 9, 6)


def test_usage_of_a_complete_body() -> None:
    body = b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}'
    usage = usage_of(body)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (4, 1, True)
    assert not usage_of(b'{"choices":[]}').reported
    assert not usage_of(b'{"usage": {').reported  # broken JSON: zeros, never an error
