"""Engine health: SGLang's /metrics read into figures (pure), the engine checks (pure), and the
watcher against the real engine emulator on loopback.

What the watcher sends is proven two ways: an httpx transport that records every request and
forwards it to the emulator, and the emulator's own counters (`/emulator/stats`). Intervals
run on a controllable clock; nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import HealthConfig
from appliance.engine.states import SERVING, EngineState
from appliance.health.engine_checks import engine_checks
from appliance.health.engine_metrics import (
    Histogram,
    MetricsFormatError,
    MetricsReading,
    figures_between,
    parse_metrics,
)
from appliance.health.engine_probe import EngineProbe, EngineWatcher
from appliance.health.model import CanaryResult, EngineFigures, Level
from appliance.testing.clock import FakeClock
from appliance.testing.fake_sglang.histograms import TTFT_BUCKETS, bounds
from appliance.testing.fake_sglang.histograms import Histogram as EmulatorHistogram
from tests.conftest import wait_for
from tests.gateway_rig import MODEL, start_engine, stop_engine
from tests.test_fake_sglang import Emulator, small_model

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
LABELS = 'model_name="kimi-k3",engine_type="unified",pp_rank="0",moe_ep_rank="0"'
TTFT_FLAGS = ("--bucket-time-to-first-token", "0.01", "0.02", "0.05", "0.1", "0.2", "0.5",
              "1", "2", "5")
GENERATION_PATHS = {"/health_generate", "/v1/chat/completions"}


# --- hand-written exposition ---------------------------------------------------------------

def exposition(*, running: int = 0, queued: int = 0, prompt: float = 0, generated: float = 0,
               cached: float = 0, requests: float = 0, ttft: dict[float, float] | None = None,
               gen_gauge: float = 0.0, hit_gauge: float = 0.0, usage: float = 0.1,
               state_usage: float = 0.3) -> str:
    """SGLang-shaped text: gauges from TP0 and TP1 (the same batch, as with
    --enable-metrics-for-all-schedulers), cached tokens split by cache_source, and time to
    first token split by is_streaming (two thirds streaming)."""
    lines = []
    for name, value in (("num_running_reqs", running), ("num_queue_reqs", queued),
                        ("token_usage", usage), ("mamba_usage", state_usage),
                        ("gen_throughput", gen_gauge),
                        ("cache_hit_rate", hit_gauge)):
        lines += [f"# TYPE sglang:{name} gauge"]
        lines += [f'sglang:{name}{{{LABELS},tp_rank="{rank}"}} {float(value)}' for rank in (0, 1)]
    for name, value in (("prompt_tokens_total", prompt), ("generation_tokens_total", generated),
                        ("num_requests_total", requests)):
        lines += [f"# TYPE sglang:{name} counter", f'sglang:{name}{{{LABELS},tp_rank="0"}} '
                  f"{float(value)}"]
    lines += ["# TYPE sglang:cached_tokens_total counter",
              f'sglang:cached_tokens_total{{{LABELS},cache_source="device"}} {cached * 0.75}',
              f'sglang:cached_tokens_total{{{LABELS},cache_source="host"}} {cached * 0.25}']
    if ttft is not None:
        lines.append("# TYPE sglang:time_to_first_token_seconds histogram")
        total = max(ttft.values(), default=0.0)
        for streaming, share in (("True", 2 / 3), ("False", 1 / 3)):
            labels = f'{LABELS},is_streaming="{streaming}",tp_rank="0"'
            for bound, cumulative in sorted(ttft.items()):
                le = "+Inf" if math.isinf(bound) else repr(bound)
                lines.append(f'sglang:time_to_first_token_seconds_bucket{{{labels},le="{le}"}} '
                             f"{cumulative * share}")
            lines += [f"sglang:time_to_first_token_seconds_count{{{labels}}} {total * share}",
                      f"sglang:time_to_first_token_seconds_sum{{{labels}}} {total * share / 4}"]
    return "\n".join(lines) + "\n"


INF = math.inf


def test_parse_combines_label_sets_as_sglang_exports_them() -> None:
    reading = parse_metrics(exposition(running=3, queued=2, cached=120, prompt=400,
                                       generated=900, requests=7,
                                       ttft={0.1: 3, 0.2: 9, INF: 12}))
    assert (reading.running_requests, reading.queued_requests) == (3, 2)  # TP0 only
    assert reading.token_usage == pytest.approx(0.1)
    assert reading.state_usage == pytest.approx(0.3)  # the recurrent-state pool
    assert reading.cached_tokens == pytest.approx(120)  # device + host
    assert (reading.prompt_tokens, reading.generation_tokens, reading.requests) == (400, 900, 7)
    assert reading.time_to_first_token is not None
    bounds = [b for b, _ in reading.time_to_first_token.buckets]
    assert bounds == [0.1, 0.2, INF]
    assert [c for _, c in reading.time_to_first_token.buckets] == pytest.approx([3, 9, 12])
    assert reading.time_to_first_token.count == pytest.approx(12)
    assert reading.e2e_latency is None


def test_parse_refuses_text_that_is_not_prometheus() -> None:
    with pytest.raises(MetricsFormatError):
        parse_metrics("<html>nginx error {{{")
    assert parse_metrics("").running_requests is None


def test_quantiles_interpolate_inside_the_bucket() -> None:
    hist = Histogram(((0.1, 10), (0.2, 30), (0.4, 40), (INF, 40)), 40, 7.0)
    assert hist.quantile(0.5) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert hist.quantile(0.9) == pytest.approx(0.32)  # rank 36: 60% through (0.2, 0.4]
    assert hist.quantile(0.25) == pytest.approx(0.1)  # rank 10: the top of (0, 0.1]
    tail = Histogram(((0.1, 1), (INF, 10)), 10, 30.0)
    assert tail.quantile(0.5) == pytest.approx(0.1)  # in +Inf: the last finite bound
    assert Histogram(((0.1, 0), (INF, 0)), 0, 0.0).quantile(0.5) is None


def test_window_figures_come_from_the_deltas() -> None:
    before = parse_metrics(exposition(prompt=1000, generated=5000, cached=500,
                                      ttft={0.1: 100, 0.2: 100, 0.4: 100, INF: 100}))
    after = parse_metrics(exposition(prompt=1400, generated=5600, cached=800,
                                     ttft={0.1: 110, 0.2: 130, 0.4: 140, INF: 140}))
    window = figures_between(before, after, 10.0)
    assert window.generation_tokens_per_second == pytest.approx(60.0)
    assert window.cache_hit_rate == pytest.approx(300 / 400)
    # the window's 40 observations: 10 ≤0.1, 20 in (0.1, 0.2], 10 in (0.2, 0.4]
    assert window.ttft_p50_seconds == pytest.approx(0.15)
    assert window.ttft_p90_seconds == pytest.approx(0.32)


def test_an_engine_restart_never_gives_negative_rates() -> None:
    before = parse_metrics(exposition(prompt=9000, generated=50_000, cached=4000, requests=90,
                                      ttft={0.1: 500, 0.2: 800, INF: 900}))
    after = parse_metrics(exposition(prompt=200, generated=300, cached=50, requests=2,
                                     ttft={0.1: 1, 0.2: 2, INF: 2}))
    window = figures_between(before, after, 10.0)
    assert window.generation_tokens_per_second == pytest.approx(30.0)  # 300 since the reset
    assert window.cache_hit_rate == pytest.approx(50 / 200)
    assert window.requests_in_window == 2
    assert window.ttft_p50_seconds == pytest.approx(0.1)  # rank 1 of 2: the top of (0, 0.1]
    assert 0 < (window.ttft_p90_seconds or 0) <= 0.2


def test_an_empty_window_has_no_percentiles_and_falls_back_to_gauges() -> None:
    text = exposition(prompt=100, generated=100, ttft={0.1: 5, INF: 5}, gen_gauge=42.0,
                      hit_gauge=0.6)
    reading = parse_metrics(text)
    window = figures_between(reading, parse_metrics(text), 10.0)
    assert window.ttft_p50_seconds is None and window.ttft_p90_seconds is None
    assert window.generation_tokens_per_second == 0.0  # nothing generated: idle, not unknown
    assert window.cache_hit_rate == pytest.approx(0.6)  # no prompt in the window: the gauge
    first = figures_between(None, reading, 0.0)
    assert first.generation_tokens_per_second == pytest.approx(42.0)
    assert first.ttft_p50_seconds is None


def test_a_series_that_appears_counts_from_zero() -> None:
    """prometheus_client exports a labelled series only from its first increment."""
    window = figures_between(MetricsReading(),
                             parse_metrics(exposition(generated=50, ttft={0.1: 2, INF: 2})),
                             10.0)
    assert window.generation_tokens_per_second == pytest.approx(5.0)
    assert window.ttft_p50_seconds == pytest.approx(0.05)


# --- checks (pure) -------------------------------------------------------------------------

HEALTH = HealthConfig()


def serving(**kw: Any) -> EngineFigures:
    base: dict[str, Any] = {"at": NOW, "state": "ready", "ready": True, "running_requests": 0,
                            "queued_requests": 0, "token_usage": 0.1}
    return EngineFigures(**{**base, **kw})


def levels(figures: EngineFigures,
           health: HealthConfig = HEALTH) -> dict[str, tuple[Level, str, str]]:
    return {r.id: (r.level, r.summary, r.hint) for r in engine_checks(figures, health)}


def test_a_loading_engine_is_not_judged() -> None:
    results = engine_checks(EngineFigures(at=NOW, state="loading_weights"), HEALTH)
    assert [r.id for r in results] == ["engine.ready", "engine.generate", "engine.latency",
                                       "engine.metrics", "engine.queue"]
    assert all(r.level is Level.OK and r.summary == "not checked while loading weights"
               and r.group == "engine" for r in results)


def test_a_healthy_serving_engine_is_ok() -> None:
    ok = CanaryResult(at=NOW, ok=True, ttft_seconds=0.25, decode_tokens_per_second=80.0)
    checks = levels(serving(canary=ok))
    assert all(level is Level.OK for level, _, _ in checks.values())
    assert "250 ms" in checks["engine.generate"][1] and "80.0 tokens/s" in checks[
        "engine.generate"][1]


def test_ready_failing_is_critical() -> None:
    assert levels(serving(ready=False))["engine.ready"][0] is Level.CRITICAL
    level, summary, hint = levels(serving(ready=None))["engine.ready"]
    assert level is Level.CRITICAL and "does not answer" in summary and "engine log" in hint


def test_a_failed_generation_is_critical_and_names_the_restart_policy() -> None:
    failed = serving(canary=CanaryResult(at=NOW, ok=False, error="/health_generate answered 503"))
    level, summary, hint = levels(failed)["engine.generate"]
    assert level is Level.CRITICAL
    assert summary == ("the engine is alive but does not generate: /health_generate "
                       "answered 503")
    assert "engine log" in hint and "not restarted automatically" in hint
    restarting = HealthConfig(restart_degraded_after_minutes=15)
    assert "after 15 minutes DEGRADED" in levels(failed, restarting)["engine.generate"][2]


def test_a_slow_canary_warns() -> None:
    slow = serving(canary=CanaryResult(at=NOW, ok=True, ttft_seconds=6.2))
    level, summary, _ = levels(slow)["engine.latency"]
    assert level is Level.WARN and "6200 ms" in summary and "5000 ms" in summary


def test_missing_metrics_warn_only_when_the_engine_answers() -> None:
    level, _, hint = levels(serving(running_requests=None))["engine.metrics"]
    assert level is Level.WARN and "--enable-metrics" in hint
    assert levels(serving(ready=None, running_requests=None))["engine.metrics"][0] is Level.OK


def test_requests_queued_behind_a_full_kv_cache_warn() -> None:
    level, summary, hint = levels(serving(queued_requests=5, token_usage=0.96))["engine.queue"]
    assert level is Level.WARN and "5 requests wait" in summary and "Tuning page" in hint
    assert levels(serving(queued_requests=5, token_usage=0.5))["engine.queue"][0] is Level.OK


# --- against the engine emulator -----------------------------------------------------------

class Recording(httpx.AsyncBaseTransport):
    """Forwards to the real emulator; records every path; can hide paths (404)."""

    def __init__(self, hide: frozenset[str] = frozenset()) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.paths: list[str] = []
        self.hide = hide

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path in self.hide:
            return httpx.Response(404, json={"detail": "Not Found"})
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def generations(self) -> list[str]:
        return [p for p in self.paths if p in GENERATION_PATHS]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = start_engine(tmp_path_factory, "--enable-metrics", *TTFT_FLAGS, token_seconds=0.02)
    yield emu
    stop_engine(emu)


def stats(emu: Emulator) -> dict[str, int]:
    body = httpx.get(f"{emu.url}/emulator/stats", timeout=5).json()
    return {str(k): int(v) for k, v in body.items()}


def idle(emu: Emulator) -> dict[str, int]:
    """The emulator's counters, once nothing runs or waits."""
    seen: list[dict[str, int]] = []

    def quiet() -> bool:
        seen.append(stats(emu))
        return seen[-1]["running"] == 0 and seen[-1]["waiting"] == 0

    wait_for(quiet, "the engine to be idle")
    return seen[-1]


def watcher_for(emu: Emulator, clock: FakeClock, hide: frozenset[str] = frozenset(),
                **health: Any) -> tuple[EngineWatcher, Recording, EngineProbe]:
    recording = Recording(hide)
    probe = EngineProbe(emu.url, transport=recording)
    config = HealthConfig(**{"generate_timeout_seconds": 10, **health})
    return EngineWatcher(probe, config, MODEL, clock), recording, probe


def test_the_emulator_histogram_is_cumulative_with_le_inclusive() -> None:
    hist = EmulatorHistogram((0.1, 0.2))
    for value in (0.1, 0.15, 5.0):
        hist.observe(value)
    text = "\n".join(hist.exposition("sglang:x_seconds", LABELS, "X.")) + "\n"
    reading = {s.labels.get("le", s.name): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert reading == {"0.1": 1, "0.2": 2, "+Inf": 3, "sglang:x_seconds_sum": 5.25,
                       "sglang:x_seconds_count": 3}
    assert bounds([0.5, 0.1, 0.5], TTFT_BUCKETS) == (0.1, 0.5)
    assert bounds(None, TTFT_BUCKETS) == TTFT_BUCKETS


def test_the_emulator_exports_valid_latency_histograms(engine: Emulator) -> None:
    text = httpx.get(f"{engine.url}/metrics", timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:e2e_request_latency_seconds"):
        family = families[name]
        assert family.type == "histogram"
        buckets = [s for s in family.samples if s.name.endswith("_bucket")]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        assert buckets[-1].value == count >= 1  # the startup warmup is a request
    ttft_bounds = [s.labels["le"] for s in families["sglang:time_to_first_token_seconds"].samples
                   if s.name.endswith("_bucket")]
    assert ttft_bounds[:3] == ["0.01", "0.02", "0.05"]  # --bucket-time-to-first-token honoured


def test_a_starting_engine_gets_no_request_at_all(engine: Emulator) -> None:
    before = idle(engine)
    clock = FakeClock()
    watcher, recording, probe = watcher_for(engine, clock)

    async def scenario() -> list[EngineFigures]:
        seen = []
        for state in EngineState:
            if state not in SERVING:
                seen.append(await watcher.poll(state, NOW))
                clock.advance(600)
        await probe.aclose()
        return seen

    figures = asyncio.run(scenario())
    assert recording.paths == [] and watcher.generation_probes == 0
    assert stats(engine)["requests_total"] == before["requests_total"]
    loading = next(f for f in figures if f.state == "loading_weights")
    assert loading == EngineFigures(at=NOW, state="loading_weights")


def test_an_idle_engine_gets_one_generation_probe_per_interval(engine: Emulator) -> None:
    before = idle(engine)
    clock = FakeClock()
    watcher, recording, probe = watcher_for(engine, clock, canary_interval_seconds=300)

    async def scenario() -> list[EngineFigures]:
        seen = [await watcher.poll(EngineState.READY, NOW)]
        for _ in range(5):  # 5 polls 10 s apart: inside the interval
            clock.advance(10)
            seen.append(await watcher.poll(EngineState.READY, NOW))
        clock.advance(250)  # 300 s after the first probe
        seen.append(await watcher.poll(EngineState.DEGRADED, NOW))
        # leaving the serving states forgets the result; the next engine is probed afresh
        seen.append(await watcher.poll(EngineState.LOADING_WEIGHTS, NOW))
        await probe.aclose()
        return seen

    figures = asyncio.run(scenario())
    assert recording.generations() == ["/health_generate", "/v1/chat/completions"] * 2
    assert recording.paths.count("/ready") == 7 and recording.paths.count("/metrics") == 7
    assert watcher.generation_probes == 4
    assert stats(engine)["requests_total"] == before["requests_total"] + 2  # two canaries
    first = figures[0].canary
    assert first is not None and first.ok and first.error == ""
    assert first.ttft_seconds is not None and first.ttft_seconds > 0
    assert first.decode_tokens_per_second is not None and first.decode_tokens_per_second > 0
    assert all(f.canary is first for f in figures[1:6])  # kept until the next probe
    assert figures[6].canary is not first and figures[6].canary is not None
    assert figures[7].canary is None
    checks = {r.id: r for r in engine_checks(figures[6], HealthConfig())}
    assert all(r.level is Level.OK for r in checks.values()), checks


def test_figures_after_traffic(engine: Emulator) -> None:
    idle(engine)
    clock = FakeClock()
    watcher, _, probe = watcher_for(engine, clock)
    prompt = " ".join(f"word{i}" for i in range(60))

    async def scenario() -> tuple[EngineFigures, list[dict[str, Any]]]:
        await watcher.poll(EngineState.READY, NOW)  # probes (due), reads a baseline
        clock.advance(1)
        await watcher.poll(EngineState.READY, NOW)  # the baseline after the canary
        usages = []
        async with httpx.AsyncClient(base_url=engine.url, trust_env=False, timeout=30) as http:
            for _ in range(6):
                reply = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 8, "ignore_eos": True,
                    "messages": [{"role": "user", "content": prompt}]})
                usages.append(reply.json()["usage"])
        clock.advance(10)
        figures = await watcher.poll(EngineState.READY, NOW)
        await probe.aclose()
        return figures, usages

    figures, usages = asyncio.run(scenario())
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 48
    assert figures.generation_tokens_per_second == pytest.approx(generated / 10)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert figures.cache_hit_rate == pytest.approx(cached / sum(u["prompt_tokens"] for u in usages))
    p50, p90 = figures.ttft_p50_seconds, figures.ttft_p90_seconds
    # every first token comes after at least one 0.02 s token step: not below (0.01, 0.02]
    assert p50 is not None and p90 is not None and 0.01 <= p50 <= p90 < 5
    assert figures.running_requests == 0 and figures.queued_requests == 0
    assert figures.token_usage == 0.0 and figures.ready is True


async def hold_busy(engine: Emulator, count: int) -> tuple[list[asyncio.Task[None]],
                                                           httpx.AsyncClient]:
    """`count` long streaming requests held open (aborted when their tasks are cancelled)."""
    http = httpx.AsyncClient(base_url=engine.url, trust_env=False, timeout=60)

    async def stream() -> None:
        async with http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 5000, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "a long one"}]}) as response:
            async for _ in response.aiter_lines():
                pass

    tasks = [asyncio.create_task(stream()) for _ in range(count)]
    for _ in range(400):  # bounded: 20 s
        if (await http.get("/emulator/stats")).json()["running"] >= count:
            break
        await asyncio.sleep(0.05)
    return tasks, http


async def release(tasks: list[asyncio.Task[None]], http: httpx.AsyncClient) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
    await http.aclose()


@pytest.mark.parametrize("hide", [frozenset(), frozenset({"/metrics"})],
                         ids=["metrics", "v1-loads"])
def test_a_busy_engine_gets_no_generation_probe(engine: Emulator, hide: frozenset[str]) -> None:
    idle(engine)
    clock = FakeClock()
    watcher, recording, probe = watcher_for(engine, clock, hide=hide, canary_max_load=2)

    async def scenario() -> EngineFigures:
        tasks, http = await hold_busy(engine, 3)
        try:
            figures = await watcher.poll(EngineState.READY, NOW)
            clock.advance(600)
            await watcher.poll(EngineState.READY, NOW)
        finally:
            await release(tasks, http)
            await probe.aclose()
        return figures

    figures = asyncio.run(scenario())
    assert recording.generations() == [] and watcher.generation_probes == 0
    assert figures.canary is None
    if hide:  # no metrics: the load came from /v1/loads, and engine.metrics says so
        assert "/v1/loads" in recording.paths and figures.running_requests is None
        assert levels(figures)["engine.metrics"][0] is Level.WARN
    else:
        assert "/v1/loads" not in recording.paths
        assert figures.running_requests == 3
    idle(engine)


def test_an_unknown_load_gets_no_generation_probe(engine: Emulator) -> None:
    idle(engine)
    watcher, recording, probe = watcher_for(
        engine, FakeClock(), hide=frozenset({"/metrics", "/v1/loads"}))

    async def scenario() -> None:
        await watcher.poll(EngineState.READY, NOW)
        await probe.aclose()

    asyncio.run(scenario())
    assert recording.paths == ["/ready", "/metrics", "/v1/loads"]
    assert watcher.generation_probes == 0


def test_an_idle_engine_without_metrics_is_probed_by_its_v1_loads(engine: Emulator) -> None:
    idle(engine)
    watcher, recording, probe = watcher_for(engine, FakeClock(), hide=frozenset({"/metrics"}))

    async def scenario() -> EngineFigures:
        figures = await watcher.poll(EngineState.READY, NOW)
        await probe.aclose()
        return figures

    figures = asyncio.run(scenario())
    assert recording.generations() == ["/health_generate", "/v1/chat/completions"]
    assert figures.canary is not None and figures.canary.ok


# --- an engine that is alive but does not generate (fault case 8) --------------------------

@pytest.fixture
def wedged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The emulator's scheduler wedges after ready; its own health check gives up after 2 s."""
    root = tmp_path_factory.mktemp("wedged")
    emu = Emulator(root, [str(small_model(root / "model", 1 << 20)), "--served-model-name",
                          MODEL, "--enable-metrics"],
                   FAKE_SGLANG_FAULT="unhealthy", SGLANG_HEALTH_CHECK_TIMEOUT="2")
    try:
        emu.wait_ready()
        yield emu
    finally:
        emu.kill()


def test_a_wedged_engine_is_critical_and_its_canary_fails(wedged: Emulator) -> None:
    clock = FakeClock()

    async def scenario() -> tuple[list[EngineFigures], CanaryResult]:
        impatient, _, first_probe = watcher_for(wedged, clock, generate_timeout_seconds=1)
        seen = [await impatient.poll(EngineState.READY, NOW)]  # gives up before the engine
        await first_probe.aclose()
        patient, recording, probe = watcher_for(wedged, clock, generate_timeout_seconds=10)
        seen.append(await patient.poll(EngineState.READY, NOW))  # the engine's own 503
        seen.append(await patient.poll(EngineState.DEGRADED, NOW))
        assert recording.generations() == ["/health_generate"]  # no canary after a failure
        canary = await probe.canary(MODEL, 1.0, at=NOW)
        await probe.aclose()
        return seen, canary

    figures, canary = asyncio.run(scenario())
    timed_out, answered, later = figures
    assert timed_out.canary is not None and not timed_out.canary.ok
    assert timed_out.canary.error == "/health_generate got no token within 1 s"
    assert answered.canary is not None and answered.canary.error == \
        "/health_generate answered 503"
    generate = levels(answered)["engine.generate"]
    assert generate[0] is Level.CRITICAL and "alive but does not generate" in generate[1]
    # SGLang marks itself UnHealthy after a failed check: /ready turns 503
    assert later.ready is False and levels(later)["engine.ready"][0] is Level.CRITICAL
    assert later.canary is answered.canary  # not probed again inside the interval
    assert not canary.ok and "gave up" in canary.error and canary.ttft_seconds is None
