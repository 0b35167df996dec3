"""A dev box whose engine is the REAL SGLang 0.5.23 on CPU (the tier's shared setup).

The product is pointed at the env's `sglang` through configuration only, as an operator
would: `engine.command` (the program), `engine.venv` (so the launch is validated with
0.5.23's own parser), `engine.extra_args` (the CPU flags), `engine.extra_env` (CPU mode) and
`health.generation_probes` (off for the hybrid). Everything else is the product's own: the
argv builder, the `--config` engine-key file, the flag table, the process runner, the
supervisor, the log parser and the records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from types import MappingProxyType

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.schema import migrate
from appliance.engine.args import model_dir
from appliance.engine.states import Command, EngineState
from appliance.engine.supervisor import Supervisor
from appliance.resources import migrations_dir
from appliance.runtime import Runtime, build_runtime
from appliance.testing.fake_gpus import FakeGpus
from appliance.weights.importer import manifest_from_dir
from tests.conftest import free_port, make_config
from tests.realengine.fixtures import CPU_ENV, START_DEADLINE, log_tail
from tests.test_engine_lifecycle import prove_weights, serving  # noqa: F401 - re-exported

MODEL = "tiny/real-engine"


def real_box(root: Path, env: Path, model: Path, *, extra_args: Sequence[str],
             extra_env: dict[str, str] | None = None, generation_probes: bool = True,
             mem_fraction_static: float = 0.5, **engine: object) -> tuple[Config, Database]:
    """A migrated dev box under `root` with `model` imported as its proven weights."""
    config = make_config(root, APPLIANCE_ENGINE_PORT=str(free_port()),
                         APPLIANCE_GPU_EXPECTED_COUNT="0")
    target = model_dir(config.paths.models_dir, MODEL)
    shutil.copytree(model, target)
    config = dataclasses.replace(
        config,
        engine=dataclasses.replace(
            config.engine, command=(str(env / "bin" / "sglang"),), venv=env, model=MODEL,
            served_model_name="tiny", tp_size=1, dcp_size=1, kv_cache_dtype="auto",
            mem_fraction_static=mem_fraction_static, extra_args=tuple(extra_args),
            extra_env=MappingProxyType({**CPU_ENV, **(extra_env or {})}), **engine),
        health=dataclasses.replace(config.health, generation_probes=generation_probes))
    # The engine refuses unproven weights: import the folder in place with its manifest.
    manifest = config.paths.models_dir.parent / f"manifest-{MODEL.replace('/', '--')}.json"
    manifest.write_text(manifest_from_dir(target, MODEL).to_json())
    database = Database(config.database_url)
    migrate(database, migrations_dir(), config.paths.state_dir / "backups", SystemClock().now())
    prove_weights(config, database)
    return config, database


def runtime_for(config: Config, db: Database) -> Runtime:
    runtime = build_runtime(config, db=db, clock=SystemClock(), gpus=FakeGpus(count=0),
                            engine_poll_seconds=0.2, engine_backoff_seconds=0.5)
    runtime.supervisor.ready_interval = 0.5
    return runtime


async def wait_for(check: Callable[[], bool], what: str, supervisor: Supervisor,
                   timeout: float = START_DEADLINE) -> None:
    """Wait on a state; on failure say where the engine is and how its log ends."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        if loop.time() > end:
            status = supervisor.status
            raise AssertionError(
                f"timed out waiting for {what}: the engine is {status.state.value} "
                f"({status.message}; {status.hint}); its log ends:\n"
                f"{log_tail(supervisor.log_path)}")
        await asyncio.sleep(0.1)


async def start_to_ready(supervisor: Supervisor) -> None:
    """An operator's start, then wait for READY (the log's ready line and its confirmation)."""
    await supervisor.submit(Command.START, "tester")
    await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY", supervisor)
