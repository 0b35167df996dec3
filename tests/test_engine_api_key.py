"""The engine port demands a key (project issue 15): the daemon launches SGLang with
`--config <state_dir>/engine/engine-auth.yaml` holding `api-key`, and the daemon's client,
the health probe and the gateway send `Authorization: Bearer <key>` on every engine call.

The engine emulator enforces the key as SGLang 0.5.23 does (utils/auth.py): everything but
/health*, /ready* and /metrics* answers 401 {"error": "Unauthorized"} without it. So a
direct request without the key is refused, the gateway's requests go through, and the
daemon still brings the engine to READY.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from appliance.config import Config
from appliance.db.database import Database
from appliance.engine.args import build_launch_spec, inputs_from_config
from appliance.engine.states import Command, EngineState
from appliance.engine.validate import validate_launch_spec
from appliance.engine.views import spec_rows
from appliance.health.engine_probe import EngineProbe
from appliance.secrets import (
    engine_api_key,
    engine_auth_path,
    read_engine_api_key,
    write_engine_auth,
)
from tests.conftest import make_config
from tests.gateway_rig import MODEL, LiveGateway, auth, chat_body, start_engine, stop_engine
from tests.test_engine_lifecycle import migrated_box, run, serving, supervisor_for, wait_for
from tests.test_fake_sglang import Emulator

UNAUTHORIZED = {"error": "Unauthorized"}


def test_the_key_is_made_once_private_and_handed_to_the_engine_by_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert read_engine_api_key(state) is None
    key = engine_api_key(state)
    assert key == engine_api_key(state) == read_engine_api_key(state)
    # hex: SGLang hands the file's value to argparse, which reads a leading "-" as an option
    assert all(c in "0123456789abcdef" for c in key) and len(key) == 64
    secret = state / "secrets" / "engine-api.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert write_engine_auth(state) == key
    auth_file = engine_auth_path(state)
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o640  # the engine reads it by group
    assert yaml.safe_load(auth_file.read_text()) == {"api-key": key}  # what SGLang reads
    inode = auth_file.stat().st_ino
    write_engine_auth(state)
    assert auth_file.stat().st_ino == inode  # unchanged: never rewritten under an engine


def test_the_launch_spec_names_the_file_never_the_key(tmp_path: Path) -> None:
    config = make_config(tmp_path / "box")
    key = write_engine_auth(config.paths.state_dir)
    spec = build_launch_spec(("sglang",), inputs_from_config(config))
    assert spec.serve_args()[-2:] == ["--config", str(engine_auth_path(config.paths.state_dir))]
    shown = json.dumps([spec.to_json(), spec.argv(), spec_rows(spec), spec.spec_hash])
    assert key not in shown
    # an operator's own --config would drop the key: the appliance's wins, and says so
    inputs = dataclasses.replace(inputs_from_config(config),
                                 operator_args=("--config", "/tmp/mine.yaml"))
    operator = build_launch_spec(("sglang",), inputs)
    source = operator.source("--config")
    assert source is not None and source.value == str(engine_auth_path(config.paths.state_dir))
    assert "operator /tmp/mine.yaml" in source.note


def test_an_operators_own_api_key_is_refused_before_a_launch(tmp_path: Path) -> None:
    """An operator --api-key would win over the appliance's and lock the gateway and the
    daemon out of the engine: validation refuses it, naming the layer."""
    config = make_config(tmp_path / "box")
    write_engine_auth(config.paths.state_dir)
    inputs = dataclasses.replace(inputs_from_config(config),
                                 operator_args=("--api-key", "mine"))
    checked = validate_launch_spec(build_launch_spec(("sglang",), inputs), None)
    assert not checked.ok
    problem = next(p for p in checked.problems if p.flag == "--api-key")
    assert "set by the appliance, not by the operator layer" in problem.message
    assert "engine.extra_args" in problem.hint
    assert validate_launch_spec(build_launch_spec(("sglang",), inputs_from_config(config)),
                                None).ok


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Emulator, Path]]:
    """The emulator launched as the daemon launches SGLang: --config with the key file."""
    state = tmp_path_factory.mktemp("state")
    write_engine_auth(state)
    emu = start_engine(tmp_path_factory, "--config", str(engine_auth_path(state)))
    yield emu, state
    stop_engine(emu)


def test_the_engine_refuses_a_request_without_its_key(keyed_engine: tuple[Emulator, Path]
                                                      ) -> None:
    emu, state = keyed_engine
    key = engine_api_key(state)
    body = chat_body(max_tokens=2)
    with httpx.Client(base_url=emu.url, timeout=30) as http:
        for path in ("/v1/models", "/server_info", "/v1/loads"):
            reply = http.get(path)
            assert (reply.status_code, reply.json()) == (401, UNAUTHORIZED), path
        assert http.post("/v1/chat/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer " + "x" * len(key)}
        assert http.post("/v1/chat/completions", json=body, headers=wrong).status_code == 401
        basic = {"Authorization": f"Basic {key}"}
        assert http.get("/v1/models", headers=basic).status_code == 401
        # SGLang's exemptions, for probes and Prometheus
        for path in ("/health", "/ready", "/metrics"):
            assert http.get(path).status_code != 401, path
        right = {"Authorization": f"Bearer {key}"}
        assert http.post("/v1/chat/completions", json=body, headers=right).status_code == 200


def test_through_the_gateway_the_key_is_sent(keyed_engine: tuple[Emulator, Path],
                                             config: Config, db: Database) -> None:
    emu, state = keyed_engine
    # the gateway reads the key from the state directory it shares with the daemon
    secrets = config.paths.state_dir / "secrets"
    secrets.mkdir(parents=True, exist_ok=True, mode=0o700)
    (secrets / "engine-api.key").write_bytes((state / "secrets" / "engine-api.key").read_bytes())
    gateway = LiveGateway(config, db, emu.url).start()
    try:
        gateway.publish("ready", "serving")
        gateway.wait_admitting()
        assert gateway.parts.gate.limit == 4  # read from /server_info, which needs the key
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(gateway.key()),
                           json=chat_body(max_tokens=3), timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == MODEL
    finally:
        gateway.stop()


def test_a_gateway_with_another_key_says_what_is_wrong(keyed_engine: tuple[Emulator, Path],
                                                       config: Config, db: Database) -> None:
    emu, _ = keyed_engine
    gateway = LiveGateway(config, db, emu.url).start()  # its own, different engine key
    try:
        gateway.publish("ready", "serving")
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(gateway.key()),
                           json=chat_body(max_tokens=3), timeout=30)
        assert reply.status_code in (502, 503), reply.text
        if reply.status_code == 503:  # the gate's /server_info was refused first
            gateway.wait_admitting()
            reply = httpx.post(f"{gateway.url}/v1/chat/completions",
                               headers=auth(gateway.key()), json=chat_body(max_tokens=3),
                               timeout=30)
        assert reply.status_code == 502
        assert reply.json()["error"]["code"] == "engine_key_refused"
    finally:
        gateway.stop()


def test_the_health_probe_needs_and_sends_the_key(keyed_engine: tuple[Emulator, Path]) -> None:
    emu, state = keyed_engine

    async def scenario() -> None:
        keyed = EngineProbe(emu.url, api_key=engine_api_key(state))
        bare = EngineProbe(emu.url)
        try:
            assert await keyed.in_flight() == 0
            assert await bare.in_flight() is None  # /v1/loads needs the key
            assert await bare.ready() is True  # exempt
            canary = await keyed.canary(MODEL, 30)
            assert canary.ok, canary.error
        finally:
            await keyed.aclose()
            await bare.aclose()

    asyncio.run(scenario())


@pytest.fixture
def emulator_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    state = tmp_path / "gpus.json"
    monkeypatch.setenv("FAKE_SGLANG_LOAD_SECONDS", "3")
    monkeypatch.setenv("FAKE_SGLANG_GPU_STATE", str(state))
    monkeypatch.delenv("FAKE_SGLANG_FAULT", raising=False)
    return state


def test_the_daemon_launches_with_the_key_and_still_sees_ready(
        tmp_path: Path, emulator_env: Path) -> None:
    config, db = migrated_box(tmp_path / "box")
    supervisor = supervisor_for(config, db, emulator_env)
    key = engine_api_key(config.paths.state_dir)
    url = f"http://127.0.0.1:{config.engine.port}"

    async def scenario() -> None:
        async with serving(supervisor):
            await supervisor.submit(Command.START, "tester")
            await wait_for(lambda: supervisor.status.state is EngineState.READY, "READY")
            live = supervisor._live
            assert live is not None
            cmdline = psutil.Process(live.ident.pid).cmdline()  # what `ps` shows everyone
            assert "--config" in cmdline and not any(key in arg for arg in cmdline)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                refused = await http.get("/v1/models")
                assert (refused.status_code, refused.json()) == (401, UNAUTHORIZED)
                allowed = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert allowed.status_code == 200
            assert await supervisor.client.in_flight() == 0  # /v1/loads, with the key
            assert await supervisor.client.server_info() is not None
            await supervisor.submit(Command.STOP, "tester")
            assert supervisor.status.state is EngineState.STOPPED

    try:
        run(scenario)
    finally:
        db.dispose()


def test_the_emulator_reads_config_files_as_sglang_does(tmp_path: Path) -> None:
    from appliance.testing.fake_sglang.args import ArgvError, parse

    config = tmp_path / "engine.yaml"
    config.write_text("api-key: from-the-file\nenable-metrics: true\nport: 31000\n")
    args = parse(["--model-path", "/m", "--config", str(config), "--port", "32000"])
    assert args.api_key == "from-the-file" and args.enable_metrics
    assert args.port == 32000  # the command line wins over the file
    with pytest.raises(ArgvError, match="Config file not found"):
        parse(["--model-path", "/m", "--config", str(tmp_path / "none.yaml")])
    with pytest.raises(ArgvError, match="must be YAML"):
        parse(["--model-path", "/m", "--config", str(tmp_path / "engine.json")])
