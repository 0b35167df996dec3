"""The engine emulator (`appliance.testing.fake_sglang`) as a real process tree on loopback:
SGLang's argv errors, log markers and pacing, the port opening only when ready, the OpenAI and
native endpoints, capacity from the memory ratio, SIGTERM drain, and faults on demand.

Every wait is a bounded poll on something observable (a log line, a port, an exit); nothing
asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from appliance.testing.fake_sglang.args import SPEC_RESET_WARNING, parse
from appliance.testing.fake_sglang.faults import FaultError, parse_faults
from appliance.testing.fake_sglang.logwriter import bar_state
from appliance.testing.fake_sglang.memory import (
    CONV_BYTES_PER_SLOT,
    GIB,
    SSM_BYTES_PER_SLOT_FP32,
    CapacityError,
    plan,
)
from appliance.testing.fake_sglang.resolution import k3_resolution
from tests.conftest import free_port, wait_for

SHARDS = 3
SHARD_BYTES = 3 << 20
MARKERS = [
    "fake_sglang: SGLang 0.5.23 ENGINE EMULATOR",
    # what 0.5.23's argument resolution logs for K3 under DCP, before `server_args=`
    "] Kimi-K3 DCP keeps decode attention backend 'cutedsl_mla' (prefill=None -> 'trtllm_mla').",
    "] server_args={'model_path': ",
    " TP0] Init parallel begin.",
    " TP7] Init parallel begin.",
    " TP0] Init parallel ends.",
    " TP0] Memory baseline taken. mem usage=1.12 GB",
    " TP0] Load weight begin. avail mem=266.93 GB",
    "Multi-thread loading shards:   0% Completed | 0/3 [",
    "Multi-thread loading shards: 100% Completed | 3/3 [",
    " TP0] Load weight end. elapsed=",
    " TP7] Load weight end.",
    " TP0] Mamba Cache is allocated. max_mamba_cache_size: 332, conv_state size: 0.59GB, "
    "ssm_state size: 16.83GB",
    " TP0] KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: ",
    " TP0] Memory pool end. avail mem=",
    " TP0] Capture target decode CUDA graph begin. backend=cutedsl_mla, avail mem=",
    "Capturing batches (bs=64 ",
    " TP0] Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 24, 32, 48, 64]",
    " TP0] max_total_num_tokens=",
    "Engine startup timings (s): load_weight=",
    "Uvicorn running on http://127.0.0.1:",
    "The server is fired up and ready to roll!",
]
SAMPLE_FLAGS = [
    "--tp-size", "8", "--dcp-size", "8", "--mem-fraction-static", "0.93",
    "--kv-cache-dtype", "fp8_e4m3", "--max-running-requests", "64", "--enable-metrics",
    "--served-model-name", "kimi-k3",
]



class Emulator:
    """`python -m appliance.testing.fake_sglang serve ...` in its own session, output in files."""

    def __init__(self, root: Path, flags: list[str], **env: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.err_path, self.out_path = root / "engine.err", root / "engine.out"
        self.gpu_state = root / "gpus.json"
        argv = [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", *flags,
                "--host", "127.0.0.1", "--port", str(self.port)]
        environ = {**os.environ, "FAKE_SGLANG_LOAD_SECONDS": "2",
                   "FAKE_SGLANG_GPU_STATE": str(self.gpu_state), **env}
        with self.err_path.open("wb") as err, self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=environ, start_new_session=True)
        self.pgid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.err_path.read_bytes().decode("utf-8", "replace")

    def wait_log(self, text: str, timeout: float = 30.0) -> str:
        def seen() -> str | None:
            log = self.log()
            if text in log:
                return log
            if self.proc.poll() is not None:
                pytest.fail(f"emulator exited {self.proc.returncode} before {text!r}:\n{log}")
            return None
        return str(wait_for(seen, repr(text), timeout))

    def wait_ready(self) -> str:
        return self.wait_log("The server is fired up and ready to roll!")

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"emulator still running after {timeout} s:\n{self.log()[-3000:]}")

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def stop_cleanly(self) -> None:
        """SIGTERM, as a stop does: the emulator exits 0 and leaves no process behind."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.wait_exit() == 0
        assert wait_for(lambda: group_gone(self.pgid), "the process group to go")

    @contextlib.contextmanager
    def served(self) -> Iterator[Emulator]:
        """Ready, then stopped cleanly (asserted) when done; killed whatever happened."""
        try:
            self.wait_ready()
            yield self
            self.stop_cleanly()
        finally:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def group_running(pgid: int) -> list[int]:
    """Members of the group that are not zombies (an orphan stays a zombie until something
    reaps it, which some containers' init never does)."""
    alive = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
    return alive


def in_order(log: str, markers: list[str]) -> None:
    position = 0
    for marker in markers:
        found = log.find(marker, position)
        assert found >= 0, f"{marker!r} missing or out of order after offset {position}"
        position = found + len(marker)


def refused(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def capacity_from(log: str) -> tuple[int, float, float, int, float]:
    state = re.search(r"TP0\] Mamba Cache is allocated\. max_mamba_cache_size: (\d+), "
                      r"conv_state size: ([\d.]+)GB, ssm_state size: ([\d.]+)GB", log)
    kv = re.search(r"TP0\] KV Cache is allocated\. dtype: \S+, #tokens: (\d+), KV size: "
                   r"([\d.]+) GB", log)
    assert state and kv, log
    return (int(state[1]), float(state[2]), float(state[3]), int(kv[1]), float(kv[2]))


def small_model(root: Path, shard_bytes: int = SHARD_BYTES) -> Path:
    """A checkpoint the emulator loads: K3's config and SHARDS shards of random bytes."""
    root.mkdir(parents=True, exist_ok=True)
    for index in range(1, SHARDS + 1):
        (root / f"model-{index:05d}-of-{SHARDS:05d}.safetensors").write_bytes(
            os.urandom(shard_bytes))
    (root / "config.json").write_text(json.dumps({
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": {"max_position_embeddings": 262144},
        "quantization_config": {"quant_method": "compressed-tensors"}}))
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def ready(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Emulator]:
    """One emulator started like the reference sample (ratio 0.5), checked on the way up and
    drained with SIGTERM at the end."""
    emu = Emulator(tmp_path_factory.mktemp("ready"),
                   [str(model_dir), *SAMPLE_FLAGS, "--mamba-full-memory-ratio", "0.5"])
    try:
        emu.wait_log(" TP0] Load weight begin.")
        assert refused(emu.port)  # SGLang binds only when every rank is ready
        emu.wait_ready()
        yield emu
        emu.stop_cleanly()
    finally:
        emu.kill()


# -- pure parts ---------------------------------------------------------------------------

def test_capacity_model_follows_the_ratio_and_reproduces_the_sample() -> None:
    def capacity(*flags: str) -> Any:
        return plan(parse(["/m", *SAMPLE_FLAGS, *flags]))

    sample = capacity("--mamba-full-memory-ratio", "0.5")
    assert (sample.state_slots, sample.max_running_requests) == (332, 64)
    assert (round(sample.conv_gb, 2), round(sample.ssm_gb, 2)) == (0.59, 16.83)
    assert sample.kv_tokens * 13824 == pytest.approx(sample.kv_gb * GIB)
    assert sample.kv_tokens == 2708160  # with the 100 MiB multimodal reservation, exactly
    low, high = capacity("--mamba-full-memory-ratio", "0.9"), capacity(
        "--mamba-full-memory-ratio", "5")
    assert high.state_slots > low.state_slots > sample.state_slots
    assert high.kv_tokens < low.kv_tokens < sample.kv_tokens
    uncapped = plan(parse(["/m", "--mamba-full-memory-ratio", "0.5"]))
    assert uncapped.capped_by_state and uncapped.max_running_requests == 332 // 5
    bf16_state = plan(parse(["/m", "--mamba-ssm-dtype", "bfloat16"]))
    assert bf16_state.state_slots > plan(parse(["/m"])).state_slots
    with pytest.raises(CapacityError, match="no GPU memory for the KV cache"):
        plan(parse(["/m", "--mem-fraction-static", "0.5"]))


def test_faults_parse_and_refuse_unknown_items() -> None:
    faults = parse_faults("crash_at=60, slow_tokens=0.2,unhealthy,oom=3,scheduler_death")
    assert faults.load_stop_at == 0.6 and faults.token_seconds == 0.2 and faults.unhealthy
    assert parse_faults("hang_at=70,corrupt_at=50").load_interruption == "corrupt"
    assert faults.oom_rank == 3 and faults.scheduler_death_after == 1.0
    with pytest.raises(FaultError, match="unknown fault"):
        parse_faults("explode")
    with pytest.raises(FaultError, match="needs a value"):
        parse_faults("hang_at")


def test_the_argument_resolution_logs_what_sglangs_k3_hooks_log() -> None:
    k3 = "KimiK3ForConditionalGeneration"
    dcp = k3_resolution(parse(["/m", "--tp-size", "8", "--dcp-size", "8"]), k3, mxfp4=True)
    assert dcp == [
        "Kimi-K3 DCP keeps decode attention backend 'cutedsl_mla' (prefill=None -> "
        "'trtllm_mla').",
        "Kimi-K3 on SM100/SM103/SM107: moe_runner_backend=flashinfer_mxfp4 (FlashInfer SiTU "
        "kernels)."]
    spec = k3_resolution(parse(["/m", "--speculative-algorithm", "DSPARK"]), k3, mxfp4=False)
    assert spec[0].startswith("Kimi-K3 DSPARK on SM100/SM103") and spec[1] == SPEC_RESET_WARNING
    assert spec[2].startswith("Kimi hybrid model with speculative decoding: pinning")
    assert spec[3].startswith("Kimi hybrid DSPARK: defaulting")
    pinned = parse(["/m", "--speculative-algorithm", "DSPARK", "--max-running-requests", "8",
                    "--attention-backend", "triton", "--linear-attn-verify-backend", "triton",
                    "--speculative-draft-attention-backend", "triton"])
    assert k3_resolution(pinned, k3, mxfp4=False) == []  # the operator's choices stand
    assert k3_resolution(parse(["/m"]), "LlamaForCausalLM", mxfp4=False) == []


def test_bar_state_is_tqdm_shaped() -> None:
    assert bar_state(0, 96, 0.0) == (
        "Multi-thread loading shards:   0% Completed | 0/96 [00:00<?, ?it/s]")
    assert bar_state(40, 96, 115.6) == (
        "Multi-thread loading shards:  42% Completed | 40/96 [01:55<02:41,  2.89s/it]")


# -- argv ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    (["--no-such-flag"], "sglang serve: error: unrecognized arguments: --no-such-flag"),
    (["--tp-size", "eight"],
     "sglang serve: error: argument --tp-size/--tensor-parallel-size: invalid int value: 'eight'"),
    (["--kv-cache-dtype", "fp9"],
     "sglang serve: error: argument --kv-cache-dtype: invalid choice: 'fp9'"),
])
def test_bad_argv_exits_2_like_sglangs_argparse(flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "appliance.testing.fake_sglang", "serve", "/m", *flags],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: sglang serve [-h]")
    assert message in result.stderr


# -- a full start -------------------------------------------------------------------------

def test_start_logs_every_marker_in_order_and_reads_the_shards(
        ready: Emulator, model_dir: Path) -> None:
    log = ready.log()
    in_order(log, MARKERS)
    bar = log[log.index("Multi-thread loading shards:"):]
    bar = bar[:bar.index("\n")]
    assert [state.split("|")[1].split("[")[0].strip() for state in bar.split("\r")] == [
        "0/3", "1/3", "2/3", "3/3"]
    assert log.count(" Load weight end.") == 8 and log.count("Init parallel begin.") == 8
    slots, conv, ssm, tokens, kv_gb = capacity_from(log)
    assert conv == round((slots + 1) * CONV_BYTES_PER_SLOT / GIB, 2)
    assert ssm == round((slots + 1) * SSM_BYTES_PER_SLOT_FP32 / GIB, 2)
    assert kv_gb == round(tokens * 13824 / GIB, 2)
    assert (f"max_total_num_tokens={tokens}, chunked_prefill_size=16384, max_prefill_tokens="
            f"16384, max_running_requests=64, context_len=262144") in log
    children = ready.children()
    names = sorted(p.name() for p in children)
    assert names == ["sglang::detoken"] + ["sglang::schedul"] * 8
    assert all(os.getpgid(p.pid) == ready.pgid for p in children)
    read = sum(p.io_counters().read_chars for p in children)
    assert read >= SHARDS * SHARD_BYTES
    gpus = json.loads(ready.gpu_state.read_text())["gpus"]
    pids = {p.pid for p in children}
    assert len(gpus) == 8 and all(g["memory_used_bytes"] > 250 * GIB for g in gpus)
    assert {proc["pid"] for g in gpus for proc in g["processes"]} <= pids


def test_server_info_models_and_probes(ready: Emulator, model_dir: Path) -> None:
    with httpx.Client(base_url=ready.url, timeout=10) as client:
        info = client.get("/server_info")
        assert info.headers["x-emulator"] == "fake_sglang"
        body = info.json()
        assert body["emulator"] is True and body["version"] == "0.5.23"
        assert body["tp_size"] == 8 and body["mamba_full_memory_ratio"] == 0.5
        assert body["max_running_requests"] == 64 and body["context_len"] == 262144
        state = body["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == 64
        assert state["memory_usage"]["weight"] == 195.86
        assert state["memory_usage"]["token_capacity"] == body["max_total_num_tokens"]
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == "kimi-k3"
        assert models["data"][0]["max_model_len"] == 262144
        assert client.get("/v1/models/kimi-k3").status_code == 200
        assert client.get("/v1/models/other").status_code == 404
        assert client.get("/model_info").json()["model_path"] == str(model_dir)
        for probe in ("/health", "/health_generate", "/ready"):
            assert client.get(probe).status_code == 200
        loads = client.get("/v1/loads").json()
        assert loads["loads"][0]["max_running_requests"] == 64
        assert loads["loads"][0]["max_total_num_tokens"] == body["max_total_num_tokens"]
        metrics = client.get("/metrics").text
        for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput",
                     "max_total_num_tokens"):
            assert re.search(rf"^sglang:{name}{{.*model_name=\"kimi-k3\".*}} ", metrics, re.M)


def test_chat_and_completions_streaming_and_not(ready: Emulator) -> None:
    chat = {"model": "kimi-k3", "messages": [{"role": "user", "content": "Say hello"}]}
    with httpx.Client(base_url=ready.url, timeout=10) as client:
        first = client.post("/v1/chat/completions", json={**chat, "max_tokens": 5}).json()
        again = client.post("/v1/chat/completions", json={**chat, "max_tokens": 5}).json()
        message = first["choices"][0]["message"]["content"]
        assert message and message == again["choices"][0]["message"]["content"]
        assert first["object"] == "chat.completion"
        assert first["usage"]["completion_tokens"] <= 5
        assert first["usage"]["total_tokens"] == (
            first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"])
        exact = client.post("/v1/chat/completions",
                            json={**chat, "max_tokens": 12, "ignore_eos": True}).json()
        assert exact["usage"]["completion_tokens"] == 12
        assert exact["choices"][0]["finish_reason"] == "length"

        events = []
        with client.stream("POST", "/v1/chat/completions", json={
                **chat, "max_tokens": 7, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert len(text.split()) == 7
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"

        completion = client.post("/v1/completions", json={
            "model": "kimi-k3", "prompt": "Once upon", "max_tokens": 3}).json()
        assert completion["object"] == "text_completion"
        assert completion["usage"]["completion_tokens"] <= 3
        bad = client.post("/v1/chat/completions", json={"model": "kimi-k3"})
        assert bad.status_code == 400 and bad.json()["object"] == "error"


def test_a_higher_ratio_logs_more_state_slots_and_fewer_kv_tokens(
        ready: Emulator, model_dir: Path, tmp_path: Path) -> None:
    emu = Emulator(tmp_path, [str(model_dir), *SAMPLE_FLAGS, "--tp-size", "2",
                              "--mamba-full-memory-ratio", "5"], FAKE_SGLANG_LOAD_SECONDS="1")
    try:
        high = capacity_from(emu.wait_log(" TP1] Memory pool end."))
    finally:
        emu.kill()
    low = capacity_from(ready.log())
    assert high[0] > low[0] and high[1] + high[2] > low[1] + low[2]
    assert high[3] < low[3] and high[4] < low[4]


# -- stopping ----------------------------------------------------------------------------

def test_sigterm_drains_a_slow_stream_then_exits_0(model_dir: Path, tmp_path: Path) -> None:
    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "2", "--max-running-requests", "1"],
                   FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_FAULT="slow_tokens=0.05")
    try:
        emu.wait_ready()
        started, received = threading.Event(), []

        def stream() -> None:
            with httpx.Client(base_url=emu.url, timeout=30) as client, client.stream(
                    "POST", "/v1/completions", json={"prompt": "long", "max_tokens": 80,
                                                     "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: "):
                        received.append(line.removeprefix("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        emu.proc.send_signal(signal.SIGTERM)
        emu.wait_log("SIGTERM received.")
        with httpx.Client(base_url=emu.url, timeout=30) as client:
            for probe in ("/health", "/health_generate", "/ready"):
                assert client.get(probe).status_code == 503
            late: list[httpx.Response] = []
            queued = threading.Thread(target=lambda: late.append(client.post(
                "/v1/completions", json={"prompt": "late", "max_tokens": 2})))
            queued.start()
            wait_for(lambda: client.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"],
                     "the late request to queue behind the only slot")
            queued.join(30)
        reader.join(30)
        assert late and late[0].status_code == 200  # not refused while draining
        assert received[-1] == "[DONE]" and len(received) == 81
        assert emu.wait_exit() == 0
        assert wait_for(lambda: group_gone(emu.pgid), "the process group to go")
        log = emu.log()
        assert "Gracefully exiting... Remaining number of requests 2." in log
        assert "Gracefully exiting... Remaining number of requests 0." in log
        gpus = json.loads(emu.gpu_state.read_text())["gpus"]
        assert all(g["processes"] == [] for g in gpus)
    finally:
        emu.kill()


def test_sigterm_while_loading_kills_at_once(model_dir: Path, tmp_path: Path) -> None:
    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "2"], FAKE_SGLANG_LOAD_SECONDS="60")
    try:
        emu.wait_log(" TP1] Load weight begin.")
        children = [p.pid for p in emu.children()]
        assert len(children) == 3
        emu.proc.send_signal(signal.SIGTERM)
        assert emu.wait_exit() == -signal.SIGTERM
        assert wait_for(lambda: not group_running(emu.pgid), "the ranks to die")
        assert "Draining" not in emu.log()
        gpus = wait_for(lambda: [g for g in json.loads(emu.gpu_state.read_text())["gpus"]
                                 if not g["processes"]], "the ranks to free their GPUs")
        assert len(gpus) == 2
    finally:
        emu.kill()


def test_a_rank_dropping_its_gpu_entry_ignores_a_second_sigterm(model_dir: Path,
                                                                 tmp_path: Path) -> None:
    """A rank whose main process is gone drops its GPU entry under the state folder's flock.
    The pipe's EOF and PDEATHSIG both lead there, and a second SIGTERM may land while the
    rank holds the lock: it must not re-enter and wait on its own lock (CI once saw the
    ranks hang for ever). Made deterministic: the state file becomes a FIFO, so the rank
    holding the lock sits in its read until the test writes, and gets SIGTERM right there."""
    import fcntl

    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "2"], FAKE_SGLANG_LOAD_SECONDS="60")
    try:
        emu.wait_log(" TP1] Load weight begin.")
        ranks = [p.pid for p in emu.children()]
        assert len(ranks) == 3
        folder = os.open(emu.gpu_state.parent, os.O_RDONLY)
        fcntl.flock(folder, fcntl.LOCK_EX)  # the ranks queue behind the test
        try:
            emu.proc.kill()
            assert emu.wait_exit() == -signal.SIGKILL
            content = emu.gpu_state.read_text()
            emu.gpu_state.unlink()
            os.mkfifo(emu.gpu_state)
        finally:
            os.close(folder)  # releases the lock: one rank takes it and opens the FIFO

        def reader_waiting() -> int | None:
            try:
                return os.open(emu.gpu_state, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no rank has opened it for reading yet
                return None

        writer = wait_for(reader_waiting, "a rank to read the state file under the lock")
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)  # let the signals land while the rank is still in its read
        # The ranks after it read a plain file; the one holding the lock keeps its FIFO open.
        plain = emu.gpu_state.with_name("gpus.json.plain")
        plain.write_text(content)
        os.replace(plain, emu.gpu_state)
        os.set_blocking(writer, True)
        os.write(writer, content.encode())
        os.close(writer)
        assert wait_for(lambda: not group_running(emu.pgid), "the ranks to die")
        gpus = json.loads(emu.gpu_state.read_text())["gpus"]
        assert all(g["processes"] == [] for g in gpus[:2]), gpus
    finally:
        emu.kill()


# -- faults ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("fault", "error"), [
    ("crash_at=60", "RuntimeError: CUDA error: unspecified launch failure"),
    ("corrupt_at=60", "SafetensorError: Error while deserializing header"),
])
def test_crash_at_kills_rank_0_and_the_engine(
        model_dir: Path, tmp_path: Path, fault: str, error: str) -> None:
    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "2"],
                   FAKE_SGLANG_LOAD_SECONDS="1", FAKE_SGLANG_FAULT=fault)
    try:
        assert emu.wait_exit() == 1
        log = emu.log()
        in_order(log, [" TP0] Load weight begin.", "1/3 [", " TP0] Scheduler hit an exception:",
                       error, "RuntimeError: Rank 0 scheduler died during "
                       "initialization (exit code: 1)."])
        assert "Load weight end" not in log and "3/3 [" not in log
        assert wait_for(lambda: group_gone(emu.pgid), "the process group to go")
    finally:
        emu.kill()


def test_hang_at_stays_alive_and_goes_quiet(model_dir: Path, tmp_path: Path) -> None:
    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "2"],
                   FAKE_SGLANG_LOAD_SECONDS="2", FAKE_SGLANG_FAULT="hang_at=40")
    try:
        emu.wait_log("1/3 [")
        # Without the hang the load would be over within the next 1.5 s; it must not move.
        size = emu.err_path.stat().st_size
        time.sleep(2.0)
        assert emu.proc.poll() is None and emu.err_path.stat().st_size == size
        assert "2/3 [" not in emu.log() and refused(emu.port)
        read = sum(p.io_counters().read_chars for p in emu.children())
        assert SHARD_BYTES <= read < SHARDS * SHARD_BYTES
    finally:
        emu.kill()


def test_oom_at_allocation(model_dir: Path, tmp_path: Path) -> None:
    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "2"],
                   FAKE_SGLANG_LOAD_SECONDS="0.5", FAKE_SGLANG_FAULT="oom=1")
    try:
        assert emu.wait_exit() == 1
        in_order(emu.log(), [" TP1] Mamba Cache is allocated.", " TP1] Scheduler hit an "
                             "exception:", "torch.OutOfMemoryError: CUDA out of memory.",
                             "Rank 1 scheduler died during initialization (exit code: 1)"])
    finally:
        emu.kill()


def test_scheduler_death_after_ready_takes_the_tree_down(model_dir: Path, tmp_path: Path) -> None:
    emu = Emulator(tmp_path, [str(model_dir), "--tp-size", "4"],
                   FAKE_SGLANG_LOAD_SECONDS="0.5", FAKE_SGLANG_FAULT="scheduler_death=0.2")
    try:
        assert emu.wait_exit() == -signal.SIGKILL
        in_order(emu.log(), ["The server is fired up", "Subprocess scheduler_3 (pid=",
                             ") crashed with exit code -9. Triggering SIGQUIT for cleanup...",
                             "SIGQUIT received."])
        assert wait_for(lambda: group_gone(emu.pgid), "the process group to go")
    finally:
        emu.kill()
