"""The supervisor and the monitor with the REAL SGLang 0.5.23 serving a tiny Kimi-Linear on CPU.

The class SGLang builds for Kimi K3's config (`KimiLinearForCausalLM`: a KDA layer and an
MLA layer) starts on CPU and allocates real state and KV pools, but its first forward
kills the engine (KDA prefill is Triton-only). So the box runs with
`health.generation_probes = false` and the engine in SGLang's no-generation mode, and the
tests prove what that must mean:
- the supervisor brings it to READY on /ready, and neither it nor the monitor ever sends a
  generation (the engine would die of it: the second test shows it does);
- a stop of an engine that never received a request is SGLang's no-drain exit (SIGTERM's
  own: 143 from a shell, -15 from Popen; any /generate, /health with generation, /server_info
  or /v1/loads reaching its tokenizer manager would have installed the drain), which
  the run records and states as such, not as a drain and not as a crash;
- a real crash (a user's generate reaching it) is named with its cause from the real log.
"""

from __future__ import annotations

import asyncio
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
from tests.realengine.box import real_box, runtime_for, serving, start_to_ready, wait_for
from tests.realengine.fixtures import HYBRID_CPU_ARGS, NO_GENERATION_ARGS, NO_GENERATION_ENV

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def hybrid_box(real_sglang_env: Path, hybrid_model: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Config, Database]]:
    # drain_seconds 0: no /v1/loads before SIGTERM, so no request of any kind ever reaches
    # the engine; max_retries 0: a crash is not relaunched (each start costs a minute).
    config, db = real_box(tmp_path_factory.mktemp("real-hybrid"), real_sglang_env,
                          hybrid_model, extra_args=HYBRID_CPU_ARGS + NO_GENERATION_ARGS,
                          extra_env=NO_GENERATION_ENV, generation_probes=False,
                          mem_fraction_static=0.1, drain_seconds=0, max_retries=0)
    yield config, db
    db.dispose()


def _generation_requests(log: str) -> list[str]:
    """Access-log lines of requests that run a forward (none may reach this engine)."""
    return [line for line in log.splitlines()
            if any(f'"{verb} {path}' in line for verb, path in (
                ("GET", "/health_generate"), ("POST", "/generate"),
                ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")))]


def test_a_hybrid_that_cannot_generate_is_served_without_a_generation_and_stops_without_a_drain(
        hybrid_box: tuple[Config, Database]) -> None:
    config, db = hybrid_box
    runtime = runtime_for(config, db)
    supervisor = runtime.supervisor
    found: dict[str, Any] = {}

    async def scenario() -> None:
        async with serving(supervisor):
            await start_to_ready(supervisor)
            watcher = runtime.health.watcher
            # Two polls: the second is past no interval, so only the setting keeps the
            # generation probe away.
            found["figures"] = await watcher.poll(EngineState.READY, runtime.clock.now())
            found["figures"] = await watcher.poll(EngineState.READY, runtime.clock.now())
            found["probes"] = watcher.generation_probes
            async with httpx.AsyncClient(timeout=30) as http:
                found["metrics"] = (await http.get(
                    f"http://127.0.0.1:{config.engine.port}/metrics")).text
            # Nothing else here: /server_info too reaches SGLang's tokenizer manager, which
            # installs the drain (the second test reads it).
            await supervisor.submit(Command.STOP, "tester")
            found["stopped"] = supervisor.status.state

    asyncio.run(scenario())

    figures = found["figures"]
    assert figures.ready is True
    # SGLang sets its scheduler gauges (token_usage, mamba_usage, num_running_reqs...) only
    # when it logs a batch (metrics_collector.log_stats): an engine that never ran one
    # exports no sample of them, and the monitor says "unknown", not 0 %.
    samples = {line.split("{")[0].split(" ")[0] for line in found["metrics"].splitlines()
               if line.startswith("sglang:")}
    assert samples, "the real /metrics had no sglang: series"
    assert "sglang:mamba_usage" not in samples and "sglang:token_usage" not in samples, \
        sorted(samples)
    assert figures.state_usage is None and figures.token_usage is None
    assert found["probes"] == 0 and figures.canary is None
    assert found["stopped"] is EngineState.STOPPED
    [run] = db.call(lambda s: list_runs(s))
    text = Path(run.log_path).read_text(errors="replace")
    assert _generation_requests(text) == [], _generation_requests(text)
    assert "Mamba Cache is allocated" in text and "KV Cache is allocated" in text
    assert len(logparse.parse_runs(text)) == 1
    # The no-drain exit: SGLang had never installed its drain (no request reached it).
    assert "Gracefully exiting" not in text
    assert run.reason == "stopped", (run.reason, run.hint)
    assert run.exit_code in (143, -15), (run.exit_code, run.hint)
    assert "without a drain" in run.hint and "drained" not in run.hint, run.hint


def test_the_hybrids_first_forward_is_a_real_crash_named_with_its_cause(
        hybrid_box: tuple[Config, Database]) -> None:
    config, db = hybrid_box
    runtime = runtime_for(config, db)
    supervisor = runtime.supervisor
    key = engine_api_key(config.paths.state_dir)
    found: dict[str, Any] = {}

    async def scenario() -> None:
        async with serving(supervisor):
            await start_to_ready(supervisor)
            found["info"] = await supervisor.client.server_info()
            async with httpx.AsyncClient(timeout=120) as http:
                try:  # a user's request reaching the engine: its first forward
                    found["answer"] = (await http.post(
                        f"http://127.0.0.1:{config.engine.port}/generate",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"text": "hello", "sampling_params": {"max_new_tokens": 2}}
                    )).status_code
                except httpx.HTTPError as exc:
                    found["answer"] = type(exc).__name__
            await wait_for(lambda: supervisor.status.state is EngineState.FAILED, "FAILED",
                           supervisor)
            found["status"] = supervisor.status

    asyncio.run(scenario())

    info = found["info"]  # the supervisor's /server_info (the key it sends binds)
    assert info is not None and info["max_mamba_cache_size"] == 64
    assert info["mamba_radix_cache_strategy"] == "no_buffer"
    assert info["mamba_full_memory_ratio"] == config.engine.mamba_full_memory_ratio
    status = found["status"]
    assert status.reason == "scheduler_died", (status.reason, status.hint)
    latest = db.call(lambda s: list_runs(s))[0]
    assert latest.reason == "scheduler_died"
    assert "0 active drivers" in latest.hint, latest.hint  # the cause, from the real log
    assert latest.exit_code not in (0, None)
