"""Cell latency: what SGLang's router, and a whole prefill/decode cell behind it, add to a
stream's latency over the same stream sent straight to one engine, in the same run (issue 17).

    .venv/bin/python benchmarks/cell_latency.py [--users 1,8,64] [--requests-per-user 8]
        [--tokens 64] [--token-ms 10] [--paths direct,router,cell] [--quickack]
        [--deadline 600] [--keep]

Everything on this machine, on 127.0.0.1, in separate processes:

  direct   client -> one unified engine emulator (`python -m appliance.testing.fake_sglang
           serve`): the baseline every ratio is against
  router   client -> SGLang's router (`python -m sglang_router.launch_router --worker-urls`,
           sglang-router 0.3.2) -> that same unified emulator: the router's hop alone
  cell     client -> the router in PD mode (`--pd-disaggregation --prefill URL
           BOOTSTRAP_PORT --decode URL`, as tests/test_cell_engine.py runs it and the head's
           spec writes it) -> a prefill emulator and a decode emulator, which hand each
           request's "KV" over through the prefill's bootstrap server: the router's hop, the
           request sent to both engines, and the handover

The routers read their tokenizer from the local model directory (`--model-path`,
`--tokenizer-path`, HF_HUB_OFFLINE=1), listen for Prometheus on loopback and use round robin.
Every engine runs with `--max-running-requests 256`, so nothing queues.

Paced streams: at each concurrency c (`--users`), c users each send a streamed chat
completion (`max_tokens: --tokens, ignore_eos: true`), read it to its end, then send the
next, `--requests-per-user` times. c short requests first open the connections (not
counted), the engines get 2 s to finish that burst's work, and the users' first requests are
spread over one request's length so that arrivals are steady. The client is this process:
httpx on asyncio, each SSE event's JSON decoded and the arrival of every event with content
timed. Per concurrency and path: TTFT p50 and p90 (request sent to first content),
inter-token latency p50 (every gap between two content events of a stream, pooled), request
latency p50 and p90 (sent to the end of the response), per-user decode tok/s p50 and p10
(per request: its tokens after the first over the time from the first to the last), each path
beside direct with the ratio path/direct; then the milliseconds each part added to TTFT p50
and ITL p50. Paths run one after another, their order reversed at every other concurrency;
no request starts after `--deadline` seconds from the start (those in flight finish, each
within 60 s), and a cell cut short says so.

The client reads like the head's gateway does, a plain socket, unless `--quickack`: then it
asks the kernel before every read to acknowledge at once (TCP_QUICKACK). That takes out a
stall of sglang-router 0.3.2 itself: it writes each event to its client as it comes, and its
connections behave as with Nagle's algorithm on (no TCP_NODELAY), so the first content
event, written right after the role event, waits for the client's acknowledgement of that,
which Linux delays up to 40 ms on a connection in use (measured: the stall is there on every
request of a kept-alive connection but the first, and gone with --quickack). Run both to see
the stall apart from the rest of the router's cost.

The emulators' clock: one token every `--token-ms` (default 10 ms: `FAKE_SGLANG_FAULT=
slow_tokens=0.01`), 64 tokens an answer. Short enough that a router's milliseconds show in the
ratios (at 20 ms a token, the engine's own sleep would hide them), long enough that c = 64
users (100 requests and 6,400 events a second direct) do not turn every cell into a contest
for a small machine's CPUs. The cell's prefill emulator spends one token's time "prefilling"
before the decode emulator starts, which a unified emulator does not spend apart, so about
`--token-ms` of the cell's added TTFT is that modelled step, not overhead.

Nothing is asserted: a measuring instrument, run by hand (about three minutes with the
defaults). The client, the routers and the emulators share this machine's CPUs, so at 64
users the ratios include who gets the CPU; compare the ratios within one run.

Measured on this machine on 2026-12-02 (2 vCPUs shared with other work, load 3.5-6;
benchmarks/README.md, "Cell latency", has both runs' tables). At 1 and 8 users: the router's
hop added 30-33 ms to TTFT p50 (x2.6-3.7 direct's 12-19 ms), nearly all of it the stall above
(+1.9 and -0.6 ms with --quickack); the cell added 42-51 ms (x3.2-5.2), 16-21 ms with
--quickack, of which 10 ms is the emulated prefill step. Inter-token latency, request latency
and per-user decode tok/s stayed within 5 % of direct (ratios 0.95-1.05, one p90 at 1.17). At
64 users this machine is CPU-bound (direct ITL p50 0.03 ms: the client reads bursts, TTFT p50
0.2-1 s and moving between runs), so that row measures the CPUs, not the router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx
from gateway_throughput import (  # beside this script
    MODEL,
    Child,
    clean_env,
    fmt,
    free_port,
    parse_cells,
    percentile,
    spawn,
    wait_until,
)

from appliance.testing.checkpoint import write_checkpoint

PATHS = ("direct", "router", "cell")
MAX_RUNNING = 256
REQUEST_TIMEOUT = 60.0  # seconds: the most one request may take
START_TIMEOUT = 120.0
SETTLE_SECONDS = 2.0  # after a cell's warm-up burst, before its measured streams


# --- one stream ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """One request's timings, perf_counter seconds: when it was sent, when each event with
    content came, when the response ended; `error` when it failed (then not counted)."""

    sent: float
    arrivals: tuple[float, ...]
    ended: float
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def latency(self) -> float:
        return self.ended - self.sent

    @property
    def decode_rate(self) -> float | None:
        """Tokens a second after the first: what one user sees the answer stream at."""
        if len(self.arrivals) < 2 or self.arrivals[-1] <= self.arrivals[0]:
            return None
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])


def request_body(index: int, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"cell latency stream {index}"}]}


def has_content(payload: bytes) -> bool:
    """Whether an SSE event's JSON carries answer text (the first event is the role's)."""
    choices = json.loads(payload).get("choices") or []
    return any((choice.get("delta") or {}).get("content") for choice in choices)


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, object],
                     quickack: bool = False) -> Stream:
    """One streamed request, each event with content timed as it is read. `quickack`: ask
    the kernel, before every read, to acknowledge what comes next at once (TCP_QUICKACK)
    rather than up to 40 ms later (a sender that waits for the acknowledgement, as Nagle's
    algorithm does, stalls on that)."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:200].decode(errors="replace")
                return Stream(sent, (), time.perf_counter(),
                              f"HTTP {response.status_code}: {text}")
            sock = response.extensions["network_stream"].get_extra_info("socket") \
                if quickack else None
            tail = b""
            chunks = response.aiter_bytes()
            while True:
                if sock is not None:  # the headers, then every chunk, acknowledged at once
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
                chunk = await anext(chunks, None)
                if chunk is None:
                    break
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]" and \
                            has_content(line[5:]):
                        arrivals.append(time.perf_counter())
    except (httpx.HTTPError, ValueError) as exc:
        return Stream(sent, tuple(arrivals), time.perf_counter(),
                      f"{type(exc).__name__}: {exc}"[:200])
    return Stream(sent, tuple(arrivals), time.perf_counter())


# --- one cell: c users, paced ----------------------------------------------------------------


async def run_cell(url: str, users: int, requests: int, tokens: int, token_seconds: float,
                   deadline: float, quickack: bool,
                   fresh: bool = False) -> tuple[list[Stream], bool]:
    """`users` paced users against `url`; (every measured stream, whether the deadline cut
    the cell short). `fresh`: a new connection for every request (no keep-alive)."""
    if time.monotonic() > deadline:
        return [], True
    limits = httpx.Limits(max_connections=users,
                          max_keepalive_connections=0 if fresh else users)
    timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=10.0)
    streams: list[Stream] = []
    cut = False
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = await asyncio.gather(*(one_stream(client, url, request_body(-1 - i, 2),
                                                 quickack) for i in range(users)))
        failed = [s.error for s in warm if s.error]
        if failed:
            raise SystemExit(f"{url}: the warm-up failed: {failed[0]}")
        request_seconds = tokens * token_seconds
        await asyncio.sleep(SETTLE_SECONDS)  # the engines' work for that burst, done

        async def user(index: int) -> None:
            nonlocal cut
            await asyncio.sleep(request_seconds * index / users)
            for number in range(requests):
                if time.monotonic() > deadline:
                    cut = True
                    return
                streams.append(await one_stream(
                    client, url, request_body(index * requests + number, tokens), quickack))

        await asyncio.gather(*(user(index) for index in range(users)))
    return streams, cut


# --- figures ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """What one path did at one concurrency, milliseconds and tokens a second."""

    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    itl_p50: float | None
    latency_p50: float | None
    latency_p90: float | None
    decode_p50: float | None
    decode_p10: float | None
    cut: bool = False
    first_error: str = ""


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def figures(streams: list[Stream], cut: bool = False) -> Figures:
    """The figures of a cell's streams (pure); failed streams count only as errors."""
    ok = [s for s in streams if not s.error]
    ttfts = [t for s in ok if (t := s.ttft) is not None]
    rates = [r for s in ok if (r := s.decode_rate) is not None]
    latencies = [s.latency for s in ok]
    gaps = [g for s in ok for g in s.gaps]
    return Figures(len(ok), len(streams) - len(ok), ms(percentile(ttfts, 0.5)),
                   ms(percentile(ttfts, 0.9)), ms(percentile(gaps, 0.5)),
                   ms(percentile(latencies, 0.5)), ms(percentile(latencies, 0.9)),
                   percentile(rates, 0.5), percentile(rates, 0.1), cut,
                   next((s.error for s in streams if s.error), ""))


# (label, Figures field, format) in print order; for the last two, higher is better
METRICS = (("TTFT p50 ms", "ttft_p50", ".2f"), ("TTFT p90 ms", "ttft_p90", ".2f"),
           ("ITL p50 ms", "itl_p50", ".3f"), ("latency p50 ms", "latency_p50", ".1f"),
           ("latency p90 ms", "latency_p90", ".1f"), ("decode p50 tok/s", "decode_p50", ".1f"),
           ("decode p10 tok/s", "decode_p10", ".1f"))


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def print_table(results: dict[tuple[int, str], Figures], paths: list[str]) -> None:
    """One row per concurrency and metric: each path's figure, and beside every path other
    than direct its ratio to direct."""
    others = [p for p in paths if p != "direct"]
    header = f"{'users':>5}  {'metric':<17}" + (f"{'direct':>10}" if "direct" in paths else "")
    for path in others:
        header += f"{path:>10}{'x direct':>9}"
    print("\n" + header)
    print("-" * len(header))
    for users in sorted({c for c, _ in results}):
        base = results.get((users, "direct"))
        for label, name, spec in METRICS:
            row = f"{users:>5}  {label:<17}"
            base_value = getattr(base, name) if base else None
            if "direct" in paths:
                row += fmt(base_value, spec, 10)
            for path in others:
                cell = results.get((users, path))
                value = getattr(cell, name) if cell else None
                row += fmt(value, spec, 10) + fmt(ratio(value, base_value), ".3f", 9)
            print(row)
        counts = "  ".join(
            f"{path} {f.requests} ok, {f.errors} failed{' (cut by --deadline)' if f.cut else ''}"
            for path in paths if (f := results.get((users, path))) is not None)
        print(f"{'':>5}  requests: {counts}")
        for path in paths:
            if (f := results.get((users, path))) is not None and f.first_error:
                print(f"{'':>5}  {path}, first failure: {f.first_error}")


# (what was added, the path, the path it is measured over)
ADDED = (("the router's hop", "router", "direct"),
         ("the cell (router, both engines, handover)", "cell", "direct"),
         ("the cell over the router's hop", "cell", "router"))


def print_added(results: dict[tuple[int, str], Figures]) -> None:
    """TTFT p50 and ITL p50, in ms, that each part of the cell added, path over path."""
    print("\nadded, ms (TTFT p50, ITL p50):")
    for users in sorted({c for c, _ in results}):
        for what, path, over in ADDED:
            mine, base = results.get((users, path)), results.get((users, over))
            if mine is None or base is None:
                continue
            parts = [f"{a - b:+.2f}" if a is not None and b is not None else "-" for a, b in
                     ((mine.ttft_p50, base.ttft_p50), (mine.itl_p50, base.itl_p50))]
            print(f"  {users:>3} users  {what:<42} {f'{path} - {over}':<16}"
                  f"{parts[0]:>8} {parts[1]:>7}")


# --- the processes ----------------------------------------------------------------------------


def start_engine(work: Path, model: Path, name: str, token_seconds: float,
                 mode: str | None = None, bootstrap: int | None = None) -> tuple[Child, str]:
    """An engine emulator on a free loopback port: unified, or a prefill (serving its
    bootstrap server on `bootstrap`) or a decode."""
    port = free_port()
    argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", str(model),
            "--served-model-name", MODEL, "--tp-size", "1",
            "--max-running-requests", str(MAX_RUNNING), "--host", "127.0.0.1",
            "--port", str(port)]
    if mode is not None:
        argv += ["--disaggregation-mode", mode]
    if bootstrap is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
    env = clean_env(FAKE_SGLANG_LOAD_SECONDS="1",
                    FAKE_SGLANG_FAULT=f"slow_tokens={token_seconds:g}",
                    FAKE_SGLANG_GPU_STATE=str(work / f"{name}-gpus.json"))
    child = spawn(f"the {name} emulator", argv, work / f"{name}.log", env)
    wait_until(child, lambda: "fired up and ready" in child.tail(20000), "ready", START_TIMEOUT)
    return child, f"http://127.0.0.1:{port}"


def start_router(work: Path, model: Path, name: str, workers: list[str]) -> tuple[Child, str]:
    """SGLang's router over `workers` (its own flags naming them), serving once a chat
    completion comes back through it."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", *workers,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--model-path", str(model), "--tokenizer-path", str(model),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-timeout-secs", "60", "--request-timeout-secs",
            str(int(REQUEST_TIMEOUT)), "--log-level", "warn"]
    child = spawn(f"the {name} router", argv, work / f"{name}-router.log",
                  clean_env(HF_HUB_OFFLINE="1", NO_PROXY="*"))
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        body = {**request_body(0, 2), "stream": False}
        with contextlib.suppress(httpx.HTTPError):
            return httpx.post(f"{url}/v1/chat/completions", json=body,
                              timeout=10).status_code == 200
        return False

    wait_until(child, serving, "serving", START_TIMEOUT)
    return child, url


CHAT = "/v1/chat/completions"


def start_paths(paths: list[str], work: Path, token_seconds: float
                ) -> tuple[dict[str, str], list[Child]]:
    """The processes behind each path; (the chat URL of each path, every process started)."""
    model = work / "model"
    write_checkpoint(model, shards=1, shard_bytes=1 << 16)
    children: list[Child] = []
    urls: dict[str, str] = {}
    if {"direct", "router"} & set(paths):
        unified, unified_url = start_engine(work, model, "unified", token_seconds)
        children.append(unified)
        urls["direct"] = unified_url
        if "router" in paths:
            router, urls["router"] = start_router(work, model, "plain",
                                                  ["--worker-urls", unified_url])
            children.append(router)
    if "cell" in paths:
        bootstrap = free_port()
        prefill, prefill_url = start_engine(work, model, "prefill", token_seconds, "prefill",
                                            bootstrap)
        children.append(prefill)
        decode, decode_url = start_engine(work, model, "decode", token_seconds, "decode")
        children.append(decode)
        cell, urls["cell"] = start_router(work, model, "pd", [
            "--pd-disaggregation", "--prefill", prefill_url, str(bootstrap),
            "--decode", decode_url])
        children.append(cell)
    return {path: url + CHAT for path, url in urls.items()}, children


# --- main -------------------------------------------------------------------------------------


def parse_paths(text: str) -> list[str]:
    paths = [part.strip() for part in text.split(",") if part.strip()]
    if not paths or any(p not in PATHS for p in paths) or len(set(paths)) != len(paths):
        raise argparse.ArgumentTypeError(f"{text!r}: some of {', '.join(PATHS)}")
    return [p for p in PATHS if p in paths]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=parse_cells, default=[1, 8, 64],
                        help="concurrent paced users per cell, comma-separated (default 1,8,64)")
    parser.add_argument("--requests-per-user", type=int, default=8,
                        help="streams each user sends, one after another (default 8)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens per answer (max_tokens, ignore_eos; default 64)")
    parser.add_argument("--token-ms", type=float, default=10.0,
                        help="the emulators' milliseconds per token (default 10)")
    parser.add_argument("--paths", type=parse_paths, default=list(PATHS),
                        help="some of direct, router, cell (default all three)")
    parser.add_argument("--quickack", action="store_true",
                        help="the client acknowledges every read at once (TCP_QUICKACK): "
                             "takes out the stall of a server that waits for acknowledgements")
    parser.add_argument("--fresh-connections", action="store_true",
                        help="a new connection for every request (no keep-alive): the "
                             "stall does not happen on a connection's first request")
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="seconds from the start after which no new request starts "
                             "(default 600)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the working folder (the processes' logs)")
    args = parser.parse_args(argv)
    if args.requests_per_user < 1 or args.tokens < 2 or args.token_ms <= 0 or \
            args.deadline <= 0:
        parser.error("--requests-per-user and --deadline must be positive, --tokens at "
                     "least 2, --token-ms above 0")
    deadline = time.monotonic() + args.deadline
    token_seconds = args.token_ms / 1000
    work = Path(tempfile.mkdtemp(prefix="cell-latency-"))
    print(f"cpus {os.cpu_count()}, load {' '.join(f'{x:.1f}' for x in os.getloadavg())}, "
          f"{platform.machine()}, Python {platform.python_version()}, "
          f"sglang-router {version('sglang-router')}, httpx {httpx.__version__}")
    print(f"users {','.join(map(str, args.users))} x {args.requests_per_user} paced streams of "
          f"{args.tokens} tokens at {args.token_ms:g} ms a token; paths "
          f"{', '.join(args.paths)}; client {'TCP_QUICKACK' if args.quickack else 'plain'}"
          f"{', a new connection per request' if args.fresh_connections else ''}; "
          f"work in {work}")
    started = time.monotonic()
    results: dict[tuple[int, str], Figures] = {}
    children: list[Child] = []
    try:
        urls, children = start_paths(args.paths, work, token_seconds)
        for number, users in enumerate(args.users):
            order = args.paths if number % 2 == 0 else args.paths[::-1]
            for path in order:
                for child in children:
                    child.check_alive()
                streams, cut = asyncio.run(run_cell(
                    urls[path], users, args.requests_per_user, args.tokens, token_seconds,
                    deadline, args.quickack, args.fresh_connections))
                results[users, path] = figures(streams, cut)
                print(f"  {users:>3} users, {path:<6}: {len(streams)} streams "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        for child in children:
            child.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results, args.paths)
    print_added(results)
    print(f"\n{(time.monotonic() - started) / 60:.1f} min in all at "
          f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
