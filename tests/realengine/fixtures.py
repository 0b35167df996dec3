"""Fixtures of the real-engine tier: the env, the tiny models, and starting the real SGLang.

Registered for the whole suite from tests/conftest.py (``pytest_plugins``). A test of the
tier is marked ``real_engine`` and asks for ``real_sglang_env`` (directly or through the
model fixtures): without a built env it skips, unless TEST_APPLIANCE_REQUIRE_REAL_ENGINE is
set (CI), where it fails naming the command that builds it.

Starting an engine costs 35-60 s on two busy cores, so share one per test module
(``scope="module"``) and stop it at the end; ``RealEngine`` never outlives its ``with``.

    def test_x(real_sglang_env, dense_model):
        with RealEngine.start(real_sglang_env, dense_model, api_key=KEY) as engine:
            engine.wait_healthy()
            ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
BUILD_ENV = HERE / "build-env.sh"
# The key the tier's engines are started with; the captured logs carry it in place of the
# real one (tests/data/sglang-cpu/).
FAKE_ENGINE_KEY = "sk-appliance-test-engine-key-0000"
# Waits are on states; these bound them only so a broken engine fails instead of hanging.
START_DEADLINE = 300.0
EXIT_DEADLINE = 90.0

# What CPU mode needs, each from the reference (sglang-cpu.md): the engine decides CPU mode
# from this variable alone.
# The two crash-diagnostics switches are off because there is no GPU to dump: left on, a
# crashing engine sleeps 5 s, looks for py-spy, then waits 60 s for CUDA coredumps before it
# exits (srt/managers/tokenizer_manager.py; tests/data/sglang-cpu/hybrid-crash.log shows it).
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONUNBUFFERED": "1",
           "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# The dense model's CPU flags: no AMX here (torch_native attention), a small KV pool so
# the engine's RAM stays small. Its weights are a real (random) checkpoint.
DENSE_CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native",
                  "--max-total-tokens", "4096")
# The hybrid (Kimi-Linear) in CPU mode: each flag is demanded by an assertion of 0.5.23,
# and the pools are bounded (at the defaults the state pool takes 6.7 GB of RAM).
HYBRID_CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native",
                   "--load-format", "dummy", "--mamba-radix-cache-strategy", "no_buffer",
                   "--disable-overlap-schedule", "--mem-fraction-static", "0.1",
                   "--max-mamba-cache-size", "64", "--max-total-tokens", "8192")
# The hybrid cannot run a forward on CPU (KDA prefill is Triton-only): no warmup generate,
# and /health must not run one either.
NO_GENERATION_ARGS = ("--skip-server-warmup",)
NO_GENERATION_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}


def free_port() -> int:
    """A free loopback port (this module imports nothing of the app: capture_logs runs it
    without the product's import chain)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env_where() -> tuple[Path, bool]:
    """The env's path and whether it is complete (build-env.sh --where; builds nothing)."""
    result = subprocess.run([str(BUILD_ENV), "--where"], capture_output=True, text=True,
                            timeout=30, check=False)
    return Path(result.stdout.strip()), result.returncode == 0


@pytest.fixture(scope="session")
def real_sglang_env() -> Path:
    """The real-engine env (its root; ``bin/python`` runs SGLang). Skips when not built."""
    where, complete = env_where()
    if not complete:
        message = (f"the real-engine env is not built at {where}: run "
                   "tests/realengine/build-env.sh (make test does)")
        if os.environ.get("TEST_APPLIANCE_REQUIRE_REAL_ENGINE"):
            pytest.fail(message)
        pytest.skip(message)
    return where


def make_model(env: Path, kind: str, directory: Path) -> Path:
    """Write the tiny ``kind`` model (dense or hybrid) with the env's `tokenizers`."""
    result = subprocess.run([str(env / "bin" / "python"), str(HERE / "models.py"), kind,
                             str(directory)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, f"models.py {kind} failed:\n{result.stderr[-2000:]}"
    return directory


@pytest.fixture(scope="session")
def dense_model(real_sglang_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForCausalLM folder (config + trained tokenizer; weights: --load-format dummy)."""
    return make_model(real_sglang_env, "dense", tmp_path_factory.mktemp("dense-model"))


@pytest.fixture(scope="session")
def hybrid_model(real_sglang_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny KimiLinearForCausalLM folder (1 KDA + 1 MLA layer): real pools, no generation."""
    return make_model(real_sglang_env, "hybrid", tmp_path_factory.mktemp("hybrid-model"))


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class RealEngine:
    """One real SGLang server process (its own session), its port and its log file."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path,
                 api_key: str | None) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{port}"

    @classmethod
    @contextlib.contextmanager
    def start(cls, env: Path, model: Path, *, log: Path, args: Sequence[str] = DENSE_CPU_ARGS,
              extra_env: dict[str, str] | None = None, api_key: str | None = FAKE_ENGINE_KEY,
              port: int | None = None) -> Iterator[RealEngine]:
        """``sglang serve`` of ``model`` on 127.0.0.1; stopped (SIGTERM, then SIGKILL of
        its group) when the ``with`` ends, whatever the test did to it."""
        port = port or free_port()
        argv = [str(env / "bin" / "sglang"), "serve", "--model-path", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--enable-metrics", *args]
        if api_key:
            argv += ["--api-key", api_key]
        child_env = {**os.environ, **CPU_ENV, **(extra_env or {})}
        with log.open("wb") as handle:
            process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                       env=child_env, start_new_session=True)
        engine = cls(process, port, log, api_key)
        try:
            yield engine
        finally:
            engine.stop()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> int | None:
        """/health's status code, or None while the port is closed."""
        try:
            return httpx.get(f"{self.base_url}/health", timeout=10).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self, deadline: float = START_DEADLINE) -> list[int | None]:
        """Poll /health until 200; returns the codes seen on the way (None: port closed).
        Fails with the log's tail when the engine exits first or the deadline passes."""
        seen: list[int | None] = []
        end = time.monotonic() + deadline
        while True:
            code = self.health()
            if not seen or seen[-1] != code:
                seen.append(code)
            if code == 200:
                return seen
            status = self.process.poll()
            assert status is None, (
                f"the engine exited ({status}) before it was healthy; its log ends:\n"
                f"{log_tail(self.log)}")
            assert time.monotonic() < end, (
                f"the engine was not healthy within {deadline:.0f} s (codes {seen}); its log "
                f"ends:\n{log_tail(self.log)}")
            time.sleep(0.5)

    def wait_log(self, needle: str, deadline: float = START_DEADLINE) -> str:
        """Wait until the log contains ``needle``; returns the log."""
        end = time.monotonic() + deadline
        while True:
            text = self.log.read_text(errors="replace")
            if needle in text:
                return text
            exited = self.process.poll() is not None
            assert not exited and time.monotonic() < end, (
                f"{needle!r} never reached the log ({'the engine exited' if exited else 'in time'}"
                f"); it ends:\n{log_tail(self.log)}")
            time.sleep(0.3)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, deadline: float = EXIT_DEADLINE) -> int:
        try:
            return self.process.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the engine did not exit within {deadline:.0f} s; its log ends:\n"
                f"{log_tail(self.log)}") from None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of the whole group (its scheduler and detokenizer too)."""
        if self.process.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


@contextlib.contextmanager
def hybrid_engine(env: Path, model: Path, log: Path, *flags: str) -> Iterator[RealEngine]:
    """The tiny Kimi-Linear started with the tier's CPU flags plus ``flags`` (e.g.
    ``"--mamba-full-memory-ratio", "0.5"``; a later flag wins over the default's), in
    no-generation mode, healthy: read its pools with ``engine.wait_log("KV Cache is
    allocated")`` and ``/server_info``. Never send it a generation: it crashes."""
    with RealEngine.start(env, model, log=log, args=(*HYBRID_CPU_ARGS, *NO_GENERATION_ARGS,
                                                      *flags),
                          extra_env=NO_GENERATION_ENV) as engine:
        engine.wait_healthy()
        yield engine
