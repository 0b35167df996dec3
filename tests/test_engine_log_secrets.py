"""The engine key never leaves through the engine's log (issue 22, High).

Real SGLang 0.5.23 logs `server_args={...}` at every start with `api_key` in clear (it redacts
only its watermark secrets). The line below is that line's real shape (a Python dict repr on
one line, cut to a few dozen of its ~400 fields; `data/sglang-cpu/` holds whole captured
logs, checked too). Each exit is tested as a **viewer** (the role the log routes are for):
the parser's `server_args` (`GET /api/v1/engine`), `GET /api/v1/engine/log`, its SSE stream,
the Engine page, the events, `appliance engine parse-log` (a real subprocess) and the support
bundle's engine-log part. Each asserts that the key's value is absent and that the rest of the
line is intact, word for word. Against the code before `logsecrets` each of them showed the key.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.auth.accounts import create_admin
from appliance.auth.roles import Role
from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.logparse import parse_text
from appliance.engine.logreport import render_json, render_text
from appliance.engine.logsecrets import MARK, redact, redact_bytes, redact_json, redact_pairs
from appliance.engine.records import open_run
from appliance.engine.runner import EngineIdentity
from appliance.engine.states import EngineState
from appliance.ops.bundle import Context
from appliance.ops.collectors import engine_logs
from appliance.runtime import Runtime, build_runtime
from appliance.testing.fake_gpus import FakeGpus
from tests.conftest import PASSWORD, Console, LiveServer, make_config, wait_for
from tests.test_engine_page_runs import RecordedEngine, _gone_pid

REPO = Path(__file__).resolve().parent.parent
CAPTURED = sorted((Path(__file__).parent / "data" / "sglang-cpu").glob("*.log"))
KEY = "sk-engine-abc"  # the brief's example: short, and shaped like a gateway key


def server_args_line(key: str) -> str:
    """The line as 0.5.23 writes it (`srt/entrypoints/engine.py:1185`), fields in its order."""
    return (
        "[2026-12-02 05:01:02] server_args={'model_path': '/m', 'tokenizer_path': '/m', "
        "'tokenizer_mode': 'auto', 'load_format': 'dummy', 'model_loader_extra_config': '{}', "
        "'mem_fraction_static': 0.716, 'max_running_requests': None, 'max_total_tokens': 4096, "
        "'chunked_prefill_size': 4096, 'max_prefill_tokens': 16384, 'tp_size': 1, "
        "'dcp_size': 1, 'host': '127.0.0.1', 'port': 30000, "
        "'ssl_keyfile': None, 'ssl_certfile': None, 'ssl_keyfile_password': None, "
        f"'api_key': '{key}', 'admin_api_key': None, 'served_model_name': '/m', "
        "'bucket_time_to_first_token': None, 'kt_max_deferred_experts_per_token': None, "
        "'enable_streaming_session': False, 'hicache_storage_backend_extra_config': None, "
        "'watermark_config': '<redacted>', 'watermark_key': '<redacted>', "
        "'watermark_key_b': '<redacted>', 'watermark_context_window': 4}"
    )


def redacted_line() -> str:
    """What must come out instead: the key's value replaced, nothing else changed."""
    return server_args_line(MARK)


def startup_log(key: str) -> str:
    """A real single launch's start (sglang-cpu.md "Startup lines, in order"), then a line
    that names the key where no field name says so."""
    return "\n".join([
        "/venv/lib/python3.11/site-packages/sglang/srt/layers/quantization/awq.py:53: "
        "UserWarning: Only CUDA, HIP and XPU support AWQ currently.",
        '  warnings.warn(f"Only CUDA, HIP and XPU support AWQ currently.")',
        "[2026-12-02 05:01:00] Cuda graph is disabled because of using torch native attention "
        "backend",
        "[2026-12-02 05:01:01] Fail to set RLIMIT_NOFILE: current limit exceeds maximum limit",
        server_args_line(key),
        "[2026-12-02 05:01:03] Init parallel begin.",
        f"[2026-12-02 05:01:04] config file read: {key} (from --config)",
        "[2026-12-02 05:01:05] Load weight begin. avail mem=120.00 GB",
        "[2026-12-02 05:01:06] Load weight end. elapsed=0.12 s, type=LlamaForCausalLM, "
        "avail mem=119.50 GB, mem usage=0.01 GB.",
        "[2026-12-02 05:01:06] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096, "
        "K size: 0.00 GB, V size: 0.00 GB",
        "",
    ])


# --- the redaction itself -------------------------------------------------------------------


def test_the_real_server_args_line_loses_the_key_and_nothing_else() -> None:
    assert redact(server_args_line(KEY)) == redacted_line()
    assert redact(redacted_line()) == redacted_line()  # idempotent


@pytest.mark.parametrize("line", [
    "[2026-12-02 05:05:00 TP0] Prefill batch, #new-seq: 1, #new-token: 6, #cached-token: 0, "
    "full token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0",
    "[2026-12-02 05:05:01 TP0] Decode batch, #running-req: 1, #full token: 2048, full token "
    "usage: 0.01, gen throughput (token/s): 12.50, #queue-req: 0",
    "[2026-12-02 05:05:02] server_args=ServerArgs(bucket_time_to_first_token=[0.1, 0.5], "
    "kt_max_deferred_experts_per_token=0, enable_streaming_session=False, tokenizer_path='/m')",
    '[2026-12-02 05:05:03] INFO:     127.0.0.1:5050 - "GET /health HTTP/1.1" 200 OK',
])
def test_figures_and_names_are_never_eaten(line: str) -> None:
    assert redact(line) == line


@pytest.mark.parametrize(("line", "expected"), [
    ("pulling https://alice:hunter22@mirror.lan/k3/",
     "pulling https://alice:[redacted]@mirror.lan/k3/"),
    ("GET https://ghp_0123456789abcdef@git.lan/x.git", "GET https://[redacted]@git.lan/x.git"),
    ("hook https://h.lan/a?token=SECRETQ&x=1", "hook https://h.lan/a?token=[redacted]&x=1"),
    ("launch ['sglang', '--api-key', 'sk-zz99', '--port', '3']",
     "launch ['sglang', '--api-key', '[redacted]', '--port', '3']"),
    ("argv: --api-key sk-zz99 --ssl-keyfile-password=pw123 --port 3",
     "argv: --api-key [redacted] --ssl-keyfile-password=[redacted] --port 3"),
    ("'hicache_storage_backend_extra_config': '{\"secret_key\": \"S3\", \"bucket\": \"b\"}'",
     "'hicache_storage_backend_extra_config': '{\"secret_key\": \"[redacted]\", "
     "\"bucket\": \"b\"}'"),
    ("Authorization: Bearer abcdefgh1234", "Authorization: Bearer [redacted]"),
])
def test_credentials_in_urls_flags_and_nested_configs(line: str, expected: str) -> None:
    assert redact(line) == expected


def test_a_known_key_goes_wherever_it_stands_and_json_stays_json() -> None:
    key = "0123456789abcdef" * 4
    assert redact(f"read {key} from the file", [key]) == f"read {MARK} from the file"
    figures = {"server_args": {"api_key": key, "admin_api_key": None, "port": "30000"},
               "failure": {"line": f"x {key}"}}
    redacted = redact_json(figures, [key])
    assert key not in json.dumps(redacted)
    assert redacted["server_args"] == {"api_key": MARK, "admin_api_key": None, "port": "30000"}
    assert redact_pairs([("api_key", key), ("admin_api_key", "None")]) == (
        ("api_key", MARK), ("admin_api_key", "None"))


@pytest.mark.parametrize("path", CAPTURED, ids=[p.name for p in CAPTURED])
def test_every_captured_real_log_keeps_only_redacted_keys(path: Path) -> None:
    text = path.read_text(errors="replace")
    cleaned = redact(text)
    for line in cleaned.splitlines():
        assert "'api_key': '" not in line or f"'api_key': '{MARK}'" in line, line
    state = parse_text(text)
    assert state.server_arg("api_key") in (None, "None", MARK)
    assert state.origin is not None and state.origin.of == 1  # one launch, one run


# --- the parser and parse-log ---------------------------------------------------------------


def test_the_parser_keeps_the_rest_of_server_args_and_not_the_key() -> None:
    state = parse_text(startup_log(KEY))
    args = dict(state.server_args)
    assert args["api_key"] == MARK and args["admin_api_key"] == "None"
    assert (args["model_path"], args["max_total_tokens"], args["port"]) == ("/m", "4096", "30000")
    assert args["watermark_key"] == "<redacted>"
    assert KEY not in json.dumps(render_json(state)) and KEY not in render_text(state)


def test_parse_log_prints_no_key_as_text_or_json(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(startup_log(KEY))
    for extra in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-m", "appliance", "engine", "parse-log",
                               str(log), *extra], capture_output=True, text=True, timeout=120,
                              cwd=REPO)
        assert done.returncode == 0, done.stderr
        assert KEY not in done.stdout
    report = json.loads(done.stdout)
    assert report["server_args"]["api_key"] == MARK
    assert report["server_args"]["model_path"] == "/m"
    assert (report["run"]["number"], report["run"]["of"]) == (1, 1)


# --- the bundle -----------------------------------------------------------------------------


def test_the_bundles_engine_log_part_holds_the_line_without_the_key(tmp_path: Path) -> None:
    config = make_config(tmp_path / "box")
    log = config.paths.log_dir / "engine.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(startup_log(KEY).encode() + b"\xff not utf-8\n")
    now = dt.datetime(2026, 12, 2, 6, 0, tzinfo=dt.UTC)
    (part,) = engine_logs(Context(config=config, now=now, since=now, db=None))
    data = part.data if isinstance(part.data, bytes) else part.data.encode()
    # The field's value, by its name; the bare literal further down is the bundle's by-value
    # table's (ops/redact.py reads the box's own key file).
    assert f"'api_key': '{KEY}'".encode() not in data
    assert redacted_line().encode() in data
    assert data.endswith(b"\xff not utf-8\n")  # nothing but secrets changes
    assert redact_bytes(b"#new-token: 6\n") == b"#new-token: 6\n"


# --- the daemon's exits, as a viewer --------------------------------------------------------


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path / "appliance")


@contextlib.contextmanager
def adopted_daemon(config: Config, db: Database,
                   log_text: str) -> Iterator[tuple[LiveServer, Runtime]]:
    """A daemon that adopted a running engine whose log is `log_text`, with a viewer vera;
    served (with its runtime) until the block ends."""
    log = config.paths.log_dir / "engine.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(log_text)
    ident = EngineIdentity("process", _gone_pid(), 0.0, "spec-h", str(log))
    at = dt.datetime(2026, 12, 2, 5, 1, tzinfo=dt.UTC)
    db.call(lambda s: open_run(s, at=at, runner="process", spec_hash="spec-h", spec_json="{}",
                               attempt=1, state="allocating", log_path=str(log),
                               identity_json=ident.to_json()))
    runtime: Runtime = build_runtime(config, clock=SystemClock(), db=db,
                                     runner=RecordedEngine(ident), gpus=FakeGpus(),
                                     engine_poll_seconds=0.1)
    db.call(lambda s: create_admin(s, "vera", PASSWORD, at, role=Role.VIEWER))
    server = LiveServer(runtime).start()
    try:
        wait_for(lambda: runtime.supervisor.status.state is EngineState.ALLOCATING,
                 "the adopted engine's log to show it allocating")
        yield server, runtime
    finally:
        server.stop()


@pytest.fixture
def live(config: Config, db: Database) -> Iterator[tuple[LiveServer, str, Path]]:
    """A daemon that adopted a running engine whose log holds the key the daemon gave it."""
    boot = build_runtime(config, clock=SystemClock(), db=db, gpus=FakeGpus())
    key = boot.engine_keys.current
    assert key
    with adopted_daemon(config, db, startup_log(key)) as (server, _):
        yield server, key, config.paths.log_dir / "engine.log"


@pytest.fixture
def viewer(live: tuple[LiveServer, str, Path]) -> Iterator[Console]:
    console = Console(live[0].base_url)
    assert console.login("vera").status_code == 303
    yield console
    console.close()


def test_a_viewer_reads_the_parsed_server_args_without_the_key(
        live: tuple[LiveServer, str, Path], viewer: Console) -> None:
    _, key, _ = live
    answer = viewer.http.get("/api/v1/engine")
    assert answer.status_code == 200, answer.text
    assert key not in answer.text
    args = answer.json()["log"]["server_args"]
    assert args["api_key"] == MARK and args["model_path"] == "/m" and args["port"] == "30000"
    for path in ("/api/v1/engine/runs", "/api/v1/events", "/engine", "/engine/status", "/"):
        shown = viewer.http.get(path)
        assert shown.status_code == 200, (path, shown.status_code)
        assert key not in shown.text, path


def test_a_viewer_reads_the_log_lines_without_the_key(
        live: tuple[LiveServer, str, Path], viewer: Console) -> None:
    _, key, _ = live
    answer = viewer.http.get("/api/v1/engine/log", params={"lines": 50})
    assert answer.status_code == 200, answer.text
    assert key not in answer.text
    lines = answer.json()["lines"]
    assert server_args_line(MARK) in lines  # the rest of the line, word for word
    assert f"[2026-12-02 05:01:04] config file read: {MARK} (from --config)" in lines
    assert "[2026-12-02 05:01:03] Init parallel begin." in lines


def test_a_viewer_follows_the_log_stream_without_the_key(
        live: tuple[LiveServer, str, Path], viewer: Console) -> None:
    _, key, log = live
    seen: list[str] = []
    arrived = threading.Event()
    with viewer.http.stream("GET", "/api/v1/engine/log/stream",
                            timeout=httpx.Timeout(10, read=60)) as response:
        assert response.status_code == 200

        def write_until_seen() -> None:
            # The stream follows the file from where it stood when it opened, which a loaded
            # box may reach after a first write: write again until the line has come through.
            for _ in range(100):
                with log.open("a") as handle:
                    handle.write(server_args_line(key).replace("05:01:02", "05:09:00") + "\n")
                if arrived.wait(0.5):
                    return

        writer = threading.Thread(target=write_until_seen, daemon=True)
        writer.start()
        for line in response.iter_lines():
            if line.startswith("data:"):
                seen.append(line)
                if "server_args=" in line:
                    arrived.set()
                    break
        writer.join(timeout=60)
    assert not any(key in line for line in seen)
    assert seen[-1] == "data: " + server_args_line(MARK).replace("05:01:02", "05:09:00")
