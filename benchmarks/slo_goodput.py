"""Goodput under SLOs (issue 24): open-loop Poisson arrivals at multiples of the qualified
capacity on the calibrated engine emulator, straight to the engine, through the gateway's
qualified admission (no classes), and through SLO-aware admission (the classes on).

    .venv/bin/python benchmarks/slo_goodput.py [--scale 0.25] [--levels 0.5,1,1.5,2]
        [--minutes 2] [--drain 120] [--batch-share 0.2] [--point 8] [--capacity N]
        [--seed 24] [--keep]

One engine emulator (`FAKE_SGLANG_PERF=k3-b300`, `--max-running-requests 62`, its clock
`FAKE_SGLANG_TIME_SCALE=--scale` times real: 0.25 runs four times faster; at 0.1 the emulator
falls behind its own clock on a 2-core machine, decoding slower than its model, so streams
read as under the floor that a box would not see) and two gateway
processes in front of it, each a fresh box on 127.0.0.1 whose ledger holds a qualification at
`--point` users for the spec it sees running (8: what this emulator qualifies at on a loaded
2-core machine, benchmarks/README.md, "Admission at the qualified point"), so both admit at
the qualified point:

  direct     straight to the emulator (SGLang's own queue and 60 s waiting timeout)
  qualified  the gateway as before classes: every request one class, waiting in its fair
             queue for up to 600 s
  slo        the gateway with [gateway.classes]: interactive with a 5 s TTFT SLO and a
             32 tokens/s floor (refused at once with 429 when predicted to miss), batch with
             a 600 s deadline, half the slots, a lower priority; a key of each

The qualified capacity (requests per model minute) is measured first: one burst of
`--point` interactive requests through the SLO gateway (its first measures, as a gateway in
service has), capacity = point / their mean duration (Little's law; `--capacity`, in
requests per model minute, replaces it, so that two runs, before and after a change, send
the same schedules; the burst runs anyway). Then for each level x that capacity and each
mode the same seeded Poisson schedule for
`--minutes` model minutes: each arrival is batch with probability `--batch-share` (a
32,768-token prompt, 1,000 tokens out), else interactive (8,192 in, 1,000 out), each one
`/v1/completions` stream (a unique prompt, `ignore_eos`). After the last arrival the cell
waits up to `--drain` model seconds, then cancels what is left (counted as not served).

Every figure is in model time (the emulator's clock: real seconds / scale), except the
refusals' answer time, which is the gateway's own and real. An interactive request meets its
SLO when it completes with its first token within 5 s of sending and decodes at 32 tokens/s
or more; a batch one when it completes within 600 s of sending. Goodput: requests meeting
their SLO per model minute of arrivals. Printed side by side with ratios; targets beside.
Nothing is asserted: a measuring instrument, run by hand (about 9 minutes at the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from gateway_throughput import (  # beside this script
    Child,
    clean_env,
    free_port,
    http_get,
    model_dir,
    percentile,
    prepare_gateway,
    spawn,
    wait_until,
)

from appliance.clock import SystemClock
from appliance.config import load_config
from appliance.db.database import Database
from appliance.engine.publish import write_published
from appliance.gateway.keys import create_key
from appliance.qualify import ledger, plan
from appliance.qualify.runner import prompt_text
from appliance.secrets import server_secret

MODEL = "kimi-k3"
MAX_RUNNING = 62
SPEC = "benchmark-slo-goodput".ljust(64, "0")
INTERACTIVE, BATCH = "interactive", "batch"
SHAPES = {INTERACTIVE: (8192, 1000), BATCH: (32768, 1000)}  # (tokens in, tokens out)
TTFT_SLO, FLOOR, DEADLINE = 5.0, 32.0, 600.0  # model seconds, tokens/s, model seconds
MODES = ("direct", "qualified", "slo")
PREDICTED_MISS = "slo_ttft_predicted_miss"
REFUSAL_MS = 50.0  # target: an early refusal answered within this (real) time


@dataclass
class Outcome:
    kind: str
    sent: float  # perf_counter
    status: int = 0
    first: float | None = None
    ended: float | None = None
    tokens: int = 0
    error: str = ""
    code: str = ""  # a refusal's error code (slo_ttft_predicted_miss, queue_timeout, ...)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.ended is not None and not self.error


class Box:
    """One gateway's box: config, migrated database, a key per class, the engine published as
    ready and the box qualified at `point` for the spec it sees."""

    def __init__(self, work: Path, engine_port: int, scale: float, point: int,
                 classes: bool) -> None:
        root = work / ("slo" if classes else "qualified")
        root.mkdir()
        extra = f"queue_wait_seconds = {max(1, math.ceil(DEADLINE * scale))}\n"
        if classes:  # the SLOs in real seconds: the emulator's clock runs `scale` times real
            extra += (f"\n[gateway.classes.interactive]\nttft_slo_seconds = {TTFT_SLO * scale:g}"
                      f"\ndecode_floor_tps = {FLOOR / scale:g}\n\n[gateway.classes.batch]\n"
                      f"deadline_seconds = {DEADLINE * scale:g}\n")
        path, key, db_url = prepare_gateway(root, engine_port, extra)
        config = load_config(path, env={})
        db = Database(db_url)
        now = SystemClock().now()
        settings = plan.Settings(plan.harsh(*SHAPES[INTERACTIVE]), plan.ladder(MAX_RUNNING),
                                 floor=FLOOR, repeats=1, max_running_requests=MAX_RUNNING)
        try:
            self.keys = {INTERACTIVE: key, BATCH: key}  # without classes: every key interactive
            if classes:
                secret = server_secret(config.paths.state_dir)
                self.keys[BATCH] = db.call(lambda s: create_key(
                    s, secret, name=BATCH, owner="benchmark", by="benchmark", now=now,
                    service_class=BATCH))[0]
            # the daemon's row again, naming the spec the qualification below is for
            db.call(lambda s: write_published(s, "ready", "serving", None, now, SPEC))
            opened = db.call(lambda s: ledger.open_qualification(
                s, spec_hash=SPEC, at=now, by="benchmark", engine_version="emulator",
                tuning="", settings=settings))
            db.call(lambda s: ledger.close_qualification(
                s, opened.id, state="done", at=now, steps=(), qualified=point,
                verdict=f"qualified at {point} (benchmark)"))
        finally:
            db.dispose()
        self.url = f"http://127.0.0.1:{config.gateway.port}"
        argv = [sys.executable, "-m", "appliance", "--config", str(path), "gateway"]
        self.child: Child = spawn(f"the gateway ({root.name})", argv, root / "gateway.log",
                                  clean_env())

        def qualified() -> bool:
            status, body = http_get(f"{self.url}/health")
            admission = json.loads(body).get("admission") if status == 200 else None
            return isinstance(admission, dict) and \
                str(admission.get("source", "")).startswith("qualified")

        wait_until(self.child, qualified, "admitting at the qualified point")


def start_engine(work: Path, scale: float) -> tuple[Child, str]:
    port = free_port()
    argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", str(model_dir(work)),
            "--served-model-name", MODEL, "--max-running-requests", str(MAX_RUNNING),
            "--enable-metrics", "--host", "127.0.0.1", "--port", str(port)]
    env = clean_env(FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_PERF="k3-b300",
                    FAKE_SGLANG_TIME_SCALE=f"{scale:g}",
                    FAKE_SGLANG_GPU_STATE=str(work / "gpus.json"))
    engine = spawn("the engine emulator", argv, work / "engine.log", env)
    wait_until(engine, lambda: "fired up and ready" in engine.tail(20000), "ready")
    return engine, f"http://127.0.0.1:{port}"


async def one(session: aiohttp.ClientSession, url: str, key: str | None, kind: str,
              nonce: str) -> Outcome:
    tokens_in, tokens_out = SHAPES[kind]
    body = {"model": MODEL, "prompt": prompt_text(nonce, tokens_in), "max_tokens": tokens_out,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = Outcome(kind, time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
            out.status = answer.status
            if answer.status != 200:
                out.ended = time.perf_counter()
                raw = await answer.read()
                out.error = raw[:200].decode(errors="replace")
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    out.code = str(json.loads(raw)["error"]["code"])
                return out
            events = 0
            async for line in answer.content:
                if not line.startswith(b"data:") or b"[DONE]" in line:
                    continue
                data = json.loads(line[5:])
                usage = data.get("usage")
                if usage:
                    out.tokens = int(usage.get("completion_tokens") or 0)
                if any(c.get("text") for c in data.get("choices") or ()):
                    events += 1
                    if out.first is None:
                        out.first = time.perf_counter()
            out.tokens = out.tokens or events
            out.ended = time.perf_counter()
            if out.tokens < tokens_out:
                out.error = f"{out.tokens} of {tokens_out} tokens"
    except asyncio.CancelledError:
        out.error = "not served by the end of the drain"
    except (aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.ended = time.perf_counter()
    return out


def schedule(rate_per_s: float, seconds: float, batch_share: float,
             seed: int) -> list[tuple[float, str]]:
    """(offset in model seconds, kind) of each arrival: Poisson, the same for every mode."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible schedule, not a secret
    at, arrivals = 0.0, []
    while True:
        at += rng.expovariate(rate_per_s)
        if at >= seconds:
            return arrivals
        arrivals.append((at, BATCH if rng.random() < batch_share else INTERACTIVE))


async def run_cell(url: str, keys: dict[str, str] | None, arrivals: list[tuple[float, str]],
                   scale: float, drain: float, tag: str) -> tuple[list[Outcome], float]:
    """Send the arrivals open loop; returns the outcomes and the cell's model seconds."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=(DEADLINE + drain) * scale + 30)
    tasks: list[asyncio.Task[Outcome]] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for number, (offset, kind) in enumerate(arrivals):
            delay = started + offset * scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            key = keys[kind] if keys else None
            tasks.append(asyncio.ensure_future(one(session, url, key, kind, f"{tag}-{number}")))
        last = time.perf_counter()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain * scale)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    ended = max([last] + [t.result().ended or 0.0 for t in tasks])
    return [t.result() for t in tasks], (ended - started) / scale


@dataclass(frozen=True)
class Figures:
    good_interactive: float  # per model minute of arrivals
    good_batch: float
    ttft_p50: float | None  # model s, admitted interactive
    ttft_p99: float | None
    decode_p50: float | None  # tokens/s per admitted interactive stream, model time
    refused: float  # share of interactive arrivals refused early (predicted to miss)
    timed_out: float  # share of interactive arrivals answered 429 after waiting
    missed_ttft: float  # share of interactive arrivals completed, first token over the SLO
    missed_decode: float  # ... first token in time, decoded under the floor
    refusal_ms_p99: float | None  # real, the early refusals
    batch_done: float  # share of batch arrivals completed within the deadline
    out_tps: float  # model
    arrivals: int
    failed: int  # neither completed nor refused


def figures(outcomes: list[Outcome], minutes: float, cell_seconds: float,
            scale: float) -> Figures:
    def model(seconds: float) -> float:
        return seconds / scale

    interactive = [o for o in outcomes if o.kind == INTERACTIVE]
    batch = [o for o in outcomes if o.kind == BATCH]
    good_i = good_b = late = slow = 0
    ttfts: list[float] = []
    speeds: list[float] = []
    for o in interactive:
        if o.completed and o.first is not None and o.ended is not None:
            ttft = model(o.first - o.sent)
            ttfts.append(ttft)
            decode = model(o.ended - o.first)
            speed = (o.tokens - 1) / decode if decode > 0 else math.inf
            speeds.append(speed)
            good_i += ttft <= TTFT_SLO and speed >= FLOOR
            late += ttft > TTFT_SLO
            slow += ttft <= TTFT_SLO and speed < FLOOR
    for o in batch:
        good_b += o.completed and o.ended is not None and model(o.ended - o.sent) <= DEADLINE
    early = [o for o in outcomes if o.code == PREDICTED_MISS]
    waited = sum(o.kind == INTERACTIVE and o.status == 429 and o.code != PREDICTED_MISS
                 for o in outcomes)
    answer_ms = [(o.ended - o.sent) * 1000 for o in early if o.ended is not None]
    failed = sum(not o.completed and o.status != 429 for o in outcomes)
    share = 1 / len(interactive) if interactive else 0.0
    return Figures(good_i / minutes, good_b / minutes, percentile(ttfts, 0.5),
                   percentile(ttfts, 0.99), percentile(speeds, 0.5), len(early) * share,
                   waited * share, late * share, slow * share, percentile(answer_ms, 0.99),
                   good_b / len(batch) if batch else math.nan,
                   sum(o.tokens for o in outcomes if o.completed) / max(cell_seconds, 1e-9),
                   len(outcomes), failed)


def show(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base or math.isnan(base) or math.isnan(value) \
        else f"{value / base:.2f}"


ROWS = (("interactive goodput /min", "good_interactive", ".1f"),
        ("batch goodput /min", "good_batch", ".1f"),
        ("TTFT p50 s (admitted int.)", "ttft_p50", ".2f"),
        ("TTFT p99 s (admitted int.)", "ttft_p99", ".2f"),
        ("decode p50 tok/s (admitted int.)", "decode_p50", ".1f"),
        ("interactive refused early", "refused", ".0%"),
        ("interactive 429 after waiting", "timed_out", ".0%"),
        ("interactive missed TTFT", "missed_ttft", ".0%"),
        ("interactive missed decode floor", "missed_decode", ".0%"),
        ("early refusal p99 ms (real)", "refusal_ms_p99", ".1f"),
        ("batch completed in deadline", "batch_done", ".0%"),
        ("output tok/s", "out_tps", ".0f"),
        ("failed (not refused)", "failed", "d"))


def print_table(results: dict[tuple[float, str], Figures], levels: list[float]) -> None:
    head = f"{'load':>5} {'':<29}" + "".join(f"{m:>10}" for m in MODES) + \
        f"{'slo/direct':>11}{'slo/qual':>9}"
    print(head)
    print("-" * len(head))
    for level in levels:
        for number, (label, name, spec) in enumerate(ROWS):
            values = [getattr(results[(level, m)], name) for m in MODES]
            ratios = "" if spec in (".0%", "d") else \
                f"{ratio(values[2], values[0]):>11}{ratio(values[2], values[1]):>9}"
            lead = f"{level:>4g}x" if number == 0 else " " * 5
            print(f"{lead} {label:<29}" + "".join(f"{show(v, spec):>10}" for v in values)
                  + ratios)
        arrivals = results[(level, MODES[0])].arrivals
        print(f"{'':>5} ({arrivals} arrivals)\n")


def print_targets(results: dict[tuple[float, str], Figures], levels: list[float]) -> None:
    def line(what: str, figure: str, ok: bool | None) -> None:
        print(f"  {what:<56} {figure:<24} "
              f"{'not measured' if ok is None else 'pass' if ok else 'MISSED'}")

    print("targets (slo mode):")
    if 1 in levels and 2 in levels:
        one, two = results[(1, "slo")].good_interactive, results[(2, "slo")].good_interactive
        line("interactive goodput at 2x >= 95% of that at 1x",
             f"{two:.1f} / {one:.1f} /min ({ratio(two, one)})", bool(one) and two >= 0.95 * one)
    worst = [results[(lv, "slo")].ttft_p99 for lv in levels]
    seen = [w for w in worst if w is not None]
    line(f"p99 TTFT of admitted interactive <= {TTFT_SLO:g} s at every load",
         ", ".join(show(w, ".2f") for w in worst), max(seen) <= TTFT_SLO if seen else None)
    answers = [results[(lv, "slo")].refusal_ms_p99 for lv in levels]
    timed = [a for a in answers if a is not None]
    line(f"early refusals answered in < {REFUSAL_MS:g} ms (p99, real)",
         ", ".join(show(a, ".1f") for a in answers), max(timed) < REFUSAL_MS if timed else None)
    done = [results[(lv, "slo")].batch_done for lv in levels]
    served = [d for d in done if not math.isnan(d)]
    line("batch still served at every load", ", ".join(show(d, ".0%") for d in done),
         all(d > 0 for d in served) if served else None)


async def capacity(box: Box, point: int, scale: float) -> float:
    """Requests per model second at the qualified point: one burst of `point` interactive
    requests, point / their mean duration. Sent through the SLO gateway (all admitted at
    once: the burst is the point), so it has measured a service time and a prefill rate
    before the cells, as a gateway in service has."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        outcomes = await asyncio.gather(*(one(session, box.url, box.keys[INTERACTIVE],
                                              INTERACTIVE, f"cap-{i}") for i in range(point)))
    durations = [(o.ended - o.sent) / scale for o in outcomes if o.completed and o.ended]
    if not durations:
        raise SystemExit(f"the capacity burst failed: {outcomes[0].error or outcomes[0].status}")
    return point / (sum(durations) / len(durations))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.25,
                        help="real seconds per model second (default 0.25: four times "
                        "faster; at 0.1 the emulator falls behind its clock on 2 cores)")
    parser.add_argument("--levels", default="0.5,1,1.5,2",
                        help="arrival rates as multiples of the qualified capacity")
    parser.add_argument("--minutes", type=float, default=2.0,
                        help="model minutes of arrivals per cell (default 2)")
    parser.add_argument("--drain", type=float, default=120.0,
                        help="model seconds to wait after the last arrival (default 120)")
    parser.add_argument("--batch-share", type=float, default=0.2,
                        help="the share of arrivals that are batch (default 0.2)")
    parser.add_argument("--point", type=int, default=8, help="the qualified point (users)")
    parser.add_argument("--capacity", type=float, default=None,
                        help="the qualified capacity in requests per model minute, for the "
                        "same schedules in two runs (default: the burst's measure)")
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    args = parser.parse_args()
    levels = [float(v) for v in args.levels.split(",")]
    if not (0 < args.scale <= 1 and args.minutes > 0 and args.drain >= 0
            and 0 <= args.batch_share < 1 and 1 <= args.point <= MAX_RUNNING and levels
            and (args.capacity is None or args.capacity > 0)):
        parser.error("--scale in (0, 1], --minutes > 0, --drain >= 0, --batch-share in [0, 1),"
                     f" --point in 1..{MAX_RUNNING}, --capacity > 0, at least one level")
    work = Path(tempfile.mkdtemp(prefix="slo-goodput-"))
    started = time.monotonic()
    children: list[Child] = []
    try:
        engine, engine_url = start_engine(work, args.scale)
        children.append(engine)
        port = int(engine_url.rsplit(":", 1)[1])
        boxes = {"qualified": Box(work, port, args.scale, args.point, classes=False),
                 "slo": Box(work, port, args.scale, args.point, classes=True)}
        children += [b.child for b in boxes.values()]
        rate = asyncio.run(capacity(boxes["slo"], args.point, args.scale))
        print(f"qualified capacity: {rate * 60:.1f} requests per model minute at {args.point} "
              f"users (scale {args.scale:g}: one model second is {args.scale:g} s)", flush=True)
        if args.capacity is not None:  # the burst still ran: the SLO gateway's first measures
            rate = args.capacity / 60
            print(f"  the schedules use --capacity {args.capacity:g} instead", flush=True)
        results: dict[tuple[float, str], Figures] = {}
        for number, level in enumerate(levels):
            arrivals = schedule(rate * level, args.minutes * 60, args.batch_share,
                                args.seed + number)
            for mode in MODES:
                box = boxes.get(mode)
                outcomes, seconds = asyncio.run(run_cell(
                    box.url if box else engine_url, box.keys if box else None, arrivals,
                    args.scale, args.drain, f"{mode}{level:g}"))
                results[(level, mode)] = got = figures(outcomes, args.minutes, seconds,
                                                       args.scale)
                print(f"  {level:g}x {mode:<9} {got.arrivals} arrivals: interactive good "
                      f"{got.good_interactive:.1f}/min, decode p50 "
                      f"{show(got.decode_p50, '.1f')} tok/s, refused early {got.refused:.0%}, "
                      f"429 after waiting {got.timed_out:.0%}, missed TTFT "
                      f"{got.missed_ttft:.0%}, missed floor {got.missed_decode:.0%}, batch "
                      f"{show(got.batch_done, '.0%')}, {got.failed} failed", flush=True)
                for child in children:
                    child.check_alive()
        print(f"\n{SHAPES[INTERACTIVE][0]:,} in / {SHAPES[INTERACTIVE][1]:,} out interactive "
              f"(TTFT SLO {TTFT_SLO:g} s, floor {FLOOR:g} tok/s), {SHAPES[BATCH][0]:,} in batch "
              f"(deadline {DEADLINE:g} s) at {args.batch_share:.0%} of arrivals; "
              f"{args.minutes:g} model min of Poisson arrivals per cell, drain "
              f"{args.drain:g} s; capacity {rate * 60:.1f}/min at {args.point} users; model "
              f"time (FAKE_SGLANG_TIME_SCALE={args.scale:g}) but refusal answer times\n")
        print_table(results, levels)
        print_targets(results, levels)
    finally:
        for child in reversed(children):
            child.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
