"""The engine emulator's serving performance model: its constants, its profiles and its knobs.
A test and demo instrument (`appliance.testing.fake_sglang`). Pure; nothing is read from the
environment until `perf_from_env` is called (at startup, by `faults.faults_from_env`).

Off by default: without `FAKE_SGLANG_PERF` the emulator paces every token at
`slow_tokens` seconds and admits up to `max_running_requests`, as it always has. With
`FAKE_SGLANG_PERF=k3-b300` a step-based scheduler (`scheduler.py`) serves requests the way
SGLang does on one B300x8 with Kimi K3, in *model time*:

    step(b, p)  = base + per_request * b + p / prefill_tps       one engine iteration: b
                                                                 requests decode, p prompt
                                                                 tokens prefill (mixed chunk)
    tokens      = tokens_per_step per decoding request per step  (DSPARK's speculative
                                                                 decoding, as a mean; one
                                                                 chunk per step)
    ITL(b)      ~ base + per_request * b                          the gap between chunks
    prefill     <= chunk tokens per step, in arrival order        (chunked prefill; a prompt
                                                                 longer than a chunk takes
                                                                 several steps)
    KV pool     kv_tokens; a request holds prompt + generated     admission reserves
                                                                 new_token_ratio x the rest
                                                                 of every answer, as SGLang's
                                                                 PrefillAdder does

When the pool cannot hold the next decode step SGLang retracts running requests (fewest
generated tokens first) back to the queue, where they re-prefill prompt and output so far,
and raises its new_token_ratio; a request left waiting longer than `waiting_timeout` model
seconds fails with SGLang's 503 "Request waiting timeout reached." (`SGLANG_REQ_WAITING_TIMEOUT`
and `SGLANG_REQ_RUNNING_TIMEOUT` override the profile's values, in model seconds; <= 0 is off).

`k3-b300` is calibrated from the field figures in `calibration.py` (8K-in/1K-out at client
concurrency 10-50): base 27 ms and 1.08 ms per running request fit the ITL column; 1.8 tokens
a step and 14,000 prefill tokens/s fit the output tok/s column and the TTFT p90s (the
initial burst of 8K prefills); a 380,000-token pool holds 40 such requests (9.2K each at the
end) but not 50, and leaves about 10 waiting at 50 (the field's 10.9 s TTFT median at about
one completion a second); the 60 s waiting timeout fits 119 failures of 200 in the 226 s the
field run at 50 took, and the TTFT p90 of 46.7 s among the rest. Not reproduced: the field's
throughput fall at 50 (367 tok/s); the model keeps decoding about 40 requests, so its output
tok/s stays near the 40-user figure while TTFT and failures collapse (see `calibration.py`).
The field engine reported 313 state slots (62 requests); the model's admission cap is the
emulator's own `max_running_requests` unless `max_running=` is given.

Knobs: `FAKE_SGLANG_PERF=PROFILE[,name=value...]` with names `base_ms`, `per_request_ms`,
`tokens_per_step`, `prefill_tps`, `chunk`, `kv_tokens`, `max_running`, `waiting_timeout`,
`running_timeout`; `FAKE_SGLANG_TIME_SCALE=F` multiplies every modelled duration by F (0.05
runs twenty times faster; timeouts scale too, since they are model seconds). Rates the model
reports (tokens/s) are in model time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any


class PerfError(ValueError):
    """A bad `FAKE_SGLANG_PERF` / `FAKE_SGLANG_TIME_SCALE` value (the emulator exits 2)."""


@dataclass(frozen=True)
class PerfModel:
    """One calibrated engine, in model seconds. `max_running` None: the emulator's own
    `max_running_requests` (from its flags and memory model)."""

    name: str
    base_seconds: float  # a decode step's fixed cost
    per_request_seconds: float  # what each running request adds to a step
    tokens_per_step: float  # tokens a decoding request gets per step (speculative decoding)
    prefill_tps: float  # prompt tokens prefilled per second of step time
    chunk_tokens: int  # at most this many prompt tokens prefill in one step
    kv_tokens: int  # the KV pool, in tokens
    max_running: int | None = None
    waiting_timeout: float = 0.0  # model seconds in the waiting queue before a 503; 0: off
    running_timeout: float = 0.0  # model seconds from arrival while running; 0: off
    init_new_token_ratio: float = 0.7  # SGLang's default_init_new_token_ratio
    min_new_token_ratio: float = 0.7 * 0.14  # ... x default_min_new_token_ratio_factor
    new_token_ratio_decay_steps: int = 600  # default_new_token_ratio_decay_steps
    time_scale: float = 1.0  # real seconds per model second

    def step_seconds(self, decoding: int, prefill_tokens: int) -> float:
        """One engine iteration, model seconds: `decoding` requests decode while
        `prefill_tokens` prompt tokens prefill in the same forward (mixed chunk)."""
        return (self.base_seconds + self.per_request_seconds * decoding
                + prefill_tokens / self.prefill_tps)

    def itl(self, decoding: int) -> float:
        """The gap between two chunks of a request in a pure decode batch of `decoding`."""
        return self.step_seconds(decoding, 0)

    @property
    def ratio_decay(self) -> float:
        return ((self.init_new_token_ratio - self.min_new_token_ratio)
                / max(1, self.new_token_ratio_decay_steps))


K3_B300 = PerfModel(
    name="k3-b300",
    base_seconds=0.027,
    per_request_seconds=0.00108,
    tokens_per_step=1.8,
    prefill_tps=14_000.0,
    chunk_tokens=8192,
    kv_tokens=380_000,
    waiting_timeout=60.0,
)
PROFILES: dict[str, PerfModel] = {K3_B300.name: K3_B300}

_FLOATS = {"base_ms": ("base_seconds", 1e-3), "per_request_ms": ("per_request_seconds", 1e-3),
           "tokens_per_step": ("tokens_per_step", 1.0), "prefill_tps": ("prefill_tps", 1.0),
           "waiting_timeout": ("waiting_timeout", 1.0),
           "running_timeout": ("running_timeout", 1.0)}
_INTS = {"chunk": "chunk_tokens", "kv_tokens": "kv_tokens", "max_running": "max_running"}
_POSITIVE = ("tokens_per_step", "prefill_tps", "chunk", "kv_tokens", "max_running")


def _number(item: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PerfError(f"FAKE_SGLANG_PERF: {item!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise PerfError(f"FAKE_SGLANG_PERF: {item!r} must be a finite number >= 0")
    return value


def parse_perf(text: str | None, time_scale: str | None = None) -> PerfModel | None:
    """`PROFILE[,name=value...]` (see the module docstring) and the time scale; None when the
    model is off (empty, or `off`). A time scale without a model is refused: a test asking
    for a fast clock would otherwise run at the default pace without knowing."""
    spec = (text or "").strip()
    scale_text = (time_scale or "").strip()
    if not spec or spec == "off":
        if scale_text:
            raise PerfError("FAKE_SGLANG_TIME_SCALE needs the performance model: set "
                            "FAKE_SGLANG_PERF too, e.g. FAKE_SGLANG_PERF=k3-b300")
        return None
    name, *items = (part.strip() for part in spec.split(","))
    if name not in PROFILES:
        raise PerfError(f"FAKE_SGLANG_PERF: unknown profile {name!r} (known: "
                        f"{', '.join(sorted(PROFILES))}, or off)")
    model = PROFILES[name]
    for item in items:
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise PerfError(f"FAKE_SGLANG_PERF: {item!r} needs a value, e.g. {key}=1")
        number = _number(item, value.strip())
        if key in _POSITIVE and number <= 0:
            raise PerfError(f"FAKE_SGLANG_PERF: {item!r} must be more than 0")
        if key in _FLOATS:
            field, unit = _FLOATS[key]
            changes: dict[str, Any] = {field: number * unit}
        elif key in _INTS:
            changes = {_INTS[key]: int(number)}
        else:
            raise PerfError(f"FAKE_SGLANG_PERF: unknown knob {key!r} (known: "
                            f"{', '.join(sorted((*_FLOATS, *_INTS)))})")
        model = replace(model, **changes)
    if scale_text:
        scale = _number(f"FAKE_SGLANG_TIME_SCALE={scale_text}", scale_text)
        if scale <= 0:
            raise PerfError("FAKE_SGLANG_TIME_SCALE must be more than 0, e.g. 0.05")
        model = replace(model, time_scale=scale)
    return model


def perf_from_env(environ: Mapping[str, str]) -> PerfModel | None:
    """The model the environment asks for, with SGLang's own request timeouts honoured
    (`SGLANG_REQ_WAITING_TIMEOUT`, `SGLANG_REQ_RUNNING_TIMEOUT`: model seconds, <= 0 off)."""
    model = parse_perf(environ.get("FAKE_SGLANG_PERF"), environ.get("FAKE_SGLANG_TIME_SCALE"))
    if model is None:
        return None
    for var, field in (("SGLANG_REQ_WAITING_TIMEOUT", "waiting_timeout"),
                       ("SGLANG_REQ_RUNNING_TIMEOUT", "running_timeout")):
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            seconds = float(raw)
        except ValueError:
            raise PerfError(f"{var}={raw!r} is not a number of seconds") from None
        timeout: dict[str, Any] = {field: max(0.0, seconds)}
        model = replace(model, **timeout)
    return model
