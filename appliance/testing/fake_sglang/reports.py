"""What the engine emulator reports about itself: `/server_info`, `/model_info`, `/v1/loads`
and `/metrics`. A test and demo instrument (`appliance.testing.fake_sglang`); every report
says so (`"emulator": true`, or an `emulator` label/comment in the Prometheus text).

Shapes follow SGLang 0.5.23: `build_server_info` plus `internal_states[]`
(`scheduler_components/internal_state.py`, `memory_usage.py`), `LoadSnapshot.to_dict`
(`managers/load_snapshot.py`, `entrypoints/v1_loads.py`), and the `sglang:*` metric names of
`observability/metrics_collector.py` (labels model_name, engine_type, tp_rank, pp_rank,
moe_ep_rank; scheduler gauges from TP0 only). Of the histograms, time to first token,
inter-token latency and end-to-end latency are kept (`histograms.py`, measured from the
emulator's own requests); the token-count and queue-time histograms are not emulated. With the
performance model on (`perfmodel.py`) the KV figures (`token_usage`, `kv_available_tokens`,
`max_total_num_tokens`, `/v1/loads`) are over the model's pool, `num_retracted_reqs` counts
retracted requests back in the queue and `new_token_ratio` is the scheduler's.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from appliance.engine.flags import SGLANG_VERSION
from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.core import Core
from appliance.testing.fake_sglang.memory import Capacity
from appliance.testing.fake_sglang.startup import GRAPH_PHASES, Model, Timings, graph_phase

ACCELERATOR = "NVIDIA B300 SXM6 AC"


def memory_usage(cap: Capacity, graph_key: str) -> dict[str, Any]:
    graph = dict.fromkeys(GRAPH_PHASES, 0.0) | {graph_key: round(cap.graph_gb, 3)}
    return {"weight": round(cap.weights_gb, 3), "kvcache": round(cap.kv_gb, 3),
            "startup_available": round(cap.ready_avail_gb, 3), "token_capacity": cap.kv_tokens,
            "token_capacity_swa": None, "graph": graph}


def server_info(args: ServeArgs, cap: Capacity, core: Core, timings: Timings) -> dict[str, Any]:
    """Resolved args, `launch_command`, scheduler info and one internal state (dp=1).
    `context_len` is an emulator extra; real SGLang reports it as /v1/models max_model_len."""
    resolved = args.resolved()
    graph_key = graph_phase(args)
    internal = {
        **resolved,
        "max_mamba_cache_size": cap.state_slots,
        "world_size": args.tp_size,
        "startup_time": timings.scheduler_e2e,
        "effective_max_running_requests_per_dp": cap.max_running_requests,
        "last_gen_throughput": round(core.gen_throughput, 2),
        "memory_usage": memory_usage(cap, graph_key),
    }
    return {
        **resolved,
        "context_length": args.context_length or cap.context_len,
        "context_len": cap.context_len,
        "launch_command": args.launch_command,
        "status": "ready",
        "max_total_num_tokens": cap.kv_tokens,
        "max_req_input_len": cap.context_len - 1,
        "startup_time": timings.scheduler_e2e,
        "kv_events": None,
        "internal_states": [internal],
        "version": SGLANG_VERSION,
        "frontend": "python",
        "emulator": True,
        # Wall seconds per modelled second (FAKE_SGLANG_TIME_SCALE): a qualification measures
        # in the engine's time by it, as /metrics already reports.
        "emulator_time_scale": core.time_scale,
    }


def model_info(args: ServeArgs, model: Model) -> dict[str, Any]:
    return {
        "model_path": args.model_path,
        "served_model_name": args.served_model_name,
        "tokenizer_path": args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": args.values.get("reasoning_parser"),
        "tool_call_parser": args.values.get("tool_call_parser"),
        "disaggregation_mode": args.disaggregation_mode,
        "has_image_understanding": model.model_type == "kimi_k3",
        "has_audio_understanding": False,
        "model_type": model.model_type,
        "architectures": [model.architecture],
        "emulator": True,
    }


def cache_hit_rate(core: Core) -> float:
    """Cached over all prefilled prompt tokens so far (the pretend radix cache)."""
    total = core.cached_tokens_total + core.prefill_tokens_total
    return core.cached_tokens_total / total if total else 0.0


SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def load_snapshot(cap: Capacity, core: Core, include: set[str] | None) -> dict[str, Any]:
    used = core.used_tokens
    load: dict[str, Any] = {
        "timestamp": time.time(), "dp_rank": 0,
        "num_running_reqs": core.num_running, "num_waiting_reqs": core.num_queue,
        "num_waiting_uncached_tokens": sum(r.prompt_tokens for r in core.waiting),
        "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0, "max_total_num_tokens": core.pool_tokens,
        "max_running_requests": cap.max_running_requests,
        "token_usage": round(core.token_usage, 4),
        "gen_throughput": round(core.gen_throughput, 2),
        "cache_hit_rate": round(cache_hit_rate(core), 4),
        "utilization": round(core.num_running / max(1, cap.max_running_requests), 4),
        "total_prefill_uncached_tokens": core.prefill_tokens_total,
        "total_prefill_busy_us": 0, "decode_moments": None,
    }
    if include == {"core"}:
        return load
    every = include is None or "all" in include
    if every or "memory" in (include or ()):
        load["memory"] = {"weight_gb": round(cap.weights_gb, 3),
                          "kv_cache_gb": round(cap.kv_gb, 3),
                          "graph_gb": round(cap.graph_gb, 3), "token_capacity": cap.kv_tokens}
    if every or "queues" in (include or ()):
        load["queues"] = {"waiting": core.num_queue, "grammar": 0, "paused": 0,
                          "retracted": core.num_retracted, "prealloc_ready": 0}
    return load


def loads(cap: Capacity, core: Core, tp_size: int, include: set[str] | None) -> dict[str, Any]:
    return {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": ACCELERATOR,
        "num_accelerators": tp_size,
        "loads": [load_snapshot(cap, core, include)],
        "emulator": True,
    }


def loads_prometheus(snapshot: dict[str, Any]) -> str:
    lines = []
    for key, value in snapshot.items():
        values = value.items() if isinstance(value, dict) else [("", value)]
        for sub, number in values:
            if key in ("dp_rank",) or isinstance(number, bool) \
                    or not isinstance(number, int | float):
                continue
            name = f"sglang_{key}_{sub}" if sub else f"sglang_{key}"
            lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {number}']
    return "\n".join(lines) + "\n"


def metrics(args: ServeArgs, cap: Capacity, core: Core, timings: Timings) -> str:
    """Prometheus text exposition (version 0.0.4) with SGLang's metric names."""
    labels = (f'engine_type="unified",model_name="{args.served_model_name}",'
              f'moe_ep_rank="0",pp_rank="0",tp_rank="0"')
    slots_used = core.state_slots_used
    gauges: list[tuple[str, float, str]] = [
        ("num_running_reqs", core.num_running, "The number of running requests."),
        ("num_queue_reqs", core.num_queue, "The number of requests in the waiting queue."),
        ("num_retracted_reqs", core.num_retracted, "The number of retracted requests."),
        ("gen_throughput", round(core.gen_throughput, 2), "The generation throughput."),
        ("cache_hit_rate", round(cache_hit_rate(core), 6), "The prefix cache hit rate."),
        ("token_usage", round(core.token_usage, 6), "The token usage."),
        ("full_token_usage", round(core.token_usage, 6), "The full-attention token usage."),
        ("mamba_usage", round(slots_used / max(1, cap.state_slots), 6), "The mamba usage."),
        ("num_used_tokens", core.used_tokens, "The number of used tokens."),
        ("kv_used_tokens", core.used_tokens, "KV tokens in use."),
        ("kv_available_tokens", core.pool_tokens - core.used_tokens, "KV tokens available."),
        ("kv_evictable_tokens", 0, "KV tokens evictable."),
        ("mamba_used_tokens", slots_used, "Mamba slots in use."),
        ("mamba_available_tokens", cap.state_slots - slots_used, "Mamba slots available."),
        ("mamba_evictable_tokens", 0, "Mamba slots evictable."),
        ("utilization", round(core.num_running / max(1, cap.max_running_requests), 6),
         "The utilization."),
        ("new_token_ratio", round(core.new_token_ratio, 6), "The new token ratio."),
        ("is_cuda_graph", 1, "Whether the batch is using CUDA graph."),
        ("max_total_num_tokens", core.pool_tokens,
         "Maximum total number of tokens in the pool."),
        ("weight_memory_usage_gb", round(cap.weights_gb, 2), "Weight memory (GB)."),
        ("kv_cache_memory_usage_gb", round(cap.kv_gb, 2), "KV cache memory (GB)."),
        ("graph_memory_usage_gb", round(cap.graph_gb, 2), "CUDA graph memory (GB)."),
        ("page_size", args.page_size, "The page size."),
        ("num_pages", core.pool_tokens // args.page_size, "The number of pages."),
        ("context_len", cap.context_len, "The context length."),
        ("startup_available_gpu_memory_gb", round(cap.ready_avail_gb, 2),
         "Available GPU memory at startup (GB)."),
        ("weight_load_duration_seconds", round(timings.load_weight, 3),
         "Weight load duration."),
        ("startup_time_seconds", round(timings.scheduler_e2e, 3), "Startup time."),
        ("startup_cuda_graph_time_seconds", round(timings.cuda_graph, 3),
         "CUDA graph capture time."),
    ]
    if args.speculative:
        gauges += [("spec_accept_length", 3.1, "Average accept length."),
                   ("spec_accept_rate", 0.3, "Average accept rate.")]
    counters: list[tuple[str, int, str]] = [
        ("prompt_tokens_total", core.prompt_tokens_total, "Number of prefill tokens processed."),
        ("generation_tokens_total", core.generation_tokens_total,
         "Number of generation tokens processed."),
        ("cached_tokens_total", core.cached_tokens_total, "Number of cached prompt tokens."),
        ("num_requests_total", core.num_requests_total, "Number of requests processed."),
        ("num_aborted_requests_total", core.num_aborted_requests_total,
         "Number of requests aborted."),
    ]
    out = ["# fake_sglang: SGLang 0.5.23 ENGINE EMULATOR (test and demo instrument)"]
    for name, value, text in gauges:
        out += [f"# HELP sglang:{name} {text}", f"# TYPE sglang:{name} gauge",
                f"sglang:{name}{{{labels}}} {float(value)}"]
    for name, count, text in counters:
        out += [f"# HELP sglang:{name} {text}", f"# TYPE sglang:{name} counter",
                f"sglang:{name}{{{labels}}} {float(count)}"]
    out += core.ttft.exposition("sglang:time_to_first_token_seconds", labels,
                                "Histogram of time to first token in seconds.")
    out += core.inter_token.exposition("sglang:inter_token_latency_seconds", labels,
                                       "Histogram of inter-token latency in seconds.")
    out += core.e2e.exposition("sglang:e2e_request_latency_seconds", labels,
                               "Histogram of End-to-end request latency in seconds")
    return "\n".join(out) + "\n"
