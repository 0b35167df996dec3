"""The load runner: real streaming requests to the local engine's OpenAI endpoint.

One round = `concurrency` users, each sending one `/v1/completions` request with
`stream=true`, a prompt of the shape's input tokens and `max_tokens` + `ignore_eos` so the
answer is exactly the shape's output tokens (SGLang takes `ignore_eos` as an extra sampling
parameter). Every prompt starts with its own nonce, so no user's prompt is a prefix of
another's and the prefix cache, flushed before the round (`POST /flush_cache`), gives nothing.
The filler is a fixed cycle of common words, one token each in the emulator (which counts
words) and about one each in a real tokenizer.

While a round runs, `/metrics` is scraped each second for the KV pool (`sglang:token_usage`)
and the state pool (`sglang:mamba_usage`); an engine without `--enable-metrics` just leaves
them unknown. A watchdog ends the round as **wedged** when no stream has produced a token
for `wedge_seconds` (a prefill counts from the round's start), and as cancelled when the
`cancel` event is set. Every loop is bounded: the users, the scrape, and a whole round by
`round_limit` seconds. Times are the engine's: on a time-scaled emulator (`time_scale`
wall seconds per engine second) the runner's clock runs at that scale.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from appliance.qualify.plan import Shape, Workload
from appliance.qualify.verdict import Sample

FILLER = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with",
          "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which",
          "but", "have", "an", "had", "they", "you", "were", "their", "one", "all", "we",
          "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who")
FLUSH_TRIES = 20
SCRAPE_SECONDS = 1.0
MAX_GAPS = 100_000  # inter-token gaps kept per request (an answer longer than this is not)


def prompt_text(nonce: str, tokens: int) -> str:
    """`tokens` words: the nonce, then the filler cycle (deterministic)."""
    words = [nonce] + [FILLER[i % len(FILLER)] for i in range(max(0, tokens - 1))]
    return " ".join(words)


@dataclass(frozen=True)
class RoundResult:
    samples: tuple[Sample, ...]
    seconds: float
    wedged: bool
    cancelled: bool
    kv_peak: float | None
    state_peak: float | None


def gauge(text: str, name: str) -> float | None:
    """The largest value of Prometheus gauge `name` in an exposition text (one per rank)."""
    found: float | None = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
            found = value if found is None else max(found, value)
    return found


class LoadRunner:
    """Talks to one engine at `base_url` with its API key (see the module doc)."""

    def __init__(self, base_url: str, *, api_key: str | None, model: str,
                 wedge_seconds: float, round_limit: float = 3600.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 monotonic: Callable[[], float] | None = None,
                 time_scale: float = 1.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No overall timeout on a stream: the watchdog judges progress across all of them.
        # Its limits are in the engine's time; a read waits that long on the wall clock.
        timeout = httpx.Timeout(10.0, read=wedge_seconds * time_scale + 30.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout,
                                       transport=transport, trust_env=False, limits=limits)
        self.model, self.wedge_seconds, self.round_limit = model, wedge_seconds, round_limit
        # Every time is the engine's (`time_scale` wall seconds per engine second), so a
        # time-scaled emulator is measured as the box it models.
        self._now = monotonic or (lambda: time.monotonic() / time_scale)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def flush_cache(self, cancel: asyncio.Event) -> None:
        """Empty the prefix cache; SGLang refuses (400) while anything still runs, so it is
        asked again a few times. Raises `RuntimeError` with the engine's words when it never
        agrees."""
        last = ""
        for _ in range(FLUSH_TRIES):
            if cancel.is_set():
                return
            try:
                response = await self._http.post("/flush_cache", timeout=30.0)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code} {response.text.strip()[:200]}"
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the engine would not flush its prefix cache ({last})")

    async def occupancy(self) -> tuple[float | None, float | None]:
        """(KV pool, state pool) in use now, 0-1; None where `/metrics` does not say."""
        try:
            response = await self._http.get("/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None, None
        if response.status_code != 200:
            return None, None
        text = response.text
        return gauge(text, "sglang:token_usage"), gauge(text, "sglang:mamba_usage")

    async def run_round(self, workload: Workload, concurrency: int, tag: str,
                        cancel: asyncio.Event) -> RoundResult:
        """One round (module doc); returns when every user is done, or at a wedge or cancel."""
        started = self._now()
        progress = [started]
        partials = [_Partial(sent_at=started) for _ in range(concurrency)]
        users = [asyncio.create_task(self._user(workload.shape(u), f"{tag}u{u}", partials[u],
                                                progress)) for u in range(concurrency)]
        peaks: list[float | None] = [None, None]
        scraper = asyncio.create_task(self._scrape(peaks))
        wedged = cancelled = False
        try:
            pending = set(users)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.25)
                now = self._now()
                if cancel.is_set():
                    cancelled = True
                    break
                if now - progress[0] > self.wedge_seconds or now - started > self.round_limit:
                    wedged = True
                    break
        finally:
            for task in (*users, scraper):
                task.cancel()
            await asyncio.gather(*users, scraper, return_exceptions=True)
        seconds = max(self._now() - started, 1e-6)
        samples = tuple(_sample(partials[u], task, workload.shape(u), wedged, cancelled)
                        for u, task in enumerate(users))
        return RoundResult(samples, seconds, wedged, cancelled, peaks[0], peaks[1])

    async def _scrape(self, peaks: list[float | None]) -> None:
        while True:
            kv, state = await self.occupancy()
            for index, value in enumerate((kv, state)):
                if value is not None:
                    current = peaks[index]
                    peaks[index] = value if current is None else max(current, value)
            await asyncio.sleep(SCRAPE_SECONDS)

    async def _user(self, shape: Shape, nonce: str, partial: _Partial,
                    progress: list[float]) -> None:
        partial.sent_at = self._now()
        body = {"model": self.model, "prompt": prompt_text(nonce, shape.input_tokens),
                "max_tokens": shape.output_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace").strip()
                    partial.error = f"HTTP {response.status_code} {text[:200]}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._chunk(partial, data, progress)
                    if partial.error:
                        return
            partial.end_at = self._now()
            if partial.reported is not None:
                partial.tokens = partial.reported
            if partial.tokens < shape.output_tokens:
                partial.error = (f"the answer ended after {partial.tokens} of "
                                 f"{shape.output_tokens} tokens")
        except httpx.HTTPError as exc:
            partial.error = f"{type(exc).__name__}: {exc}"[:300]

    def _chunk(self, partial: _Partial, data: str, progress: list[float]) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            partial.error = str(event["error"])[:300]
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            partial.reported = usage["completion_tokens"]
        choices = event.get("choices")
        if not choices or not isinstance(choices, list):
            return
        text = choices[0].get("text") if isinstance(choices[0], dict) else None
        if not text:
            return
        now = self._now()
        progress[0] = now
        if partial.first_token_at is None:
            partial.first_token_at = now
        elif len(partial.gaps) < MAX_GAPS:
            partial.gaps.append(now - partial.last_at)
        partial.last_at = now
        partial.tokens += 1


@dataclass
class _Partial:
    """A user's request as it streams (mutable; frozen into a `Sample` at the end)."""

    sent_at: float
    first_token_at: float | None = None
    last_at: float = 0.0
    end_at: float | None = None
    tokens: int = 0
    reported: int | None = None
    gaps: list[float] = field(default_factory=list)
    error: str = ""


def _sample(partial: _Partial, task: asyncio.Task[None], shape: Shape, wedged: bool,
            cancelled: bool) -> Sample:
    """The frozen sample of one user, however its task ended: a task that did not finish on
    its own (the round was cut) is a failure, with the tokens it did get still counted."""
    error = partial.error
    finished = task.done() and not task.cancelled() and task.exception() is None
    if not finished and not error:
        error = ("cancelled" if cancelled else
                 "no token within the wedge limit" if wedged else "the request did not finish")
    return Sample(sent_at=partial.sent_at, first_token_at=partial.first_token_at,
                  end_at=None if error else partial.end_at, output_tokens=partial.tokens,
                  input_tokens=shape.input_tokens, gaps=tuple(partial.gaps), error=error)
