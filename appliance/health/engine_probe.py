"""The health monitor's view of the engine: an HTTP probe (`EngineProbe`) and the watcher that
decides what to send when (`EngineWatcher`).

Rules the watcher keeps, because a cold start costs ~90 minutes and a generation costs GPU
time that belongs to users:
- outside READY/DEGRADED (starting, loading, draining, stopped, backoff...) it sends nothing
  at all, not even `/ready`: a loading engine's port is closed anyway, and "never during
  loading" is simpler to prove than "only harmless requests during loading";
- while serving it reads `/ready` and `/metrics` on every poll, for figures only: the
  supervisor's own `/ready` watch owns READY⇄DEGRADED on that signal;
- a generation probe (`/health_generate`, then if it passed a small streaming canary) goes out
  at most once per `canary_interval_seconds`, and only when running+queued requests are at
  most `canary_max_load` by the metrics just read (or `/v1/loads` when there are none); when
  the load is unknown, nothing is sent. SGLang's `/health_generate` is itself a generation.
  It is not gated on `/ready`: a successful `/health_generate` is what turns an engine SGLang
  marked UnHealthy back to Up, so skipping it would keep a recovered engine DEGRADED;
- with `health.generation_probes` off (an engine that cannot generate: a hybrid model on a
  CPU, whose first forward kills it) no generation probe is ever sent; /ready and /metrics
  are all it reads;
- the last probe's result stays in `EngineFigures.canary` until the next one; leaving the
  serving states forgets it (a new engine is probed afresh).

`poll` runs the probes in line: a wedged engine makes one poll last up to twice
`generate_timeout_seconds` (the monitor's job must not overlap itself).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from appliance.clock import Clock
from appliance.config import HealthConfig
from appliance.engine.client import engine_headers
from appliance.engine.states import SERVING, EngineState
from appliance.health.engine_metrics import (
    MetricsFormatError,
    MetricsReading,
    figures_between,
    parse_metrics,
)
from appliance.health.model import CanaryResult, EngineFigures

CANARY_PROMPT = "Count from 1 to 20, separated by spaces."
CANARY_MAX_TOKENS = 16
CHEAP_TIMEOUT = 5.0


class Probe(Protocol):
    """What the watcher asks the engine (the port; `EngineProbe` is the HTTP adapter)."""

    async def ready(self) -> bool | None: ...
    async def metrics_text(self) -> str | None: ...
    async def in_flight(self) -> int | None: ...
    async def health_generate_failure(self, timeout: float) -> str | None: ...
    async def canary(self, model: str, timeout: float, *,
                     at: dt.datetime | None = None) -> CanaryResult: ...


class EngineProbe:
    """SGLang's HTTP endpoints as the health monitor uses them (127.0.0.1). Nothing raises:
    an engine that does not answer is an answer (None, False, or a failed `CanaryResult`).
    `timer` measures the canary (real seconds: a fake clock would hide real latency)."""

    def __init__(self, base_url: str, transport: httpx.AsyncBaseTransport | None = None, *,
                 timer: Callable[[], float] = time.monotonic,
                 api_key: str | None = None) -> None:
        # The engine's API key on every request: /v1/loads and the canary need it.
        self._http = httpx.AsyncClient(base_url=base_url, transport=transport,
                                       timeout=CHEAP_TIMEOUT, trust_env=False,
                                       headers=engine_headers(api_key))
        self._timer = timer

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str, timeout: float = CHEAP_TIMEOUT) -> httpx.Response | None:
        try:
            return await self._http.get(path, timeout=timeout)
        except httpx.HTTPError:
            return None

    async def ready(self) -> bool | None:
        """True: 200; False: answered otherwise (503 while draining, paused, unhealthy);
        None: no answer (port closed, hung)."""
        response = await self._get("/ready")
        return None if response is None else response.status_code == 200

    async def metrics_text(self) -> str | None:
        """`/metrics` (only with --enable-metrics), or None."""
        response = await self._get("/metrics")
        return response.text if response is not None and response.status_code == 200 else None

    async def in_flight(self) -> int | None:
        """Running plus waiting requests from `/v1/loads` (no --enable-metrics needed)."""
        response = await self._get("/v1/loads")
        if response is None or response.status_code != 200:
            return None
        try:
            return sum(int(entry.get("num_running_reqs", 0)) + int(entry.get("num_waiting_reqs", 0))
                       for entry in response.json()["loads"])
        except (ValueError, KeyError, AttributeError, TypeError):
            return None

    async def health_generate_failure(self, timeout: float) -> str | None:
        """Why SGLang's one-token generation through the whole engine (`/health_generate`)
        failed, or None when it answered 200 in time; a timeout is a failure."""
        try:
            response = await self._http.get("/health_generate", timeout=timeout)
        except httpx.TimeoutException:
            return f"/health_generate got no token within {timeout:g} s"
        except httpx.HTTPError as exc:
            return f"/health_generate could not reach the engine ({type(exc).__name__})"
        if response.status_code != 200:
            return f"/health_generate answered {response.status_code}"
        return None

    async def canary(self, model: str, timeout: float, *,
                     at: dt.datetime | None = None) -> CanaryResult:
        """A short streaming chat completion (temperature 0): time to the first content
        chunk, and decode tokens/s from the first to the last one."""
        at = at or dt.datetime.now(dt.UTC)
        body = {"model": model, "messages": [{"role": "user", "content": CANARY_PROMPT}],
                "max_tokens": CANARY_MAX_TOKENS, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        started = self._timer()
        timing = _Timing()
        try:
            async with asyncio.timeout(timeout):
                failure = await self._stream(body, timeout, timing)
        except (TimeoutError, httpx.TimeoutException):
            failure = f"the canary got {timing.chunks} tokens in {timeout:g} s and gave up"
        except httpx.HTTPError as exc:
            failure = f"the canary request failed ({type(exc).__name__}: {exc})"
        if failure is None and timing.first is None:
            failure = "the engine answered the canary without generating a token"
        if failure is not None or timing.first is None or timing.last is None:
            return CanaryResult(at=at, ok=False, error=failure or "no token")
        tokens = timing.usage_tokens or timing.chunks
        span = timing.last - timing.first
        decode = (tokens - 1) / span if tokens > 1 and span > 0 else None
        return CanaryResult(at=at, ok=True, ttft_seconds=timing.first - started,
                            decode_tokens_per_second=decode)

    async def _stream(self, body: dict[str, Any], timeout: float, timing: _Timing) -> str | None:
        async with self._http.stream("POST", "/v1/chat/completions", json=body,
                                     timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread())[:200].decode("utf-8", "replace")
                return f"the canary was answered {response.status_code}: {text}"
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data) if data else None
                except ValueError:
                    continue
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    return f"the engine reported an error mid-stream: {event['error']}"
                timing.note(event, self._timer)
        return None


class _Timing:
    """Content chunk times of one canary stream (reasoning text counts: K3 may think first)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage_tokens: int | None = None

    def note(self, event: dict[str, Any], timer: Callable[[], float]) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
                now = timer()
                self.first = now if self.first is None else self.first
                self.last = now
                self.chunks += 1


class EngineWatcher:
    """Polls one engine on the monitor's schedule (see the module docstring for the rules).
    `generation_probes` counts generation requests sent (`/health_generate` and canaries)."""

    def __init__(self, probe: Probe, health: HealthConfig, model: str, clock: Clock) -> None:
        self._probe, self._health, self._model, self._clock = probe, health, model, clock
        self._previous: tuple[float, MetricsReading] | None = None
        self._probed_at: float | None = None  # monotonic start of the last generation probe
        self._canary: CanaryResult | None = None
        self.generation_probes = 0

    def _forget(self) -> None:
        self._previous, self._probed_at, self._canary = None, None, None

    async def poll(self, state: EngineState, now: dt.datetime) -> EngineFigures:
        if state not in SERVING:
            self._forget()
            return EngineFigures(at=now, state=state.value)
        ready = await self._probe.ready()
        reading = await self._read_metrics()
        moment = self._clock.monotonic()
        previous = self._previous
        window = None
        if reading is not None:
            window = figures_between(previous[1] if previous else None, reading,
                                     moment - previous[0] if previous else 0.0)
            self._previous = (moment, reading)
        # health.generation_probes off: an engine that cannot generate gets none, ever.
        if self._health.generation_probes and self._due(moment) and await self._quiet(reading):
            self._probed_at = moment
            self._canary = await self._generation_probe(now)
        return EngineFigures(
            at=now, state=state.value, ready=ready,
            running_requests=reading.running_requests if reading else None,
            queued_requests=reading.queued_requests if reading else None,
            token_usage=reading.token_usage if reading else None,
            state_usage=reading.state_usage if reading else None,
            cache_hit_rate=window.cache_hit_rate if window else None,
            generation_tokens_per_second=window.generation_tokens_per_second if window else None,
            ttft_p50_seconds=window.ttft_p50_seconds if window else None,
            ttft_p90_seconds=window.ttft_p90_seconds if window else None,
            canary=self._canary)

    async def _read_metrics(self) -> MetricsReading | None:
        text = await self._probe.metrics_text()
        if text is None:
            return None
        try:
            return parse_metrics(text)
        except MetricsFormatError:
            return None

    def _due(self, moment: float) -> bool:
        return self._probed_at is None \
            or moment - self._probed_at >= self._health.canary_interval_seconds

    async def _quiet(self, reading: MetricsReading | None) -> bool:
        """Whether the engine is idle enough for a generation probe; unknown is not."""
        load: int | None = None
        if reading is not None and reading.running_requests is not None \
                and reading.queued_requests is not None:
            load = reading.running_requests + reading.queued_requests
        if load is None:
            load = await self._probe.in_flight()
        return load is not None and load <= self._health.canary_max_load

    async def _generation_probe(self, now: dt.datetime) -> CanaryResult:
        timeout = float(self._health.generate_timeout_seconds)
        self.generation_probes += 1
        failure = await self._probe.health_generate_failure(timeout)
        if failure is not None:
            return CanaryResult(at=now, ok=False, error=failure)
        self.generation_probes += 1
        return await self._probe.canary(self._model, timeout, at=now)
