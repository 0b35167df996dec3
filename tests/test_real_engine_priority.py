"""Priorities reach the engine (issue 24), against the real SGLang 0.5.23 on CPU: the tier's
tiny dense Llama launched with the priority flags the product builds for its service classes
(`appliance.engine.priority.priority_args`), one engine for the module.

What it settles: 0.5.23 starts with those flags, accepts the per-request `priority` field the
gateway adds (`appliance.gateway.priority.with_priority`) on /v1/chat/completions,
/v1/completions and /generate, and schedules by it: with one running slot, a priority-10
request preempts a running priority-0 one (which then resumes and completes), and a full
queue (--max-queued-requests 1) aborts its priority-0 request for it with SGLang's 503. The
emulator models the same (tests/test_fake_sglang_priority.py); with priority scheduling off,
tests/test_engine_conformance.py checks both answer a request with `priority` alike.

The Anthropic /v1/messages body has no such field; the engine runs with the environment the
classes give it (`appliance.gateway.priority.engine_env`: SGLang's header overrides on), and
there the `x-override-priority` header (`priority_headers`) sets the request's priority: a
value out of SGLang's range is refused by its range check (so the header reached the
priority), and a queued priority-0 /v1/messages request is the one a full queue drops for a
priority-10 newcomer (at the default priority, 10, it would have been kept).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.engine.priority import priority_args
from appliance.engine.validate import check_argv
from appliance.gateway.classes import parse_classes
from appliance.gateway.priority import (
    HEADER_OVERRIDES_ENV,
    OVERRIDE_HEADERS,
    PRIORITY_HEADER,
    engine_env,
    priority_headers,
    with_priority,
)
from appliance.testing.fake_sglang.priority import ABORTED_BY_HIGHER
from tests.realengine.fixtures import DENSE_CPU_ARGS, RealEngine

pytestmark = pytest.mark.real_engine

# The default classes (interactive 10, batch 0 and preemptible), a gateway of one slot and
# no queue: --max-queued-requests 1.
CLASSES = parse_classes({"interactive": {"ttft_slo_seconds": 5}})
FLAGS = tuple(token for flag, value in priority_args(CLASSES, queue_max=0, max_concurrency=1)
              for token in (flag, *(() if value is None else (value,))))
ENV = dict(engine_env(CLASSES))
LONG = 1800  # tokens: the running request must outlast the two that arrive after it


@pytest.fixture(scope="module")
def engine(real_sglang_env: Path, dense_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    args = (*DENSE_CPU_ARGS, "--max-running-requests", "1", *FLAGS)
    assert check_argv(["--model-path", str(dense_model), *args]) == []
    log = tmp_path_factory.mktemp("priority-engine") / "engine.log"
    with RealEngine.start(real_sglang_env, dense_model, log=log, args=args,
                          extra_env=ENV) as running:
        running.wait_healthy()
        yield running


def body(path: str, priority: int | None, tokens: int) -> bytes:
    """A request as the gateway forwards it: the client's JSON, the class's priority added."""
    if path == "/generate":
        data: dict[str, object] = {"text": "Once upon a time", "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    elif path == "/v1/messages":  # the priority goes in the header: `headers_for`
        data = {"model": "default", "max_tokens": tokens, "temperature": 0,
                "messages": [{"role": "user", "content": "Once upon a time"}]}
    else:
        data = {"model": "default", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
        if path == "/v1/completions":
            data["prompt"] = "Once upon a time"
        else:
            data["messages"] = [{"role": "user", "content": "Once upon a time"}]
    return with_priority(json.dumps(data).encode(), path, priority)


def headers_for(engine: RealEngine, path: str, priority: int | None) -> dict[str, str]:
    """The gateway's headers to the engine: its key, JSON, and the priority's header where
    the body cannot carry it."""
    return {**engine.headers(), "content-type": "application/json",
            **priority_headers(path, priority)}


def test_the_override_headers_and_their_switch_are_sglangs(real_sglang_env: Path) -> None:
    """What `appliance.gateway.priority` names of SGLang's header overrides is what 0.5.23
    has: the variable that turns them on, and every header it then reads (none of which the
    gateway forwards from a client)."""
    script = ("import json\n"
              "from sglang.srt.entrypoints.request_headers import _HEADER_OVERRIDES as H\n"
              "from sglang.srt.environ import envs\n"
              f"print(json.dumps([sorted(H), H[{PRIORITY_HEADER!r}][0], "
              f"hasattr(envs, {HEADER_OVERRIDES_ENV!r})]))")
    done = subprocess.run([str(real_sglang_env / "bin" / "python"), "-c", script],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    headers, field, switch = json.loads(done.stdout.splitlines()[-1])
    assert set(headers) == OVERRIDE_HEADERS
    assert (field, switch) == ("priority", True)


def test_the_flags_start_the_engine_and_its_log_shows_them(engine: RealEngine) -> None:
    log = engine.log.read_text(errors="replace")
    for shown in ("'enable_priority_scheduling': True", "'default_priority_value': 10",
                  "'priority_scheduling_preemption_threshold': 0", "'max_queued_requests': 1",
                  "'retraction_policy': 'priority'", "'disable_priority_preemption': False"):
        assert shown in log, shown


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_a_request_carrying_its_class_priority_is_served(engine: RealEngine, path: str) -> None:
    for priority in (10, 0):
        reply = httpx.post(engine.base_url + path, content=body(path, priority, 4),
                           headers={**engine.headers(), "content-type": "application/json"},
                           timeout=120)
        assert reply.status_code == 200, reply.text


def test_a_messages_request_carries_its_class_priority_in_the_header(
        engine: RealEngine) -> None:
    path = "/v1/messages"
    for priority in (10, 0):
        reply = httpx.post(engine.base_url + path, content=body(path, priority, 4),
                           headers=headers_for(engine, path, priority), timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["type"] == "message"
    # The header reached the request's priority: SGLang's own range check refuses it.
    out_of_range = httpx.post(engine.base_url + path, content=body(path, None, 4),
                              headers=headers_for(engine, path, 1 << 63), timeout=120)
    assert out_of_range.status_code == 400, out_of_range.text
    assert "priority must be a signed 64-bit integer" in out_of_range.text


# /v1/messages as the queued request: its class priority (0) rides in the header. Without
# it the request would run at the default priority (10), the urgent one's, and be kept.
@pytest.mark.parametrize("queued_path", ["/v1/completions", "/v1/messages"])
def test_a_higher_priority_preempts_and_a_full_queue_drops_the_lowest(
        engine: RealEngine, queued_path: str) -> None:
    finished: list[str] = []

    async def ask(client: httpx.AsyncClient, name: str, path: str, priority: int,
                  tokens: int) -> httpx.Response:
        reply = await client.post(path, content=body(path, priority, tokens),
                                  headers=headers_for(engine, path, priority))
        finished.append(name)
        return reply

    async def until(client: httpx.AsyncClient, running: int, waiting: int) -> None:
        for _ in range(6000):  # bounded; the state is what is waited on
            entry = (await client.get("/v1/loads")).json()["loads"][0]
            if (entry["num_running_reqs"], entry["num_waiting_reqs"]) == (running, waiting):
                return
            if finished:
                pytest.fail(f"{finished} finished before the queue was set up; "
                            "lengthen LONG")
            await asyncio.sleep(0.02)
        pytest.fail(f"never {running} running and {waiting} waiting")

    async def scenario() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(base_url=engine.base_url, headers=engine.headers(),
                                     timeout=600) as client:
            batch = asyncio.ensure_future(ask(client, "batch", "/v1/chat/completions", 0, LONG))
            await until(client, 1, 0)
            queued = asyncio.ensure_future(ask(client, "queued", queued_path, 0, 4))
            await until(client, 1, 1)
            urgent = asyncio.ensure_future(ask(client, "urgent", "/generate", 10, 4))
            replies = await asyncio.gather(batch, queued, urgent)
            return dict(zip(("batch", "queued", "urgent"), replies, strict=True))

    got = asyncio.run(scenario())
    assert got["queued"].status_code == 503, got["queued"].text
    if queued_path == "/v1/messages":  # SGLang's Anthropic shape hides a 5xx's words
        assert got["queued"].json()["error"]["type"] == "overloaded_error"
    else:
        assert ABORTED_BY_HIGHER in got["queued"].text
    assert got["urgent"].status_code == 200 and got["batch"].status_code == 200
    assert finished.index("urgent") < finished.index("batch")  # it did not wait for the batch
    assert got["batch"].json()["usage"]["completion_tokens"] == LONG  # preempted, then resumed
