"""The performance model's scheduler: SGLang's loop of engine iterations over a KV pool, as
a pure state machine in model time. A test and demo instrument
(`appliance.testing.fake_sglang`); the constants are `perfmodel.py`'s.

The emulator's core (`core.py`) and the calibration's simulation (`calibration.py`) drive the
same `Scheduler`: `add` a request, call `step(now)` for the next iteration, and apply what it
returns at `now + step.duration` (the core sleeps that long, scaled; the simulation just
advances its clock). Requests that arrive during a step join at the next one, as in SGLang.

One step, in SGLang's order:
1. timeouts: a request waiting longer than `waiting_timeout` (since it last entered the queue)
   or running longer than `running_timeout` (since arrival) fails with SGLang's 503 message;
2. prefill: up to `chunk_tokens` prompt tokens, first the chunked request in progress, then
   new requests in arrival order (retracted ones keep their arrival, so they go first), each
   admitted only while the running count is under `max_running` and the pool holds what the
   running requests still need (their unprefilled prompt plus `new_token_ratio` x the rest of
   their answers, capped at 4,096 each: SGLang's PrefillAdder) and the newcomer's share;
3. decode: every request whose prompt was prefilled before this step gets `tokens_per_step`
   tokens (a fraction carries over); a request whose last chunk of prompt prefills in this step
   gets its first token. If the pool cannot hold this step's tokens, requests are retracted
   first (fewest generated tokens, then longest prompt; at least one; never the last): they
   free their KV and go back to the queue to prefill prompt + generated again, and
   new_token_ratio rises to (generated + 20 x running) / requested, as SGLang's
   `retract_decode` sets it; otherwise the ratio decays towards its minimum;
4. the step lasts `model.step_seconds(decoding, prefilled)`.

With priority scheduling (`policy`, `priority.py`: SGLang's rules, from its flags) step 2 first
sorts the queue by priority then queue-entry time; when the running count is at `max_running`,
the head of the queue preempts running requests more than the threshold below it (they free
their KV and are queued again after this step's admissions, as SGLang re-adds its
`preempt_list`); step 3 retracts the lowest priority first under `--retraction-policy
priority`; and `--max-queued-requests` applies wherever a request enters the queue (`add`, a
preempted or retracted one going back): the newcomer is refused or, with priority
scheduling, a lower-ranked waiting request aborted for it (both in `failed`).

Invariants: `used_tokens <= kv_tokens` after every step; a request is in exactly one of
waiting and running until it finishes, fails or is cancelled; tokens only ever add up to the
request's `target`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from appliance.testing.fake_sglang.perfmodel import PerfModel
from appliance.testing.fake_sglang.priority import PriorityPolicy

WAITING_TIMEOUT = "Request waiting timeout reached."
RUNNING_TIMEOUT = "Request running timeout reached."
TOO_LARGE = "Request does not fit in the KV cache pool."
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS


@dataclass(eq=False)
class Seq:
    """One request as the scheduler sees it (token counts only)."""

    key: str
    prompt: int
    target: int  # tokens it will generate
    arrived: float  # model seconds
    cached: int = 0  # prompt tokens the prefix cache already holds
    generated: int = 0
    credit: float = 0.0  # a fraction of a token carried to the next step
    kv: int = 0  # tokens it holds in the pool
    to_prefill: int = 0  # tokens to prefill before it decodes
    queued_at: float = 0.0  # when it last entered the waiting queue
    retractions: int = 0
    priority: int = 0  # as PriorityPolicy.assign set it (0 without priority scheduling)

    @property
    def remaining(self) -> int:
        return self.target - self.generated


@dataclass(frozen=True)
class Step:
    """One engine iteration: it starts at `started`, and its tokens, finishes and retractions
    take effect `duration` model seconds later; `failed` (timeouts) take effect at once."""

    started: float
    duration: float
    tokens: dict[str, int]
    finished: tuple[str, ...]
    failed: dict[str, str]
    retracted: tuple[str, ...]
    prefill_tokens: int
    decoding: int
    new_token_ratio: float
    log: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()  # running requests a higher priority took the place of

    @property
    def ends(self) -> float:
        return self.started + self.duration


@dataclass
class Scheduler:
    model: PerfModel
    max_running: int
    waiting: deque[Seq] = field(default_factory=deque)
    running: dict[str, Seq] = field(default_factory=dict)
    chunked: Seq | None = None
    new_token_ratio: float = -1.0
    retracted_total: int = 0
    failed_total: int = 0
    prefill_tokens_total: int = 0
    steps: int = 0
    policy: PriorityPolicy = field(default_factory=PriorityPolicy)
    preempted_total: int = 0
    _preempted: list[Seq] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.new_token_ratio < 0:
            self.new_token_ratio = self.model.init_new_token_ratio
        self.max_running = max(1, self.model.max_running or self.max_running)

    # -- state ----------------------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        return self.model.kv_tokens

    @property
    def used_tokens(self) -> int:
        return sum(s.kv for s in self.running.values())

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def retracted_waiting(self) -> int:
        """Requests in the queue that were running once (SGLang's num_retracted_reqs)."""
        return sum(1 for s in self.waiting if s.retractions)

    def add(self, seq: Seq, now: float) -> dict[str, str]:
        """Queue `seq`; what `--max-queued-requests` aborted instead (the newcomer, or a
        lower-ranked waiting request), key to SGLang's 503 message."""
        seq.queued_at = now
        seq.to_prefill = seq.prompt - seq.cached
        return self._queue(seq)

    def _queue(self, seq: Seq) -> dict[str, str]:
        """SGLang's `_add_request_to_queue`, which a preempted or retracted request passes
        through again: `--max-queued-requests` may abort it, or a waiting one for it."""
        verdict = self.policy.on_full_queue(seq, self.waiting)
        if verdict is None:
            self._enqueue(seq)
            return {}
        self.failed_total += 1
        if verdict[0] != seq.key:
            self.waiting = deque(s for s in self.waiting if s.key != verdict[0])
            self._enqueue(seq)
        return dict([verdict])

    def cancel(self, key: str) -> None:
        """The client went away: forget the request wherever it is."""
        seq = self.running.pop(key, None)
        if seq is self.chunked:
            self.chunked = None
        if seq is None:
            self.waiting = deque(s for s in self.waiting if s.key != key)

    def _enqueue(self, seq: Seq) -> None:
        # SGLang appends to its waiting queue, a retracted request too (fcfs keeps that order)
        self.waiting.append(seq)

    def _reserved(self, seq: Seq) -> float:
        return seq.to_prefill + min(seq.remaining, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def _fits(self, seq: Seq) -> bool:
        if not self.running:  # alone it only needs room for its prompt and a first token
            return seq.to_prefill + seq.cached + 1 <= self.pool_tokens
        free = self.pool_tokens - self.used_tokens
        return free - sum(self._reserved(s) for s in self.running.values()) \
            >= self._reserved(seq)

    # -- one iteration --------------------------------------------------------------------
    def step(self, now: float) -> Step | None:
        """The next engine iteration at model time `now`, or None when there is no work."""
        failed = self._timeouts(now)
        prefill = self._prefill(now)
        for seq in self._preempted:  # queued again after this step's admissions
            failed.update(self._queue(seq))
        first = {key for key, _ in prefill if self.running[key].to_prefill == 0}
        decoders = [s for s in self.running.values()
                    if s.to_prefill == 0 and s.key not in first]
        need = len(decoders) * math.ceil(self.model.tokens_per_step) + len(first)
        retracted: list[Seq] = []
        log: list[str] = []
        if decoders and self.pool_tokens - self.used_tokens < need:
            old = self.new_token_ratio
            retracted = self._retract(decoders, need, now, failed)
            decoders = [s for s in decoders if s not in retracted]
            log.append(f"KV cache pool is full. Retract requests. #retracted_reqs: "
                       f"{len(retracted)}, #aborted_retracted_reqs: 0, #new_token_ratio: "
                       f"{old:.4f} -> {self.new_token_ratio:.4f}")
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.model.ratio_decay,
                                       self.model.min_new_token_ratio)
        if not prefill and not decoders and not failed:
            if self.waiting and not self.running:  # it can never fit: refuse it
                seq = self.waiting.popleft()
                failed[seq.key] = TOO_LARGE
                self.failed_total += 1
            if not failed:
                return None
        tokens: dict[str, int] = {}
        free = self.pool_tokens - self.used_tokens  # what retraction could not free stalls
        for key in first:
            seq = self.running[key]
            if seq.target > 0 and free > 0:
                seq.generated += 1
                seq.kv += 1
                free -= 1
                tokens[key] = 1
        for seq in decoders:
            seq.credit += self.model.tokens_per_step
            count = max(0, min(int(seq.credit), seq.remaining, free))
            free -= count
            seq.credit -= count
            seq.generated += count
            seq.kv += count
            if count:
                tokens[seq.key] = count
        finished = tuple(key for key, seq in self.running.items()
                         if seq.to_prefill == 0 and seq.remaining <= 0)
        for key in finished:
            del self.running[key]
        prefilled = sum(n for _, n in prefill)
        self.prefill_tokens_total += prefilled
        self.steps += 1
        duration = self.model.step_seconds(len(decoders), prefilled) \
            if prefill or decoders else 0.0
        preempted, self._preempted = tuple(s.key for s in self._preempted), []
        return Step(started=now, duration=duration, tokens=tokens, finished=finished,
                    failed=failed, retracted=tuple(s.key for s in retracted),
                    prefill_tokens=prefilled, decoding=len(decoders),
                    new_token_ratio=self.new_token_ratio, log=tuple(log), preempted=preempted)

    def _timeouts(self, now: float) -> dict[str, str]:
        failed: dict[str, str] = {}
        limit = self.model.waiting_timeout
        if limit > 0:
            for seq in [s for s in self.waiting if now - s.queued_at > limit]:
                self.waiting.remove(seq)
                failed[seq.key] = WAITING_TIMEOUT
        limit = self.model.running_timeout
        if limit > 0:
            for seq in [s for s in self.running.values() if now - s.arrived > limit]:
                del self.running[seq.key]
                if seq is self.chunked:
                    self.chunked = None
                failed[seq.key] = RUNNING_TIMEOUT
        self.failed_total += len(failed)
        return failed

    def _prefill(self, now: float) -> list[tuple[str, int]]:
        """This step's prompt chunks, admitting from the queue as room allows."""
        if self.policy.enabled:
            self.waiting = deque(self.policy.order(self.waiting))
        admitted: set[str] = set()
        budget = self.model.chunk_tokens
        chunks: list[tuple[str, int]] = []
        if self.chunked is not None:
            seq = self.chunked
            count = min(budget, seq.to_prefill)
            chunks.append((seq.key, count))
            budget -= count
            seq.to_prefill -= count
            seq.kv += count
            self.chunked = seq if seq.to_prefill else None
        while budget > 0 and self.chunked is None and self.waiting:
            head = self.waiting[0]
            if len(self.running) >= self.max_running \
                    and not self._preempt_for(head, admitted, now):
                break
            if not self._fits(head):
                break
            seq = self.waiting.popleft()
            admitted.add(seq.key)
            self.running[seq.key] = seq
            seq.kv = seq.cached
            count = min(budget, seq.to_prefill)
            chunks.append((seq.key, count))
            budget -= count
            seq.to_prefill -= count
            seq.kv += count
            if seq.to_prefill:
                self.chunked = seq
        return chunks

    def _preempt_for(self, seq: Seq, admitted: set[str], now: float) -> bool:
        """SGLang's `preempt_to_schedule`: free running requests of a low enough priority
        (never the chunked one, nor one admitted in this step) until `seq` fits."""
        candidates = [s for s in self.running.values()
                      if s is not self.chunked and s.key not in admitted]
        taken: list[Seq] = []
        for victim in self.policy.preemptible(seq, candidates):
            taken.append(victim)
            del self.running[victim.key]
            if self._fits(seq):
                break
        if not taken or not self._fits(seq):
            for victim in taken:
                self.running[victim.key] = victim
            return False
        for victim in taken:
            self._release(victim, now)
            self._preempted.append(victim)
            self.preempted_total += 1
        return True

    def _release(self, seq: Seq, now: float) -> None:
        """A request leaves the running batch with its KV freed, to prefill its prompt and
        what it generated again when it is admitted next."""
        seq.kv = 0
        seq.credit = 0.0
        seq.cached = 0
        seq.to_prefill = seq.prompt + seq.generated
        seq.queued_at = now  # SGLang restarts the waiting clock when it re-queues one

    def _retract(self, decoders: list[Seq], need: int, now: float,
                 failed: dict[str, str]) -> list[Seq]:
        """SGLang's `retract_decode`: retract until this step's tokens fit (at least one,
        never the last), then re-estimate new_token_ratio from what stays."""
        order = sorted(decoders, reverse=True, key=lambda s: self.policy.retraction_key(
            s.priority, s.generated, s.prompt))
        retracted: list[Seq] = []
        per_request = math.ceil(self.model.tokens_per_step)
        while len(order) > 1 and (not retracted or self.pool_tokens - self.used_tokens < need):
            seq = order.pop()
            del self.running[seq.key]
            need -= per_request
            self._release(seq, now)
            seq.retractions += 1
            failed.update(self._queue(seq))
            retracted.append(seq)
            self.retracted_total += 1
        requested = sum(s.target for s in self.running.values()) or 1
        generated = sum(s.generated for s in self.running.values())
        self.new_token_ratio = min(
            1.0, (generated + RETRACT_DECODE_STEPS * len(self.running)) / requested)
        return retracted
