"""The engine emulator's pretend scheduler: admission, queueing and token pacing. A test and
demo instrument (`appliance.testing.fake_sglang`): no model runs here.

At most `max_running_requests` requests run at once; the rest wait in arrival order (they are
`num_queue_reqs`), or by priority then arrival with `--enable-priority-scheduling`, and
`--max-queued-requests` refuses at the queue's bound (SGLang's rules: `priority.py`). A
running request produces one token every `token_seconds` (`FAKE_SGLANG_FAULT=slow_tokens=S`,
default 0.01 s). The text is deterministic: words from a
fixed list, chosen by a hash of the prompt, so the same prompt always gets the same answer.
Without `max_tokens` an answer is 8-40 tokens long and ends with "stop"; with it, an answer
that would run longer is cut at `max_tokens` ("length"); `ignore_eos` makes it exactly
`max_tokens`. Prompt tokens are counted as words (plus a few per chat message), which is
what the usage figures report. A caller may fix an answer's natural length (`plan(natural=)`:
reasoning and tool calls, see `answer.py`).

When a request is admitted (its prefill) the pretend radix cache (`prefixcache.py`) gives it
its `cached_tokens`. The counters behind `GET /emulator/stats` live here too: requests
started, finished and aborted (a client that went away, queued or running), and the most
requests ever running at once (`peak_running`, reset by `reset_peak`). So do the latency
histograms `/metrics` reports (`histograms.py`): time to first token and inter-token gaps as
tokens come out, end-to-end latency when a request finishes, all from arrival on the
emulator's monotonic clock.

With the performance model on (`FAKE_SGLANG_PERF`, `perfmodel.py`) the pacing above is
replaced: one stepping task drives the model's `Scheduler` (`scheduler.py`), sleeping each
step's modelled duration times `FAKE_SGLANG_TIME_SCALE`, and hands every request the tokens
its step produced (with speculative decoding, often two at once). Admission, the queue, KV
usage, retraction and timeouts are then the model's; a request the model fails raises
`EngineAbort` (SGLang's 503 "Request waiting timeout reached."), which the serving layer
answers as SGLang does. The histograms and `gen_throughput` are then in model seconds (real
seconds divided by the scale), so a demo at 20x speed still shows the box's figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.faults import Faults
from appliance.testing.fake_sglang.histograms import (
    E2E_BUCKETS,
    INTER_TOKEN_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    bounds,
)
from appliance.testing.fake_sglang.logwriter import LogWriter
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.perfmodel import PerfModel
from appliance.testing.fake_sglang.prefixcache import PrefixCache
from appliance.testing.fake_sglang.priority import PriorityPolicy
from appliance.testing.fake_sglang.scheduler import Scheduler, Seq, Step

if TYPE_CHECKING:
    from appliance.testing.fake_sglang.disagg import Bootstrap, Handover

WORDS = (
    "emulated", "tokens", "from", "fake_sglang", "the", "appliance", "test", "instrument",
    "no", "model", "was", "run", "here", "kimi", "k3", "would", "answer", "better", "than",
    "this", "deterministic", "placeholder", "text", "for", "demos", "and", "tests", "only",
)
THROUGHPUT_WINDOW = 5


def seed_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "replace")).digest()[:8], "big")


def word(seed: int, index: int) -> str:
    text = WORDS[(seed + index * 7) % len(WORDS)]
    return text if index == 0 else " " + text


def natural_length(seed: int) -> int:
    """How long a text answer runs when nothing cuts it: 8-40 tokens."""
    return 8 + seed % 33


@dataclass(frozen=True)
class Prompt:
    """A prompt as the emulator sees it: `text` seeds the answer, `ids` are its tokens (their
    count is `prompt_tokens`; the prefix cache compares them)."""

    text: str
    ids: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass
class Request:
    rid: str
    prompt_tokens: int
    completion_tokens: int  # how many it will produce
    finish_reason: str  # "stop" or "length"
    seed: int
    prompt_ids: tuple[str, ...] = ()
    reasoning: int = 0  # the first this many generated tokens are reasoning (answer.py)
    cached_tokens: int = 0  # set at admission by the prefix cache
    generated: int = 0
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    bootstrap: Bootstrap | None = None  # a cell's request: where its KV comes from (disagg.py)
    priority: int = 0  # PriorityPolicy.assign's (priority.py)
    refused: str | None = None  # aborted while waiting (by a higher priority, priority.py)

    @property
    def key(self) -> str:
        return self.rid

    @property
    def queued_at(self) -> float:
        return self.arrived

    @property
    def text(self) -> str:
        return "".join(word(self.seed, i) for i in range(self.generated))


class EngineAbort(Exception):
    """The engine gave up on a request (the performance model's timeouts): SGLang's
    `FINISH_ABORT` with a status code, answered as an error (503), in-band when streaming."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class Mailbox:
    """What the stepping task has handed one modelled request and not yet consumed."""

    tokens: int = 0
    gap: float = 0.0  # model seconds between this delivery and the one before
    done: bool = False
    error: str | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Core:
    """Running and waiting requests, the counters `/metrics` and `/v1/loads` report, and the
    server's status (SGLang's ServerStatus plus the SIGTERM drain flag)."""

    def __init__(self, args: ServeArgs, cap: Capacity, faults: Faults, log: LogWriter) -> None:
        self.args, self.cap, self.faults, self.log = args, cap, faults, log
        self.token_seconds = faults.token_seconds
        self.running: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.status = "Starting"  # Starting -> Up (after warmup) -> UnHealthy (failed check)
        self.draining = False
        self.handle_loop_started = False
        self.on_handle_loop: Callable[[], None] | None = None  # lifecycle.py: arms the drain
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.prefill_tokens_total = 0
        self.cached_tokens_total = 0
        self.finished_total = 0
        self.peak_running = 0
        self.prefix_cache = PrefixCache()
        values = args.values
        self.ttft = Histogram(bounds(values.get("bucket_time_to_first_token"), TTFT_BUCKETS))
        self.inter_token = Histogram(
            bounds(values.get("bucket_inter_token_latency"), INTER_TOKEN_BUCKETS))
        self.e2e = Histogram(bounds(values.get("bucket_e2e_request_latency"), E2E_BUCKETS))
        self._recent: deque[list[int]] = deque()  # [whole second, tokens in it]
        self._ids = itertools.count()
        self.perf: PerfModel | None = faults.perf
        self.priority = PriorityPolicy.of(args)
        self.engine = Scheduler(faults.perf, cap.max_running_requests,
                                policy=self.priority) if faults.perf else None
        self.time_scale = faults.perf.time_scale if faults.perf else 1.0
        self._mailboxes: dict[str, Mailbox] = {}
        self._modelled: dict[str, Request] = {}
        self._stepper: asyncio.Task[None] | None = None
        self.handover: Handover | None = None
        if args.disaggregation_mode in ("prefill", "decode"):
            from appliance.testing.fake_sglang.disagg import Handover

            self.handover = Handover(args, log, self.time_scale)

    # -- planning -------------------------------------------------------------------------
    def plan(self, prompt: Prompt, max_tokens: int | None, min_tokens: int = 0,
             ignore_eos: bool = False, *, natural: int | None = None,
             reasoning: int = 0) -> Request:
        """How many tokens the answer gets and why it ends. `natural` replaces the text
        answer's own length (a reasoning prefix, a tool call)."""
        seed = seed_of(prompt.text)
        prompt_tokens = prompt.tokens
        if natural is None:
            natural = natural_length(seed)
        room = max(1, self.cap.context_len - prompt_tokens)
        if max_tokens is None:
            count, reason = natural, "stop"
        elif ignore_eos:
            count, reason = max_tokens, "length"
        else:
            count = min(natural, max_tokens)
            reason = "length" if natural > max_tokens else "stop"
        if min_tokens > count:
            count = min_tokens if max_tokens is None else min(min_tokens, max_tokens)
        if count >= room:
            count, reason = room, "length"
        return Request(rid=uuid.uuid4().hex, prompt_tokens=prompt_tokens,
                       completion_tokens=max(0, count), finish_reason=reason, seed=seed,
                       prompt_ids=prompt.ids, reasoning=reasoning)

    # -- state ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queue(self) -> int:
        return len(self.waiting)

    @property
    def in_flight(self) -> int:
        return self.num_running + self.num_queue

    @property
    def used_tokens(self) -> int:
        if self.engine is not None:
            return self.engine.used_tokens
        return sum(r.prompt_tokens + r.generated for r in self.running.values())

    @property
    def pool_tokens(self) -> int:
        """The KV pool in tokens: the performance model's when it is on, else the memory
        model's (`max_total_num_tokens`)."""
        return self.engine.pool_tokens if self.engine is not None else self.cap.kv_tokens

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.pool_tokens if self.pool_tokens else 0.0

    @property
    def num_retracted(self) -> int:
        """Retracted requests now back in the queue (SGLang's `num_retracted_reqs`)."""
        return self.engine.retracted_waiting if self.engine is not None else 0

    @property
    def new_token_ratio(self) -> float:
        return self.engine.new_token_ratio if self.engine is not None else 0.0

    def clock(self) -> float:
        """Seconds on the emulator's monotonic clock, in model time when the model is on."""
        return time.monotonic() / self.time_scale

    @property
    def state_slots_used(self) -> int:
        return self.num_running * self.cap.slots_per_request

    def _prune(self, now: int) -> None:
        while self._recent and self._recent[0][0] <= now - THROUGHPUT_WINDOW:
            self._recent.popleft()

    def _count_token(self) -> None:
        now = int(self.clock())
        if self._recent and self._recent[-1][0] == now:
            self._recent[-1][1] += 1
        else:
            self._recent.append([now, 1])
            self._prune(now)

    @property
    def gen_throughput(self) -> float:
        """Tokens per second over the last few seconds."""
        self._prune(int(self.clock()))
        return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW

    def auto_create_handle_loop(self) -> None:
        """SGLang's `TokenizerManager.auto_create_handle_loop`: the first request that reaches
        the tokenizer manager (a generation, warmup included; a health check that generates;
        `/server_info`, `/v1/loads`, `/flush_cache`) starts its loop, which installs the
        SIGTERM drain handler. Before it SIGTERM is uvicorn's: no drain (lifecycle.py)."""
        if not self.handle_loop_started:
            self.handle_loop_started = True
            if self.on_handle_loop is not None:
                self.on_handle_loop()

    def ready(self) -> bool:
        """SGLang's `/ready`: started, not draining, not unhealthy."""
        return self.status == "Up" and not self.draining

    def stats(self) -> dict[str, int]:
        """`GET /emulator/stats` (an emulator-only extension, for tests). With the performance
        model on it adds `failed_total` (requests the engine aborted: timeouts),
        `retracted_total` (retractions so far) and `kv_pool_tokens`."""
        stats = {"running": self.num_running, "waiting": self.num_queue,
                 "peak_running": self.peak_running, "requests_total": self.num_requests_total,
                 "finished_total": self.finished_total,
                 "aborted_total": self.num_aborted_requests_total,
                 "max_running_requests": self.cap.max_running_requests}
        if self.engine is not None:
            stats |= {"failed_total": self.engine.failed_total,
                      "retracted_total": self.engine.retracted_total,
                      "kv_pool_tokens": self.engine.pool_tokens,
                      "max_running_requests": self.engine.max_running}
        return stats

    def reset_peak(self) -> None:
        """Start a new peak window: the peak since now is what runs now."""
        self.peak_running = self.num_running

    def flush_cache(self) -> bool:
        """SGLang's `/flush_cache`: refused while any request is running or waiting."""
        if self.in_flight:
            return False
        self.prefix_cache.flush()
        return True

    # -- the request's life ---------------------------------------------------------------
    def _admit_waiting(self) -> None:
        while self.waiting and self.num_running < self.cap.max_running_requests:
            req = self.waiting.popleft() if not self.priority.enabled \
                else min(self.waiting, key=self.priority.rank)
            if self.priority.enabled:
                self.waiting.remove(req)
            self.running[req.rid] = req
            self.peak_running = max(self.peak_running, self.num_running)
            req.admitted.set()
            req.cached_tokens = self.prefix_cache.admit(req.prompt_ids)
            self.cached_tokens_total += req.cached_tokens
            new = req.prompt_tokens - req.cached_tokens
            self.prefill_tokens_total += new
            self.log.line(
                f"Prefill batch, #new-seq: 1, #new-token: {new}, "
                f"#cached-token: {req.cached_tokens}, "
                f"full token usage: {self.token_usage:.2f}, mamba usage: "
                f"{self.state_slots_used / max(1, self.cap.state_slots):.2f}, #running-req: "
                f"{self.num_running - 1}, #queue-req: {self.num_queue}, #pending-token: 0, "
                f"cuda graph: False, input throughput (token/s): 0.00", 0)

    async def generate(self, req: Request) -> AsyncGenerator[str, None]:
        """The request's tokens, paced; queued first when every running slot is taken. Closing
        the iterator early (a client that went away) aborts the request. A cell's request
        (`req.bootstrap`, on a prefill or decode engine) hands its KV over first, and a
        prefill's one token waits for the handover (`disagg.py`; failures raise
        `EngineAbort`)."""
        self.auto_create_handle_loop()
        handover, boot = self.handover, req.bootstrap
        if handover is None or boot is None:
            async with contextlib.aclosing(self._generate(req)) as tokens:
                async for token in tokens:
                    yield token
            return
        await handover.before(req, boot)
        held: list[str] = []
        finished = False
        try:
            async with contextlib.aclosing(self._generate(req)) as tokens:
                async for token in tokens:
                    if handover.prefill:
                        held.append(token)
                    else:
                        yield token
            finished = True
        finally:
            if handover.prefill:
                handover.sent(req, boot, finished)
        if handover.prefill:
            for token in held:
                yield token

    async def _generate(self, req: Request) -> AsyncGenerator[str, None]:
        self.num_requests_total += 1
        self.prompt_tokens_total += req.prompt_tokens
        if self.engine is not None:
            async with contextlib.aclosing(self._generate_modelled(req, self.engine)) as tokens:
                async for token in tokens:
                    yield token
            return
        self._queue(req)
        self._admit_waiting()
        finished = False
        try:
            await req.admitted.wait()
            if req.refused is not None:
                raise EngineAbort(req.refused)
            if self.faults.unhealthy and self.status != "Starting":
                # wedged after ready (the warmup still passes, as faults.py says): never answers
                await asyncio.Event().wait()
            last_token_at = req.arrived
            while req.generated < req.completion_tokens:
                await asyncio.sleep(self.token_seconds)
                req.generated += 1
                now = time.monotonic()
                if req.first_token_at is None:
                    req.first_token_at = now
                    self.ttft.observe(now - req.arrived)
                else:
                    self.inter_token.observe(now - last_token_at)
                last_token_at = now
                self.generation_tokens_total += 1
                self._count_token()
                yield word(req.seed, req.generated - 1)
            finished = True
            self.finished_total += 1
            self.e2e.observe(time.monotonic() - req.arrived)
        finally:
            if not finished:
                self.num_aborted_requests_total += 1
            self.running.pop(req.rid, None)
            if req in self.waiting:
                self.waiting.remove(req)
            self._admit_waiting()

    def _queue(self, req: Request) -> None:
        """Into the waiting queue, unless `--max-queued-requests` refuses it (EngineAbort) or
        aborts a lower-priority waiting request for it (priority.py)."""
        verdict = self.priority.on_full_queue(req, self.waiting)
        if verdict is not None and verdict[0] == req.rid:
            raise EngineAbort(verdict[1])
        if verdict is not None:
            victim = next(r for r in self.waiting if r.rid == verdict[0])
            self.waiting.remove(victim)
            victim.refused = verdict[1]
            victim.admitted.set()
        self.waiting.append(req)

    # -- the performance model ------------------------------------------------------------
    async def _generate_modelled(self, req: Request,
                                 engine: Scheduler) -> AsyncGenerator[str, None]:
        """`generate` under the performance model: the stepping task delivers the tokens."""
        if self.faults.unhealthy and self.status != "Starting":
            await asyncio.Event().wait()  # wedged after ready, as in `generate`
        box = self._mailboxes[req.rid] = Mailbox()
        self._modelled[req.rid] = req
        req.cached_tokens = self.prefix_cache.admit(req.prompt_ids)
        self.cached_tokens_total += req.cached_tokens
        self.prefill_tokens_total += req.prompt_tokens - req.cached_tokens
        refused = engine.add(Seq(key=req.rid, prompt=req.prompt_tokens,
                                 target=req.completion_tokens, arrived=self.clock(),
                                 cached=req.cached_tokens, priority=req.priority), self.clock())
        for key, message in refused.items():
            if key == req.rid:
                self._mailboxes.pop(req.rid, None)
                self._modelled.pop(req.rid, None)
                raise EngineAbort(message)
            self._fail(key, message)
        self._sync(engine)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.ensure_future(self._run_steps(engine))
        finished = False
        try:
            while True:
                await box.event.wait()
                box.event.clear()
                if box.error is not None:
                    raise EngineAbort(box.error)
                count, box.tokens = box.tokens, 0
                now = self.clock()
                for _ in range(count):
                    req.generated += 1
                    if req.first_token_at is None:
                        req.first_token_at = now
                        self.ttft.observe(now - req.arrived / self.time_scale)
                    else:
                        self.inter_token.observe(box.gap / count)
                    self.generation_tokens_total += 1
                    self._count_token()
                    yield word(req.seed, req.generated - 1)
                if box.done:
                    break
            finished = True
            self.finished_total += 1
            self.e2e.observe(self.clock() - req.arrived / self.time_scale)
        finally:
            if not finished:
                self.num_aborted_requests_total += 1
                engine.cancel(req.rid)
            self._mailboxes.pop(req.rid, None)
            self._modelled.pop(req.rid, None)
            self._sync(engine)

    def _sync(self, engine: Scheduler) -> None:
        """Mirror the model's running and waiting requests into the core's own (what the
        reports, the stats and the drain read)."""
        requests = self._modelled
        self.running = {s.key: requests[s.key] for s in engine.running.values()
                        if s.key in requests}
        self.waiting = deque(requests[s.key] for s in engine.waiting if s.key in requests)
        self.peak_running = max(self.peak_running, self.num_running)

    async def _run_steps(self, engine: Scheduler) -> None:
        """The engine loop: one modelled step after another while there is work."""
        last: dict[str, float] = {}
        while engine.busy:
            step = engine.step(self.clock())
            if step is None:
                break
            for key, message in step.failed.items():
                last.pop(key, None)
                self._fail(key, message)
            self._sync(engine)
            self._log_step(step)
            # Until the step's modelled end, not for its duration: the work done since it
            # started (scheduling, logging) is then inside the step instead of adding to it,
            # which made a loaded machine's emulator drift behind its model.
            await asyncio.sleep(max(0.0, step.ends - self.clock()) * self.time_scale)
            for key, count in step.tokens.items():
                box = self._mailboxes.get(key)
                if box is not None:
                    box.tokens += count
                    box.gap = step.ends - last.get(key, step.ends)
                    box.event.set()
                last[key] = step.ends
            for key in step.finished:
                last.pop(key, None)
                box = self._mailboxes.get(key)
                if box is not None:
                    box.done = True
                    box.event.set()
            self._sync(engine)

    def _fail(self, key: str, message: str) -> None:
        box = self._mailboxes.get(key)
        if box is not None:
            box.error = message
            box.event.set()

    def _log_step(self, step: Step) -> None:
        for line in step.log:
            self.log.line(line, 0)
        if step.prefill_tokens:
            self.log.line(
                f"Prefill batch, #new-seq: 1, #new-token: {step.prefill_tokens}, "
                f"#cached-token: 0, full token usage: {self.token_usage:.2f}, #running-req: "
                f"{step.decoding}, #queue-req: {self.num_queue}, #pending-token: 0, cuda graph: "
                f"False, input throughput (token/s): "
                f"{step.prefill_tokens / max(step.duration, 1e-9):.2f}", 0)

    async def decode_log_loop(self) -> None:
        """TP0's `Decode batch` line every --decode-log-interval steps while anything runs."""
        interval = max(0.2, self.args.decode_log_interval * self.token_seconds)
        while True:
            await asyncio.sleep(interval)
            if not self.running or self.faults.unhealthy:
                continue
            self.log.line(
                f"Decode batch, #running-req: {self.num_running}, #full token: "
                f"{self.used_tokens}, full token usage: {self.token_usage:.2f}, mamba num: "
                f"{self.state_slots_used}, mamba usage: "
                f"{self.state_slots_used / max(1, self.cap.state_slots):.2f}, cuda graph: True, "
                f"gen throughput (token/s): {self.gen_throughput:.2f}, #queue-req: "
                f"{self.num_queue}", 0)
