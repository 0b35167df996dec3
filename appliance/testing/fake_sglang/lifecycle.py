"""The engine emulator once loaded: bind, warm up, serve, watch the children, drain on SIGTERM.
A test and demo instrument (`appliance.testing.fake_sglang`).

As in SGLang 0.5.23 (shared/reference/sglang-0.5.23.md, section 5):
- the port is bound only now, after the weights, pools and graphs;
- after the warmup `POST /generate`: `The server is fired up and ready to roll!`;
- SIGTERM, once a request has reached the tokenizer manager (the warmup, a generation, a
  health check that generates, `/server_info`, `/v1/loads`: `Core.auto_create_handle_loop`),
  logs `SIGTERM received. signum=None frame=None. Draining requests and shutting
  down...` (the handler is registered with `loop.add_signal_handler`, which passes no
  arguments, hence the Nones), turns `/health*` and `/ready` to 503, keeps serving (new
  requests too), logs `Gracefully exiting... Remaining number of requests N. ...` until none
  remain (every 5 s in SGLang; here scaled with the load time, 1 s at the default 20 s), then
  stops the children and exits 0. An UnHealthy server or `SGL_FORCE_SHUTDOWN=1` skips the wait.
  Before any such request (`--skip-server-warmup`, only `/health` or `/v1/models` asked)
  SIGTERM is uvicorn's: the server stops at once, no drain line, and the process dies of the
  signal (exit 143), as the real 0.5.23 does on the CPU box;
- a child that dies (exit code other than 0) makes the watchdog log `Subprocess scheduler_<i>
  (or detokenizer) (pid=...) crashed with exit code <c>. Triggering SIGQUIT for cleanup...`;
  SIGQUIT logs `SIGQUIT received. ... It usually means one child failed.` and kills the whole
  tree, the main process last, by SIGKILL;
- SIGINT stops the HTTP server at once and kills the children, without a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import http.client
import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.core import Core
from appliance.testing.fake_sglang.faults import Faults
from appliance.testing.fake_sglang.gpustate import GpuStateFile
from appliance.testing.fake_sglang.logwriter import LogWriter
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.ranks import Children
from appliance.testing.fake_sglang.server import App
from appliance.testing.fake_sglang.startup import Model, Timings

WATCHDOG_SECONDS = 0.25  # SGLang's SubprocessWatchdog polls every 1 s
SCHEDULER_EXIT_SECONDS = 5.0  # SGLang waits 15 s for schedulers after ShutdownReq
WARMUP_PROMPT = "The capital city of France is"


def log_config() -> dict[str, Any]:
    """uvicorn's logging as SGLang sets it (`set_uvicorn_logging_configs`): timestamps, no
    colours; the access log on stdout, the rest on stderr."""
    config = copy.deepcopy(LOGGING_CONFIG)
    for name in ("default", "access"):
        config["formatters"][name]["datefmt"] = "%Y-%m-%d %H:%M:%S"
        config["formatters"][name]["use_colors"] = False
    config["formatters"]["default"]["fmt"] = "[%(asctime)s] %(levelprefix)s %(message)s"
    config["formatters"]["access"]["fmt"] = (
        '[%(asctime)s] %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'
    )
    return config


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the emulator installs SGLang's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Lifecycle:
    def __init__(self, args: ServeArgs, cap: Capacity, model: Model, timings: Timings,
                 faults: Faults, log: LogWriter, children: Children, gpu: GpuStateFile,
                 load_seconds: float) -> None:
        self.args, self.cap, self.model, self.timings = args, cap, model, timings
        self.faults, self.log, self.children, self.gpu = faults, log, children, gpu
        self.core = Core(args, cap, faults, log)
        self.drain_seconds = min(5.0, max(0.25, load_seconds / 20))
        self.stopping = False
        self.uvicorn_exit = False  # SIGTERM reached uvicorn's handler, not SGLang's drain
        self.exit_code = 0
        self.done = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: Server | None = None

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self) -> int:
        if self.core.handover is not None:  # a cell's prefill: its bootstrap server
            await self.core.handover.start()
        app = App(self.args, self.cap, self.model, self.timings, self.core, self.log)
        config = uvicorn.Config(app, host=self.args.host, port=self.args.port,
                                log_config=log_config(), lifespan="on", timeout_keep_alive=5,
                                timeout_graceful_shutdown=2)
        server = self.server = Server(config)
        failed: list[int] = []

        async def serve() -> None:
            try:
                await server.serve()
            except SystemExit as exc:  # could not bind: uvicorn has logged why
                failed.append(exc.code if isinstance(exc.code, int) else 1)

        serving = asyncio.ensure_future(serve())
        while not server.started:
            if serving.done():
                self.shutdown_children()
                return failed[0] if failed else 1
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_uvicorn_sigterm)
        self.core.on_handle_loop = lambda: loop.add_signal_handler(signal.SIGTERM,
                                                                   self.on_sigterm)
        loop.add_signal_handler(signal.SIGQUIT, self.on_sigquit)
        loop.add_signal_handler(signal.SIGINT, self.on_sigint)
        self.spawn(self.watchdog())
        self.spawn(self.core.decode_log_loop())
        if not self.args.skip_server_warmup:
            try:
                await asyncio.to_thread(self.warmup)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self.log.line(f"Initialization failed. warmup error: {exc!r}")
                self.on_sigquit()
        self.core.status = "Up"
        self.log.line("The server is fired up and ready to roll!")
        if self.faults.scheduler_death_after is not None:
            self.spawn(self.kill_a_scheduler(self.faults.scheduler_death_after))
        await self.done.wait()
        server.should_exit = True
        await serving
        if self.core.handover is not None:
            await self.core.handover.stop()
        for task in list(self.tasks):
            task.cancel()
        self.gpu.clear(self.args.tp_size)
        if self.uvicorn_exit:
            # uvicorn's capture_signals re-raises the signal it caught once the server is
            # down; SIGTERM's action is the default then: the process dies of it (143).
            sys.stderr.flush()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        return self.exit_code

    def warmup(self) -> None:
        """SGLang's `_execute_server_warmup`: `GET /model_info`, then one `POST /generate`."""
        wildcard = self.args.host in ("0.0.0.0", "::", "")  # noqa: S104 - a client, not a bind
        host = "127.0.0.1" if wildcard else self.args.host
        headers = {"Content-Type": "application/json"}
        if self.args.api_key:
            headers["Authorization"] = f"Bearer {self.args.api_key}"
        for method, path, body in (
            ("GET", "/model_info", None),
            ("POST", "/generate", {"text": WARMUP_PROMPT,
                                   "sampling_params": {"temperature": 0, "max_new_tokens": 8}}),
        ):
            conn = http.client.HTTPConnection(host, self.args.port, timeout=600)
            try:
                conn.request(method, path, json.dumps(body) if body else None, headers)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise ValueError(f"{method} {path} answered {response.status}")
            finally:
                conn.close()

    # -- signals --------------------------------------------------------------------------
    def on_uvicorn_sigterm(self) -> None:
        """SIGTERM before any request reached the tokenizer manager (no warmup, only `/health`
        and the like): uvicorn's `handle_exit`. The server stops with no drain and no
        SGLang line, the children die with their parent (PDEATHSIG), and the process ends by
        the signal itself: exit 143 (-15 to Popen)."""
        self.uvicorn_exit = True
        self.stopping = True
        self.children.kill_all()
        self.done.set()

    def on_sigterm(self) -> None:
        self.log.line("SIGTERM received. signum=None frame=None. Draining requests and "
                      "shutting down...")
        if not self.core.draining:
            self.core.draining = True
            self.spawn(self.drain())

    async def drain(self) -> None:
        """SGLang's `sigterm_watchdog`: wait, without a time limit, for in-flight requests."""
        forced = False
        while True:
            if self.core.status == "UnHealthy":
                self.log.line("Signal SIGTERM received while health check failed. Force exiting.")
                forced = True
                break
            if os.environ.get("SGL_FORCE_SHUTDOWN", "").lower() in ("1", "true", "yes"):
                self.log.line("Signal SIGTERM received while force shutdown flag set. "
                              "Force exiting.")
                forced = True
                break
            rids = [*self.core.running, *(r.rid for r in self.core.waiting)]
            self.log.line(f"Gracefully exiting... Remaining number of requests {len(rids)}. "
                          f"Remaining requests remaining_rids={rids!r}.")
            if not rids:
                break
            await asyncio.sleep(self.drain_seconds)
        self.stopping = True
        stragglers = await asyncio.to_thread(self.children.shutdown, SCHEDULER_EXIT_SECONDS)
        if stragglers:
            self.log.line(f"Schedulers still alive {SCHEDULER_EXIT_SECONDS:g}s after ShutdownReq, "
                          f"killing them before they released: {stragglers}")
        if forced:  # in-flight requests are cut off: their connections just close
            self.gpu.clear(self.args.tp_size)
            sys.stderr.flush()
            os._exit(0)
        self.exit_code = 0
        self.done.set()

    def on_sigint(self) -> None:
        """After startup ^C goes to uvicorn: the server stops, the children are killed."""
        self.stopping = True
        self.children.kill_all()
        self.done.set()

    def on_sigquit(self) -> None:
        self.log.line("SIGQUIT received. signum=None, frame=None. It usually means one child "
                      "failed.")
        self.die()

    def die(self) -> None:
        """kill_process_tree(os.getpid()): every child, then this process, by SIGKILL."""
        self.stopping = True
        self.children.kill_all()
        self.gpu.clear(self.args.tp_size)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def shutdown_children(self) -> None:
        self.stopping = True
        self.children.kill_all()
        self.gpu.clear(self.args.tp_size)

    # -- watchdog and faults --------------------------------------------------------------
    async def watchdog(self) -> None:
        """SGLang's SubprocessWatchdog: a child that exits non-zero ends everything."""
        while True:
            await asyncio.sleep(WATCHDOG_SECONDS)
            if self.stopping:
                return
            for child in self.children.reap():
                if child.exit_code == 0:
                    continue
                name = "detokenizer" if child.rank < 0 else f"scheduler_{child.rank}"
                self.log.line(f"Subprocess {name} (pid={child.pid}) crashed with exit code "
                              f"{child.exit_code}. Triggering SIGQUIT for cleanup...")
                os.kill(os.getpid(), signal.SIGQUIT)
                return

    async def kill_a_scheduler(self, after: float) -> None:
        await asyncio.sleep(after)
        victim = self.children.rank(min(3, self.args.tp_size - 1))
        self.children.kill(victim, signal.SIGKILL)
