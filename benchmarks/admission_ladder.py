"""Admission at the qualified point against the engine's own limit (issue 15, "admission
measured, not guessed"): bursts of long streams on the calibrated engine emulator, sent
straight to it, through the gateway admitting up to the engine's `max_running_requests`, and
through the gateway admitting at the qualified point.

    .venv/bin/python benchmarks/admission_ladder.py [--scale 0.2] [--levels 10,20,30,40,50,60]
        [--input 8192] [--output 1000] [--floor 32] [--point N] [--keep]

One engine emulator (`FAKE_SGLANG_PERF=k3-b300`, a B300x8 serving Kimi K3, on a clock
`--scale` times real: 0.2 runs five times faster) with `--max-running-requests 62` (the field
engine's 313 state slots), and one gateway process (`python -m appliance gateway`, a fresh box
on 127.0.0.1). First the box is qualified as `appliance qualify` does it, against the engine
directly: the harsh ladder (1, 2, 4, 8, 16, 24, 32, 48, 62), one repeat a step after a cache
flush, judged at `--floor` tokens/s per user (p10) by appliance.qualify's own verdict; the
point found (or `--point`) is written to the ledger for the spec the gateway sees as running.

Then, at each level: one burst of that many users, each sending one `/v1/completions` stream
of `--input` prompt tokens and exactly `--output` answer tokens (appliance.qualify's load
runner, the prefix cache flushed first), in three modes:

  direct        straight to the emulator: SGLang's own queue and its 60 s waiting timeout
  gw-engine     through the gateway, admitting up to max_running_requests (unqualified)
  gw-qualified  through the gateway, admitting at the qualified point (the rest queue there)

Printed side by side: output tok/s over the burst, per-user decode tok/s at p10, TTFT p90 (a
queued request's wait shows here) and failures; every figure in model time (the emulator's
clock), so they read as the box's. The gateway's queue wait is set to 600 model seconds, so
the queue, not its timeout, is measured. Nothing is asserted: a measuring instrument, run by
hand (a few minutes at the default scale).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gateway_throughput import (  # beside this script
    Child,
    clean_env,
    free_port,
    http_get,
    model_dir,
    spawn,
    wait_until,
)

from appliance.clock import SystemClock
from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.engine.publish import write_published
from appliance.gateway.keys import create_key
from appliance.qualify import ledger, plan
from appliance.qualify.runner import LoadRunner
from appliance.qualify.verdict import Round, Step, judge, qualified_point, round_of
from appliance.resources import migrations_dir
from appliance.secrets import server_secret

MODEL = "kimi-k3"
MAX_RUNNING = 62
SPEC = "benchmark-admission-ladder".ljust(64, "0")
WAITING_TIMEOUT = 60.0  # SGLang's, in model seconds (the profile's)
QUEUE_WAIT_MODEL_SECONDS = 600
MODES = ("direct", "gw-engine", "gw-qualified")


@dataclass(frozen=True)
class Figures:
    output_tps: float  # model time
    decode_p10: float | None
    ttft_p90: float | None
    failures: int
    requests: int


def to_model(measured: Round, scale: float) -> Figures:
    """A round measured in real seconds, as the box's figures (model seconds)."""
    return Figures(measured.output_tps * scale,
                   None if measured.decode_p10 is None else measured.decode_p10 * scale,
                   None if measured.ttft_p90 is None else measured.ttft_p90 / scale,
                   measured.failures, measured.requests)


class Box:
    """The emulator and the gateway, started for this run and stopped at its end."""

    def __init__(self, work: Path, scale: float) -> None:
        self.work, self.scale = work, scale
        self.engine_port = free_port()
        argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve",
                str(model_dir(work)), "--served-model-name", MODEL, "--max-running-requests",
                str(MAX_RUNNING), "--enable-metrics", "--host", "127.0.0.1", "--port",
                str(self.engine_port)]
        env = clean_env(FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_PERF="k3-b300",
                        FAKE_SGLANG_TIME_SCALE=f"{scale:g}",
                        FAKE_SGLANG_GPU_STATE=str(work / "gpus.json"))
        self.engine: Child = spawn("the engine emulator", argv, work / "engine.log", env)
        self.gateway: Child | None = None
        wait_until(self.engine, lambda: "fired up and ready" in self.engine.tail(20000),
                   "ready")
        self.engine_url = f"http://127.0.0.1:{self.engine_port}"
        self.config_path, self.key, self.db_url = self._prepare()
        self.gateway_url = f"http://127.0.0.1:{load_config(self.config_path, env={}).gateway.port}"

    def _prepare(self) -> tuple[Path, str, str]:
        box = self.work / "box"
        box.mkdir(parents=True)
        queue_wait = max(1, math.ceil(QUEUE_WAIT_MODEL_SECONDS * self.scale))
        text = (f'[paths]\nstate_dir = "{box / "state"}"\nmodels_dir = "{box / "models"}"\n'
                f'log_dir = "{box / "log"}"\n\n[server]\nport = {free_port()}\n\n'
                f'[engine]\nport = {self.engine_port}\nserved_model_name = "{MODEL}"\n\n'
                f'[gateway]\nhost = "127.0.0.1"\nport = {free_port()}\n'
                f"queue_wait_seconds = {queue_wait}\n")
        path = box / "appliance.toml"
        path.write_text(text)
        config = load_config(path, env={})
        db = Database(config.database_url)
        now = SystemClock().now()
        try:
            migrate(db, migrations_dir(), config.paths.state_dir / "backups", now)
            secret = server_secret(config.paths.state_dir)
            key, _ = db.call(lambda s: create_key(s, secret, name="benchmark",
                                                  owner="benchmark", by="benchmark", now=now))
            # the daemon's row: READY, naming the running spec (unqualified so far)
            db.call(lambda s: write_published(s, "ready", "serving", None, now, SPEC))
        finally:
            db.dispose()
        return path, key, config.database_url

    def start_gateway(self) -> None:
        argv = [sys.executable, "-m", "appliance", "--config", str(self.config_path), "gateway"]
        self.gateway = spawn("the gateway", argv, self.work / "gateway.log", clean_env())
        self.wait_source("unqualified")

    def health(self) -> dict[str, object]:
        status, body = http_get(f"{self.gateway_url}/health")
        return dict(json.loads(body)) if status == 200 else {}

    def wait_source(self, prefix: str) -> None:
        assert self.gateway is not None

        def seen() -> bool:
            admission = self.health().get("admission")
            return isinstance(admission, dict) and str(admission["source"]).startswith(prefix)

        wait_until(self.gateway, seen, f"admitting ({prefix})")

    def record(self, point: int, floor: float, steps: tuple[Step, ...],
               settings: plan.Settings) -> None:
        """The qualification, in the ledger, for the spec the gateway sees running."""
        db = Database(self.db_url)
        now = SystemClock().now()
        try:
            opened = db.call(lambda s: ledger.open_qualification(
                s, spec_hash=SPEC, at=now, by="benchmark", engine_version="emulator",
                tuning="", settings=settings))
            db.call(lambda s: ledger.close_qualification(
                s, opened.id, state="done", at=now, steps=steps, qualified=point,
                verdict=f"qualified at {point} (benchmark)"))
        finally:
            db.dispose()

    def stop(self) -> None:
        for child in (self.gateway, self.engine):
            if child is not None:
                child.stop()


async def burst(box: Box, mode: str, users: int, workload: plan.Workload,
                tag: str) -> Round:
    """One burst of `users` streams to the engine (direct) or through the gateway."""
    scale = box.scale
    direct = LoadRunner(box.engine_url, api_key=None, model=MODEL,
                        wedge_seconds=max(5.0, 300 * scale))
    via = direct if mode == "direct" else LoadRunner(
        box.gateway_url, api_key=box.key, model=MODEL, wedge_seconds=max(5.0, 900 * scale))
    never = asyncio.Event()
    try:
        await direct.flush_cache(never)
        result = await via.run_round(workload, users, tag, never)
    finally:
        await direct.aclose()
        if via is not direct:
            await via.aclose()
    return round_of(users, 1, result.samples, result.seconds, wedged=result.wedged)


async def qualify(box: Box, workload: plan.Workload, floor: float) -> tuple[
        int | None, tuple[Step, ...], plan.Settings]:
    """The harsh ladder against the engine directly, judged as appliance.qualify judges."""
    ladder = plan.ladder(MAX_RUNNING)
    settings = plan.Settings(workload, ladder, floor=floor, repeats=1,
                             max_running_requests=MAX_RUNNING)
    steps: list[Step] = []
    for concurrency in ladder:
        measured = await burst(box, "direct", concurrency, workload, f"q{concurrency}")
        # the verdict in real time: the floor in real tokens/s
        step = judge(concurrency, [measured], floor=floor / box.scale, ttft_p90_max=None,
                     repeats=1)
        steps.append(step)
        shown = to_model(measured, box.scale)
        print(f"  qualify {concurrency:>3}: decode p10 {fmt(shown.decode_p10)} tok/s, "
              f"{shown.failures} failed -> {'pass' if step.passed else 'fail'}", flush=True)
        if not step.passed:
            break
    return qualified_point(steps), tuple(steps), settings


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def table(results: dict[tuple[str, int], Figures], levels: list[int]) -> str:
    head = (f"{'users':>5} | " + " | ".join(f"{m:^31}" for m in MODES)
            + " | qualified/direct\n")
    sub = (f"{'':>5} | " + " | ".join(f"{'out tok/s':>9} {'p10':>5} {'TTFT90':>7} {'fail':>5}"
                                     for _ in MODES) + " | out tok/s  p10\n")
    lines = [head, sub, "-" * (len(sub) - 1) + "\n"]
    for users in levels:
        cells = []
        for mode in MODES:
            f = results[(mode, users)]
            cells.append(f"{f.output_tps:>9,.1f} {fmt(f.decode_p10):>5} "
                         f"{fmt(f.ttft_p90):>6}s {f.failures:>2}/{f.requests:<2}")
        d, q = results[("direct", users)], results[("gw-qualified", users)]
        gain = ratio(q.output_tps, d.output_tps)
        lines.append(f"{users:>5} | " + " | ".join(cells)
                     + f" | {gain:>9}  {ratio(q.decode_p10, d.decode_p10)}\n")
    return "".join(lines)


async def main_async(args: argparse.Namespace, box: Box) -> None:
    workload = plan.harsh(args.input, args.output)
    levels = [int(v) for v in args.levels.split(",")]
    print(f"qualifying the emulated box (floor {args.floor:g} tok/s, scale {args.scale:g})",
          flush=True)
    point, steps, settings = await qualify(box, workload, args.floor)
    if args.point:
        point = args.point
    if point is None:
        raise SystemExit("the box qualified at no step; give --point to admit at one anyway")
    print(f"qualified point: {point} concurrent users", flush=True)

    results: dict[tuple[str, int], Figures] = {}
    box.start_gateway()
    for mode in ("direct", "gw-engine"):
        for users in levels:
            measured = await burst(box, mode, users, workload, f"{mode}{users}")
            results[(mode, users)] = shown = to_model(measured, box.scale)
            print(f"  {mode:<12} {users:>3}: {shown.output_tps:,.1f} tok/s, "
                  f"{shown.failures} failed", flush=True)
    box.record(point, args.floor, steps, settings)
    box.wait_source("qualified")
    for users in levels:
        measured = await burst(box, "gw-qualified", users, workload, f"gq{users}")
        results[("gw-qualified", users)] = shown = to_model(measured, box.scale)
        print(f"  {'gw-qualified':<12} {users:>3}: {shown.output_tps:,.1f} tok/s, "
              f"{shown.failures} failed", flush=True)
    print()
    print(f"{args.input:,} tokens in, {args.output:,} out; engine max_running_requests "
          f"{MAX_RUNNING}, qualified point {point} at {args.floor:g} tok/s; model time "
          f"(scale {args.scale:g}); one burst per cell, each user one stream")
    print(table(results, levels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.2,
                        help="real seconds per model second (default 0.2)")
    parser.add_argument("--levels", default="10,20,30,40,50,60")
    parser.add_argument("--input", type=int, default=plan.HARSH_INPUT)
    parser.add_argument("--output", type=int, default=plan.HARSH_OUTPUT)
    parser.add_argument("--floor", type=float, default=plan.DEFAULT_FLOOR)
    parser.add_argument("--point", type=int, default=0,
                        help="admit at this point instead of the one measured")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and logs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="admission-ladder-"))
    started = time.monotonic()
    box = Box(work, args.scale)
    try:
        asyncio.run(main_async(args, box))
    finally:
        box.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"took {dt.timedelta(seconds=round(time.monotonic() - started))}")


if __name__ == "__main__":
    main()
