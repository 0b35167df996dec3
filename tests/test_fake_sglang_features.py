"""The engine emulator's serving features the gateway's tests lean on, over real HTTP: cached
prompt tokens from its pretend radix cache (`--enable-cache-report`), tool calls and reasoning
in SGLang's shapes (read back with the real `openai` SDK), continuous usage stats, the
Anthropic Messages API, and the emulator-only `/emulator/stats` (peak concurrency, aborts when
a client goes away, queued or running).

Two emulators: `featured` runs the appliance's serving flags (cache report, `kimi_k3` reasoning
and tool-call parsers, an API key, at most 2 running requests); `plain` runs none of them.
Every wait is a bounded poll on something observable; nothing asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appliance.testing.fake_sglang.answer import Script, reasoning_tokens
from appliance.testing.fake_sglang.prefixcache import PrefixCache
from appliance.testing.fake_sglang.tools import Call, arguments
from tests.conftest import wait_for
from tests.test_fake_sglang import Emulator, small_model

KEY = "sk-emulator-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "kimi-k3"
SYSTEM = "You are a careful assistant for the appliance tests"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "extra": {"type": "object"}, "optional": {"type": "string"}},
        "required": ["city", "days", "metric", "unit", "extra"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}, "required": ["query"]}}}


@contextlib.contextmanager
def running(root: Path, *flags: str) -> Iterator[Emulator]:
    emu = Emulator(root, [str(small_model(root / "model", 1 << 20)), "--tp-size", "2",
                          "--max-running-requests", "2", "--served-model-name", MODEL, *flags],
                   FAKE_SGLANG_LOAD_SECONDS="1")
    with emu.served():
        yield emu


@pytest.fixture(scope="module")
def featured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with running(tmp_path_factory.mktemp("featured"), "--enable-cache-report",
                 "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3",
                 "--api-key", KEY, "--enable-metrics") as emu:
        yield emu


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with running(tmp_path_factory.mktemp("plain")) as emu:
        yield emu


def http(emu: Emulator) -> httpx.Client:
    return httpx.Client(base_url=emu.url, timeout=30, headers=AUTH)


def sdk(emu: Emulator) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{emu.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def sse(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name or None, data) for every frame of an SSE reply."""
    frames, event = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            frames.append((event, line.removeprefix("data: ")))
            event = None
    return frames


def stream_chunks(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        frames = sse(reply)
    assert frames[-1] == (None, "[DONE]")
    return [json.loads(data) for _, data in frames[:-1]]


def flush(client: httpx.Client) -> None:
    reply = client.post("/flush_cache")
    assert reply.status_code == 200 and reply.text.startswith("Cache flushed.")


# -- pure parts ---------------------------------------------------------------------------

def test_prefix_cache_matches_the_longest_recent_prefix_capped_below_the_prompt() -> None:
    cache = PrefixCache(size=2)
    assert cache.admit(("a", "b", "c")) == 0
    assert cache.admit(("a", "b", "x", "y")) == 2
    assert cache.admit(("a", "b", "x", "y")) == 3  # all of it is cached: one token is not
    assert cache.admit(("a", "b", "c")) == 2  # ("a", "b", "c") fell out of the last two
    cache.flush()
    assert cache.admit(("a", "b", "c")) == 0


def test_tool_arguments_follow_the_schemas_required_properties() -> None:
    args = json.loads(arguments(WEATHER["function"]["parameters"], seed=5))
    assert list(args) == ["city", "days", "metric", "unit", "extra"]
    assert isinstance(args["city"], str) and args["city"]
    assert (args["days"], args["metric"], args["unit"], args["extra"]) == (
        1, True, "celsius", None)
    assert arguments(None, 1) == "{}" and arguments({"type": "object"}, 1) == "{}"
    call = Call(id="f:0", name="f", arguments=json.dumps(args))
    assert "".join(call.fragments) == call.arguments


def test_a_script_reasons_then_calls_then_writes() -> None:
    call = Call(id="f:0", name="f", arguments='{"a": 1}')
    script = Script(reasoning=2, call=call)
    kinds = [script.piece(7, i).kind for i in range(script.call_end + 1)]
    assert kinds == ["reasoning", "reasoning", "none", "call", "arguments", "arguments", "none",
                     "content"]
    assert script.natural(7) == script.call_end == 2 + call.tokens
    parser = "kimi_k3"
    assert reasoning_tokens({"chat_template_kwargs": {"thinking": True}}, parser, 0) == 4
    assert reasoning_tokens({"reasoning_effort": "high"}, parser, 1) == 5
    assert reasoning_tokens({"reasoning_effort": "none"}, parser, 1) == 0
    assert reasoning_tokens({"reasoning_effort": "high",
                             "chat_template_kwargs": {"thinking": False}}, parser, 1) == 0
    assert reasoning_tokens({"chat_template_kwargs": {"thinking": True},
                             "separate_reasoning": False}, parser, 1) == 0
    assert reasoning_tokens({"chat_template_kwargs": {"thinking": True}}, None, 1) == 0


# -- cached tokens ------------------------------------------------------------------------

def test_cached_tokens_come_from_the_shared_prefix_in_every_usage(featured: Emulator) -> None:
    def system_chat(question: str) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 6, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}

    with http(featured) as client:
        flush(client)
        first = client.post("/v1/chat/completions", json=system_chat("what is up")).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = client.post("/v1/chat/completions", json=system_chat("how are you")).json()
        # the system block (4 template tokens + its words) and the user block's 3 opening
        # tokens are shared; the first user word differs
        shared = 4 + len(SYSTEM.split()) + 3
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": shared}
        prompt = second["usage"]["prompt_tokens"]
        assert prompt == shared + 3 + 1 + 2  # how are you, <|im_end|>, the generation prompt

        chunks = stream_chunks(client, "/v1/chat/completions", {
            **system_chat("how are you"), "stream_options": {"include_usage": True}})
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == []
        assert usage["prompt_tokens_details"] == {"cached_tokens": prompt - 1}  # capped

        messages = {"model": MODEL, "max_tokens": 6, "system": SYSTEM,
                    "messages": [{"role": "user", "content": "how are you"}]}
        anthropic = client.post("/v1/messages", json=messages).json()["usage"]
        assert anthropic["cache_read_input_tokens"] == prompt - 1
        assert anthropic["input_tokens"] == 1  # Anthropic counts the uncached part only
        counted = client.post("/v1/messages/count_tokens", json=messages).json()
        assert counted == {"input_tokens": prompt}

        completion = {"model": MODEL, "prompt": "alpha beta gamma delta", "max_tokens": 3}
        client.post("/v1/completions", json=completion)
        again = client.post("/v1/completions", json={
            **completion, "prompt": "alpha beta gamma epsilon zeta"}).json()
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
        native = client.post("/generate", json={"text": "alpha beta gamma delta",
                                                "sampling_params": {"max_new_tokens": 2}})
        assert native.json()["meta_info"]["cached_tokens"] == 3  # 4 tokens, one computed

        metrics = client.get("/metrics").text
        counted = re.search(r"^sglang:cached_tokens_total\{.*\} ([\d.]+)$", metrics, re.M)
        assert counted and float(counted[1]) >= shared + 2 * (prompt - 1) + 3 + 3
        flush(client)
        cold = client.post("/v1/chat/completions", json=system_chat("how are you")).json()
        assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_without_the_cache_report_usage_has_no_prompt_token_details(plain: Emulator) -> None:
    with httpx.Client(base_url=plain.url, timeout=30) as client:
        body = chat("the same question twice", max_tokens=4)
        client.post("/v1/chat/completions", json=body)
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"] is None
        chunks = stream_chunks(client, "/v1/chat/completions",
                               {**body, "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"]["prompt_tokens_details"] is None
        reply = client.post("/v1/messages", json={**body, "max_tokens": 4}).json()
        assert "cache_read_input_tokens" not in reply["usage"]
        assert reply["usage"]["input_tokens"] == usage["prompt_tokens"]
        native = client.post("/generate", json={"text": "one two three",
                                                "sampling_params": {"max_new_tokens": 2}})
        native = client.post("/generate", json={"text": "one two three",
                                                "sampling_params": {"max_new_tokens": 2}})
        assert native.json()["meta_info"]["cached_tokens"] == 2  # SGLang always reports it


# -- tool calls ---------------------------------------------------------------------------

def test_tool_calls_in_sglangs_shapes_through_the_openai_sdk(featured: Emulator) -> None:
    client = sdk(featured)
    ask = [{"role": "user", "content": "what is the weather in Paris"}]
    answer = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, LOOKUP])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id == "get_weather:0"  # kimi_k3's id
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert list(args) == ["city", "days", "metric", "unit", "extra"] and args["days"] == 1
    assert answer.usage is not None and answer.usage.completion_tokens > 0

    named = client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER, LOOKUP],
        tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert named.choices[0].message.tool_calls is not None
    assert named.choices[0].message.tool_calls[0].function.name == "lookup"

    deltas, finish, usage = [], None, None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER, LOOKUP],
            stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and usage is not None
    assert usage.completion_tokens == answer.usage.completion_tokens
    head, rest = deltas[0], deltas[1:]
    assert (head.index, head.id, head.type) == (0, "get_weather:0", "function")
    assert head.function is not None and head.function.name == "get_weather"
    assert rest and all(d.id is None and d.function is not None and d.function.name is None
                        for d in rest)
    assert "".join(d.function.arguments or "" for d in rest if d.function) == \
        call.function.arguments

    answered = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    text = client.chat.completions.create(model=MODEL, messages=answered, tools=[WEATHER])
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert text.choices[0].finish_reason == "stop"
    follow_up = client.chat.completions.create(
        model=MODEL, tools=[WEATHER],
        messages=[*answered, {"role": "assistant", "content": "It is sunny."},
                  {"role": "user", "content": "and tomorrow"}])
    assert follow_up.choices[0].message.tool_calls is not None
    assert follow_up.choices[0].message.tool_calls[0].id == "get_weather:1"  # one call before

    refused = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                             tool_choice="none")
    assert refused.choices[0].message.tool_calls is None
    cut = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                         max_tokens=3)
    assert cut.choices[0].message.tool_calls is None
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="Tool 'nope' not found in tools list"):
        client.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}})


def test_without_a_tool_call_parser_or_reasoning_parser_the_answer_is_text(
        plain: Emulator) -> None:
    with httpx.Client(base_url=plain.url, timeout=30) as client:
        reply = client.post("/v1/chat/completions", json=chat(
            "weather please", tools=[WEATHER], chat_template_kwargs={"thinking": True})).json()
        message = reply["choices"][0]["message"]
        assert "tool_calls" not in message and message["content"]
        assert message["reasoning_content"] is None and reply["usage"]["reasoning_tokens"] == 0
        thinking = client.post("/v1/messages", json={
            **chat("hi"), "max_tokens": 5, "thinking": {"type": "adaptive"}})
        assert thinking.status_code == 400
        assert thinking.json()["error"]["message"] == (
            "Anthropic thinking is not supported for models without a reasoning parser")


# -- reasoning and continuous usage -------------------------------------------------------

def test_reasoning_comes_first_and_counts_in_usage(featured: Emulator) -> None:
    body = chat("think about this", chat_template_kwargs={"thinking": True})
    with http(featured) as client:
        reply = client.post("/v1/chat/completions", json=body).json()
        message, usage = reply["choices"][0]["message"], reply["usage"]
        reasoning = message["reasoning_content"]
        assert reasoning and message["content"]
        assert usage["reasoning_tokens"] == len(reasoning.split()) >= 4
        assert usage["completion_tokens_details"] == {"reasoning_tokens": usage[
            "reasoning_tokens"]}
        assert usage["completion_tokens"] == usage["reasoning_tokens"] + len(
            message["content"].split())

        chunks = stream_chunks(client, "/v1/chat/completions", body)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert deltas[0] == {"reasoning_content": None, "role": "assistant", "content": ""}
        kinds = ["reasoning" if d.get("reasoning_content") else "content"
                 for d in deltas[1:-1]]
        assert kinds == sorted(kinds, reverse=True)  # all reasoning, then all content
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]

        effort = client.post("/v1/chat/completions", json=chat(
            "think about this", reasoning_effort="high")).json()
        assert effort["usage"]["reasoning_tokens"] > 0
        off = client.post("/v1/chat/completions", json={
            **body, "chat_template_kwargs": {"thinking": False}}).json()
        assert off["usage"]["reasoning_tokens"] == 0
        assert off["choices"][0]["message"]["reasoning_content"] is None


def test_continuous_usage_stats_put_usage_on_every_token_chunk(featured: Emulator) -> None:
    body = chat("count with me", max_tokens=6, ignore_eos=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    with http(featured) as client:
        chunks = stream_chunks(client, "/v1/chat/completions", body)
        tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3, 4, 5, 6]
        assert all(c["usage"]["prompt_tokens_details"] is not None for c in tokens)
        assert "usage" not in chunks[0]  # the role chunk
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

        plain_stream = stream_chunks(client, "/v1/chat/completions", {
            **body, "stream_options": {"include_usage": True}})
        assert all("usage" not in c for c in plain_stream[:-1])

        completion = stream_chunks(client, "/v1/completions", {
            "model": MODEL, "prompt": "count", "max_tokens": 4, "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True}})
        assert [c["usage"]["completion_tokens"] for c in completion] == [1, 2, 3, 4]


# -- Anthropic Messages -------------------------------------------------------------------

def test_anthropic_messages_non_stream_stream_and_errors(featured: Emulator) -> None:
    body = {"model": MODEL, "max_tokens": 9, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}]}
    with http(featured) as client:
        reply = client.post("/v1/messages", json=body).json()
        assert reply["id"].startswith("msg_") and reply["type"] == "message"
        assert reply["role"] == "assistant" and reply["model"] == MODEL
        assert [b["type"] for b in reply["content"]] == ["text"]
        assert reply["stop_reason"] in ("end_turn", "max_tokens")
        output = reply["usage"]["output_tokens"]
        assert output == len(reply["content"][0]["text"].split())

        with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            frames = [(event, json.loads(data)) for event, data in sse(r)]
        names = [event for event, _ in frames]
        assert all(event == data["type"] for event, data in frames)
        assert names == ["message_start", "content_block_start",
                         *["content_block_delta"] * output, "content_block_stop",
                         "message_delta", "message_stop"]
        start = frames[0][1]["message"]
        assert start["content"] == [] and start["usage"]["output_tokens"] == 0
        assert start["usage"]["input_tokens"] + start["usage"].get(
            "cache_read_input_tokens", 0) == reply["usage"]["input_tokens"] + reply[
            "usage"].get("cache_read_input_tokens", 0)
        assert frames[1][1]["content_block"] == {"type": "text", "text": ""}
        text = "".join(data["delta"]["text"] for event, data in frames
                       if event == "content_block_delta")
        assert text == reply["content"][0]["text"]
        assert frames[-2][1] == {"type": "message_delta", "delta": {
            "stop_reason": reply["stop_reason"]}, "usage": {"output_tokens": output}}

        missing = client.post("/v1/messages", json={"model": MODEL, "messages": []})
        assert missing.status_code == 400
        assert missing.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "max_tokens: Field required"}}
        assert httpx.post(f"{featured.url}/v1/messages", json=body).status_code == 401


def test_anthropic_tool_use_and_thinking_blocks(featured: Emulator) -> None:
    body = {"model": MODEL, "max_tokens": 200, "thinking": {"type": "enabled",
                                                             "budget_tokens": 2048},
            "tools": [{"name": "lookup", "input_schema": LOOKUP["function"]["parameters"]}],
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "find the manual"}]}
    with http(featured) as client:
        reply = client.post("/v1/messages", json=body).json()
        assert [b["type"] for b in reply["content"]] == ["thinking", "tool_use"]
        use = reply["content"][1]
        assert use["name"] == "lookup" and use["id"] == "lookup:0"
        assert list(use["input"]) == ["query"] and reply["stop_reason"] == "tool_use"

        with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            frames = [json.loads(data) for _, data in sse(r)]
        starts = [f["content_block"] for f in frames if f["type"] == "content_block_start"]
        assert starts == [{"type": "thinking", "thinking": ""},
                          {"type": "tool_use", "id": "lookup:0", "name": "lookup", "input": {}}]
        partial = "".join(f["delta"]["partial_json"] for f in frames
                          if f["type"] == "content_block_delta" and f["index"] == 1)
        assert json.loads(partial) == use["input"]
        assert frames[-2]["delta"] == {"stop_reason": "tool_use"}

        result = client.post("/v1/messages", json={**body, "tool_choice": {"type": "auto"},
                                                   "messages": [
            *body["messages"],
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                          "content": "page 12"}]}]}).json()
        assert [b["type"] for b in result["content"]] == ["thinking", "text"]
        assert result["stop_reason"] == "end_turn"


# -- /emulator/stats ----------------------------------------------------------------------

def test_stats_count_peak_running_and_aborts_queued_or_running(featured: Emulator) -> None:
    stats_url = f"{featured.url}/emulator/stats"
    assert httpx.get(f"{featured.url}/v1/models").status_code == 401  # the key is on...
    before = httpx.get(stats_url).json()  # ...but the stats need none
    assert before["max_running_requests"] == 2 and before["running"] == 0
    reset = httpx.post(f"{stats_url}/reset").json()
    assert reset["peak_running"] == 0

    long = chat("a very long answer", max_tokens=100000, ignore_eos=True, stream=True)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(http(featured))
        for _ in range(2):
            stack.enter_context(client.stream("POST", "/v1/chat/completions", json=long))
        queued = stack.enter_context(socket.create_connection(("127.0.0.1", featured.port)))
        payload = json.dumps({**long, "stream": False}).encode()
        queued.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nAuthorization: Bearer " + KEY.encode() +
                       b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" +
                       payload)
        now = wait_for(lambda: (s := httpx.get(stats_url).json())["waiting"] == 1 and s,
                       "a third request to queue")
        assert now["running"] == 2 and now["peak_running"] == 2  # never more than the limit
        assert now["requests_total"] == before["requests_total"] + 3
        queued.close()  # a client that gives up while queued
        wait_for(lambda: httpx.get(stats_url).json()["aborted_total"] ==
                 before["aborted_total"] + 1, "the queued request's abort")
    after = wait_for(lambda: (s := httpx.get(stats_url).json())["running"] == 0 and s,
                     "the running streams' aborts")
    assert after["aborted_total"] == before["aborted_total"] + 3
    assert after["waiting"] == 0 and after["finished_total"] == before["finished_total"]
    assert after["peak_running"] == 2
    assert httpx.post(f"{stats_url}/reset").json()["peak_running"] == 0
    with http(featured) as client:
        client.post("/v1/chat/completions", json=chat("short", max_tokens=2))
    done = httpx.get(stats_url).json()
    assert done["finished_total"] == after["finished_total"] + 1
    assert done["peak_running"] == 1
