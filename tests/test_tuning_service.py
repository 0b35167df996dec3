"""The tuning service on a real runtime: facts from the box, the applied choice, the spec.

The budget is an estimate (labelled) until the engine has started once, then it is measured
from the engine's own log; applying a profile's split puts it in the launch spec's tuning
layer, survives a daemon restart, and is what the next start launches.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from appliance.clock import SystemClock
from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.args import Origin
from appliance.errors import ApplianceError
from appliance.runtime import Runtime, build_runtime
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.fake_gpus import FakeGpus
from appliance.tuning.geometry import GeometryError

SAMPLE_LOG = Path(__file__).parents[2] / "shared" / "reference" / "sglang-k3-startup.sample.log"


def box(config: Config, db: Database, *, model: bool = True) -> Runtime:
    if model:
        write_checkpoint(config.paths.models_dir / "moonshotai--Kimi-K3", shards=2,
                         shard_bytes=4096)
    return build_runtime(config, db=db, clock=SystemClock(), gpus=FakeGpus())


def test_an_estimate_is_labelled_until_a_startup_is_measured(config: Config,
                                                             db: Database) -> None:
    runtime = box(config, db)

    async def scenario() -> None:
        view = await runtime.tuning.view("chat")
        assert not view.budget.measured and view.budget.detail.startswith("estimate")
        assert any("estimate" in p for p in view.problems)
        assert "69 KDA layers" in view.geometry_summary and "24 MLA" in view.geometry_summary
        assert view.current_ratio == config.engine.mamba_full_memory_ratio
        assert view.recommendation.recommended.concurrent >= view.current.concurrent
        assert len(view.curve) > 20 and view.choice is None and not view.restart_needed

        if not SAMPLE_LOG.exists():
            pytest.skip("the shared reference folder is not beside the checkout")
        runtime.supervisor.log_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SAMPLE_LOG, runtime.supervisor.log_path)
        measured = await runtime.tuning.view("chat")
        assert measured.budget.measured and "measured from" in measured.budget.detail
        assert measured.problems == ()

    asyncio.run(scenario())


def test_applying_a_split_changes_the_spec_and_survives_a_restart(config: Config,
                                                                  db: Database) -> None:
    runtime = box(config, db)

    async def scenario() -> None:
        view = await runtime.tuning.view("coding-agent")
        ratio = view.recommendation.ratio
        choice = await runtime.tuning.apply(profile="coding-agent", ratio=ratio, pin=300,
                                            actor="ops")
        spec = runtime.supervisor.current_spec()
        assert choice.spec_hash == spec.spec_hash
        flags = {a.flag: a for a in spec.args}
        assert flags["--mamba-full-memory-ratio"].value == repr(ratio)
        assert flags["--mamba-full-memory-ratio"].origin is Origin.TUNING
        assert "overrides default 0.9" in flags["--mamba-full-memory-ratio"].note
        assert flags["--max-mamba-cache-size"].value == "300"

        again = build_runtime(config, db=db, clock=SystemClock(), gpus=FakeGpus())
        assert "--max-mamba-cache-size" not in again.supervisor.current_spec().argv()
        await again.tuning.start_service()  # what the daemon does before the supervisor
        assert again.supervisor.current_spec().spec_hash == spec.spec_hash
        applied = await again.tuning.view()
        assert applied.profile.name == "coding-agent" and applied.choice is not None

    asyncio.run(scenario())


def test_bad_choices_and_a_missing_model_say_what_to_do(config: Config, db: Database) -> None:
    runtime = box(config, db, model=False)

    async def scenario() -> None:
        with pytest.raises(GeometryError, match=r"config\.json"):
            await runtime.tuning.view()
        with pytest.raises(GeometryError, match=r"config\.json"):  # cannot size: not recorded
            await runtime.tuning.apply(profile="chat", ratio=1.0, pin=None, actor="ops")
        write_checkpoint(config.paths.models_dir / "moonshotai--Kimi-K3", shards=1,
                         shard_bytes=1024)
        with pytest.raises(ApplianceError, match="ratio"):
            await runtime.tuning.apply(profile="chat", ratio=-1.0, pin=None, actor="ops")
        with pytest.raises(ApplianceError, match="no-such-profile"):
            await runtime.tuning.apply(profile="no-such-profile", ratio=1.0, pin=None,
                                       actor="ops")
        with pytest.raises(ApplianceError, match="leave no GPU memory for the KV cache"):
            await runtime.tuning.apply(profile="chat", ratio=1.0, pin=99_999_999, actor="ops")
        assert runtime.supervisor.tuning_args == ()

    asyncio.run(scenario())


def test_the_observed_workload_comes_from_the_engines_own_log(config: Config,
                                                              db: Database) -> None:
    """Decode lines since the last start become the observed workload and its advice."""
    from tests.test_tuning_observed import _decode, _startup

    runtime = box(config, db)
    head, capacity, slots, _ = _startup(5.0)
    lines = [head] + [_decode(f"10:{10 + i}:00", 50, int(capacity * 0.95), capacity, 150,
                              slots, queued=4) for i in range(20)]
    runtime.supervisor.log_path.parent.mkdir(parents=True, exist_ok=True)
    runtime.supervisor.log_path.write_text("\n".join(lines) + "\n")

    async def scenario() -> None:
        view = await runtime.tuning.view("coding-agent")
        assert view.observed is not None
        assert view.observed.summary.startswith("the KV pool saturated first in 20 of 20")
        assert view.to_dict()["observed"]["observed"]["samples"] == 20

    asyncio.run(scenario())
