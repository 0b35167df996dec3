"""The head's router (issue 17): the engine's address on the cell network (`cell.listen_address`),
the router's spec built from the members (appliance/cell/router.py), `appliance cell
exec-router`'s checks, and the real sglang-router 0.3.2 started from the spec in front of a
prefill and a decode emulator. Everything binds 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from appliance.cell import router_exec
from appliance.cell.router import (
    NoCell,
    RouterInputs,
    RouterSpec,
    Worker,
    build_router_spec,
    router_spec_path,
    worker_url,
    workers_of,
    write_router_spec,
)
from appliance.config import CellConfig, Config, engine_url, load_config
from appliance.engine.args import build_launch_spec, inputs_from_config
from appliance.errors import ApplianceError
from tests.conftest import free_port, wait_for
from tests.test_cell_engine import ROUTER_MISSING, TIMEOUTS
from tests.test_cell_engine import model as model  # the module's fixture
from tests.test_fake_sglang import Emulator

SGLANG = ("/opt/appliance/engine/bin/sglang",)
KEY = "k" * 64


def config_with(**cell: object) -> Config:
    return dataclasses.replace(Config(), cell=CellConfig(**cell))  # type: ignore[arg-type]


def launch(config: Config) -> tuple[list[str], str]:
    inputs = dataclasses.replace(inputs_from_config(config), engine_auth=None)
    spec = build_launch_spec(SGLANG, inputs)
    return spec.serve_args(), spec.spec_hash


# --------------------------------------------------------------------------- listen address


def test_a_member_engine_listens_on_the_cell_network_and_the_box_reaches_it_there() -> None:
    config = config_with(role="decode", listen_address="10.0.0.6")
    argv, _ = launch(config)
    assert argv[argv.index("--host") + 1] == "10.0.0.6"
    assert engine_url(config) == "http://10.0.0.6:30000"
    v6 = config_with(role="prefill", listen_address="fd00::5")
    assert engine_url(v6) == "http://[fd00::5]:30000"
    everywhere = "0.0.0.0"  # noqa: S104 - every interface, loopback included
    assert engine_url(config_with(role="prefill", listen_address=everywhere)) == \
        "http://127.0.0.1:30000"


def test_unified_stays_on_loopback_and_hashes_as_before() -> None:
    before = launch(Config())
    assert before[0][before[0].index("--host") + 1] == "127.0.0.1"
    # A box given a cell address binds it whatever its role, so a role change at run time
    # never moves the address its own daemon reaches the engine at.
    argv, _ = launch(config_with(listen_address="10.0.0.6"))
    assert argv[argv.index("--host") + 1] == "10.0.0.6"
    assert engine_url(Config()) == "http://127.0.0.1:30000"
    assert launch(config_with(role="decode")) != before
    argv, _ = launch(config_with(role="decode"))  # no address given: loopback, as today
    assert argv[argv.index("--host") + 1] == "127.0.0.1"




def test_listen_address_loads(tmp_path: Path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text('[cell]\nrole = "prefill"\nlisten_address = "10.0.0.5"\n'
                    "router_port = 30200\n")
    cell = load_config(path, env={}, check_dirs=False).cell
    assert (cell.listen_address, cell.router_host, cell.router_port) == (
        "10.0.0.5", "127.0.0.1", 30200)


# --------------------------------------------------------------------------- the router's spec

MEMBERS = [("prefill", "10.0.0.5", 30000, 8998), ("decode", "10.0.0.6", 30000, 8998),
           ("decode", "fd00::7", 30000, None), ("unified", "10.0.0.9", 30000, None)]


def inputs(members: list[tuple[str, str, int, int | None]] = MEMBERS, **extra: object
           ) -> RouterInputs:
    given: dict[str, object] = {"model_path": Path("/models/kimi"),
                                "key_file": Path("/state/secrets/engine-api.key"), **extra}
    return RouterInputs(workers=workers_of(members), **given)  # type: ignore[arg-type]


def flag(args: list[str] | tuple[str, ...], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_the_argv_names_each_member_its_model_dir_and_loopback() -> None:
    spec = build_router_spec(inputs())
    assert spec.command == ("/opt/appliance/router/bin/python", "-m",
                            "sglang_router.launch_router")
    args = list(spec.args)
    assert args[:4] == ["--pd-disaggregation", "--prefill", "http://10.0.0.5:30000", "8998"]
    assert flag(args, "--decode") == ["http://10.0.0.6:30000", "http://[fd00::7]:30000"]
    assert "http://10.0.0.9:30000" not in args  # a unified member serves alone
    assert flag(args, "--model-path") == flag(args, "--tokenizer-path") == ["/models/kimi"]
    assert flag(args, "--host") == ["127.0.0.1"] and flag(args, "--port") == ["30100"]
    assert flag(args, "--prometheus-host") == ["127.0.0.1"]  # not the router's 0.0.0.0
    assert "--api-key" not in args and KEY not in spec.to_json()  # only the key's path
    assert spec.key_file == "/state/secrets/engine-api.key"
    assert dict(spec.env) == {"HF_HUB_OFFLINE": "1"}
    assert router_exec.check_router_spec(spec) == []


def test_retries_are_bounded_the_breaker_is_off_and_health_waits_for_the_engine() -> None:
    """Issue 25: the router's five attempts per request, counted on the prefill's breaker
    too, opened the healthy prefill's circuit; its 5 s health timeout could take a busy
    prefill out although SGLang's /health answers within its own 20 s."""
    args = list(build_router_spec(inputs()).args)
    assert flag(args, "--retry-max-retries") == ["3"]
    assert "--disable-circuit-breaker" in args
    assert not [a for a in args if a.startswith("--cb-")]
    assert int(flag(args, "--health-check-timeout-secs")[0]) > 20
    assert flag(args, "--health-check-interval-secs") == ["10"]
    assert flag(args, "--health-failure-threshold") == ["3"]


def test_a_prefill_without_a_bootstrap_port_says_none() -> None:
    spec = build_router_spec(inputs([("prefill", "10.0.0.5", 30000, None),
                                     ("decode", "10.0.0.6", 30000, None)]))
    assert list(spec.args[1:4]) == ["--prefill", "http://10.0.0.5:30000", "none"]


def test_the_spec_is_deterministic_and_changes_with_membership() -> None:
    one = build_router_spec(inputs())
    assert build_router_spec(inputs(list(reversed(MEMBERS)))).spec_hash == one.spec_hash
    assert build_router_spec(inputs([*MEMBERS, MEMBERS[1]])).spec_hash == one.spec_hash
    fewer = build_router_spec(inputs(MEMBERS[:2]))
    assert fewer.spec_hash != one.spec_hash
    moved = build_router_spec(inputs([("prefill", "10.0.0.5", 30000, 9000), *MEMBERS[1:]]))
    assert moved.spec_hash != one.spec_hash
    assert build_router_spec(inputs(port=30200)).spec_hash != one.spec_hash


@pytest.mark.parametrize("members", [[], MEMBERS[:1], MEMBERS[1:]])
def test_no_pd_router_without_both_roles(members: list[tuple[str, str, int, int | None]]
                                         ) -> None:
    with pytest.raises(NoCell, match="at least one prefill and one decode"):
        build_router_spec(inputs(members))


def test_the_spec_file_round_trips_and_is_rewritten_only_when_it_changes(tmp_path: Path) -> None:
    path = router_spec_path(tmp_path)
    spec = build_router_spec(inputs())
    assert write_router_spec(path, spec) is True
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o640, 0o750)
    assert RouterSpec.from_json(path.read_text()) == spec
    assert write_router_spec(path, spec) is False
    assert write_router_spec(path, build_router_spec(inputs(MEMBERS[:2]))) is True
    body = json.loads(path.read_text())
    body["args"].append("--mcp-config-path")
    with pytest.raises(ValueError, match="does not match its hash"):
        RouterSpec.from_json(json.dumps(body))
    with pytest.raises(ValueError, match="not format"):
        RouterSpec.from_json("{}")


def test_worker_url() -> None:
    assert worker_url("10.0.0.5", 30000) == "http://10.0.0.5:30000"
    assert worker_url("fd00::5", 1) == "http://[fd00::5]:1"
    assert Worker("decode", "http://x:1") < Worker("prefill", "http://a:1", 8998)


# --------------------------------------------------------------------------- exec-router


def rehashed(spec: RouterSpec, **changes: object) -> RouterSpec:
    from appliance.cell.router import router_spec_hash

    new = dataclasses.replace(spec, **changes)  # type: ignore[arg-type]
    return dataclasses.replace(new, spec_hash=router_spec_hash(new.command, new.args, new.env,
                                                                new.key_file))


@pytest.mark.parametrize(("changes", "words"), [
    ({"command": ("/opt/appliance/router/bin/python", "-c", "print(1)")}, "leading arguments"),
    ({"args": ("--pd-disaggregation", "--mcp-config-path", "/tmp/x")}, "'--mcp-config-path'"),
    ({"args": ("--pd-disaggregation", "--api-key", "mine")}, "'--api-key'"),
    ({"args": ("--host",)}, "--host lacks its value"),
    ({"env": (("LD_PRELOAD", "/tmp/x.so"),)}, "'LD_PRELOAD'"),
])
def test_exec_router_refuses_what_the_appliance_never_writes(changes: dict[str, object],
                                                              words: str) -> None:
    spec = rehashed(build_router_spec(inputs()), **changes)
    assert any(words in p for p in router_exec.check_router_spec(spec))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", "cell", "exec-router", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_exec_router_refuses_a_foreign_program(tmp_path: Path) -> None:
    key = tmp_path / "engine-api.key"
    key.write_text(KEY)
    spec = build_router_spec(inputs(program=Path(sys.executable).parent / "python",
                                    key_file=key))
    path = router_spec_path(tmp_path)
    write_router_spec(path, spec)
    result = cli("--spec", str(path))  # the default router dir: /opt/appliance/router
    assert result.returncode == 64, result.stderr
    assert "refusing to run the router spec" in result.stderr
    assert "not inside the engines directory /opt/appliance/router" in result.stderr
    assert KEY not in result.stderr
    missing = cli("--spec", str(tmp_path / "nothing.json"))
    assert missing.returncode == 64 and "cannot use the router spec" in missing.stderr


RECORDER = """#!/bin/sh
# A stand-in for the router's Python: what it was given, and what its command line shows.
here=$(dirname "$0")/..
tr '\\0' '\\n' < /proc/$$/cmdline > "$here/cmdline.txt"
cat > "$here/stdin.txt"
"""


def recorder(root: Path) -> Path:
    """A router directory whose `bin/python` records its argv and stdin."""
    program = root / "bin" / "python"
    program.parent.mkdir(parents=True)
    program.write_text(RECORDER)
    program.chmod(0o755)
    return program


def recorded_spec(tmp_path: Path) -> tuple[Path, Path]:
    key = tmp_path / "engine-api.key"
    key.write_text(KEY)
    program = recorder(tmp_path / "router")
    path = router_spec_path(tmp_path / "state")
    write_router_spec(path, build_router_spec(inputs(program=program, key_file=key)))
    return path, tmp_path / "router"


def test_exec_router_keeps_the_key_off_the_routers_command_line(tmp_path: Path) -> None:
    """Issue 22: exec-router put `--api-key KEY` in the router's argv, which every user of
    the box reads in /proc/PID/cmdline. The key now reaches the router on its stdin."""
    path, router_dir = recorded_spec(tmp_path)
    result = cli("--spec", str(path), "--router-dir", str(router_dir))
    assert result.returncode == 0, result.stderr
    cmdline = (router_dir / "cmdline.txt").read_text()
    assert KEY not in cmdline and "--api-key" not in cmdline.split("\n")
    assert "--pd-disaggregation" in cmdline  # the spec's arguments all the same
    assert (router_dir / "stdin.txt").read_text() == KEY + "\n"


def test_the_development_runner_keeps_the_key_off_the_command_line_too(tmp_path: Path) -> None:
    import asyncio

    from appliance.cell.router_runner import ProcessRouterRunner

    path, router_dir = recorded_spec(tmp_path)
    runner = ProcessRouterRunner(tmp_path / "state")
    asyncio.run(runner.restart(path))
    wait_for(lambda: (router_dir / "stdin.txt").exists()
             and (router_dir / "stdin.txt").read_text().endswith("\n"),
             "the stand-in router to read its stdin", 30)
    assert KEY not in (router_dir / "cmdline.txt").read_text()
    assert (router_dir / "stdin.txt").read_text() == KEY + "\n"
    asyncio.run(runner.stop())


def test_the_launcher_refuses_to_start_without_a_key() -> None:
    done = subprocess.run([sys.executable, "-c", router_exec.KEY_ON_STDIN, "--help"],
                          input="\n", capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "no engine key" in done.stderr


def test_exec_router_refuses_a_file_without_a_key(tmp_path: Path) -> None:
    bad = tmp_path / "engine-api.key"
    bad.write_text("short")
    spec = build_router_spec(inputs(program=Path(sys.prefix) / "bin" / "python",
                                    key_file=bad))
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    with pytest.raises(ApplianceError, match="does not hold an engine API key"):
        router_exec.exec_router(path, Path(sys.prefix))


# --------------------------------------------------------------------------- the real router


def keyed_engine(root: Path, model: Path, mode: str, bootstrap: int | None = None
                 ) -> Emulator:
    """tests/test_cell_engine.py's `engine`, requiring the engine key as a member's does."""
    root.mkdir(parents=True, exist_ok=True)
    emu = Emulator.__new__(Emulator)
    emu.port = free_port()
    emu.err_path, emu.out_path = root / "engine.err", root / "engine.out"
    emu.gpu_state = root / "gpus.json"
    argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", str(model),
            "--served-model-name", "kimi-k3", "--tp-size", "1", "--disaggregation-mode", mode,
            "--host", "127.0.0.1", "--port", str(emu.port), "--api-key", KEY]
    if bootstrap is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
    env = {**os.environ, "FAKE_SGLANG_LOAD_SECONDS": "1", **TIMEOUTS}
    with emu.err_path.open("wb") as err, emu.out_path.open("wb") as out:
        emu.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
    emu.pgid, emu.url = emu.proc.pid, f"http://127.0.0.1:{emu.port}"
    emu.wait_ready()
    return emu


def keyed_chat(url: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30, json={
        "model": "kimi-k3", "messages": [{"role": "user", "content": "hello cell"}],
        "max_tokens": 5})


@pytest.mark.skipif(ROUTER_MISSING, reason="sglang-router is not installed (dev extra)")
def test_the_real_router_runs_from_the_spec(tmp_path: Path, model: Path) -> None:
    """exec-router, given this test's venv as the router directory, execs the real router
    with the spec's argv and the key; the router asks callers for the same key and sends it
    to the engines, which require it; a chat completion goes through prefill and decode."""
    bootstrap = free_port()
    prefill = keyed_engine(tmp_path / "prefill", model, "prefill", bootstrap)
    decode = keyed_engine(tmp_path / "decode", model, "decode")
    key = tmp_path / "engine-api.key"
    key.write_text(KEY)
    port = free_port()
    members = [("prefill", "127.0.0.1", prefill.port, bootstrap),
               ("decode", "127.0.0.1", decode.port, None)]
    spec = build_router_spec(inputs(
        members, program=Path(sys.prefix) / "bin" / "python", key_file=key, port=port,
        model_path=model, metrics_port=free_port(), health_interval_secs=1,
        startup_timeout_secs=30))
    path = router_spec_path(tmp_path / "state")
    write_router_spec(path, spec)
    log_path = tmp_path / "router.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "appliance", "cell", "exec-router", "--spec", str(path),
             "--router-dir", sys.prefix], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "NO_PROXY": "*"},
            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"router exited {proc.returncode}: {log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                return keyed_chat(url).status_code == 200
            return False

        wait_for(up, "the router to serve a chat completion", 60)
        answer = keyed_chat(url)
        assert answer.json()["usage"]["completion_tokens"] == 5
        assert keyed_chat(url, None).status_code == 401  # the gateway's key discipline holds
        assert keyed_chat(prefill.url, None).status_code == 401
        # exec'd in place: the pid exec-router started is the router (it retitles itself);
        # the key reached it on its stdin, never on its command line
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert cmdline.startswith(b"sglang::router") and KEY.encode() not in cmdline
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(10)
        prefill.kill()
        decode.kill()


def test_a_role_chosen_by_the_head_outlives_the_configuration_and_returns_to_it(
        tmp_path: Path) -> None:
    from appliance.cell.role_choice import effective_role, role_file, store_role

    config = load_config(dev=True, dev_root=tmp_path, env={})
    assert effective_role(config) == "unified"
    store_role(config, "decode")
    assert effective_role(config) == "decode"
    argv = build_launch_spec(config.engine.command,
                             inputs_from_config(config, role="decode")).serve_args()
    assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
    role_file(config.paths.state_dir).write_text("root\n")  # hand-edited: ignored, not applied
    assert effective_role(config) == "unified"
    store_role(config, "prefill")
    store_role(config, "unified")  # the configured role again: no file left to disagree
    assert not role_file(config.paths.state_dir).exists()
    with pytest.raises(ValueError, match="not a cell role"):
        store_role(config, "both")
