"""The engine emulator's serving performance model (issue 15, "an emulator that behaves like
the box under load"): the calibrated model reproduces the field table in model time (a pure
simulation over the same scheduler the emulator serves with), its knobs are refused when
malformed, and a real emulator process with the model on and a fast clock keeps up with 10
streaming users and collapses (waiting timeouts, SGLang's 503 in-band) under 50.

No wall-clock assertions: the pure tests run in model time, and the process test asserts on
what the emulator's own counters and the streams say.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from appliance.testing.fake_sglang.calibration import FIELD, simulate
from appliance.testing.fake_sglang.faults import FaultError, faults_from_env
from appliance.testing.fake_sglang.perfmodel import K3_B300, PerfError, parse_perf
from appliance.testing.fake_sglang.scheduler import WAITING_TIMEOUT, Scheduler, Seq
from tests.test_fake_sglang import Emulator, small_model


# -- the model against the field table (model time) ----------------------------------------
@pytest.mark.parametrize("point", FIELD[:4], ids=lambda p: f"c{p.concurrency}")
def test_itl_and_output_throughput_match_the_field_within_15_percent(point: Any) -> None:
    result = simulate(point.concurrency)
    assert result.failed == 0 and result.completed == 200
    assert result.output_tps == pytest.approx(point.output_tps, rel=0.15)
    assert result.itl_median * 1000 == pytest.approx(point.itl_median_ms, rel=0.15)


def test_fifty_users_collapse_with_failures_and_ttft_over_10_s() -> None:
    forty, fifty = simulate(40), simulate(50)
    assert forty.failed == 0 and forty.retracted == 0
    assert fifty.failed > 0  # waiting past SGLang's timeout
    assert fifty.ttft_p90 > 10.0 and fifty.ttft_median > forty.ttft_median
    assert fifty.retracted > 0  # the pool filled: running requests went back to the queue


def test_the_pool_is_never_overrun_and_retraction_requeues() -> None:
    """Invariants under pressure: eight requests, and a pool that admits four prompts on a
    low new_token_ratio but cannot hold their answers."""
    model = replace(K3_B300, kv_tokens=4 * 1100, waiting_timeout=0.0,
                    init_new_token_ratio=0.1, min_new_token_ratio=0.1)
    scheduler = Scheduler(model, max_running=64)
    for index in range(8):
        scheduler.add(Seq(key=str(index), prompt=1000, target=200, arrived=0.0), 0.0)
    now, produced, done = 0.0, dict.fromkeys(map(str, range(8)), 0), set()
    for _ in range(20_000):
        step = scheduler.step(now)
        if step is None:
            break
        assert scheduler.used_tokens <= model.kv_tokens
        for key, count in step.tokens.items():
            produced[key] += count
        done.update(step.finished)
        now = step.ends
    assert not scheduler.busy and done == set(produced)
    assert all(count == 200 for count in produced.values())
    assert scheduler.retracted_total > 0


def test_a_request_waiting_past_the_timeout_fails_with_sglangs_message() -> None:
    model = replace(K3_B300, kv_tokens=2000, waiting_timeout=5.0)
    scheduler = Scheduler(model, max_running=64)
    scheduler.add(Seq(key="a", prompt=1500, target=1000, arrived=0.0), 0.0)
    scheduler.add(Seq(key="b", prompt=1500, target=10, arrived=0.0), 0.0)
    now, failed = 0.0, {}
    while scheduler.busy and not failed:
        step = scheduler.step(now)
        assert step is not None
        failed.update(step.failed)
        now = step.ends
    assert failed == {"b": WAITING_TIMEOUT} and 5.0 < now < 6.0


# -- the knobs ----------------------------------------------------------------------------
def test_knobs_parse_and_bad_ones_are_refused() -> None:
    assert parse_perf(None) is None and parse_perf("off") is None
    model = parse_perf("k3-b300,kv_tokens=60000,waiting_timeout=8,base_ms=30", "0.1")
    assert model is not None
    assert (model.kv_tokens, model.waiting_timeout, model.base_seconds, model.time_scale) == \
        (60000, 8.0, pytest.approx(0.030), 0.1)
    for spec, scale in (("k9-h100", None), ("k3-b300,kv_tokens", None),
                        ("k3-b300,speed=2", None), ("k3-b300,kv_tokens=0", None),
                        ("k3-b300", "0"), ("k3-b300", "fast"), (None, "0.05")):
        with pytest.raises(PerfError):
            parse_perf(spec, scale)
    env = {"FAKE_SGLANG_PERF": "k3-b300", "SGLANG_REQ_WAITING_TIMEOUT": "-1"}
    faults = faults_from_env(env)
    assert faults.perf is not None and faults.perf.waiting_timeout == 0.0
    assert faults_from_env({}).perf is None  # off by default: the old pacing
    with pytest.raises(FaultError):
        faults_from_env({"FAKE_SGLANG_TIME_SCALE": "0.05"})


# -- a real emulator process with the model on ----------------------------------------------
SCALE = 0.1
PROMPT_WORDS = 2048
OUTPUT_TOKENS = 256
# a pool for about 26 such requests: 10 users fit, 50 leave 24 waiting past the 8 s timeout
PERF = "k3-b300,kv_tokens=60000,waiting_timeout=8"


@pytest.fixture(scope="module")
def modelled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    model_dir = small_model(tmp_path_factory.mktemp("model"), shard_bytes=1 << 16)
    emu = Emulator(tmp_path_factory.mktemp("modelled"),
                   [str(model_dir), "--enable-metrics", "--mamba-full-memory-ratio", "0.5"],
                   FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_PERF=PERF,
                   FAKE_SGLANG_TIME_SCALE=str(SCALE))
    with emu.served():
        yield emu


async def stream_one(client: httpx.AsyncClient, index: int) -> tuple[int, str | None]:
    """One streaming completion: (tokens received, the in-band error's message or None)."""
    body = {"model": "k3", "prompt": " ".join(f"w{index}x{i}" for i in range(PROMPT_WORDS)),
            "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": True}
    tokens, error = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line.removeprefix("data: "))
            if "error" in frame:
                error = frame["error"]["message"]
            elif frame["choices"][0]["text"]:
                tokens += 1
    return tokens, error


async def ladder_round(url: str, users: int, requests: int) -> list[tuple[int, str | None]]:
    """`users` closed-loop clients sharing `requests` prompts (bench_serving's
    --max-concurrency), 127.0.0.1 only, every loop bounded by `requests`."""
    queue = list(range(requests))
    results: list[tuple[int, str | None]] = []
    limits = httpx.Limits(max_connections=users + 5)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def user() -> None:
            while queue:
                results.append(await stream_one(client, queue.pop()))

        await asyncio.gather(*(user() for _ in range(users)))
    return results


def stats(emu: Emulator) -> dict[str, int]:
    return dict(httpx.get(f"{emu.url}/emulator/stats", timeout=10).json())


def test_a_real_emulator_serves_10_users_and_collapses_at_50(modelled: Emulator) -> None:
    before = stats(modelled)
    assert before["kv_pool_tokens"] == 60000 and before["failed_total"] == 0
    ten = asyncio.run(ladder_round(modelled.url, 10, 20))
    assert [error for _, error in ten] == [None] * 20
    assert all(tokens == OUTPUT_TOKENS for tokens, _ in ten)
    after_ten = stats(modelled)
    assert after_ten["failed_total"] == 0 and after_ten["running"] == 0
    assert after_ten["finished_total"] - before["finished_total"] == 20

    fifty = asyncio.run(ladder_round(modelled.url, 50, 50))
    failures = [error for _, error in fifty if error is not None]
    assert failures and set(failures) == {WAITING_TIMEOUT}
    assert all(tokens == OUTPUT_TOKENS for tokens, error in fifty if error is None)
    after = stats(modelled)
    assert after["failed_total"] == len(failures)
    assert after["peak_running"] < 50  # the pool, not the users, set the batch
    metrics = httpx.get(f"{modelled.url}/metrics", timeout=10).text
    assert 'sglang:max_total_num_tokens{' in metrics and "} 60000.0" in metrics
    aborted = next(line for line in metrics.splitlines()
                   if line.startswith("sglang:num_aborted_requests_total{"))
    assert float(aborted.rsplit(" ", 1)[1]) >= len(failures)
