"""The supervisor and the health monitor driving the REAL SGLang 0.5.23 (CPU, a tiny Llama).

One engine for the module, started by the supervisor with the argv the product builds (its
builder, its `--config` engine-key file, validated by 0.5.23's own parser), through the
process runner. It is followed through its real log to READY; the health monitor probes
its real endpoints; then the supervisor stops it with a stream in flight and SGLang's own
drain finishes the stream before the engine exits 0. Each assertion is one the emulator
cannot settle: what the real engine prints, answers and does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.config import Config
from appliance.db.database import Database
from appliance.engine import logparse
from appliance.engine.records import list_runs
from appliance.engine.states import Command, EngineState
from appliance.secrets import engine_api_key
from tests.conftest import run_cli
from tests.realengine.box import real_box, runtime_for, serving, start_to_ready, wait_for
from tests.realengine.fixtures import DENSE_CPU_ARGS

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def dense_box(real_sglang_env: Path, dense_model: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Config, Database]]:
    # drain_seconds 0: the supervisor sends SIGTERM with the stream still in flight, so the
    # drain under test is SGLang's own (the supervisor's wait is the emulator suite's).
    config, db = real_box(tmp_path_factory.mktemp("real-dense"), real_sglang_env, dense_model,
                          extra_args=DENSE_CPU_ARGS, drain_seconds=0)
    yield config, db
    db.dispose()


def test_the_supervisor_runs_the_real_engine_to_ready_probes_it_and_stop_drains_a_stream(
        dense_box: tuple[Config, Database]) -> None:
    config, db = dense_box
    runtime = runtime_for(config, db)
    supervisor = runtime.supervisor
    seen: list[EngineState] = []
    supervisor.on_change(lambda s: seen.append(s.state) if not seen or seen[-1] != s.state
                         else None)
    key = engine_api_key(config.paths.state_dir)
    base = f"http://127.0.0.1:{config.engine.port}"
    found: dict[str, Any] = {}

    async def scenario() -> None:
        async with serving(supervisor):
            await start_to_ready(supervisor)
            assert supervisor._live is not None
            found["argv"] = supervisor._live.spec.argv() if supervisor._live.spec else []
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                # The engine key from the product's --config file binds on the real port.
                found["no_key"] = (await http.get("/v1/models")).status_code
                found["health"] = (await http.get("/health")).status_code
                authed = {"Authorization": f"Bearer {key}"}
                found["model_info"] = (await http.get("/model_info", headers=authed)).json()
                found["server_info"] = await supervisor.client.server_info()
            # The monitor's own watcher against the real endpoints: /ready, /metrics with
            # the real metric names, /health_generate, then the streaming canary.
            watcher = runtime.health.watcher
            found["figures"] = await watcher.poll(EngineState.READY, runtime.clock.now())
            found["probes"] = watcher.generation_probes
            await _stop_with_a_stream_in_flight(supervisor, base, key, config, found)

    asyncio.run(scenario())

    # The argv is the product's: its builder, its engine-key file, no key in the argv.
    argv = found["argv"]
    assert argv[0].endswith("/bin/sglang") and argv[1] == "serve"
    assert "--config" in argv and key not in " ".join(argv)
    assert found["no_key"] == 401 and found["health"] == 200
    assert found["model_info"]["model_path"].endswith("tiny--real-engine")
    assert found["server_info"] is not None
    assert found["server_info"]["served_model_name"] == "tiny"
    # The monitor read the real /ready and /metrics (sglang: names) and its generation
    # probes (/health_generate, then the streaming canary) passed against the real engine.
    figures = found["figures"]
    assert figures.ready is True
    assert figures.running_requests == 0 and figures.queued_requests == 0
    assert figures.token_usage is not None and 0.0 <= figures.token_usage <= 1.0
    assert found["probes"] == 2
    assert figures.canary is not None and figures.canary.ok, figures.canary
    assert figures.canary.ttft_seconds is not None
    # Followed through the real phases, never backwards, to READY.
    start = seen[: seen.index(EngineState.READY) + 1]
    assert start[0] in (EngineState.STOPPED, EngineState.PREFLIGHT)
    assert EngineState.LAUNCHING in start and start[-1] is EngineState.READY
    assert seen[-3:] == [EngineState.DRAINING, EngineState.STOPPING, EngineState.STOPPED]
    # SGLang's own drain: the stream in flight at SIGTERM completed, then exit 0.
    assert found["chunks"][-1] == "[DONE]", found["chunks"][-3:]
    assert found["stream_status"] == 200
    [run] = db.call(lambda s: list_runs(s))
    assert run.exit_code == 0, (run.exit_code, run.hint)
    assert run.reason == "stopped" and "drained and exited cleanly" in run.hint, run.hint
    text = Path(run.log_path).read_text(errors="replace")
    assert "SIGTERM received" in text and "Gracefully exiting" in text
    # Nothing the product called is deprecated in 0.5.23 (/get_model_info and
    # /get_server_info log a deprecation pointing to /model_info and /server_info).
    assert "Endpoint '/get_" not in text
    # The log the product reads shows one run for this one launch (the Engine page's
    # parse and `parse-log`), and what it read of the real engine's startup.
    runs = logparse.parse_runs(text)
    assert len(runs) == 1, [r.phase for r in runs]
    assert runs[0].ready
    cli = run_cli("engine", "parse-log", run.log_path)
    assert cli.returncode == 0, cli.stderr
    assert "run 1 of 1" in cli.stdout, cli.stdout
    parsed = json.loads(run_cli("engine", "parse-log", run.log_path, "--json").stdout)
    assert parsed["ready"] is True
    assert key not in cli.stdout


async def _stop_with_a_stream_in_flight(supervisor: Any, base: str, key: str, config: Config,
                                        found: dict[str, Any]) -> None:
    chunks: list[str] = []

    async def stream() -> None:
        body = {"model": config.engine.served_model_name,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as http, \
                http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
            found["stream_status"] = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])

    reader = asyncio.create_task(stream())
    await wait_for(lambda: len(chunks) >= 2 or reader.done(), "the stream's first tokens",
                   supervisor)
    assert not reader.done(), f"the stream ended before the stop: {chunks[-3:]}"
    await supervisor.submit(Command.STOP, "tester")
    await asyncio.wait_for(reader, 120)
    found["chunks"] = chunks
