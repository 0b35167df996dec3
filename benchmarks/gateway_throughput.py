"""Gateway throughput: streams straight to the engine against the same streams through a
minimal passthrough, through the gateway and through LiteLLM's proxy, to the same engine
emulator, in the same run.

    .venv/bin/python benchmarks/gateway_throughput.py [--cells 1,8,64] [--seconds 8]
        [--paces paced,unpaced] [--min-requests 20] [--max-requests 20000] [--skip-litellm]
        [--litellm-venv DIR] [--classes] [--profile [paced|unpaced]] [--profile-only] [--keep]

Four paths, each a separate process in front of one engine emulator (`python -m
appliance.testing.fake_sglang serve ... --max-running-requests 256`, so the engine never
queues), all on 127.0.0.1:

  direct    client -> emulator (the baseline every ratio is against)
  passthrough  client -> an aiohttp server forwarding each stream chunk by chunk with one
            pooled aiohttp client (`PASSTHROUGH`): the least any proxy costs, the yardstick
            for the gateway's own cost ("the gateway against the passthrough" lines)
  gateway   client -> `python -m appliance --config FILE gateway` -> emulator, in a fresh box
            (temporary state folder, migrated SQLite database, one API key, the engine
            published as ready the way the control plane does it): keys, admission (its limit
            learned from the engine, 256) and usage accounting (rows written once a second)
            all on, as in production; with `--classes`, service classes configured too
            (`CLASSES`: interactive with a TTFT SLO and a floor, batch), so every request
            takes the class path
  litellm   client -> LiteLLM's proxy (`litellm --config`, one worker, master key, no
            database) -> emulator; installed on demand into its own virtual environment
            (default ~/.cache/appliance-bench/litellm-venv), never into the project's; run
            offline (LITELLM_LOCAL_MODEL_COST_MAP=True, telemetry off). If it cannot be
            installed the run says why and goes on with the other two.

Each cell is N concurrent streaming chat completions (`max_tokens: 64, ignore_eos: true,
stream: true`), closed loop: every stream starts its next request when the last ends. New
requests start for `--seconds` (and past it, for at most 60 s more, until `--min-requests`
have started, so that slow cells still give percentiles; never more than `--max-requests`),
then the ones in flight finish. Before each cell N short requests open the connections (not
counted). Each cell runs once per pace: `paced` (the emulator takes 20 ms per token, like a
loaded engine; the N streams start spread evenly over one request's length, so requests
arrive steadily rather than in lockstep) and `unpaced` (0 ms: a stress test where every
process is CPU-bound). The order of the paths is reversed on every other cell.

The load generator is this process: aiohttp on uvloop, SSE split into lines and each `data:`
event decoded with msgspec into just `choices[].delta.content`. TTFT is the time from sending
the request to the first event with non-empty content. Requests and tokens per second are
counted in the steady part of the cell (from once every stream has started to the start of
the last request; tokens taken as evenly spread over each stream). Printed per cell and
path: those, throughput as a fraction of direct, TTFT p50 and p99 (nearest rank) and what the
proxy added to each, tokens per stream (64 when `ignore_eos` got through), and CPU per stream
of the proxy, the client and the emulator (user + system of every thread, psutil, over the
whole cell). The proxies' idle CPU (the gateway's half-second polls) is printed apart, and
the gateway's resident memory (once ready, after the cells, and peak: VmHWM) after each pace,
with the number of usage rows it wrote.

The machine is shared by every process here: on a small box the unpaced cells measure who
gets the CPU as much as who needs it, which the CPU-per-stream columns show. `--profile`
then runs one more cell (the largest, paced unless `--profile unpaced`) through a gateway
whose main thread is under cProfile for the measured requests only (switched by SIGUSR1 and
SIGUSR2), and prints its time per request by package and the top functions; `--profile-only`
skips the table. Nothing is asserted: this is a measuring instrument, run by hand. Targets
are printed beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import pstats
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import aiohttp
import msgspec
import psutil
import uvloop
from profiling import profile_group  # beside this script

from appliance.clock import SystemClock
from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.engine.publish import write_published
from appliance.gateway.keys import create_key
from appliance.resources import migrations_dir
from appliance.secrets import server_secret

MODEL = "kimi-k3"
TOKENS = 64
MAX_RUNNING = 256
PACES = {"paced": 0.02, "unpaced": 0.0}
PATHS = ("direct", "passthrough", "gateway", "litellm")
DEFAULT_VENV = Path.home() / ".cache" / "appliance-bench" / "litellm-venv"
START_TIMEOUT = 120.0
EXTRA_SECONDS = 60.0  # the most a cell runs past --seconds to reach --min-requests
MIB = 1 << 20

# Targets from the gateway issue.
PACED_RATIO = 0.98          # paced, 64 streams: gateway throughput / direct
ADDED_64 = (5.0, 15.0)      # paced, 64 streams: added TTFT p50, p99 (ms)
ADDED_8 = (1.0, 3.0)        # paced, <= 8 streams: added TTFT p50, p99 (ms)
UNPACED_RATIO = 0.50        # unpaced: gateway throughput / direct
LITELLM_TIMES = 50.0        # ... which is more than 50x LiteLLM's
CPU_PER_STREAM_MS = 3.0     # gateway CPU per 64-token stream (issue 24; was 5)
RSS_MIB = 100.0             # gateway resident memory


# --- the load generator ---------------------------------------------------------------------


class Delta(msgspec.Struct):
    content: str | None = None


class Choice(msgspec.Struct):
    delta: Delta | None = None


class Chunk(msgspec.Struct):
    choices: list[Choice] = []


CHUNK = msgspec.json.Decoder(Chunk)


@dataclass
class Sample:
    started: float  # perf_counter when the request was sent
    first: float | None  # ... when the first content event came
    ended: float  # ... when the response ended
    tokens: int  # content events
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.started

    def tokens_within(self, start: float, end: float) -> float:
        """Tokens received between `start` and `end`, taking them as evenly spread from the
        first content event to the end of the response."""
        if self.first is None or not self.tokens:
            return 0.0
        if self.ended <= self.first:
            return float(self.tokens) if start <= self.ended < end else 0.0
        overlap = min(end, self.ended) - max(start, self.first)
        return self.tokens * max(0.0, overlap) / (self.ended - self.first)


@dataclass(frozen=True)
class Target:
    """Where one path is reached: the URL of the chat endpoint and the headers it needs."""

    url: str
    headers: dict[str, str]


def request_body(index: int, max_tokens: int) -> bytes:
    return json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": f"benchmark stream {index}"}],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()


async def one_stream(session: aiohttp.ClientSession, target: Target, body: bytes) -> Sample:
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        async with session.post(target.url, data=body, headers=target.headers) as response:
            if response.status != 200:
                text = (await response.read())[:200].decode(errors="replace")
                return Sample(started, None, time.perf_counter(), 0,
                              f"HTTP {response.status}: {text}")
            tail = b""
            async for chunk in response.content.iter_any():
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    for choice in CHUNK.decode(payload).choices:
                        if choice.delta is not None and choice.delta.content:
                            tokens += 1
                            if first is None:
                                first = time.perf_counter()
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        return Sample(started, first, time.perf_counter(), tokens,
                      f"{type(exc).__name__}: {exc}"[:200])
    return Sample(started, first, time.perf_counter(), tokens)


Snapshot = tuple[float, float, float]  # CPU seconds: this process, the engine, the proxy


@dataclass(frozen=True)
class Window:
    """Where the load was steady: from once every stream has started (`stagger` after the
    first) to the start of the last request (then streams only stop)."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Load:
    samples: list[Sample]
    window: Window
    elapsed: float  # from the first request sent to the last answer's end
    cpu: Snapshot  # used from the first request sent to the last answer's end


async def run_load(target: Target, streams: int, seconds: float, min_requests: int,
                   max_requests: int, stagger: float, snapshot: Callable[[], Snapshot]) -> Load:
    """`streams` closed-loop workers, the first starts spread evenly over `stagger` seconds,
    after `streams` short requests that open the connections. New requests start for
    `seconds`, or until `min_requests` have started (for at most `EXTRA_SECONDS` more),
    never more than `max_requests`."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=seconds + EXTRA_SECONDS + 120, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False) as session:
        warm = await asyncio.gather(*[one_stream(session, target, request_body(-1 - i, 4))
                                      for i in range(streams)])
        failed = [s.error for s in warm if s.error]
        if failed:
            raise SystemExit(f"the warm-up through {target.url} failed: {failed[0]}")
        samples: list[Sample] = []
        cpu_before = snapshot()
        started = time.perf_counter()
        deadline, hard = started + seconds, started + seconds + EXTRA_SECONDS
        count = 0

        async def worker(offset: float) -> None:
            nonlocal count
            await asyncio.sleep(offset)
            while count < max_requests:
                now = time.perf_counter()
                if now >= hard or (now >= deadline and count >= min_requests):
                    return
                count += 1
                samples.append(await one_stream(session, target, request_body(count, TOKENS)))

        await asyncio.gather(*[worker(i * stagger / streams) for i in range(streams)])
        ended = time.perf_counter()
        cpu_after = snapshot()
    last = max(s.started for s in samples) if samples else ended
    window = Window(started + stagger, last) if last - started > 2 * stagger \
        else Window(started, ended)
    cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1],
           cpu_after[2] - cpu_before[2])
    return Load(samples, window, ended - started, cpu)


# --- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    """A process this benchmark started, in its own session, output in a log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    handle: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.handle = psutil.Process(self.process.pid)

    def cpu(self) -> float:
        """CPU seconds of the process (every thread) and its children."""
        total = 0.0
        with contextlib.suppress(psutil.NoSuchProcess):
            times = self.handle.cpu_times()
            total += times.user + times.system
            for child in self.handle.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = child.cpu_times()
                    total += times.user + times.system
        return total

    def rss(self) -> tuple[float, float]:
        """(resident MiB now, peak resident MiB) of the process itself."""
        now = self.handle.memory_info().rss / MIB
        peak = now
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
        return now, peak

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise SystemExit(f"{self.name} exited ({self.process.returncode}); the end of its "
                             f"log ({self.log}):\n{self.tail()}")

    def tail(self, size: int = 3000) -> str:
        return self.log.read_bytes()[-size:].decode(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # what is left of its session
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> Child:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                   start_new_session=True)
    return Child(name, process, log)


def wait_until(child: Child, ready: Callable[[], bool], what: str,
               timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        child.check_alive()
        if time.monotonic() > deadline:
            child.stop()
            raise SystemExit(f"{child.name} did not become {what} within {timeout:.0f} s; the "
                             f"end of its log ({child.log}):\n{child.tail()}")
        time.sleep(0.1)


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - loopback
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:  # noqa: S310
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update(extra)
    return env


def model_dir(root: Path) -> Path:
    """A tiny checkpoint the emulator loads: K3's config.json and three 1 MiB shards."""
    path = root / "model"
    path.mkdir(parents=True, exist_ok=True)
    for index in range(1, 4):
        (path / f"model-{index:05d}-of-00003.safetensors").write_bytes(os.urandom(MIB))
    (path / "config.json").write_text(json.dumps({
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": {"max_position_embeddings": 262144},
        "quantization_config": {"quant_method": "compressed-tensors"}}))
    return path


def start_engine(work: Path, model: Path, token_seconds: float) -> tuple[Child, int]:
    port = free_port()
    argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", str(model),
            "--served-model-name", MODEL, "--max-running-requests", str(MAX_RUNNING),
            "--host", "127.0.0.1", "--port", str(port)]
    env = clean_env(FAKE_SGLANG_LOAD_SECONDS="1",
                    FAKE_SGLANG_FAULT=f"slow_tokens={token_seconds:g}",
                    FAKE_SGLANG_GPU_STATE=str(work / "gpus.json"))
    child = spawn("the engine emulator", argv, work / "engine.log", env)
    wait_until(child, lambda: "fired up and ready" in child.tail(20000), "ready")
    return child, port


@dataclass
class Gateway:
    child: Child
    target: Target
    config: Path
    db_url: str


# `--classes`: the service classes of issue 24 configured as docs/configuration.md's example,
# so every request takes the class path (its share, the SLO prediction, the priority spliced
# into the body, the per-class counting). The benchmark's key is interactive; with a 5 s SLO
# and no queue nothing is refused, so the figures measure the path's cost, not refusals.
CLASSES = ('\n[gateway.classes.interactive]\nttft_slo_seconds = 5\ndecode_floor_tps = 32\n'
           '\n[gateway.classes.batch]\ndeadline_seconds = 900\nshare = 0.25\n')


def prepare_gateway(work: Path, engine_port: int, extra: str = "") -> tuple[Path, str, str]:
    """A fresh box under `work/box`: config file (`extra` appended to its [gateway] table),
    migrated database, one key, the engine published as ready. Returns (the config file, the
    key, the database URL)."""
    box = work / "box"
    port = free_port()
    text = (f'[paths]\nstate_dir = "{box / "state"}"\nmodels_dir = "{box / "models"}"\n'
            f'log_dir = "{box / "log"}"\n\n[server]\nport = {free_port()}\n\n'
            f'[engine]\nport = {engine_port}\nserved_model_name = "{MODEL}"\n\n'
            f'[gateway]\nhost = "127.0.0.1"\nport = {port}\n' + extra)
    box.mkdir(parents=True)
    path = box / "appliance.toml"
    path.write_text(text)
    config = load_config(path, env={})
    db = Database(config.database_url)
    now = SystemClock().now()
    try:
        migrate(db, migrations_dir(), config.paths.state_dir / "backups", now)
        secret = server_secret(config.paths.state_dir)
        key, _ = db.call(lambda s: create_key(s, secret, name="benchmark", owner="benchmark",
                                              by="benchmark", now=now))
        db.call(lambda s: write_published(s, "ready", "serving", None, now))
    finally:
        db.dispose()
    return path, key, config.database_url


# `python -c PROFILED PROFILE CONFIG`: the gateway as `python -m appliance --config CONFIG
# gateway`, with cProfile switched on by SIGUSR1 and off (and saved to PROFILE) by SIGUSR2, so
# the profile holds the measured requests only, not the imports, the start or the warm-up.
PROFILED = """
import cProfile, runpy, signal, sys
profile, config = sys.argv[1:3]
profiler = cProfile.Profile()
def stop(*_):
    profiler.disable()
    profiler.dump_stats(profile)
signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
signal.signal(signal.SIGUSR2, stop)
sys.argv = ["appliance", "--config", config, "gateway"]
runpy.run_module("appliance", run_name="__main__", alter_sys=True)
"""


def start_gateway(work: Path, engine_port: int, profile: Path | None = None,
                  classes: bool = False) -> Gateway:
    path, key, db_url = prepare_gateway(work, engine_port, CLASSES if classes else "")
    port = load_config(path, env={}).gateway.port
    argv = [sys.executable, "-m", "appliance", "--config", str(path), "gateway"]
    if profile is not None:
        argv = [sys.executable, "-c", PROFILED, str(profile), str(path)]
    child = spawn("the gateway", argv, work / "gateway.log", clean_env())
    url = f"http://127.0.0.1:{port}"

    def admitting() -> bool:
        status, body = http_get(f"{url}/health")
        return status == 200 and bool(json.loads(body).get("admitting"))

    wait_until(child, admitting, "ready to admit")
    target = Target(f"{url}/v1/chat/completions",
                    {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    return Gateway(child, target, path, db_url)


# `python -c PASSTHROUGH ENGINE PORT`: the least a proxy can do, the yardstick for the
# gateway's own cost. aiohttp's server and client on uvloop, one pooled session, the body and
# the SSE stream forwarded chunk by chunk as they come; no keys, no admission, no accounting.
PASSTHROUGH = """
import sys, aiohttp, uvloop
from aiohttp import web
engine, port = sys.argv[1], int(sys.argv[2])
async def open_session(app):
    app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app["session"].close()
async def health(request):
    return web.Response(text="ok")
async def forward(request):
    body = await request.read()
    async with request.app["session"].post(
            engine + request.path, data=body,
            headers={"Content-Type": "application/json"}) as answer:
        response = web.StreamResponse(
            status=answer.status,
            headers={"Content-Type": answer.headers.get("Content-Type", "text/plain")})
        await response.prepare(request)
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response
app = web.Application()
app.cleanup_ctx.append(open_session)
app.router.add_get("/health", health)
app.router.add_post("/v1/chat/completions", forward)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
"""


def start_passthrough(work: Path, engine_port: int,
                      script: str = PASSTHROUGH) -> tuple[Child, str]:
    """`python -c script ENGINE PORT` (this passthrough, or another with the same argv and a
    /health route), once it answers; returns it and its base URL."""
    port = free_port()
    child = spawn("the passthrough", [sys.executable, "-c", script,
                                      f"http://127.0.0.1:{engine_port}", str(port)],
                  work / "passthrough.log", clean_env())
    url = f"http://127.0.0.1:{port}"
    wait_until(child, lambda: http_get(f"{url}/health")[0] == 200, "ready")
    return child, url


def usage_rows(db_url: str) -> int:
    from sqlalchemy import func, select

    from appliance.db.models import UsageRequest

    db = Database(db_url)
    try:
        return int(db.call(lambda s: s.scalar(select(func.count()).select_from(UsageRequest)))
                   or 0)
    finally:
        db.dispose()


def ensure_litellm(venv: Path) -> Path | str:
    """The `litellm` program in its own virtual environment (created and installed on first
    use); or why it could not be had."""
    program = venv / "bin" / "litellm"
    if program.exists():
        return program
    print(f"installing litellm[proxy] into {venv} (once; a few minutes) ...", flush=True)
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {venv.parent}: {exc}"
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "litellm[proxy]"]]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1200,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(step[-3:])}: {exc}"
        if done.returncode:
            return (f"`{' '.join(step[-3:])}` exited {done.returncode}: "
                    f"{(done.stderr or done.stdout)[-800:]}")
    return program if program.exists() else f"no {program} after the install"


def litellm_version(venv: Path) -> str:
    done = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('litellm'))"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def start_litellm(work: Path, program: Path, engine_port: int) -> tuple[Child, Target]:
    port = free_port()
    master = "sk-bench-" + secrets.token_hex(16)
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{engine_port}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        f"  master_key: {master}\n")
    env = clean_env(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False",
                    DO_NOT_TRACK="1")
    env.pop("DATABASE_URL", None)
    child = spawn("LiteLLM's proxy", [str(program), "--config", str(config), "--host",
                                      "127.0.0.1", "--port", str(port), "--telemetry", "False"],
                  work / "litellm.log", env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    wait_until(child, lambda: http_get(f"{url}/health/liveliness")[0] == 200, "ready")
    return child, Target(f"{url}/v1/chat/completions",
                         {"Authorization": f"Bearer {master}",
                          "Content-Type": "application/json"})


# --- figures ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Cell:
    pace: str
    streams: int
    path: str
    samples: list[Sample]
    window: Window  # requests/s and tokens/s are measured here
    elapsed: float  # CPU is measured over this
    client_cpu: float
    engine_cpu: float
    proxy_cpu: float | None
    requests_sent: int  # with the warm-up
    proxy_idle: float = 0.0  # the proxy's CPU seconds per second with no traffic

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if not s.error]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    @property
    def rps(self) -> float:
        window = self.window
        return sum(window.start <= s.ended < window.end for s in self.ok) / window.seconds

    @property
    def tps(self) -> float:
        window = self.window
        return sum(s.tokens_within(window.start, window.end) for s in self.ok) / window.seconds

    def ttft(self, q: float) -> float | None:
        value = percentile([s.ttft for s in self.ok if s.ttft is not None], q)
        return None if value is None else value * 1000

    def per_stream(self, cpu: float | None) -> float | None:
        return None if cpu is None or not self.samples else cpu / len(self.samples) * 1000

    def proxy_net(self) -> float | None:
        """The proxy's CPU ms per stream, less what it uses idle over the same time."""
        if self.proxy_cpu is None:
            return None
        return self.per_stream(max(0.0, self.proxy_cpu - self.proxy_idle * self.elapsed))


def fmt(value: float | None, spec: str, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    sign = "+" if spec.startswith("+") else ""
    return format(value, f">{sign}{width}{spec.lstrip('+')}")


def print_cells(cells: list[Cell]) -> None:
    header = (f"{'pace':<8} {'streams':>7} {'path':<11} {'n':>5} {'req/s':>8} {'tok/s':>9} "
              f"{'x direct':>8} {'TTFT p50':>9} {'p99 ms':>7} {'+p50':>7} {'+p99 ms':>8} "
              f"{'tok/str':>7} {'proxy':>7} {'client':>7} {'engine':>7} {'err':>4}")
    print("\n" + " " * 100 + "CPU ms per stream")
    print(header)
    print("-" * len(header))
    last: tuple[str, int] | None = None
    for cell in cells:
        if last is not None and last != (cell.pace, cell.streams):
            print()
        last = (cell.pace, cell.streams)
        base = find(cells, cell.pace, cell.streams, "direct")
        ratio = cell.tps / base.tps if base and base.tps else None
        p50, p99 = cell.ttft(0.5), cell.ttft(0.99)
        add50 = None if base is None or p50 is None or base.ttft(0.5) is None else \
            p50 - base.ttft(0.5)  # type: ignore[operator]
        add99 = None if base is None or p99 is None or base.ttft(0.99) is None else \
            p99 - base.ttft(0.99)  # type: ignore[operator]
        tokens = sum(s.tokens for s in cell.ok) / len(cell.ok) if cell.ok else None
        if cell.path == "direct":
            add50 = add99 = None
        print(f"{cell.pace:<8} {cell.streams:>7} {cell.path:<11} {len(cell.samples):>5} "
              f"{cell.rps:>8.1f} {cell.tps:>9.0f} {fmt(ratio, '.3f', 8)} {fmt(p50, '.2f', 9)} "
              f"{fmt(p99, '.2f', 7)} {fmt(add50, '+.2f', 7)} {fmt(add99, '+.2f', 8)} "
              f"{fmt(tokens, '.1f', 7)} {fmt(cell.per_stream(cell.proxy_cpu), '.2f', 7)} "
              f"{fmt(cell.per_stream(cell.client_cpu), '.2f', 7)} "
              f"{fmt(cell.per_stream(cell.engine_cpu), '.2f', 7)} {cell.errors:>4}")
    for cell in cells:
        failed = [s.error for s in cell.samples if s.error]
        if failed:
            print(f"  {cell.pace} {cell.streams} {cell.path}: {len(failed)} errors, e.g. "
                  f"{failed[0]}")


def find(cells: list[Cell], pace: str, streams: int, path: str) -> Cell | None:
    for cell in cells:
        if (cell.pace, cell.streams, cell.path) == (pace, streams, path):
            return cell
    return None


def verdict(ok: bool) -> str:
    return "pass" if ok else "MISSED"


def print_targets(cells: list[Cell], memory: dict[str, Memory]) -> None:
    print("\ntargets (gateway against direct, same run):")

    def pair(pace: str, streams: int) -> tuple[Cell, Cell] | None:
        base, gateway = find(cells, pace, streams, "direct"), find(cells, pace, streams,
                                                                   "gateway")
        return (base, gateway) if base and gateway and base.ok and gateway.ok else None

    def added(base: Cell, gateway: Cell, q: float) -> float:
        return gateway.ttft(q) - base.ttft(q)  # type: ignore[operator]

    def line(what: str, figure: str, ok: bool | None) -> None:
        state = "not measured" if ok is None else verdict(ok)
        print(f"  {what:<58} {figure:<36} {state}")

    got = pair("paced", 64)
    if got:
        base, gateway = got
        ratio = gateway.tps / base.tps
        line(f"paced, 64 streams: throughput >= {PACED_RATIO:.0%} of direct",
             f"{ratio:.1%}", ratio >= PACED_RATIO)
        a50, a99 = added(base, gateway, 0.5), added(base, gateway, 0.99)
        line(f"paced, 64 streams: added TTFT p50 < {ADDED_64[0]:g} ms, p99 < {ADDED_64[1]:g} ms",
             f"{a50:+.2f} ms, {a99:+.2f} ms", a50 < ADDED_64[0] and a99 < ADDED_64[1])
    else:
        line("paced, 64 streams", "", None)
    for streams in sorted({c.streams for c in cells if c.streams <= 8}):
        got = pair("paced", streams)
        if got:
            a50, a99 = added(*got, 0.5), added(*got, 0.99)
            line(f"paced, {streams} streams: added TTFT p50 < {ADDED_8[0]:g} ms, "
                 f"p99 < {ADDED_8[1]:g} ms", f"{a50:+.2f} ms, {a99:+.2f} ms",
                 a50 < ADDED_8[0] and a99 < ADDED_8[1])
    for streams in sorted({c.streams for c in cells if c.pace == "unpaced"}):
        got = pair("unpaced", streams)
        if got:
            ratio = got[1].tps / got[0].tps
            line(f"unpaced, {streams} streams: throughput >= {UNPACED_RATIO:.0%} of direct",
                 f"{ratio:.1%}", ratio >= UNPACED_RATIO)
            litellm = find(cells, "unpaced", streams, "litellm")
            if litellm and litellm.tps:
                times = got[1].tps / litellm.tps
                theirs, ours = litellm.per_stream(litellm.proxy_cpu), \
                    got[1].per_stream(got[1].proxy_cpu)
                less = f" (CPU/stream {theirs / ours:.0f}x less)" if theirs and ours else ""
                line(f"unpaced, {streams} streams: gateway > {LITELLM_TIMES:g}x LiteLLM",
                     f"{times:.1f}x{less}", times > LITELLM_TIMES)
    for pace in PACES:
        largest = max((c.streams for c in cells if c.pace == pace and c.path == "gateway"),
                      default=None)
        if largest is None:
            continue
        busiest = find(cells, pace, largest, "gateway")
        assert busiest is not None
        cpu, net = busiest.per_stream(busiest.proxy_cpu), busiest.proxy_net()
        line(f"{pace}, {largest} streams: gateway CPU <= {CPU_PER_STREAM_MS:g} ms per stream",
             f"{cpu:.2f} ms ({net:.2f} net of idle)", cpu is not None and cpu <= CPU_PER_STREAM_MS)
    print("\nthe gateway against the passthrough (the same run; ratios < 1 favour the gateway):")
    for cell in cells:
        if cell.path != "gateway":
            continue
        base = find(cells, cell.pace, cell.streams, "direct")
        thru = find(cells, cell.pace, cell.streams, "passthrough")
        if not (base and thru and base.ok and thru.ok and cell.ok):
            continue
        ours, theirs = cell.per_stream(cell.proxy_cpu), thru.per_stream(thru.proxy_cpu)
        g50, g99 = added(base, cell, 0.5), added(base, cell, 0.99)
        t50, t99 = added(base, thru, 0.5), added(base, thru, 0.99)
        cpu_ratio = f"x{ours / theirs:.2f}" if ours and theirs else "-"
        print(f"  {cell.pace}, {cell.streams} streams: CPU {ours:.2f} / {theirs:.2f} ms per "
              f"stream ({cpu_ratio}); added TTFT p50 {g50:+.2f} / {t50:+.2f} ms, p99 "
              f"{g99:+.2f} / {t99:+.2f} ms (gateway - passthrough: {g50 - t50:+.2f}, "
              f"{g99 - t99:+.2f} ms)")
    for pace, rss in memory.items():
        line(f"gateway RSS after the {pace} cells < {RSS_MIB:g} MiB",
             f"{rss.after:.1f} MiB (ready {rss.started:.1f}, peak {rss.peak:.1f})",
             rss.after < RSS_MIB)


# --- profile ----------------------------------------------------------------------------------


def show_profile(profile: Path, requests: int, limit: int = 25) -> None:
    """Own time by package and the top functions, per request. cProfile sees the main
    thread only (the database writer's thread is not in it), and the time uvloop waits in
    epoll lands on whichever frame it last saw: the few-call entries at the top are that."""
    stats = pstats.Stats(str(profile))
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = (
        stats.stats)  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    hot: list[tuple[float, int, str]] = []
    for (filename, line, function), (_, calls, own, _, _) in raw.items():
        if calls < requests // 2:  # not on every request's path: start, stop, the idle wait
            continue
        group = profile_group(filename, function)
        groups[group] = groups.get(group, 0.0) + own
        where = profile_group(filename, function) if filename == "~" else \
            f"{Path(filename).name}:{line}({function})"
        hot.append((own, calls, where))
    whole = sum(groups.values())
    print(f"\ncProfile of the gateway's main thread during the cell: {whole:.2f} s of own time "
          f"in functions called at least every other request, {whole / requests * 1e3:.2f} ms "
          "per request (the profiler roughly doubles it), by where it is spent:")
    for group, own in sorted(groups.items(), key=lambda item: -item[1])[:20]:
        print(f"  {own / requests * 1e6:8.1f} us/request {own / whole:6.1%}  {group}")
    print(f"top {limit} functions by own time:")
    for own, calls, where in sorted(hot, reverse=True)[:limit]:
        print(f"  {own / requests * 1e6:8.1f} us/request {calls / requests:6.1f} calls/request"
              f"  {where}")


# --- the run ----------------------------------------------------------------------------------


def parse_cells(text: str) -> list[int]:
    try:
        cells = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: concurrencies like 1,8,64") from None
    if not cells or cells[0] < 1 or cells[-1] > MAX_RUNNING:
        raise argparse.ArgumentTypeError(f"concurrencies from 1 to {MAX_RUNNING}")
    return cells


def parse_paces(text: str) -> list[str]:
    paces = [part.strip() for part in text.split(",") if part.strip()]
    if not paces or any(p not in PACES for p in paces):
        raise argparse.ArgumentTypeError(f"{text!r}: one or both of {', '.join(PACES)}")
    return paces


def measure(runner: asyncio.Runner, path: str, target: Target, pace: str, streams: int,
            args: argparse.Namespace, engine: Child, proxy: Child | None,
            proxy_idle: float = 0.0, mark: Callable[[], None] | None = None) -> Cell:
    """One cell; `mark` is called once the connections are open and again at the end."""
    me = psutil.Process()

    def snapshot() -> Snapshot:
        if mark is not None:
            mark()
        times = me.cpu_times()
        return (times.user + times.system, engine.cpu(), proxy.cpu() if proxy else 0.0)

    stagger = TOKENS * PACES[pace]  # one request's length: arrivals spread evenly
    load = runner.run(run_load(target, streams, args.seconds, args.min_requests,
                               args.max_requests, stagger, snapshot))
    engine.check_alive()
    if proxy is not None:
        proxy.check_alive()
    client, engine_cpu, proxy_cpu = load.cpu
    return Cell(pace, streams, path, load.samples, load.window, load.elapsed, client,
                engine_cpu, None if proxy is None else proxy_cpu,
                len(load.samples) + streams, proxy_idle)


def idle_cpu(children: list[Child], seconds: float = 2.0) -> list[float]:
    """CPU seconds per second each child uses with no traffic."""
    before = [child.cpu() for child in children]
    time.sleep(seconds)
    return [(child.cpu() - cpu) / seconds for child, cpu in zip(children, before, strict=True)]


@dataclass(frozen=True)
class Memory:
    started: float  # MiB resident once ready, before any request
    after: float  # after the cells
    peak: float  # VmHWM


def run_pace(pace: str, args: argparse.Namespace, work: Path, model: Path,
             litellm: Path | None, runner: asyncio.Runner, cells: list[Cell],
             memory: dict[str, Memory]) -> None:
    root = work / pace
    root.mkdir()
    engine, engine_port = start_engine(root, model, PACES[pace])
    children = [engine]
    try:
        gateway = start_gateway(root, engine_port, classes=args.classes)
        children.append(gateway.child)
        rss_started = gateway.child.rss()[0]
        passthrough, passthrough_url = start_passthrough(root, engine_port)
        children.append(passthrough)
        passthrough_target = Target(f"{passthrough_url}/v1/chat/completions",
                                    {"Content-Type": "application/json"})
        targets: dict[str, tuple[Target, Child | None]] = {
            "direct": (Target(f"http://127.0.0.1:{engine_port}/v1/chat/completions",
                              {"Content-Type": "application/json"}), None),
            "passthrough": (passthrough_target, passthrough),
            "gateway": (gateway.target, gateway.child)}
        if litellm is not None:
            proxy, target = start_litellm(root, litellm, engine_port)
            children.append(proxy)
            targets["litellm"] = (target, proxy)
        proxies = [child for _, child in targets.values() if child is not None]
        idle = dict(zip([c.name for c in proxies], idle_cpu(proxies), strict=True))
        print(f"\n{pace} (the emulator takes {PACES[pace] * 1000:g} ms per token): engine pid "
              f"{engine.process.pid}; " + ", ".join(
                  f"{c.name} pid {c.process.pid} uses {idle[c.name] * 1000:.1f} ms CPU per "
                  "second idle" for c in proxies), flush=True)
        sent = 0
        for number, streams in enumerate(args.cells):
            order = list(targets) if number % 2 == 0 else list(targets)[::-1]
            for path in order:
                target, through = targets[path]
                cell = measure(runner, path, target, pace, streams, args, engine, through,
                               idle[through.name] if through else 0.0)
                cells.append(cell)
                if path == "gateway":
                    sent += cell.requests_sent
                p50, p99 = cell.ttft(0.5), cell.ttft(0.99)
                print(f"  {streams:>3} streams {path:<11} {len(cell.samples):>5} requests in "
                      f"{cell.elapsed:5.1f} s: {cell.tps:8.0f} tok/s, TTFT p50 "
                      f"{fmt(p50, '.2f', 7)} ms p99 {fmt(p99, '.2f', 7)} ms"
                      + (f", {cell.errors} errors" if cell.errors else ""), flush=True)
        now, peak = gateway.child.rss()
        memory[pace] = Memory(rss_started, now, peak)
        gateway.child.stop()
        print(f"  gateway: RSS {rss_started:.1f} MiB once ready, {now:.1f} MiB after the cells "
              f"(peak {peak:.1f} MiB); {usage_rows(gateway.db_url)} usage rows written for "
              f"the {sent} requests sent through it")
    finally:
        for child in reversed(children):
            child.stop()


def run_profile(pace: str, args: argparse.Namespace, work: Path, model: Path,
                runner: asyncio.Runner) -> None:
    root = work / "profile"
    root.mkdir()
    streams = max(args.cells)
    engine, engine_port = start_engine(root, model, PACES[pace])
    profile = root / "gateway.prof"
    try:
        gateway = start_gateway(root, engine_port, profile, classes=args.classes)
        signals = iter((signal.SIGUSR1, signal.SIGUSR2))

        def mark() -> None:
            os.kill(gateway.child.process.pid, next(signals))

        try:
            cell = measure(runner, "gateway", gateway.target, pace, streams, args, engine,
                           gateway.child, mark=mark)
            deadline = time.monotonic() + 10
            while not profile.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # the dump may still be being written
        finally:
            gateway.child.stop()
        print(f"\nprofiled: {pace}, {streams} streams through the gateway under cProfile: "
              f"{len(cell.samples)} requests, {cell.tps:.0f} tok/s, gateway CPU "
              f"{cell.per_stream(cell.proxy_cpu):.2f} ms per stream (slowed by the profiler)")
    finally:
        engine.stop()
    if profile.exists():
        show_profile(profile, len(cell.samples))
    else:
        print(f"no profile was written; the end of the gateway's log:\n"
              f"{(root / 'gateway.log').read_text(errors='replace')[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=parse_cells, default=[1, 8, 64],
                        help="concurrent streams per cell, comma-separated (default 1,8,64)")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="seconds new requests start for, per cell (default 8)")
    parser.add_argument("--paces", type=parse_paces, default=list(PACES),
                        help="paced (20 ms per token), unpaced (0 ms), or both (default)")
    parser.add_argument("--min-requests", type=int, default=20,
                        help="go on past --seconds (up to 60 s more) until this many "
                             "requests have started, for the TTFT percentiles (default 20)")
    parser.add_argument("--max-requests", type=int, default=20_000,
                        help="at most this many requests per cell (default 20000)")
    parser.add_argument("--skip-litellm", action="store_true",
                        help="direct and gateway only (no LiteLLM install or proxy)")
    parser.add_argument("--litellm-venv", type=Path, default=DEFAULT_VENV,
                        help=f"LiteLLM's own virtual environment (default {DEFAULT_VENV})")
    parser.add_argument("--profile", nargs="?", const="paced", choices=list(PACES),
                        help="then run one more cell (the largest, paced unless given) "
                             "through a gateway under cProfile and print where its time goes")
    parser.add_argument("--profile-only", action="store_true",
                        help="skip the measured cells: only the --profile run")
    parser.add_argument("--classes", action="store_true",
                        help="configure the service classes (interactive with a 5 s TTFT "
                             "SLO and a 32 tokens/s floor, batch at a quarter of the slots)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the working folder (logs, databases, profile)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.max_requests < 1:
        parser.error("--seconds and --max-requests must be positive")
    if args.profile_only:
        args.profile = args.profile or "paced"
        args.skip_litellm = True

    litellm: Path | None = None
    litellm_note = "skipped (--skip-litellm)"
    if not args.skip_litellm:
        found = ensure_litellm(args.litellm_venv)
        if isinstance(found, Path):
            litellm = found
            litellm_note = f"LiteLLM {litellm_version(args.litellm_venv)} ({args.litellm_venv})"
        else:
            litellm_note = "not available"
            print(f"LiteLLM could not be installed, carrying on without it: {found}",
                  file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    print(f"cpus {os.cpu_count()}, {platform.machine()}, Python {platform.python_version()}, "
          f"aiohttp {aiohttp.__version__}, uvloop {version('uvloop')}; {litellm_note}")
    print(f"cells {','.join(map(str, args.cells))} streams x {args.seconds:g} s, "
          f"{TOKENS} tokens per stream, paces {', '.join(args.paces)}; work in {work}")
    cells: list[Cell] = []
    memory: dict[str, Memory] = {}
    started = time.monotonic()
    try:
        model = model_dir(work)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            if not args.profile_only:
                for pace in args.paces:
                    run_pace(pace, args, work, model, litellm, runner, cells, memory)
                print_cells(cells)
                print_targets(cells, memory)
            if args.profile:
                run_profile(args.profile, args, work, model, runner)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{(time.monotonic() - started) / 60:.1f} min in all at "
          f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
