"""The engine emulator's conformance suite: what the rest of the suite relies on about SGLang
0.5.23, checked against BOTH the engine emulator and the real engine (the real-engine tier,
`tests/realengine`: SGLang 0.5.23 on CPU with a tiny random-weight Llama), wherever both can.

Each check is one thing the appliance builds on: the endpoints and the JSON fields it reads
(`/health` 503 while starting then 200, `/health_generate`, `/ready`, `/v1/models`,
`/server_info`, `/model_info` and the deprecated `/get_model_info`, `/v1/loads`, `/generate`,
`/v1/chat/completions` streaming with usage and `[DONE]`, `/v1/completions`); the error
bodies and status codes (bad JSON, a missing field, an unknown model card, an unknown path,
the engine key missing or wrong); the log lines `appliance.engine.logparse` reads (one run per
launch, the phases to READY, the pool figures, the stop); the `/metrics` names the health
monitor and the qualification read; and the stop: SIGTERM with a stream in flight drains it
and exits 0, while an engine no request ever reached exits 143 with no drain.

Both engines are launched the way the product launches them: the engine key in a `--config`
YAML file written by `appliance.secrets.write_engine_auth`, never on the command line. The
emulator plays Kimi K3 on a B300 box and the real engine a 64-wide Llama on two CPU cores, so
the checks compare shapes, names and behaviour, never model-dependent values. Where the two
must differ (a GPU-only behaviour) the difference is listed in docs/emulator.md with why.

One module-scoped engine of each kind serves every check (a real start costs 35-60 s on the
2-core box); the drain check runs last and consumes it. The no-drain check needs an engine
started with `--skip-server-warmup` of its own, and the `x-override-priority` checks one
launched as a box with service classes is (the classes' flags and environment, issue 24).
Every wait is a bounded poll on a state.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.engine import logparse
from appliance.health.engine_metrics import parse_metrics
from appliance.secrets import engine_api_key, engine_auth_path, write_engine_auth
from tests.conftest import free_port, wait_for

READY_LINE = "The server is fired up and ready to roll!"
EMULATOR_MODEL = "kimi-k3"
REAL_MODEL = "tiny-llama"
# The emulator's warmup is 8 tokens: at 0.5 s each its `/health` stays 503 for ~4 s after the
# port opens, a window the startup recorder cannot miss. The checks ask for few tokens.
EMULATOR_TOKEN_SECONDS = 0.5
# What the health monitor (appliance.health.engine_metrics) and the qualification
# (appliance.qualify.runner) read from `/metrics`; `mamba_usage` only a hybrid model exports.
METRIC_NAMES = (
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
    "sglang:cache_hit_rate", "sglang:gen_throughput", "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total", "sglang:num_requests_total",
    "sglang:time_to_first_token_seconds_bucket", "sglang:e2e_request_latency_seconds_bucket",
)
# The drain check's stream: long enough to be in flight when SIGTERM lands (the emulator's
# tokens are EMULATOR_TOKEN_SECONDS apart; the tiny Llama's a few ms on CPU).
DRAIN_TOKENS = {"emulator": 6, "real": 100}
ERROR_FIELDS = {"object", "message", "type", "param", "code"}  # protocol.py ErrorResponse
# A whole chat completion's fields as 0.5.23 writes them (seen on the real engine)
CHAT_FIELDS = {"id", "object", "created", "model", "choices", "usage", "metadata"}
CHOICE_FIELDS = {"index", "message", "logprobs", "finish_reason", "matched_stop"}
USAGE_FIELDS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                "reasoning_tokens", "completion_tokens_details"}
UNAUTHORIZED = {"error": "Unauthorized"}  # utils/auth.py


@dataclass
class Subject:
    """One engine under test: a process started with the product's key file, its log, and
    what `/health` answered from its launch until it first said 200 (`startup`)."""

    kind: str  # "emulator" or "real"
    url: str
    key: str
    model: str  # the served model name
    proc: subprocess.Popen[bytes]
    log_path: Path
    startup: list[str] = field(default_factory=list)
    consumed: bool = False  # stopped by the drain check

    def log(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")

    def http(self, *, keyed: bool = True) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.key}"} if keyed else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def wait_log(self, text: str, timeout: float = 120.0) -> str:
        def seen() -> str | None:
            log = self.log()
            if text in log:
                return log
            if self.proc.poll() is not None:
                pytest.fail(f"the {self.kind} engine exited {self.proc.returncode} before "
                            f"{text!r}:\n{log[-4000:]}")
            return None
        return str(wait_for(seen, repr(text), timeout))

    def wait_exit(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {self.kind} engine still runs {timeout:g} s after SIGTERM:\n"
                        f"{self.log()[-4000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def record_startup(subject: Subject, timeout: float) -> None:
    """Poll `/health` from the launch until it answers 200 (or the process exits, or the
    bound passes), keeping each change: `refused` while the port is closed, then codes."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=subject.url, timeout=10) as client:
        while time.monotonic() < deadline and subject.proc.poll() is None:
            try:
                answer = str(client.get("/health").status_code)
            except httpx.TransportError:
                answer = "refused"
            if not seen or seen[-1] != answer:
                seen.append(answer)
            if answer == "200":
                break
            time.sleep(0.1)
    subject.startup = seen


def keyed_state(root: Path) -> tuple[Path, str]:
    """The product's engine key file (`--config`), as the daemon writes it, and its key."""
    state = root / "state"
    write_engine_auth(state)
    return engine_auth_path(state), engine_api_key(state)


def started(subject: Subject, deadline: float) -> Subject:
    record_startup(subject, deadline)
    if subject.startup[-1:] != ["200"]:
        subject.kill()
        pytest.fail(f"the {subject.kind} engine never answered /health 200 (saw "
                    f"{subject.startup}, exit {subject.proc.poll()}):\n{subject.log()[-4000:]}")
    return subject


@contextlib.contextmanager
def emulator_engine(request: pytest.FixtureRequest, root: Path, *extra: str,
                    **env: str) -> Iterator[Subject]:
    """The emulator launched with the product's argv (`build_launch_spec`, its key file), on a
    free port, its log (stdout and stderr) in one file."""
    from appliance.engine.args import build_launch_spec, inputs_from_config
    from tests.conftest import make_config

    root.mkdir(parents=True, exist_ok=True)
    config = make_config(root / "box")
    auth, key = keyed_state(root)
    spec = build_launch_spec((sys.executable, "-m", "appliance.testing.fake_sglang"),
                             inputs_from_config(config))
    port = free_port()
    argv = [*spec.argv()[:-2], "--config", str(auth), "--port", str(port), *extra]
    environ = {**os.environ, "FAKE_SGLANG_LOAD_SECONDS": "2",
               "FAKE_SGLANG_FAULT": f"slow_tokens={EMULATOR_TOKEN_SECONDS}", **env}
    environ.pop("FAKE_SGLANG_GPU_STATE", None)
    log_path = root / "engine.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=environ, start_new_session=True)
    subject = Subject("emulator", f"http://127.0.0.1:{port}", key, EMULATOR_MODEL, proc,
                      log_path)
    try:
        yield started(subject, 60)
    finally:
        subject.kill()


@contextlib.contextmanager
def real_dense_engine(request: pytest.FixtureRequest, root: Path, *extra: str,
                **env: str) -> Iterator[Subject]:
    """The real SGLang 0.5.23 on the tier's tiny dense Llama (CPU), keyed by the product's
    file: `--config` with `api-key`, not the tier's `--api-key` on the command line."""
    from tests.realengine.fixtures import DENSE_CPU_ARGS, START_DEADLINE, RealEngine

    sglang_env = request.getfixturevalue("real_sglang_env")
    model = request.getfixturevalue("dense_model")
    root.mkdir(parents=True, exist_ok=True)
    auth, key = keyed_state(root)
    args = (*DENSE_CPU_ARGS, "--served-model-name", REAL_MODEL, "--config", str(auth), *extra)
    with RealEngine.start(sglang_env, model, log=root / "engine.log", args=args,
                          extra_env=env, api_key=None) as engine:
        subject = Subject("real", engine.base_url, key, REAL_MODEL, engine.process, engine.log)
        try:
            yield started(subject, START_DEADLINE)
        finally:
            subject.kill()


STARTERS = {"emulator": emulator_engine, "real": real_dense_engine}
KINDS = ["emulator", pytest.param("real", marks=pytest.mark.real_engine)]


@pytest.fixture(scope="module", params=KINDS)
def engine(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subject]:
    root = tmp_path_factory.mktemp(f"{request.param}-engine")
    with STARTERS[request.param](request, root) as subject:
        yield subject


@pytest.fixture
def serving(engine: Subject) -> Subject:
    if engine.consumed:
        pytest.fail("the module's engine was already stopped by the drain check, which must "
                    "run last")
    return engine


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines()
            if line.startswith("data: ")]


def chat(model: str, content: str = "Hello, how are you today?", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


# -- readiness and probes --------------------------------------------------------------------

def test_health_is_refused_while_loading_503_while_starting_then_200(serving: Subject) -> None:
    # SGLang binds its port only once every rank has loaded, then answers 503 until its
    # warmup request has come back: the supervisor never reads a 503 as a dead engine.
    assert serving.startup == ["refused", "503", "200"], serving.startup
    log = serving.log()
    assert READY_LINE in log


def test_probes_answer_200_when_ready(serving: Subject) -> None:
    with serving.http(keyed=False) as http:  # exempt from the key, for probes
        for probe in ("/health", "/health_generate", "/ready"):
            reply = http.get(probe)
            assert reply.status_code == 200, (probe, reply.text)


# -- reports ---------------------------------------------------------------------------------

def test_v1_models_names_the_served_model_and_its_context(serving: Subject) -> None:
    with serving.http() as http:
        models = http.get("/v1/models")
        assert models.status_code == 200
        body = models.json()
        assert body["object"] == "list" and len(body["data"]) == 1
        card = body["data"][0]
        assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(card)
        assert card["id"] == serving.model and card["object"] == "model"
        assert isinstance(card["max_model_len"], int) and card["max_model_len"] > 0
        one = http.get(f"/v1/models/{serving.model}")
        assert one.status_code == 200 and one.json()["id"] == serving.model
        missing = http.get("/v1/models/no-such-model")
        assert missing.status_code == 404
        assert missing.json() == {"error": {
            "message": "The model 'no-such-model' does not exist",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_server_info_carries_what_the_gateway_and_qualification_read(serving: Subject) -> None:
    with serving.http() as http:
        info = http.get("/server_info").json()
    assert info["version"] == "0.5.23"
    states = info["internal_states"]
    assert isinstance(states, list) and len(states) == 1
    limit = states[0]["effective_max_running_requests_per_dp"]
    assert isinstance(limit, int) and limit > 0
    assert isinstance(info["max_total_num_tokens"], int) and info["max_total_num_tokens"] > 0
    assert info["served_model_name"] == serving.model
    assert isinstance(info["launch_command"], str)
    # 0.5.23 echoes its resolved arguments, the engine key included, to whoever holds the key
    assert info["api_key"] == serving.key


def test_model_info_and_its_deprecated_name(serving: Subject) -> None:
    with serving.http() as http:
        info = http.get("/model_info").json()
        assert {"model_path", "served_model_name", "is_generation", "architectures",
                "model_type", "weight_version"} <= set(info)
        assert info["served_model_name"] == serving.model and info["is_generation"] is True
        assert isinstance(info["architectures"], list) and info["architectures"]
        old = http.get("/get_model_info")
        assert old.status_code == 200
        assert old.json()["model_path"] == info["model_path"]
    serving.wait_log("Endpoint '/get_model_info' is deprecated and will be removed in a future "
                     "version. Please use '/model_info' instead.")


def test_v1_loads_counts_what_runs_and_waits(serving: Subject) -> None:
    with serving.http() as http:
        loads = http.get("/v1/loads").json()
    assert loads["version"] == "0.5.23"
    entry = loads["loads"][0]
    assert entry["num_running_reqs"] == 0 and entry["num_waiting_reqs"] == 0
    assert isinstance(entry["max_total_num_tokens"], int)


# -- generation ------------------------------------------------------------------------------

def test_chat_completion_and_its_usage(serving: Subject) -> None:
    with serving.http() as http:
        reply = http.post("/v1/chat/completions", json=chat(serving.model, max_tokens=3))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == CHAT_FIELDS and set(body["choices"][0]) == CHOICE_FIELDS, body
    assert set(body["usage"]) == USAGE_FIELDS, body["usage"]
    assert body["object"] == "chat.completion"
    assert re.fullmatch(r"[0-9a-f]{32}", body["id"]), body["id"]  # the request id, bare
    assert body["metadata"]["weight_version"] == "default"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 3 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_stream_sends_chunks_usage_then_done(serving: Subject) -> None:
    body = chat(serving.model, max_tokens=3, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    with serving.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]  # include_usage: a last chunk with no choices and the usage
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"])


def test_completions_streaming_and_not(serving: Subject) -> None:
    prompt = {"model": serving.model, "prompt": "The capital of France is", "max_tokens": 2,
              "ignore_eos": True}
    with serving.http() as http:
        reply = http.post("/v1/completions", json=prompt)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "text_completion"
        assert isinstance(body["choices"][0]["text"], str)
        assert body["usage"]["completion_tokens"] == 2
        with http.stream("POST", "/v1/completions", json={
                **prompt, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_native_generate(serving: Subject) -> None:
    with serving.http() as http:
        reply = http.post("/generate", json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert isinstance(body["text"], str)
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 2 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] == "length"


def test_a_priority_field_is_served_with_priority_scheduling_off(serving: Subject) -> None:
    # 0.5.23 ignores a request's `priority` without --enable-priority-scheduling (it refuses
    # one only under --abort-on-priority-when-disabled); the product's argv here has no
    # service classes, so neither engine orders by it, and both must serve it
    with serving.http() as http:
        replies = [http.post("/v1/chat/completions",
                             json=chat(serving.model, max_tokens=2, priority=10)),
                   http.post("/v1/completions", json={"model": serving.model, "prompt": "Hi",
                                                      "max_tokens": 2, "priority": 0}),
                   http.post("/generate", json={"text": "Hi", "priority": -3,
                                                "sampling_params": {"max_new_tokens": 2}})]
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]


# -- x-override-priority (issue 24) -----------------------------------------------------------
# The gateway puts a /v1/messages request's class priority in this header; 0.5.23 reads it
# only with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES on, which the classes add to the spec.
BAD_PRIORITY = {"x-override-priority": "high"}
BAD_PRIORITY_WORDS = ("invalid x-override-priority header 'high': invalid literal for int() "
                      "with base 10: 'high'")
OUT_OF_RANGE_WORDS = ("priority must be a signed 64-bit integer between -9223372036854775808 "
                      "and 9223372036854775807")


def classes_launch() -> tuple[tuple[str, ...], dict[str, str]]:
    """What the product's spec adds for a box with the default classes (interactive 10,
    batch 0): the classes layer's flags, and the environment a box without classes lacks."""
    import dataclasses

    from appliance.config import Config, GatewayConfig
    from appliance.engine.args import Origin, build_launch_spec, inputs_from_config
    from appliance.gateway.classes import parse_classes

    def spec(config: Config) -> Any:
        return build_launch_spec(("sglang",), dataclasses.replace(
            inputs_from_config(config), engine_auth=None))

    classes = parse_classes({"interactive": {"ttft_slo_seconds": 5}})
    with_classes, plain = spec(Config(gateway=GatewayConfig(classes=classes))), spec(Config())
    flags = tuple(token for arg in with_classes.args if arg.origin is Origin.CLASSES
                  for token in arg.tokens())
    env = dict(set(with_classes.env) - set(plain.env))
    return flags, env


@pytest.fixture(scope="module", params=KINDS)
def overriding(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subject]:
    """An engine of each kind launched with the classes' flags and environment."""
    flags, env = classes_launch()
    assert env == {"SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES": "1"}, env
    root = tmp_path_factory.mktemp(f"{request.param}-overriding")
    with STARTERS[request.param](request, root, *flags, **env) as subject:
        yield subject


def messages(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, **extra,
            "messages": [{"role": "user", "content": "Hello, how are you today?"}]}


def native(**extra: Any) -> dict[str, Any]:
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, **extra}


def test_a_priority_header_is_ignored_without_the_header_overrides(serving: Subject) -> None:
    with serving.http() as http:
        for path, body in (("/v1/chat/completions", chat(serving.model, max_tokens=2)),
                           ("/generate", native()), ("/v1/messages", messages(serving.model))):
            reply = http.post(path, json=body, headers=BAD_PRIORITY)
            assert reply.status_code == 200, (path, reply.text)


def test_with_header_overrides_a_bad_priority_header_is_sglangs_400(
        overriding: Subject) -> None:
    model = overriding.model
    with overriding.http() as http:
        for path, body in (("/v1/chat/completions", chat(model, max_tokens=2)),
                           ("/generate", native())):
            reply = http.post(path, json=body, headers=BAD_PRIORITY)
            assert (reply.status_code, reply.json()) == (400, {
                "object": "error", "message": BAD_PRIORITY_WORDS, "type": "400",
                "param": None, "code": 400}), path
        anthropic = http.post("/v1/messages", json=messages(model), headers=BAD_PRIORITY)
        assert (anthropic.status_code, anthropic.json()) == (400, {"type": "error", "error": {
            "type": "invalid_request_error", "message": BAD_PRIORITY_WORDS}})
        # the streaming path catches the HTTPException as any error: a 500 that says no more
        streamed = http.post("/v1/messages", json=messages(model, stream=True),
                             headers=BAD_PRIORITY)
        assert (streamed.status_code, streamed.json()) == (500, {"type": "error", "error": {
            "type": "api_error", "message": "Internal server error"}})
        # /v1/completions never reads the header overrides (only /generate and the chat
        # handler do): the gateway's priority rides in its body there
        completion = http.post("/v1/completions", headers=BAD_PRIORITY,
                               json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text


def test_with_header_overrides_the_header_sets_the_requests_priority(
        overriding: Subject) -> None:
    model = overriding.model
    with overriding.http() as http:
        for path, body in (("/v1/chat/completions", chat(model, max_tokens=2)),
                           ("/generate", native()), ("/v1/messages", messages(model))):
            for value in ("0", "10", "-5"):
                reply = http.post(path, json=body, headers={"x-override-priority": value})
                assert reply.status_code == 200, (path, value, reply.text)
        # the header reached the priority: the tokenizer manager's range check refuses it
        huge = {"x-override-priority": str(1 << 63)}
        for path, body, shape in (
                ("/v1/chat/completions", chat(model, max_tokens=2), {
                    "object": "error", "message": OUT_OF_RANGE_WORDS,
                    "type": "BadRequestError", "param": None, "code": 400}),
                ("/generate", native(), {"error": {"message": OUT_OF_RANGE_WORDS}}),
                ("/v1/messages", messages(model), {"type": "error", "error": {
                    "type": "BadRequestError", "message": OUT_OF_RANGE_WORDS}})):
            reply = http.post(path, json=body, headers=huge)
            assert (reply.status_code, reply.json()) == (400, shape), path


# -- errors ----------------------------------------------------------------------------------

def test_bad_requests_get_sglangs_error_body(serving: Subject) -> None:
    json_header = {"content-type": "application/json"}
    with serving.http() as http:
        for name, reply, kind, message in (
            # refused by FastAPI before SGLang's handler: "Bad Request", pydantic's words
            ("bad JSON", http.post("/v1/chat/completions", content=b"{not json",
                                   headers=json_header), "Bad Request", "json_invalid"),
            ("no messages", http.post("/v1/chat/completions", json={"model": serving.model}),
             "Bad Request", "Field required"),
            ("not JSON", http.post("/v1/chat/completions", content=b"{}",
                                   headers={"content-type": "text/plain"}), "Bad Request",
             "Only 'application/json' is allowed"),
            # refused by SGLang's own checks (serving_*.py _validate_request)
            ("empty messages", http.post("/v1/chat/completions",
                                         json={"model": serving.model, "messages": []}),
             "BadRequestError", "Messages cannot be empty."),
            ("empty prompt", http.post("/v1/completions",
                                       json={"model": serving.model, "prompt": ""}),
             "BadRequestError", "Prompt cannot be empty"),
        ):
            assert reply.status_code == 400, (name, reply.text)
            body = reply.json()
            assert set(body) == ERROR_FIELDS, (name, body)
            assert body["object"] == "error" and body["code"] == 400, (name, body)
            assert body["type"] == kind and body["param"] is None, (name, body)
            assert message in body["message"], (name, body)
        unknown = http.get("/no/such/path")
        assert (unknown.status_code, unknown.json()) == (404, {"detail": "Not Found"})


def test_any_model_name_is_served(serving: Subject) -> None:
    # SGLang does not check `model` against its served name (only a `base:adapter` form
    # picks a LoRA adapter): the gateway must refuse unknown models itself.
    with serving.http() as http:
        reply = http.post("/v1/chat/completions", json=chat("no-such-model", max_tokens=1))
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "no-such-model"


def test_the_engine_key_is_required_on_the_engine_port(serving: Subject) -> None:
    body = chat(serving.model, max_tokens=1)
    with serving.http(keyed=False) as bare:
        for path in ("/v1/models", "/server_info", "/v1/loads", "/model_info"):
            reply = bare.get(path)
            assert (reply.status_code, reply.json()) == (401, UNAUTHORIZED), path
        assert bare.post("/v1/chat/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer " + "x" * len(serving.key)}
        assert bare.post("/v1/chat/completions", json=body, headers=wrong).status_code == 401
        basic = {"Authorization": f"Basic {serving.key}"}
        assert bare.get("/v1/models", headers=basic).status_code == 401
        for path in ("/health", "/ready", "/metrics"):  # exempt: probes and Prometheus
            assert bare.get(path).status_code == 200, path


# -- metrics ---------------------------------------------------------------------------------

def test_metrics_carry_the_names_the_appliance_reads(serving: Subject) -> None:
    with serving.http() as http:
        assert http.post("/v1/chat/completions",
                         json=chat(serving.model, max_tokens=2)).status_code == 200
        text = http.get("/metrics").text
    names = {m.group(1) for m in re.finditer(r"^(sglang:[a-z0-9_]+)\{", text, re.M)}
    missing = [name for name in METRIC_NAMES if name not in names]
    assert not missing, f"missing {missing}; the engine exported {sorted(names)}"
    reading = parse_metrics(text)
    assert reading.running_requests == 0 and reading.queued_requests == 0
    assert reading.requests is not None and reading.requests >= 1
    assert reading.generation_tokens is not None and reading.generation_tokens >= 2
    assert reading.time_to_first_token is not None and reading.time_to_first_token.count >= 1


# -- the log the parser reads ----------------------------------------------------------------

def test_the_log_parser_reads_one_run_to_ready_with_its_pool(serving: Subject) -> None:
    log = serving.log()
    runs = logparse.parse_runs(log)
    assert len(runs) == 1, [r.origin.label if r.origin else None for r in runs]
    state = runs[0]
    assert state.ready and state.phase is logparse.Phase.READY, state.phase
    assert state.failure is None, state.failure
    reached = [phase for phase, _ in state.phases]
    for phase in (logparse.Phase.LOADING_WEIGHTS, logparse.Phase.ALLOCATING,
                  logparse.Phase.READY):
        assert phase in reached, reached
    assert state.figures is not None
    with serving.http() as http:
        info = http.get("/server_info").json()
    assert state.figures.max_total_num_tokens == info["max_total_num_tokens"]
    rank0 = state.rank(0)
    assert rank0 is not None and rank0.kv_tokens is not None and rank0.kv_tokens > 0
    assert rank0.weights_gb is not None
    # the parser keeps the engine key out of what it hands the console
    assert serving.key not in json.dumps(state.server_args)


def test_the_log_has_the_key_in_clear_as_sglang_writes_it(serving: Subject) -> None:
    # 0.5.23 logs `server_args={...}` with `api_key` in clear (it redacts only watermark
    # secrets): whatever shows the log must redact it, and the emulator must not hide it.
    log = serving.log()
    line = next(line for line in log.splitlines() if "] server_args={" in line)
    assert f"'api_key': '{serving.key}'" in line
    before = log[:log.index("] server_args={")]
    assert "] " in before  # records the main process logs while it resolves its arguments


# -- stopping (last: the drain check consumes the module's engine) ---------------------------

def test_sigterm_drains_a_stream_in_flight_then_exits_0(serving: Subject) -> None:
    tokens = DRAIN_TOKENS[serving.kind]
    body = chat(serving.model, max_tokens=tokens, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    started, events, failure = threading.Event(), [], []

    def stream() -> None:
        try:
            with serving.http() as http, \
                    http.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        started.set()
        except httpx.HTTPError as exc:
            failure.append(exc)
            started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(120) and not failure, failure
    serving.consumed = True
    serving.proc.send_signal(signal.SIGTERM)
    assert "[DONE]" not in events, "the stream ended before the signal: nothing to drain"
    serving.wait_log("SIGTERM received.")
    with serving.http(keyed=False) as http:
        assert http.get("/health").status_code == 503  # draining: no new work routed here
    reader.join(300)
    assert not failure, failure
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == tokens  # all of it
    assert serving.wait_exit() == 0
    log = serving.log()
    # SGLang polls every 5 s: a stream that ends sooner is never counted as remaining
    assert "Gracefully exiting... Remaining number of requests 0." in log
    stop = logparse.parse_text(log).stop
    assert stop is not None and stop.drained, stop


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_no_request_reached_exits_143_without_a_drain(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # SGLang installs its drain handler when a first request reaches its tokenizer manager;
    # before that SIGTERM is uvicorn's: the server stops, the process dies of the signal.
    with STARTERS[kind](request, tmp_path, "--skip-server-warmup",
                        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="0") as subject:
        assert subject.startup[-1] == "200"
        with subject.http() as http:  # what does not reach the tokenizer manager
            assert http.get("/v1/models").status_code == 200
            assert http.get("/model_info").status_code == 200
        subject.proc.send_signal(signal.SIGTERM)
        assert subject.wait_exit() == -signal.SIGTERM  # 143 to a shell
        log = subject.log()
        assert "SIGTERM received" not in log and "Gracefully exiting" not in log
        stop = logparse.parse_text(log).stop
        assert stop is None or not stop.drained, stop
