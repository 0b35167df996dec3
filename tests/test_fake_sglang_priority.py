"""The emulator's priority scheduling (issue 24), as SGLang 0.5.23's: the rules (pure), the
performance model's scheduler under them (pure, model time), and emulators over loopback
HTTP that order their queue by priority and refuse at --max-queued-requests, one of them
honouring `x-override-priority` (SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from appliance.testing.fake_sglang.args import parse
from appliance.testing.fake_sglang.perfmodel import K3_B300
from appliance.testing.fake_sglang.priority import (
    ABORTED_BY_HIGHER,
    DISABLED,
    OUT_OF_RANGE,
    QUEUE_FULL,
    BadHeader,
    PriorityPolicy,
    Refused,
    header_overrides_on,
    header_priority,
)
from appliance.testing.fake_sglang.scheduler import Scheduler, Seq
from tests.test_fake_sglang import Emulator, small_model

ON = PriorityPolicy.of(parse(["--model-path", "/m", "--enable-priority-scheduling"]))


# --- the rules ------------------------------------------------------------------------------
def test_flags_become_the_policy() -> None:
    policy = PriorityPolicy.of(parse([
        "--model-path", "/m", "--enable-priority-scheduling", "--default-priority-value", "10",
        "--priority-scheduling-preemption-threshold", "0", "--retraction-policy", "priority",
        "--max-queued-requests", "5"]))
    assert policy == PriorityPolicy(enabled=True, preemption=True, threshold=0, default=10,
                                    max_queued=5, retract_by_priority=True)
    off = PriorityPolicy.of(parse(["--model-path", "/m", "--enable-priority-scheduling",
                                   "--disable-priority-preemption"]))
    assert off.enabled and not off.preemption and off.threshold == 10
    assert PriorityPolicy.of(parse(["--model-path", "/m"])) == PriorityPolicy()


def test_assign_defaults_ranges_and_the_disabled_server() -> None:
    assert ON.assign(None) == -sys.maxsize - 1  # no default: below everything
    assert replace(ON, default=10).assign(None) == 10 and ON.assign(3) == 3
    assert replace(ON, low_first=True).assign(None) == sys.maxsize
    assert PriorityPolicy().assign(7) == 0  # ignored without priority scheduling
    with pytest.raises(Refused) as refused:
        PriorityPolicy(abort_when_disabled=True).assign(7)
    assert (refused.value.status, refused.value.message) == (503, DISABLED)
    with pytest.raises(Refused) as refused:
        ON.assign(1 << 63)
    assert (refused.value.status, refused.value.message) == (400, OUT_OF_RANGE)


def test_the_header_overrides_switch_reads_as_sglangs_env_bool() -> None:
    switch = "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES"
    for on in ("1", "true", "True", "YES", "y"):
        assert header_overrides_on({switch: on}), on
    for off in ("0", "false", "no", "", "2", "on"):  # "on" is no EnvBool value: the default
        assert not header_overrides_on({switch: off}), off
    assert not header_overrides_on({})


def test_the_priority_header_is_read_with_ints_rules_over_the_body() -> None:
    def headers(value: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", b"application/json"), (b"x-override-priority", value),
                (b"x-override-priority", b"99")]  # the first one counts (Starlette's get)

    assert header_priority([], 7) == 7 and header_priority([], None) is None
    assert header_priority(headers(b"-3"), 7) == -3
    assert header_priority(headers(b" +1_0 "), None) == 10  # what int() accepts
    assert header_priority(headers(str(1 << 63).encode()), None) == 1 << 63  # range: later
    with pytest.raises(BadHeader) as bad:
        header_priority(headers(b"high"), 7)
    assert (bad.value.status, bad.value.message) == (
        400, "invalid x-override-priority header 'high': invalid literal for int() with "
        "base 10: 'high'")


def seq(key: str, priority: int, at: float = 0.0, **kw: int) -> Seq:
    return Seq(key=key, prompt=kw.get("prompt", 100), target=kw.get("target", 50), arrived=at,
               queued_at=at, priority=priority)


def test_the_queue_is_ordered_by_priority_then_arrival() -> None:
    waiting = [seq("a", 0, 1), seq("b", 10, 2), seq("c", 0, 0), seq("d", 10, 3)]
    assert [s.key for s in ON.order(waiting)] == ["b", "d", "c", "a"]
    assert [s.key for s in replace(ON, low_first=True).order(waiting)] == ["c", "a", "b", "d"]
    assert [s.key for s in PriorityPolicy().order(waiting)] == ["c", "a", "b", "d"]  # fcfs


def test_preemption_takes_the_lowest_newest_first_above_the_threshold() -> None:
    running = [seq("old", 0, 1), seq("new", 0, 5), seq("mid", 5, 2), seq("top", 10, 0)]
    policy = replace(ON, preemption=True, threshold=4)
    assert [s.key for s in policy.preemptible(seq("x", 10), running)] == ["new", "old", "mid"]
    assert [s.key for s in replace(policy, threshold=5).preemptible(seq("x", 10), running)] \
        == ["new", "old"]  # a difference of exactly the threshold does not preempt
    assert replace(policy, preemption=False).preemptible(seq("x", 10), running) == []


def test_a_full_queue_refuses_the_newcomer_or_drops_a_lower_one() -> None:
    waiting = [seq("lo", 0, 1), seq("lo2", 0, 2), seq("hi", 10, 0)]
    full = replace(ON, max_queued=3)
    assert full.on_full_queue(seq("x", 10, 5), waiting) == ("lo2", ABORTED_BY_HIGHER)
    assert full.on_full_queue(seq("x", 0, 5), waiting) == ("x", QUEUE_FULL)  # not strictly above
    assert replace(full, max_queued=4).on_full_queue(seq("x", 0, 5), waiting) is None
    assert PriorityPolicy(max_queued=3).on_full_queue(seq("x", 10, 5), waiting) \
        == ("x", QUEUE_FULL)  # without priority scheduling the newcomer is refused


# --- the scheduler --------------------------------------------------------------------------
MODEL = replace(K3_B300, kv_tokens=100_000, waiting_timeout=0.0)


def run(scheduler: Scheduler, now: float = 0.0, limit: int = 5000) -> tuple[list[str], float]:
    """Steps until idle: the keys in the order they got their first token, and the clock."""
    first: list[str] = []
    for _ in range(limit):
        step = scheduler.step(now)
        if step is None:
            break
        first += [key for key in step.tokens if key not in first]
        now = step.ends
    return first, now


def test_the_scheduler_admits_by_priority_then_arrival() -> None:
    scheduler = Scheduler(MODEL, max_running=1, policy=replace(ON, preemption=False))
    for index, priority in enumerate([0, 0, 10, 5, 10]):
        scheduler.add(seq(f"r{index}", priority), float(index) / 100)
    first, _ = run(scheduler)
    assert first == ["r2", "r4", "r3", "r0", "r1"]
    plain = Scheduler(MODEL, max_running=1)
    for index, priority in enumerate([0, 0, 10, 5, 10]):
        plain.add(seq(f"r{index}", priority), float(index) / 100)
    assert run(plain)[0] == ["r0", "r1", "r2", "r3", "r4"]


def test_a_higher_priority_preempts_a_running_batch_request_which_resumes() -> None:
    policy = replace(ON, preemption=True, threshold=0)
    scheduler = Scheduler(MODEL, max_running=1, policy=policy)
    scheduler.add(seq("batch", 0, target=400), 0.0)
    now = 0.0
    while "batch" not in scheduler.running or scheduler.running["batch"].generated < 20:
        step = scheduler.step(now)
        assert step is not None
        now = step.ends
    scheduler.add(seq("chat", 10, now, target=30), now)
    step = scheduler.step(now)
    assert step is not None and step.preempted == ("batch",)
    assert list(scheduler.running) == ["chat"] and scheduler.waiting[0].key == "batch"
    batch = scheduler.waiting[0]
    assert batch.kv == 0 and batch.to_prefill == batch.prompt + batch.generated
    run(scheduler, step.ends)
    assert scheduler.preempted_total == 1 and not scheduler.busy
    assert batch.generated == 400  # it resumed and finished


def test_an_equal_priority_or_preemption_off_does_not_preempt() -> None:
    for policy in (replace(ON, preemption=True, threshold=10), replace(ON, preemption=False)):
        scheduler = Scheduler(MODEL, max_running=1, policy=policy)
        scheduler.add(seq("batch", 0, target=200), 0.0)
        step = scheduler.step(0.0)
        assert step is not None
        scheduler.add(seq("chat", 10, step.ends), step.ends)
        step = scheduler.step(step.ends)
        assert step is not None and step.preempted == () and list(scheduler.running) == ["batch"]


def test_retraction_by_priority_retracts_the_lowest_first() -> None:
    """A pool that admits three answers on a low new_token_ratio but cannot hold them: the
    priority-0 request is retracted, however much it has generated."""
    model = replace(K3_B300, kv_tokens=3 * 1100, waiting_timeout=0.0,
                    init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    policy = replace(ON, retract_by_priority=True)
    scheduler = Scheduler(model, max_running=8, policy=policy)
    for key, priority in (("low", 0), ("high", 10), ("mid", 5)):
        scheduler.add(seq(key, priority, prompt=1000, target=300), 0.0)
    now, retracted = 0.0, []
    while not retracted:
        step = scheduler.step(now)
        assert step is not None
        retracted = list(step.retracted)
        now = step.ends
    assert retracted[0] == "low"
    run(scheduler, now, limit=20_000)
    assert not scheduler.busy


def test_a_retracted_request_finding_the_queue_full_is_aborted_as_in_sglang() -> None:
    """SGLang re-queues a retracted request through `_add_request_to_queue`, where the queue
    bound applies: at a full queue of a higher priority, the retracted one is aborted."""
    model = replace(K3_B300, kv_tokens=3 * 1100, waiting_timeout=0.0,
                    init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    policy = replace(ON, retract_by_priority=True, max_queued=1)
    scheduler = Scheduler(model, max_running=8, policy=policy)
    for key, priority in (("low", 0), ("high", 10), ("mid", 5)):
        assert scheduler.add(seq(key, priority, prompt=1000, target=300), 0.0) == {}
        step = scheduler.step(0.0)  # admitted one by one: the bound counts the queue only
        assert step is not None
    assert scheduler.add(seq("wait", 5, prompt=1000, target=300), 0.0) == {}
    now, failed = 0.0, {}
    while not failed:
        step = scheduler.step(now)
        assert step is not None
        failed = step.failed
        now = step.ends
    assert step.retracted == ("low",) and failed == {"low": QUEUE_FULL}
    assert [s.key for s in scheduler.waiting] == ["wait"] and "low" not in scheduler.running


def test_the_scheduler_applies_max_queued_requests() -> None:
    scheduler = Scheduler(MODEL, max_running=1, policy=replace(ON, max_queued=2))
    assert scheduler.add(seq("a", 0), 0.0) == {}
    assert scheduler.add(seq("b", 0, 1), 1.0) == {}
    assert scheduler.add(seq("c", 0, 2), 2.0) == {"c": QUEUE_FULL}
    assert scheduler.add(seq("d", 10, 3), 3.0) == {"b": ABORTED_BY_HIGHER}
    assert [s.key for s in scheduler.waiting] == ["a", "d"] and scheduler.failed_total == 2


# --- over HTTP ------------------------------------------------------------------------------
def one_slot(tmp_path_factory: pytest.TempPathFactory, name: str,
             **env: str) -> Emulator:
    """One running slot, priority scheduling (default 10), a queue of two, slow tokens."""
    model_dir = small_model(tmp_path_factory.mktemp("model"), shard_bytes=1 << 16)
    return Emulator(tmp_path_factory.mktemp(name),
                    [str(model_dir), "--max-running-requests", "1", "--enable-priority-scheduling",
                     "--default-priority-value", "10", "--max-queued-requests", "2"],
                    FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_FAULT="slow_tokens=0.05", **env)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with one_slot(tmp_path_factory, "priority").served() as emu:
        yield emu


async def until(client: httpx.AsyncClient, running: int, waiting: int) -> None:
    for _ in range(3000):  # bounded: the state, not a time, is what the test waits on
        stats = (await client.get("/emulator/stats")).json()
        if (stats["running"], stats["waiting"]) == (running, waiting):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"never {running} running and {waiting} waiting")


async def ask(client: httpx.AsyncClient, ended: list[str], name: str, path: str,
              body: dict[str, object], priority: str | None = None) -> httpx.Response:
    """POST `body` to `path` (with `x-override-priority: priority` when given); `name` joins
    `ended` when the answer has come (the finish order)."""
    headers = {} if priority is None else {"x-override-priority": priority}
    reply = await client.post(path, json=body, headers=headers)
    ended.append(name)
    return reply


def test_over_http_the_queue_runs_by_priority_and_refuses_when_full(emulator: Emulator) -> None:
    order: list[str] = []

    async def scenario() -> dict[str, httpx.Response]:
        chat = {"model": "k3", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 40, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=emulator.url, timeout=60) as client:
            tasks = {"first": asyncio.ensure_future(
                ask(client, order, "first", "/v1/chat/completions", chat))}
            await until(client, 1, 0)
            tasks["low"] = asyncio.ensure_future(ask(client, order, "low", "/v1/completions", {
                "model": "k3", "prompt": "a b", "max_tokens": 4, "priority": 0}))
            await until(client, 1, 1)
            tasks["high"] = asyncio.ensure_future(ask(client, order, "high", "/generate", {
                "text": "c d", "sampling_params": {"max_new_tokens": 4}, "priority": 20}))
            await until(client, 1, 2)
            full = await client.post("/v1/completions", json={
                "model": "k3", "prompt": "e", "max_tokens": 2, "priority": 0})
            tasks["bumped"] = asyncio.ensure_future(ask(
                client, order, "bumped", "/v1/chat/completions", {**chat, "max_tokens": 4,
                                                                  "priority": 30}))
            low = await tasks.pop("low")  # aborted at once for the newcomer
            await until(client, 1, 2)
            bad = await client.post("/v1/completions", json={
                "model": "k3", "prompt": "e", "priority": "high"})
            done = dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))
            return {**done, "low": low, "full": full, "bad": bad}

    got = asyncio.run(scenario())
    assert got["full"].status_code == 503
    assert got["full"].json()["message"] == QUEUE_FULL
    # the newcomer of priority 30 took the place of the lowest waiting request (low, 0)
    assert got["low"].status_code == 503 and got["low"].json()["message"] == ABORTED_BY_HIGHER
    assert all(got[name].status_code == 200 for name in ("first", "high", "bumped"))
    assert order.index("low") < order.index("first") < order.index("bumped") \
        < order.index("high")  # the queue ran by priority, not by arrival
    assert got["bad"].status_code == 400 and "priority" in got["bad"].json()["message"]


@pytest.fixture(scope="module")
def modelled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The performance model, with the product's flags for the default classes as the real
    engine's tier test runs them (tests/test_real_engine_priority.py): one slot, a queue of
    one, preemption above a difference of 0."""
    model_dir = small_model(tmp_path_factory.mktemp("model"), shard_bytes=1 << 16)
    emu = Emulator(tmp_path_factory.mktemp("modelled"),
                   [str(model_dir), "--max-running-requests", "1", "--enable-priority-scheduling",
                    "--default-priority-value", "10", "--priority-scheduling-preemption-threshold",
                    "0", "--retraction-policy", "priority", "--max-queued-requests", "1"],
                   FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_PERF="k3-b300",
                   FAKE_SGLANG_TIME_SCALE="1")
    with emu.served():
        yield emu


def test_the_model_preempts_for_a_higher_priority_as_the_real_engine_does(
        modelled: Emulator) -> None:
    finished: list[str] = []
    long = 400

    async def scenario() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(base_url=modelled.url, timeout=120) as client:
            tasks = {"batch": asyncio.ensure_future(ask(
                client, finished, "batch", "/v1/chat/completions", {
                "model": "k3", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": long, "ignore_eos": True, "priority": 0}))}
            await until(client, 1, 0)
            tasks["queued"] = asyncio.ensure_future(ask(
                client, finished, "queued", "/v1/completions", {
                "model": "k3", "prompt": "a b", "max_tokens": 4, "priority": 0}))
            await until(client, 1, 1)
            tasks["urgent"] = asyncio.ensure_future(ask(client, finished, "urgent", "/generate", {
                "text": "c d", "sampling_params": {"max_new_tokens": 4}, "priority": 10}))
            return dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))

    got = asyncio.run(scenario())
    assert got["queued"].status_code == 503
    assert got["queued"].json()["message"] == ABORTED_BY_HIGHER
    assert got["urgent"].status_code == 200 and got["batch"].status_code == 200
    assert finished.index("urgent") < finished.index("batch")
    assert got["batch"].json()["usage"]["completion_tokens"] == long  # preempted, resumed


# --- x-override-priority over HTTP ----------------------------------------------------------
@pytest.fixture(scope="module")
def overriding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The first emulator's flags, run with SGLang's header overrides on."""
    with one_slot(tmp_path_factory, "overriding",
                  SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES="1").served() as emu:
        yield emu


MESSAGES = {"model": "k3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
LONG_CHAT = {"model": "k3", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 100, "ignore_eos": True}


def test_the_header_sets_a_messages_requests_priority_and_overrides_the_body(
        overriding: Emulator) -> None:
    order: list[str] = []

    async def scenario() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(base_url=overriding.url, timeout=60) as client:
            tasks = {"first": asyncio.ensure_future(
                ask(client, order, "first", "/v1/chat/completions", LONG_CHAT))}
            await until(client, 1, 0)
            tasks["low"] = asyncio.ensure_future(
                ask(client, order, "low", "/v1/messages", MESSAGES, "0"))
            await until(client, 1, 1)
            tasks["default"] = asyncio.ensure_future(
                ask(client, order, "default", "/v1/messages", MESSAGES))
            await until(client, 1, 2)
            tasks["urgent"] = asyncio.ensure_future(ask(
                client, order, "urgent", "/generate",
                {"text": "c d", "sampling_params": {"max_new_tokens": 4}}, "20"))
            low = await tasks.pop("low")  # the queue's lowest, dropped for the newcomer
            await until(client, 1, 2)
            # the header's 1, not the body's 30: too low to drop the default's 10
            full = await client.post("/v1/chat/completions", json={
                **LONG_CHAT, "max_tokens": 2, "priority": 30},
                headers={"x-override-priority": "1"})
            done = dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))
            return {**done, "low": low, "full": full}

    got = asyncio.run(scenario())
    # dropped, not the later `default`: header 0 below the default priority 10
    assert got["low"].status_code == 503, got["low"].text
    assert got["low"].json() == {"type": "error", "error": {
        "type": "overloaded_error", "message": "Internal server error"}}
    assert got["full"].status_code == 503 and got["full"].json()["message"] == QUEUE_FULL
    assert all(got[name].status_code == 200 for name in ("first", "default", "urgent"))
    assert got["default"].json()["type"] == "message"
    assert order.index("first") < order.index("urgent") < order.index("default")


def test_a_bad_priority_header_is_sglangs_error_on_each_path(overriding: Emulator) -> None:
    bad = {"x-override-priority": "high"}
    words = ("invalid x-override-priority header 'high': invalid literal for int() with "
             "base 10: 'high'")
    chat = {"model": "k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    with httpx.Client(base_url=overriding.url, timeout=60) as client:
        for path, body in (("/v1/chat/completions", chat), ("/generate", native)):
            reply = client.post(path, json=body, headers=bad)
            assert (reply.status_code, reply.json()) == (400, {
                "object": "error", "message": words, "type": "400", "param": None,
                "code": 400}), path
        ignored = client.post("/v1/completions", headers=bad,
                              json={"model": "k3", "prompt": "hi", "max_tokens": 1})
        assert ignored.status_code == 200, ignored.text  # 0.5.23's completions never read it
        messages = client.post("/v1/messages", json={**MESSAGES, "max_tokens": 1}, headers=bad)
        assert (messages.status_code, messages.json()) == (400, {"type": "error", "error": {
            "type": "invalid_request_error", "message": words}})
        streamed = client.post("/v1/messages", headers=bad,
                               json={**MESSAGES, "max_tokens": 1, "stream": True})
        assert (streamed.status_code, streamed.json()) == (500, {"type": "error", "error": {
            "type": "api_error", "message": "Internal server error"}})
        huge = {"x-override-priority": str(1 << 63)}  # an int, out of SGLang's range
        for path, body, shape in (
                ("/v1/chat/completions", chat, {"object": "error", "message": OUT_OF_RANGE,
                                                "type": "BadRequestError", "param": None,
                                                "code": 400}),
                ("/generate", native, {"error": {"message": OUT_OF_RANGE}}),
                ("/v1/messages", MESSAGES, {"type": "error", "error": {
                    "type": "BadRequestError", "message": OUT_OF_RANGE}})):
            reply = client.post(path, json=body, headers=huge)
            assert (reply.status_code, reply.json()) == (400, shape), path


def test_without_the_switch_the_header_is_ignored_and_messages_take_the_default(
        emulator: Emulator) -> None:
    order: list[str] = []

    async def scenario() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(base_url=emulator.url, timeout=60) as client:
            tasks = {"first": asyncio.ensure_future(
                ask(client, order, "first", "/v1/chat/completions", LONG_CHAT))}
            await until(client, 1, 0)
            tasks["five"] = asyncio.ensure_future(ask(
                client, order, "five", "/v1/chat/completions",
                {**LONG_CHAT, "max_tokens": 4, "priority": 5}, "99"))
            await until(client, 1, 1)
            tasks["messages"] = asyncio.ensure_future(
                ask(client, order, "messages", "/v1/messages", MESSAGES, "high"))
            return dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))

    got = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in got.values()), [r.text for r in got.values()]
    assert order == ["first", "messages", "five"]  # the default, 10, above the body's 5
