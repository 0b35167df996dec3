"""The engine side of a cell of boxes (issue 17): the `[cell]` settings, the role layer of the
launch spec, the disaggregation lines of SGLang 0.5.23's log, and the engine emulator playing
a prefill and a decode engine, end to end behind the real `sglang-router` with the real
`openai` SDK. Everything binds 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config import CellConfig, Config, load_config
from appliance.engine import logparse
from appliance.engine.args import Origin, build_launch_spec, inputs_from_config, role_args
from appliance.engine.validate import check_argv
from appliance.errors import ConfigError
from tests.conftest import free_port, wait_for
from tests.test_fake_sglang import Emulator, small_model

SGLANG = ("/opt/appliance/engine/bin/sglang",)


def config_with(**cell: object) -> Config:
    return dataclasses.replace(Config(), cell=CellConfig(**cell))  # type: ignore[arg-type]


def spec_for(config: Config) -> list[str]:
    inputs = dataclasses.replace(inputs_from_config(config), engine_auth=None)
    return build_launch_spec(SGLANG, inputs).serve_args()


# --------------------------------------------------------------------------- [cell] settings


def test_cell_defaults_to_unified_with_sglangs_bootstrap_port() -> None:
    cell = Config().cell
    assert (cell.role, cell.transfer_backend, cell.ib_device, cell.bootstrap_port,
            cell.hierarchical_cache, cell.hicache_ratio) == ("unified", "mooncake", "", 8998,
                                                             False, 0.0)


def test_cell_values_load_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text('[cell]\nrole = "prefill"\nib_device = "mlx5_0,mlx5_1"\n'
                    'hierarchical_cache = true\nhicache_ratio = 1.5\n')
    config = load_config(path, env={"APPLIANCE_CELL_TRANSFER_BACKEND": "nixl",
                                    "APPLIANCE_CELL_BOOTSTRAP_PORT": "9100"}, check_dirs=False)
    assert config.cell == CellConfig("prefill", "nixl", "mlx5_0,mlx5_1", 9100, True, 1.5)


def test_a_host_cache_is_used_while_the_box_is_a_prefill_whoever_made_it_one(
        tmp_path: Path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text('[cell]\nrole = "decode"\nhierarchical_cache = true\nhicache_ratio = 4.0\n')
    config = load_config(path, env={}, check_dirs=False)  # not refused: the head may choose
    assert "--enable-hierarchical-cache" not in spec_for(config)
    inputs = dataclasses.replace(inputs_from_config(config, role="prefill"), engine_auth=None)
    argv = build_launch_spec(SGLANG, inputs).serve_args()
    assert argv[argv.index("--hicache-ratio") + 1] == "4.0"
    assert "--enable-hierarchical-cache" in argv


@pytest.mark.parametrize(("body", "key"), [
    ('role = "both"', "cell.role"),
    ('transfer_backend = "tcp"', "cell.transfer_backend"),
    ("hicache_ratio = -1", "cell.hicache_ratio"),
    ('role = "prefill"\nbootstrap_port = 30000', "cell.bootstrap_port"),
    ('listen_address = "box-2.cell"', "cell.listen_address"),
    ('router_host = "localhost"', "cell.router_host"),
    ("router_port = 30000", "cell.router_port"),
    ("router_metrics_port = 30100", "cell.router_metrics_port"),  # the router's own port
])
def test_bad_cell_values_name_their_key(tmp_path: Path, body: str, key: str) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text(f"[cell]\n{body}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={}, check_dirs=False)
    assert key in str(caught.value)


# --------------------------------------------------------------------------- the role layer


def test_unified_adds_nothing() -> None:
    assert role_args(Config().cell) == ()
    assert spec_for(config_with()) == spec_for(Config())


def test_prefill_adds_sglangs_flags_with_their_origin() -> None:
    config = config_with(role="prefill", ib_device="mlx5_0", hierarchical_cache=True,
                         hicache_ratio=2.5)
    inputs = dataclasses.replace(inputs_from_config(config), engine_auth=None)
    spec = build_launch_spec(SGLANG, inputs)
    added = [a for a in spec.args if a.origin is Origin.ROLE]
    assert [(a.flag, a.value) for a in added] == [
        ("--disaggregation-mode", "prefill"), ("--disaggregation-transfer-backend", "mooncake"),
        ("--disaggregation-ib-device", "mlx5_0"), ("--disaggregation-bootstrap-port", "8998"),
        ("--enable-hierarchical-cache", None), ("--hicache-ratio", "2.5")]
    assert check_argv(spec.serve_args()) == []  # SGLang 0.5.23's table accepts every one
    assert spec.spec_hash != build_launch_spec(
        SGLANG, dataclasses.replace(inputs, role_args=())).spec_hash


def test_decode_leaves_out_the_bootstrap_port_and_an_empty_ib_device() -> None:
    argv = spec_for(config_with(role="decode", transfer_backend="nixl"))
    assert argv[-4:] == ["--disaggregation-mode", "decode",
                         "--disaggregation-transfer-backend", "nixl"]
    assert "--disaggregation-bootstrap-port" not in argv
    assert "--disaggregation-ib-device" not in argv


def test_operator_overrides_the_role_and_the_note_says_so() -> None:
    config = dataclasses.replace(
        config_with(role="prefill"),
        engine=dataclasses.replace(Config().engine,
                                   extra_args=("--disaggregation-bootstrap-port", "9000")))
    inputs = dataclasses.replace(inputs_from_config(config), engine_auth=None)
    source = build_launch_spec(SGLANG, inputs).source("--disaggregation-bootstrap-port")
    assert source is not None
    assert (source.value, source.origin, source.note) == ("9000", Origin.OPERATOR,
                                                          "overrides role 8998")


# --------------------------------------------------------------------------- the log

LOG = "\n".join([
    "[2026-05-01 10:00:00] server_args=ServerArgs(tp_size=8, disaggregation_mode='prefill', "
    "disaggregation_bootstrap_port=8998)",
    "[2026-05-01 10:00:01] CommonKVBootstrapServer started successfully on 10.0.0.5:8998",
    "[2026-05-01 10:40:00] The server is fired up and ready to roll!",
    "[2026-05-01 10:41:00 TP0] Some requests timed out when bootstrapping, which means prefill "
    "instances fail to receive the KV indices from the decode instance of this request.",
    "[2026-05-01 10:41:00 TP0] Prefill bootstrap failed for request rank=0 req.rid='a' "
    "req.bootstrap_room=7 with exception KVTransferError(bootstrap_room=7): Request 7 timed "
    "out after 300.0s in KVPoll.Bootstrapping",
    "[2026-05-01 10:42:00 TP3] Prefill transfer failed for request rank=3 req.rid='b' "
    "req.bootstrap_room=8 with exception KVTransferError(bootstrap_room=8): Decode instance "
    "could be dead, remote mooncake session 10.0.0.6:17000 is not alive",
    "[2026-05-01 10:43:00 TP0] Lost connection with prefill instance (bootstrap_addr: "
    "10.0.0.5:8998), 2 requests affected",
    "[2026-05-01 10:44:00 TP0] Decode transfer failed for request rank=0 decode_req.req.rid='c' "
    "decode_req.req.bootstrap_room=9 with exception KVTransferError(bootstrap_room=9): Request "
    "9 timed out after 300.0s in KVPoll.WaitingForInput",
    "[2026-05-01 10:45:00 TP0] KV cache dtype mismatch: prefill server has kv_cache_dtype=fp8_e4m3,"
    " but decode server has kv_cache_dtype=auto. Both servers must use the same "
    "--kv-cache-dtype value.",
    "[2026-05-01 10:46:00 TP0] Could not fetch prefill parallel info from 10.0.0.5:8998 after 3 "
    "attempts",
    "[2026-05-01 10:47:00 TP0] Prefill instance failed to register to bootstrap server after 5 "
    "retries",
    "[2026-05-01 10:48:00 TP1] Failed to send kv chunk of 12 to 10.0.0.6:17001",
])


def test_disaggregation_lines_are_issues_with_hints_not_failures() -> None:
    state = logparse.parse_text(LOG)
    assert state.ready and state.failure is None  # the engine kept serving
    assert state.bootstrap_server == "10.0.0.5:8998"
    issues = {issue.kind: issue for issue in state.transfer_issues}
    assert {kind: issue.count for kind, issue in issues.items()} == {
        "bootstrap_timeout": 2, "peer_lost": 2, "waiting_timeout": 1, "layout_mismatch": 1,
        "handshake_failed": 1, "register_failed": 1, "transfer_failed": 1}
    assert issues["peer_lost"].peer == "10.0.0.5:8998"
    assert issues["peer_lost"].line.startswith("Lost connection with prefill instance")
    assert issues["bootstrap_timeout"].first_at == "2026-05-01 10:41:00"
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in issues["bootstrap_timeout"].hint
    assert "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" in issues["waiting_timeout"].hint
    assert "--kv-cache-dtype" in issues["layout_mismatch"].hint
    assert all(issue.hint for issue in state.transfer_issues)


def test_a_bootstrap_port_in_use_names_the_bootstrap_port() -> None:
    state = logparse.parse_text("\n".join([
        LOG.splitlines()[0],
        "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8998): "
        "address already in use",
    ]))
    assert state.failure is not None and state.failure.reason == "bad_argument"
    assert "bootstrap port" in state.failure.hint and "cell.bootstrap_port" in state.failure.hint


# --------------------------------------------------------------------------- the emulator

TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "2",
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "2"}


def write_tokenizer(model: Path) -> None:
    """The smallest tokenizer Hugging Face's `tokenizers` (the router's loader) accepts: the
    router refuses a model path without one, and must never reach the Hub for it."""
    (model / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "<s>": 1, "</s>": 2},
                  "unk_token": "[UNK]"}}))
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"model_max_length": 262144, "bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = small_model(tmp_path_factory.mktemp("cell") / "model", 1 << 12)
    write_tokenizer(root)
    return root


def engine(root: Path, model: Path, mode: str, bootstrap: int | None = None,
           port: int | None = None) -> Emulator:
    """A prefill or decode emulator, ready, on `port` (a restarted engine keeps its address,
    which the router names) or a free one."""
    root.mkdir(parents=True, exist_ok=True)
    emu = Emulator.__new__(Emulator)  # Emulator() picks its own port
    emu.port = port or free_port()
    emu.err_path, emu.out_path = root / "engine.err", root / "engine.out"
    emu.gpu_state = root / "gpus.json"
    argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", str(model),
            "--served-model-name", "kimi-k3", "--tp-size", "1", "--disaggregation-mode", mode,
            "--host", "127.0.0.1", "--port", str(emu.port)]
    if bootstrap is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
    env = {**os.environ, "FAKE_SGLANG_LOAD_SECONDS": "1",
           "FAKE_SGLANG_FAULT": "slow_tokens=0.005", **TIMEOUTS}
    with emu.err_path.open("wb") as err, emu.out_path.open("wb") as out:
        emu.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
    emu.pgid, emu.url = emu.proc.pid, f"http://127.0.0.1:{emu.port}"
    emu.wait_ready()
    return emu


@contextlib.contextmanager
def engines(tmp_path: Path, model: Path) -> Iterator[tuple[Emulator, Emulator, int]]:
    bootstrap = free_port()
    prefill = engine(tmp_path / "prefill", model, "prefill", bootstrap)
    decode = engine(tmp_path / "decode", model, "decode")
    try:
        yield prefill, decode, bootstrap
    finally:
        prefill.kill()
        decode.kill()


def chat(url: str, **extra: object) -> httpx.Response:
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": "hello cell"}],
            "max_tokens": 5, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_prefill_serves_the_bootstrap_endpoint(tmp_path: Path, model: Path) -> None:
    with engines(tmp_path, model) as (prefill, _, bootstrap):
        assert f"CommonKVBootstrapServer started successfully on 127.0.0.1:{bootstrap}" in \
            prefill.log()
        base = f"http://127.0.0.1:{bootstrap}"
        assert httpx.get(f"{base}/health", timeout=5).text == "OK"
        info = httpx.get(f"{base}/route", params={k: -1 for k in (
            "prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")},
            timeout=5).json()
        assert info["page_size"] == 64 and info["prefill_http_port"] == prefill.port
        assert httpx.get(f"{base}/route", timeout=5).status_code == 400
        assert httpx.get(f"{prefill.url}/model_info", timeout=5).json()[
            "disaggregation_mode"] == "prefill"


def test_a_room_goes_from_prefill_to_decode(tmp_path: Path, model: Path) -> None:
    with engines(tmp_path, model) as (prefill, decode, bootstrap):
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                  "bootstrap_room": 4242}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both at once, as the
            first = pool.submit(chat, prefill.url, **fields)    # router sends them
            second = pool.submit(chat, decode.url, **fields)
            p, d = first.result(60), second.result(60)
        assert p.status_code == 200 and p.json()["usage"]["completion_tokens"] == 1
        assert d.status_code == 200 and d.json()["usage"]["completion_tokens"] == 5


def test_decode_reports_an_unreachable_prefill_and_a_transfer_timeout(
        tmp_path: Path, model: Path) -> None:
    with engines(tmp_path, model) as (prefill, decode, bootstrap):
        nobody = chat(decode.url, bootstrap_host="127.0.0.1", bootstrap_port=free_port(),
                      bootstrap_room=1)
        assert nobody.status_code == 500
        assert "Decode handshake failed" in nobody.json()["message"]
        # a room the prefill never gets: the decode waits, then gives up as SGLang does
        lonely = chat(decode.url, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap,
                      bootstrap_room=2)
        assert lonely.status_code == 500
        assert "in KVPoll.WaitingForInput" in lonely.json()["message"]
        # and a prefill whose decode never comes times out in KVPoll.Bootstrapping
        alone = chat(prefill.url, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap,
                     bootstrap_room=3)
        assert alone.status_code == 500 and "KVPoll.Bootstrapping" in alone.json()["message"]
        state = logparse.parse_text(decode.log())
        assert {i.kind for i in state.transfer_issues} >= {"handshake_failed", "waiting_timeout"}
        assert state.failure is None
        assert httpx.get(f"{decode.url}/health", timeout=10).status_code == 200


# --------------------------------------------------------------------------- the real router

ROUTER_MISSING = importlib.util.find_spec("sglang_router") is None


class Router:
    """`python -m sglang_router.launch_router --pd-disaggregation` (sglang-router 0.3.2) over
    one prefill and one decode, on loopback, with the local model path for its tokenizer (it
    would download one from the Hub by model name otherwise)."""

    def __init__(self, root: Path, model: Path, prefill: Emulator, bootstrap: int,
                 decode_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "router.log"
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill.url, str(bootstrap), "--decode", decode_url,
                "--host", "127.0.0.1", "--port", str(self.port), "--policy", "round_robin",
                "--model-path", str(model), "--tokenizer-path", str(model),
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--cb-timeout-duration-secs", "1",
                "--worker-startup-timeout-secs", "30", "--request-timeout-secs", "60",
                "--log-level", "warn"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"router exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                return chat(self.url).status_code == 200
            return False
        wait_for(up, "the router to serve a chat completion", 60)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@pytest.mark.skipif(ROUTER_MISSING, reason="sglang-router is not installed (dev extra: "
                    "pip install -e '.[dev]'); the cell test drives SGLang's own router")
def test_the_real_router_serves_through_the_cell_and_survives_a_decode_restart(
        tmp_path: Path, model: Path) -> None:
    import openai

    bootstrap = free_port()
    prefill = engine(tmp_path / "prefill", model, "prefill", bootstrap)
    decode = engine(tmp_path / "decode1", model, "decode")
    router: Router | None = None
    try:
        router = Router(tmp_path, model, prefill, bootstrap, decode.url)
        router.wait_serving()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        stream = client.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": "stream through the cell"}],
            max_tokens=6, stream=True)
        pieces = [c.choices[0].delta.content for c in stream if c.choices and
                  c.choices[0].delta.content]
        assert len(pieces) == 6  # the decode engine's tokens, after the prefill's handover
        assert "Prefill bootstrap failed" not in prefill.log()
        prefill_pid = prefill.proc.pid

        decode.kill()  # the decode box goes away
        failed: list[int] = []
        for _ in range(20):  # bounded: the router answers each at once or within a timeout
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(
                    model="kimi-k3", messages=[{"role": "user", "content": "anyone?"}],
                    max_tokens=3)
            failed.append(caught.value.status_code)
            if caught.value.status_code == 503:
                break
        assert failed[-1] == 503 and all(code >= 500 for code in failed)
        assert "decode" in str(caught.value.body or caught.value.message).lower()
        assert prefill.proc.poll() is None and prefill.proc.pid == prefill_pid

        decode = engine(tmp_path / "decode2", model, "decode", port=decode.port)  # back
        router.wait_serving()
        answer = client.chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": "back again"}], max_tokens=4)
        assert answer.choices[0].message.content
        assert prefill.proc.poll() is None and prefill.proc.pid == prefill_pid
    finally:
        if router is not None:
            router.stop()
        prefill.kill()
        decode.kill()

