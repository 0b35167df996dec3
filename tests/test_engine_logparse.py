"""The engine log parser (`appliance.engine.logparse`) and its reports (`logreport`).

The K3 sample (`data/engine_logs/k3_startup.sample.log`, a byte copy of
shared/reference/sglang-k3-startup.sample.log) is replayed through `LineSplitter` in awkward
chunks; the failure logs next to it are SGLang 0.5.23-format logs cut at a failure. Expected
figures are read off the sample by hand, not computed by the code under test.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.engine.logparse import (
    Failure,
    LaunchFigures,
    LineSplitter,
    LogState,
    Phase,
    RankMemory,
    feed,
    initial,
    parse_runs,
    parse_text,
)
from appliance.engine.logreport import render_json, render_text

LOGS = Path(__file__).parent / "data" / "engine_logs"
SAMPLE = LOGS / "k3_startup.sample.log"

SAMPLE_PHASES = (
    (Phase.LAUNCHING, "2026-11-30 09:00:00"),
    (Phase.LOADING_WEIGHTS, "2026-11-30 09:00:46"),
    (Phase.ALLOCATING, "2026-11-30 10:22:24"),
    (Phase.CAPTURING_GRAPHS, "2026-11-30 10:22:40"),
    (Phase.WARMING, "2026-11-30 10:26:12"),
    (Phase.READY, "2026-11-30 10:26:24"),
)
SAMPLE_RANK = {  # every rank of the sample logs the same figures
    "weights_gb": 195.86, "avail_after_weights_gb": 71.07, "state_slots": 332,
    "conv_gb": 0.59, "ssm_gb": 16.83, "kv_tokens": 2_708_160, "kv_gb": 34.87,
    "kv_dtype": "torch.float8_e4m3fn", "avail_after_pools_gb": 18.78,
    "draft_weights_gb": None, "draft_kv_tokens": None, "draft_kv_gb": None,
    "weight_loads_done": 1, "kv_pools_done": 1,
}
SAMPLE_FIGURES = LaunchFigures(
    max_total_num_tokens=2_708_160, chunked_prefill_size=65_536, max_prefill_tokens=16_384,
    max_running_requests=64, context_len=1_048_576, available_gpu_mem_gb=16.21,
)


def _sample_text() -> str:
    return SAMPLE.read_bytes().decode("utf-8")


def _stream(text: str, chunk: int) -> tuple[LogState, list[LogState]]:
    """Feed `text` through a LineSplitter `chunk` characters at a time; every state after each
    record, in order."""
    splitter, state, history = LineSplitter(), initial(), []
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for piece in pieces:
        for record in splitter.feed(piece):
            state = feed(state, record)
            history.append(state)
    for record in splitter.flush():
        state = feed(state, record)
        history.append(state)
    return state, history


# --- the sample, replayed ---------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [7, 4096, 1])
def test_sample_replayed_in_chunks_gives_the_expected_state(chunk: int) -> None:
    state, history = _stream(_sample_text(), chunk)

    assert state.phases == SAMPLE_PHASES
    assert state.phase is Phase.READY and state.ready
    assert state.failure is None
    assert (state.shards_done, state.shards_total) == (96, 96)
    assert (state.draft_shards_done, state.draft_shards_total) == (0, None)
    assert state.weight_load_seconds == 4898.40
    assert state.ranks == tuple(RankMemory(rank=r, **SAMPLE_RANK) for r in range(8))
    assert state.figures == SAMPLE_FIGURES
    assert (state.tp_size, state.dcp_size) == (8, 8)
    assert state.kv_token_capacity == 2_708_160 * 8
    assert state.startup_timings == (
        ("load_weight", 4898.40), ("kv_cache_allocation", 12.31), ("scheduler_e2e", 5176.40),
        ("cuda_graph.target_decode", 211.84), ("tokenizer_e2e", 3.02),
    )
    assert dict(state.server_args)["mem_fraction_static"] == "0.93"
    assert dict(state.server_args)["model_path"] == "/var/lib/appliance/models/moonshotai--Kimi-K3"
    assert dict(state.server_args)["max_running_requests"] == "64"
    assert state.warnings == ()
    assert state.last_timestamp == "2026-11-30 10:26:24"
    # 93 physical lines; the bar line holds 97 `\r` records, the capture bar line 9.
    assert state.lines == len(history) == 93 - 2 + 97 + 9

    # The shard bar was seen advancing one shard at a time, never backwards.
    progress = [s.shards_done for s in history]
    assert progress == sorted(progress)
    assert {s.shards_done for s in history if s.shards_total == 96} == set(range(97))
    # And the phase sequence was entered in order, never revisited.
    phases = [s.phase.value for s in history]
    assert phases == sorted(phases)


def test_parse_text_equals_the_streamed_result() -> None:
    streamed, _ = _stream(_sample_text(), 7)
    assert parse_text(_sample_text()) == streamed


def test_capacity_uses_dcp_from_server_args() -> None:
    state = parse_text(_sample_text().replace("dcp_size=8", "dcp_size=4"))
    assert state.dcp_size == 4
    assert state.kv_token_capacity == 2_708_160 * 4


def test_phases_during_load_and_rank_prefix_variants() -> None:
    state = initial()
    for record in (
        "[2026-11-30 09:00:46.123 DP0 TP3 EP3] Load weight begin. avail mem=266.93 GB",
        "Multi-thread loading shards:  42% Completed | 40/96 [01:23<01:55,  2.89s/it]",
    ):
        state = feed(state, record)
    assert state.phases == (
        (Phase.LAUNCHING, "2026-11-30 09:00:46.123"),
        (Phase.LOADING_WEIGHTS, "2026-11-30 09:00:46.123"),
    )
    assert (state.shards_done, state.shards_total) == (40, 96)
    state = feed(state, "[2026-11-30 10:22:24 DP0 TP3 EP3] Load weight end. elapsed=4898.40 s, "
                        "type=KimiK3ForConditionalGeneration, avail mem=71.07 GB, "
                        "mem usage=195.86 GB.")
    memory = state.rank(3)
    assert memory is not None and memory.weights_gb == 195.86
    assert state.phase is Phase.ALLOCATING
    assert state.tp_size == 4  # no server_args line: the highest rank seen + 1


def test_single_threaded_loader_bar_counts_too() -> None:
    state = feed(initial(), "Loading safetensors checkpoint shards:  10% Completed | 10/96 "
                            "[08:29<1:12:57, 50.90s/it]")
    assert (state.shards_done, state.shards_total) == (10, 96)
    assert state.phase is Phase.LOADING_WEIGHTS  # a log whose head was cut off


def test_log_line_glued_to_an_unfinished_bar_is_read() -> None:
    record = ("Multi-thread loading shards:  42% Completed | 40/96 [33:56<47:31, 50.90s/it]"
              "[2026-11-30 09:34:42 TP3] Load weight end. elapsed=2036.00 s, "
              "type=KimiK3ForConditionalGeneration, avail mem=71.07 GB, mem usage=195.86 GB.")
    state = feed(initial(), record)
    assert state.shards_done == 40
    memory = state.rank(3)
    assert memory is not None and memory.avail_after_weights_gb == 71.07
    assert state.lines == 1


def test_log_line_glued_to_a_capture_bar_is_read() -> None:
    record = ("Capturing batches (bs=1 avail_mem=18.12 GB): 100%|##########| 9/9 [03:31<00:00]"
              "[2026-11-30 10:26:12 TP0] max_total_num_tokens=2708160, chunked_prefill_size=65536, "
              "max_prefill_tokens=16384, max_running_requests=64, context_len=1048576, "
              "available_gpu_mem=16.21 GB")
    state = feed(initial(), record)
    assert [phase for phase, _ in state.phases] == [
        Phase.LAUNCHING, Phase.CAPTURING_GRAPHS, Phase.WARMING]
    assert state.figures == SAMPLE_FIGURES


# --- DSPARK draft -----------------------------------------------------------------------------

def test_dspark_draft_loads_inside_loading_and_has_its_own_bar_and_pool() -> None:
    text = (LOGS / "dspark_startup.log").read_text()
    state, history = _stream(text, 4096)

    # The target's "Load weight end" (10:22:24) does not end LOADING_WEIGHTS when a speculative
    # algorithm is configured; the draft's (10:23:30) does.
    assert state.phases == (
        (Phase.LAUNCHING, "2026-12-06 08:59:58"),
        (Phase.LOADING_WEIGHTS, "2026-12-06 09:00:46"),
        (Phase.ALLOCATING, "2026-12-06 10:23:30"),
        (Phase.CAPTURING_GRAPHS, "2026-12-06 10:23:45"),
        (Phase.WARMING, "2026-12-06 10:26:56"),
        (Phase.READY, "2026-12-06 10:27:08"),
    )
    assert (state.shards_done, state.shards_total) == (96, 96)
    assert (state.draft_shards_done, state.draft_shards_total) == (2, 2)
    assert max(s.draft_shards_done for s in history if s.shards_done < 96) == 0
    assert (state.weight_load_seconds, state.draft_weight_load_seconds) == (4898.40, 63.52)
    for rank in range(8):
        memory = state.rank(rank)
        assert memory is not None
        assert (memory.weights_gb, memory.draft_weights_gb) == (195.86, 9.84)
        assert (memory.state_slots, memory.conv_gb, memory.ssm_gb) == (66, 0.12, 3.34)
        assert (memory.kv_tokens, memory.kv_gb, memory.kv_dtype) == (
            65_984, 0.85, "torch.float8_e4m3fn")
        assert (memory.draft_kv_tokens, memory.draft_kv_gb) == (527_872, 2.02)
        assert memory.avail_after_pools_gb == 49.94  # after the draft's pool, the last one
    assert state.kv_token_capacity == 527_872
    assert state.figures is not None and state.figures.max_running_requests == 13
    # The 0.5.23 `server_args={...}` dict form, with quoted commas and nested brackets.
    args = dict(state.server_args)
    assert args["speculative_algorithm"] == "DSPARK"
    assert args["served_model_name"] == "kimi-k3, the big one"
    assert args["cuda_graph_bs"] == "[1, 2, 4, 8, 16, 24, 32, 48]"
    assert args["lora_paths"] == "None" and args["enable_metrics"] == "True"
    assert (state.tp_size, state.dcp_size) == (8, 8)
    # Each rank logs the cap; it is kept once.
    assert state.warnings == (
        "Max running requests is reset to 48 for speculative decoding. You can override this "
        "by explicitly setting --max-running-requests.",
        "Kimi-K3 DCP keeps decode attention backend 'cutedsl_mla' (prefill=None -> "
        "'trtllm_mla').",
        "max_running_requests is capped to 13 by the mamba state cache (max_mamba_cache_size=66, "
        "5 state slots per request). To raise it: increase --mamba-full-memory-ratio or "
        "--max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype bfloat16.",
    )


def test_without_a_speculative_algorithm_the_target_end_enters_allocating() -> None:
    state = feed(initial(), "[2026-12-06 09:00:00] server_args={'tp_size': 8, "
                            "'speculative_algorithm': None}")
    state = feed(state, "[2026-12-06 10:22:24 TP0] Load weight end. elapsed=1.00 s, type=X, "
                        "avail mem=71.07 GB, mem usage=195.86 GB.")
    assert state.phase is Phase.ALLOCATING


# --- failures -----------------------------------------------------------------------------------

def _failure(name: str) -> tuple[LogState, Failure]:
    state, _ = _stream((LOGS / name).read_text(), 4096)
    assert state.failure is not None, name
    assert not state.failure.hint.endswith(" ") and state.failure.hint.endswith(".")
    return state, state.failure


def test_oom_at_allocation() -> None:
    state, failure = _failure("oom_at_allocation.log")
    assert (failure.reason, failure.rank) == ("out_of_memory", 5)
    # The first rank's OOM line, not the "Scheduler hit an exception" before it, nor TP2's.
    assert failure.line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                   "allocate 36.56 GiB. GPU 5 ")
    assert "--mem-fraction-static (now 0.97)" in failure.hint
    assert state.phase is Phase.ALLOCATING and not state.ready


def test_scheduler_died_during_initialization_on_rank_3() -> None:
    state, failure = _failure("scheduler_died_rank3.log")
    assert (failure.reason, failure.rank) == ("scheduler_died", 3)
    assert failure.line.startswith("RuntimeError: Rank 3 scheduler died during initialization "
                                   "(exit code: -9).")
    assert "dmesg" in failure.hint and "OOM killer" in failure.hint
    assert state.phase is Phase.LOADING_WEIGHTS
    assert (state.shards_done, state.shards_total) == (40, 96)


def test_bad_argument() -> None:
    state, failure = _failure("bad_argument.log")
    assert (failure.reason, failure.rank) == ("bad_argument", None)
    assert failure.line == "sglang serve: error: unrecognized arguments: --no-such-flag"
    assert "same way" in failure.hint
    assert state.phases == ((Phase.LAUNCHING, None),)


@pytest.mark.parametrize("line", [
    "sglang serve: error: argument --tp-size: invalid int value: 'eight'",
    "sglang serve: error: argument --kv-cache-dtype: invalid choice: 'fp9' (choose from 'auto', "
    "'fp8_e5m2', 'fp8_e4m3')",
    "sglang serve: error: the following arguments are required: --model-path",
    "ValueError: Kimi-K3 DCP + DSPARK currently requires SGLANG_RAGGED_VERIFY_MODE=static; "
    "compact/cap-accept are not validated under DCP (got 'compact').",
])
def test_other_argument_errors(line: str) -> None:
    failure = feed(initial(), line).failure
    assert failure is not None and failure.reason == "bad_argument"


def test_corrupt_shard() -> None:
    state, failure = _failure("corrupt_shard.log")
    assert (failure.reason, failure.rank) == ("weights_error", 2)
    assert failure.line == ("safetensors._safetensors_rust.SafetensorError: Error while "
                            "deserializing header: incomplete metadata, file not fully covered")
    assert "re-download" in failure.hint
    assert state.phase is Phase.LOADING_WEIGHTS and state.shards_done == 57


def test_missing_shard_is_named_in_the_hint() -> None:
    state = feed(initial(), "[2026-12-04 09:49:13 TP1] Scheduler hit an exception: Traceback "
                            "(most recent call last):")
    state = feed(state, "FileNotFoundError: [Errno 2] No such file or directory: "
                        "'/var/lib/appliance/models/k3/model-00042-of-00096.safetensors'")
    assert state.failure is not None
    assert (state.failure.reason, state.failure.rank) == ("weights_error", 1)
    assert "model-00042-of-00096.safetensors is missing" in state.failure.hint


def test_sigquit_child_crash() -> None:
    state, failure = _failure("sigquit_child_crash.log")
    assert (failure.reason, failure.rank) == ("signal", None)
    assert failure.line == ("[2026-12-05 11:03:07] Subprocess detokenizer (pid=51903) crashed "
                            "with exit code -11. Triggering SIGQUIT for cleanup...")
    assert "SIGSEGV" in failure.hint
    assert state.ready and state.phase is Phase.READY  # it failed after it was ready


def test_a_crashed_scheduler_subprocess_names_its_rank() -> None:
    state = feed(initial(), "[2026-12-05 11:03:07] Subprocess scheduler_4 (pid=51899) crashed "
                            "with exit code -6. Triggering SIGQUIT for cleanup...")
    state = feed(state, "[2026-12-05 11:03:07] SIGQUIT received. signum=3, frame=None. It "
                        "usually means one child failed.")
    assert state.failure is not None
    assert (state.failure.reason, state.failure.rank) == ("scheduler_died", 4)
    assert "SIGABRT" in state.failure.hint


def test_refinement_is_upward_only_and_keeps_the_rank() -> None:
    sigquit = "[2026-12-02 10:22:37] Received sigquit from a child process. It usually means " \
              "the child failed."
    state = feed(initial(), sigquit)
    assert state.failure is not None and state.failure.reason == "signal"
    state = feed(state, "[2026-12-02 10:22:37 TP6] Scheduler hit an exception: Traceback (most "
                        "recent call last):")
    assert state.failure is not None
    assert (state.failure.reason, state.failure.rank) == ("scheduler_died", 6)
    state = feed(state, '  File "/x/scheduler.py", line 1, in run_scheduler_process')
    state = feed(state, "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
                        "system error")
    assert state.failure is not None
    assert state.failure.detail == ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
                                    "unhandled system error")
    state = feed(state, "RuntimeError: Not enough memory. Please try to increase "
                        "--mem-fraction-static.")
    assert state.failure is not None
    assert (state.failure.reason, state.failure.rank) == ("out_of_memory", 6)
    assert "raise --mem-fraction-static" in state.failure.hint
    before = state.failure
    for later in (sigquit, "[2026-12-02 10:22:38] Initialization failed. Please see the error "
                           "messages above.",
                  "RuntimeError: Rank 2 scheduler died during initialization (exit code: 1)."):
        state = feed(state, later)
        assert state.failure == before


def test_a_rank_fills_in_for_an_equal_failure_without_one() -> None:
    state = feed(initial(), "[2026-12-02 10:22:37] Scheduler hit an exception: boom")
    assert state.failure is not None and state.failure.rank is None
    state = feed(state, "RuntimeError: Rank 2 scheduler died during initialization (exit code: 1).")
    assert state.failure is not None
    assert (state.failure.reason, state.failure.rank) == ("scheduler_died", 2)
    assert state.failure.line == "[2026-12-02 10:22:37] Scheduler hit an exception: boom"


@pytest.mark.parametrize("line", [
    "[2026-12-05 10:22:50 TP0] FlashInfer extend autotune skipped: not enough free memory for a "
    "8192-token dummy forward.",
    "[2026-12-05 12:00:00] SIGTERM received. signum=15 frame=None. Draining requests and "
    "shutting down...",
    "[2026-12-05 12:00:05] Gracefully exiting... Remaining number of requests 0. Remaining "
    "requests remaining_rids=[].",
    "[2026-12-05 11:02:52] INFO:     127.0.0.1:60112 - \"POST /v1/chat/completions HTTP/1.1\" "
    "200 OK",
    "[2026-12-05 10:26:24 TP0] Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0, "
    "full token usage: 0.00, mamba usage: 0.00, #running-req: 0, #queue-req: 0",
    "  File \"/x/scheduler.py\", line 6362, in run_scheduler_process",
    "RuntimeError: something went wrong in a handled path",
])
def test_benign_lines_are_not_failures(line: str) -> None:
    assert feed(initial(), line).failure is None


def test_port_in_use_after_loading() -> None:
    failure = feed(initial(), "[2026-12-05 10:26:14] ERROR:    [Errno 98] error while "
                              "attempting to bind on address ('127.0.0.1', 30000): address "
                              "already in use").failure
    assert failure is not None and failure.reason == "bad_argument"
    assert "('127.0.0.1', 30000)" in failure.hint and "--port" in failure.hint


def test_soft_watchdog_is_not_a_failure_but_a_hard_one_is() -> None:
    soft = "[2026-12-05 12:00:00 TP1] Scheduler watchdog timeout (self.watchdog_timeout=300, " \
           "self.soft=True)"
    assert feed(initial(), soft).failure is None
    hard = feed(initial(), soft.replace("True", "False")).failure
    assert hard is not None and (hard.reason, hard.rank) == ("scheduler_died", 1)


# --- robustness ---------------------------------------------------------------------------------

def _junk() -> list[str]:
    rng = random.Random(20261130)
    binary = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))).decode(
        "utf-8", errors="replace") for _ in range(200)]
    return [
        "", " ", "\t", "\x00\x01\x02", "\ufffd" * 50, "[", "[]", "[2026-", "] ]",
        "[not a timestamp TP0] Load weight begin.",
        "Multi-thread loading shards:", "Multi-thread loading shards: 99% Completed | x/96",
        "Capture", "KV Cache", "max_total_num_tokens", "server_args", "error:",
        "x" * 2_000_000, "9" * 100_000, "[" * 100_000, "Rank " * 50_000,
        "a." * 100_000 + "Error", "\x1b[2K\x1b[1A", "#tokens: " + "9" * 10_000,
        *binary,
    ]


@pytest.mark.parametrize("base", ["", "k3_startup.sample.log", "oom_at_allocation.log"])
def test_garbage_never_raises_and_changes_only_the_line_count(base: str) -> None:
    start = parse_text((LOGS / base).read_text()) if base else initial()
    for junk in _junk():
        after = feed(start, junk)
        assert after == replace(start, lines=start.lines + 1), repr(junk[:80])


def test_splitter_handles_cr_lf_crlf_partial_tails_and_caps_records() -> None:
    splitter = LineSplitter(max_record_chars=10)
    assert splitter.feed("ab") == []
    assert splitter.feed("c\r\nde\rf") == ["abc", "de"]
    assert splitter.feed("g" * 30) == []
    assert splitter.feed("\nxyz") == ["fgggggggggg"[:10]]
    assert splitter.flush() == ["xyz"]
    assert splitter.flush() == []


def test_phases_never_go_backwards_even_out_of_order() -> None:
    records = [r for line in _sample_text().split("\n") for r in line.split("\r") if r]
    for seed in range(5):
        shuffled = records[:]
        random.Random(seed).shuffle(shuffled)
        state, seen = initial(), []
        for record in shuffled:
            state = feed(state, record)
            seen.append(state.phase.value)
        assert seen == sorted(seen)
        entered = [phase.value for phase, _ in state.phases]
        assert entered == sorted(set(entered))
        assert state.phases[-1][0] is state.phase
    # A late "Load weight begin" after READY changes nothing.
    ready = parse_text(_sample_text())
    late = feed(ready, "[2026-11-30 11:00:00 TP0] Load weight begin. avail mem=266.93 GB")
    assert late.phases == ready.phases and late.phase is Phase.READY


# --- reports ------------------------------------------------------------------------------------

def test_render_text_shows_the_memory_table_and_capacity() -> None:
    text = render_text(parse_text(_sample_text()))
    assert "2,708,160 tokens per rank \u00d7 DCP8 = 21,665,280 tokens" in text
    table = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    rows = [row for row in table if len(row) >= 8 and row[0] in "01234567"]
    assert [row[0] for row in rows] == [str(r) for r in range(8)]
    for row in rows:
        assert row[1:] == ["195.86", "17.42", "for", "332", "slots", "34.87", "=", "2,708,160",
                           "18.78"]
    assert "Weights: 96/96 shards, loaded in 4898.40 s" in text
    assert "Ready: yes" in text and "Failure: none seen" in text
    assert "max_running_requests   64" in text and "context_len            1,048,576" in text
    for phase, at in SAMPLE_PHASES:
        assert f"{phase.name:<17} {at}" in text


def test_render_text_on_failure_and_warnings() -> None:
    oom = render_text(parse_text((LOGS / "oom_at_allocation.log").read_text()))
    assert "Ready: no (last phase reached: ALLOCATING)" in oom
    assert "Failure: out_of_memory on TP5" in oom and "next:   TP5 ran out of GPU memory" in oom
    dspark = render_text(parse_text((LOGS / "dspark_startup.log").read_text()))
    assert "65,984 tokens per rank \u00d7 DCP8 = 527,872 tokens" in dspark
    assert "  - max_running_requests is capped to 13" in dspark
    assert "Draft weights: 2/2 shards" in dspark


@pytest.mark.parametrize("name", sorted(p.name for p in LOGS.glob("*.log")))
def test_render_json_round_trips(name: str) -> None:
    state = parse_text((LOGS / name).read_text())
    data = render_json(state)
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["phase"] == state.phase.name and data["lines"] == state.lines


def test_render_json_content_for_the_sample() -> None:
    data = render_json(parse_text(_sample_text()))
    assert data["phases"][-1] == {"phase": "READY", "at": "2026-11-30 10:26:24"}
    assert data["shards"] == {"done": 96, "total": 96}
    assert data["kv_token_capacity"] == 21_665_280
    assert data["ranks"][3]["state_gb"] == 17.42 and data["ranks"][3]["rank"] == 3
    assert data["figures"]["max_total_num_tokens"] == 2_708_160
    assert data["startup_timings"]["cuda_graph.target_decode"] == 211.84
    assert data["failure"] is None and data["ready"] is True
    failed = render_json(parse_text((LOGS / "scheduler_died_rank3.log").read_text()))
    assert failed["failure"]["reason"] == "scheduler_died" and failed["failure"]["rank"] == 3


# --- the real engine's own logs (SGLang 0.5.23 on a CPU, reference/sglang-cpu.md) -------------

CPU_LOGS = Path(__file__).parent / "data" / "sglang-cpu"
REPO = Path(__file__).resolve().parent.parent
# A single launch as the real engine writes it: import warnings (no log prefix, each with its
# source line), "Cuda graph is disabled" and "Fail to set RLIMIT_NOFILE" before server_args.
CPU_START = """\
/venv/lib/python3.11/site-packages/sglang/srt/layers/quantization/awq/awq.py:53: UserWarning: Only CUDA, HIP and XPU support AWQ currently.
  warnings.warn(f"Only CUDA, HIP and XPU support AWQ currently.")
[2026-12-02 06:02:19] Cuda graph is disabled because of using torch native attention backend
/venv/lib/python3.11/site-packages/sglang/kernels/ops/attention/fla/utils.py:223: UserWarning: Triton is not supported on current platform, roll back to CPU.
  warnings.warn(
[2026-12-02 06:02:22] Fail to set RLIMIT_NOFILE: current limit exceeds maximum limit
[2026-12-02 06:02:22] server_args={'model_path': '/m', 'tokenizer_path': '/m', 'tp_size': 1, 'api_key': 'sk-engine-abc', 'admin_api_key': None}
[2026-12-02 06:02:59] Init parallel begin.
[2026-12-02 06:03:02] Load weight begin. avail mem=20.12 GB
[2026-12-02 06:03:02] Load weight end. elapsed=0.07 s, type=LlamaForCausalLM, avail mem=20.11 GB, mem usage=0.00 GB.
[2026-12-02 06:03:04] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096, K size: 0.00 GB, V size: 0.00 GB
[2026-12-02 06:03:04] max_total_num_tokens=4096, chunked_prefill_size=4096, max_prefill_tokens=16384, max_running_requests=2048, context_len=2048, available_cpu_mem=20.19 GB
[2026-12-02 06:03:04] INFO:     Uvicorn running on http://127.0.0.1:40569 (Press CTRL+C to quit)
[2026-12-02 06:03:07] The server is fired up and ready to roll!
[2026-12-02 06:03:10] INFO:     127.0.0.1:48436 - "POST /v1/chat/completions HTTP/1.1" 200 OK
"""  # noqa: E501 - the engine's own lines, unwrapped
CPU_DRAIN = """\
[2026-12-02 06:03:10] SIGTERM received. signum=None frame=None. Draining requests and shutting down...
[2026-12-02 06:03:10] Gracefully exiting... Remaining number of requests 1. Remaining requests remaining_rids=['0d5aa77b'].
[2026-12-02 06:03:13] Decode batch, #running-req: 1, #token: 43, token usage: 0.01, cpu graph: False, gen throughput (token/s): 4.21, #queue-req: 0
[2026-12-02 06:03:30] Gracefully exiting... Remaining number of requests 0. Remaining requests remaining_rids=[].
[2026-12-02 06:03:30] kill_process_tree called: parent_pid=6566, include_parent=False, pid=6566
[2026-12-02 06:03:30] INFO:     Shutting down
[2026-12-02 06:03:32] INFO:     Finished server process [6566]
"""  # noqa: E501
# No request ever reached the tokenizer manager: SGLang's drain handler was never installed.
CPU_NO_DRAIN = """\
[2026-12-02 06:04:30] INFO:     Shutting down
[2026-12-02 06:04:30] INFO:     Waiting for application shutdown.
[2026-12-02 06:04:30] INFO:     Application shutdown complete.
[2026-12-02 06:04:30] INFO:     Finished server process [8968]
"""


def test_a_real_single_launch_is_one_run_with_its_warnings_in_it() -> None:
    """Issue 21: the lines before server_args made a phantom run ("run 2 of 2")."""
    state = parse_text(CPU_START)
    assert state.origin is not None and (state.origin.number, state.origin.of) == (1, 1)
    assert state.origin.start_line == 1 and state.origin.started_at == "2026-12-02 06:02:19"
    assert state.ready and state.phase is Phase.READY and state.stop is None
    # A second launch appended: its own warnings open its run, not the first run's tail.
    first, second = parse_runs(CPU_START + CPU_DRAIN + CPU_START)
    assert first.stop is not None and second.stop is None
    assert second.origin is not None and second.origin.start_line == (
        (CPU_START + CPU_DRAIN).count("\n") + 1)


def test_a_rotated_head_with_a_run_under_way_stays_a_run_of_its_own() -> None:
    head = "[2026-12-02 06:00:00 TP0] Decode batch, #running-req: 1, #token: 43\n"
    runs = parse_runs(head + CPU_START)
    assert [run.origin.marked for run in runs if run.origin] == [False, True]


def test_a_real_drain_shows_the_stop_not_ready() -> None:
    state = parse_text(CPU_START + CPU_DRAIN)
    assert state.phase is Phase.STOPPED
    assert [phase for phase, _ in state.phases][-3:] == [Phase.READY, Phase.DRAINING,
                                                        Phase.STOPPED]
    assert state.stop is not None
    assert (state.stop.signal_at, state.stop.drained, state.stop.in_flight,
            state.stop.remaining, state.stop.ended_at) == (
        "2026-12-02 06:03:10", True, 1, 0, "2026-12-02 06:03:30")
    assert state.failure is None
    text = render_text(state)
    assert "Ready: it was, until its stop (last phase reached: STOPPED)" in text
    assert ("Stop: SIGTERM at 2026-12-02 06:03:10; drained 1 request in flight, stopped at "
            "2026-12-02 06:03:30") in text
    assert render_json(state)["stop"]["drained"] is True
    # Mid-drain (the log ends while a request is still in flight): draining.
    mid = parse_text(CPU_START + CPU_DRAIN[:CPU_DRAIN.index("[2026-12-02 06:03:30]")])
    assert mid.phase is Phase.DRAINING and mid.stop is not None and mid.stop.remaining == 1
    assert "requests still in flight when the log ends" in render_text(mid)


def test_a_stop_without_sglangs_drain_reads_as_stopped_without_a_drain() -> None:
    state = parse_text(CPU_START + CPU_NO_DRAIN)
    assert state.phase is Phase.STOPPED and state.stop is not None
    assert not state.stop.drained and state.stop.signal_at is None
    assert state.stop.ended_at == "2026-12-02 06:04:30"
    assert "stopped at 2026-12-02 06:04:30 without a drain" in render_text(state)


def test_a_forced_exit_is_named() -> None:
    forced = ("[2026-12-02 06:05:00] SIGTERM received. signum=15 frame=None. Draining requests "
              "and shutting down...\n[2026-12-02 06:05:05] Signal SIGTERM received while health "
              "check failed. Force exiting.\n")
    state = parse_text(CPU_START + forced)
    assert state.phase is Phase.STOPPED and state.stop is not None
    assert state.stop.forced is not None and "health check failed" in state.stop.forced


@pytest.mark.parametrize("path", sorted(CPU_LOGS.glob("*.log")), ids=lambda p: p.name)
def test_parse_log_on_each_captured_real_log_says_run_1_of_1(path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "appliance", "engine", "parse-log", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Log: run 1 of 1,"), done.stdout
    state = parse_text(path.read_text(errors="replace"))
    if "SIGTERM received." in path.read_text(errors="replace"):
        assert state.stop is not None and state.phase in (Phase.DRAINING, Phase.STOPPED)
        assert "Stop: SIGTERM at" in done.stdout
