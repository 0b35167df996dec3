"""The engine emulator's startup, from `server_args=` to the CUDA graphs, at a scaled pace.
A test and demo instrument (`appliance.testing.fake_sglang`).

The reference K3 start takes ~86 minutes: 38 s of distributed init, 81.6 min of weights, ~12 s
of pools, 3.5 min of CUDA graphs. Here the whole start takes `load_seconds` (env
`FAKE_SGLANG_LOAD_SECONDS`), with the weights taking 90% of it, and the markers follow the
reference sample's order exactly. Timestamps, tqdm elapsed/rate fields and `elapsed=` figures
are real (they agree with the wall clock), memory figures come from `memory.Capacity`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from appliance.testing.fake_sglang.args import ServeArgs
from appliance.testing.fake_sglang.faults import Faults
from appliance.testing.fake_sglang.gpustate import GpuStateFile
from appliance.testing.fake_sglang.logwriter import LogWriter, bar_state
from appliance.testing.fake_sglang.memory import GIB, Capacity, CapacityError
from appliance.testing.fake_sglang.ranks import Children, RankDied
from appliance.testing.fake_sglang.tracebacks import oom_exception, scheduler_exception

PSEUDO_SHARDS = 96
# Where each phase starts, as a share of the whole start (the rest is tokenizer and warmup).
INIT_BEGIN, INIT_END, LOAD_BEGIN, LOAD_END = 0.002, 0.008, 0.009, 0.909
STATE_POOL, KV_POOL, CAPTURE_BEGIN, CAPTURE_END, TIMINGS = 0.915, 0.918, 0.925, 0.975, 0.98
K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
K3_QUANT = "compressed-tensors"
REPLAYSSM_PARTS = (("d", 49152), ("k", 49152), ("g", 98304), ("rawv", 49152),
                   ("rawk", 49152), ("beta", 768))  # bytes per KDA layer per slot, L=16
KDA_LAYERS = 69


@dataclass(frozen=True)
class Model:
    """What the emulator reads from --model-path: its shards and a few config.json fields."""

    path: Path
    files: tuple[Path, ...]
    sizes: tuple[int, ...]
    architecture: str = K3_ARCHITECTURE
    model_type: str = "kimi_k3"
    quant: str | None = K3_QUANT
    context_len: int | None = None
    mxfp4: bool = False  # quantization_config names an mxfp4 format (K3's MoE runner choice)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def inspect_model(model_path: str) -> Model:
    path = Path(model_path)
    files = tuple(sorted(path.glob("*.safetensors"))) if path.is_dir() else ()
    sizes = tuple(f.stat().st_size for f in files)
    model = Model(path=path, files=files, sizes=sizes)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return model
    if not isinstance(config, dict):
        return model
    text = config.get("text_config")
    if not isinstance(text, dict):
        text = config
    archs = config.get("architectures")
    quant = config.get("quantization_config") or text.get("quantization_config")
    ctx = text.get("max_position_embeddings")
    return Model(
        path=path, files=files, sizes=sizes,
        architecture=archs[0] if isinstance(archs, list) and archs else K3_ARCHITECTURE,
        model_type=str(config.get("model_type") or "kimi_k3"),
        quant=str(quant.get("quant_method")) if isinstance(quant, dict)
        and quant.get("quant_method") else None,
        context_len=ctx if isinstance(ctx, int) and ctx > 0 else None,
        mxfp4="mxfp4" in json.dumps(quant) if isinstance(quant, dict) else False,
    )


# model_executor/graph_memory_usage.py GRAPH_MEMORY_USAGE_KEYS: every phase is reported, the
# ones not captured as 0 (the startup timings line, /server_info's memory_usage.graph).
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                "draft_extend")


def graph_phase(args: ServeArgs) -> str:
    """The phase the emulator's one capture is: the target's decode, or its verify under
    speculative decoding."""
    return "target_verify" if args.speculative else "decode"


@dataclass(frozen=True)
class Timings:
    started: float  # wall clock
    load_weight: float
    kv_cache_allocation: float
    cuda_graph: float
    scheduler_e2e: float


class Startup:
    def __init__(self, args: ServeArgs, cap: Capacity | CapacityError, faults: Faults,
                 model: Model, log: LogWriter, children: Children, gpu: GpuStateFile,
                 load_seconds: float) -> None:
        self.args, self.cap, self.faults, self.model = args, cap, faults, model
        self.log, self.children, self.gpu = log, children, gpu
        self.seconds = max(0.05, load_seconds)
        self.t0 = time.monotonic()
        self.tp = args.tp_size
        self.kv_elapsed = 0.0

    # -- pacing ---------------------------------------------------------------------------
    def sleep(self, seconds: float) -> None:
        """Sleep, watching the children (a dead rank ends the start, as in SGLang)."""
        deadline = time.monotonic() + seconds
        while True:
            self.children.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def at(self, share: float) -> None:
        self.sleep(self.t0 + share * self.seconds - time.monotonic())

    def publish(self, phase: str, fraction: float = 0.0) -> None:
        used = self.cap.used_bytes(phase, fraction) if isinstance(self.cap, Capacity) \
            else int((1.12 + 195.86 * (fraction if phase == "loading" else 1.0)) * GIB)
        self.gpu.publish([used] * self.tp, self.children.rank_pids)

    # -- the phases -----------------------------------------------------------------------
    def run(self) -> tuple[Capacity, Timings]:
        started = time.time()
        log, tp = self.log, self.tp
        if not self.model.files:
            log.line(f"fake_sglang (emulator): no *.safetensors under {self.model.path}; "
                     f"pacing {PSEUDO_SHARDS} pretend shards instead of reading files.")
        self.at(INIT_BEGIN)
        log.ranks("Init parallel begin.", tp)
        init_start = time.monotonic()
        self.at(INIT_END)
        self.publish("baseline")
        for rank in range(tp):
            log.line(f"Init parallel ends. elapsed={time.monotonic() - init_start:.2f} s", rank)
            log.line("Memory baseline taken. mem usage=1.12 GB", rank)
        self.at(LOAD_BEGIN)
        log.ranks("Load weight begin. avail mem=266.93 GB", tp)
        load_start = time.monotonic()
        self.load_weights(load_start)
        load_elapsed = time.monotonic() - load_start
        quant = f"quant={self.model.quant}, " if self.model.quant else ""
        log.ranks(f"Load weight end. elapsed={load_elapsed:.2f} s, type={self.model.architecture},"
                  f" {quant}avail mem=71.07 GB, mem usage=195.86 GB.", tp)
        self.publish("loaded")
        cap = self.allocate()
        capture = self.capture(cap)
        log.line(f"max_total_num_tokens={cap.kv_tokens}, chunked_prefill_size="
                 f"{cap.chunked_prefill_size}, max_prefill_tokens={cap.max_prefill_tokens}, "
                 f"max_running_requests={cap.max_running_requests}, context_len={cap.context_len}"
                 f", available_gpu_mem={cap.ready_avail_gb:.2f} GB", 0)
        self.at(TIMINGS)
        e2e = time.monotonic() - self.t0
        timings = Timings(started=started, load_weight=load_elapsed,
                          kv_cache_allocation=self.kv_elapsed, cuda_graph=capture,
                          scheduler_e2e=e2e)
        graphs = dict.fromkeys(GRAPH_PHASES, 0.0) | {graph_phase(self.args): capture}
        phases = ", ".join(f"{phase}={seconds:.2f}" for phase, seconds in graphs.items())
        log.line(f"Engine startup timings (s): load_weight={load_elapsed:.2f}, kv_cache_allocation"
                 f"={self.kv_elapsed:.2f}, scheduler_e2e={e2e:.2f}, cuda_graph={{{phases}}}, "
                 f"tokenizer_e2e={e2e * 0.0006:.2f}")
        return cap, timings

    def load_weights(self, load_start: float) -> None:
        files, sizes = self.model.files, self.model.sizes
        count = len(files) or PSEUDO_SHARDS
        total = self.model.total_bytes
        shares = [s / total for s in sizes] if total else [1 / count] * count
        window = (LOAD_END - LOAD_BEGIN) * self.seconds
        stop = self.faults.load_stop_at
        self.log.bar(bar_state(0, count, 0.0))
        done_share = 0.0
        for index, share in enumerate(shares):
            end_share = done_share + share
            last = index == count - 1
            if stop is not None and (stop < end_share or (last and stop <= end_share + 1e-9)):
                part = min(1.0, max(0.0, (stop - done_share) / share)) if share else 0.0
                self._shard(index, window * share * part, part)
                self.publish("loading", stop)
                self.interrupt()
            self._shard(index, window * share, None)
            done_share = end_share
            self.log.bar(bar_state(index + 1, count, time.monotonic() - load_start))
            self.publish("loading", done_share)
        self.log.line_break()

    def _shard(self, index: int, seconds: float, part: float | None) -> None:
        if not self.model.files:
            self.sleep(seconds)
            return
        limit = None if part is None else int(self.model.sizes[index] * part)
        self.children.read(index % self.tp, self.model.files[index], seconds, limit)

    def interrupt(self) -> None:
        """crash_at / corrupt_at / hang_at reached: rank 0 dies, or all goes quiet for good."""
        kind = self.faults.load_interruption
        if kind in ("crash", "corrupt"):
            self.log.line_break()
            code = self.children.crash(0, scheduler_exception(0, str(kind)))
            raise RankDied(0, code)
        while True:  # hang: no more logs, reads or GPU updates; a dying rank still ends it
            self.sleep(3600)

    def allocate(self) -> Capacity:
        self.at(STATE_POOL)
        kv_start = time.monotonic()
        cap = self.cap
        if isinstance(cap, CapacityError):
            code = self.children.crash(0, scheduler_exception(0, "capacity", str(cap)))
            raise RankDied(0, code)
        if cap.capped_by_state:
            self.log.ranks(
                f"max_running_requests is capped to {cap.max_running_requests} by the mamba "
                f"state cache (max_mamba_cache_size={cap.state_slots}, {cap.slots_per_request} "
                f"state slots per request). To raise it: increase --mamba-full-memory-ratio or "
                f"--max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype "
                f"bfloat16.", self.tp)
        for rank in range(self.tp):
            self.log.line(f"Mamba Cache is allocated. max_mamba_cache_size: {cap.state_slots}, "
                          f"conv_state size: {cap.conv_gb:.2f}GB, ssm_state size: "
                          f"{cap.ssm_gb:.2f}GB ", rank)
            if self.args.replayssm:
                scale = (cap.state_slots + 1) * KDA_LAYERS * self.args.replayssm_cache_len / 16
                parts = [f"{name}={scale * size / GIB:.3f}GB" for name, size in REPLAYSSM_PARTS]
                self.log.line(f"GDN ReplaySSM ring buffers allocated (record_len="
                              f"{self.args.replayssm_cache_len}, fold=False): "
                              f"{', '.join(parts[:3])} {', '.join(parts[3:])} ", rank)
        self.publish("state")
        oom = self.faults.oom_rank
        if oom is not None:
            rank = min(max(0, oom), self.tp - 1)
            code = self.children.crash(rank, oom_exception(rank, cap))
            raise RankDied(rank, code)
        self.at(KV_POOL)
        for rank in range(self.tp):
            self.log.line(f"KV Cache is allocated. dtype: {cap.kv_dtype}, #tokens: "
                          f"{cap.kv_tokens}, KV size: {cap.kv_gb:.2f} GB", rank)
            self.log.line(f"Memory pool end. avail mem={cap.pool_end_avail_gb:.2f} GB", rank)
        self.publish("pools")
        self.kv_elapsed = time.monotonic() - kv_start
        return cap

    def capture(self, cap: Capacity) -> float:
        self.at(CAPTURE_BEGIN)
        start = time.monotonic()
        if not cap.cuda_graph_batch_sizes:  # --disable-cuda-graph: nothing captured
            self.publish("graphs")
            return 0.0
        backend = "cutedsl_mla" if self.args.dcp_size > 1 else "trtllm_mla"
        if self.args.speculative:
            role = "target verify"
            block = self.args.values.get("speculative_dspark_block_size")
            extra = f", num_tokens_per_req={(block if isinstance(block, int) else 7) + 1}"
        else:
            role, extra = "target decode", ""
        begin = cap.capture_begin_avail_gb
        self.log.ranks(f"Capture {role} CUDA graph begin. backend={backend}{extra}, "
                       f"avail mem={begin:.2f} GB", self.tp)
        sizes = cap.cuda_graph_batch_sizes
        window = (CAPTURE_END - CAPTURE_BEGIN) * self.seconds
        for step, bs in enumerate(reversed(sizes)):
            self.log.bar(f"Capturing batches (bs={bs} avail_mem={begin - 0.05 * step:.2f} GB): ")
            self.sleep(window / len(sizes))
        self.log.line_break()
        self.publish("graphs")
        elapsed = time.monotonic() - start
        self.log.ranks(f"Capture {role} CUDA graph end. bs={list(sizes)}, elapsed={elapsed:.2f} "
                       f"s, mem usage={cap.graph_gb:.2f} GB, avail mem={cap.ready_avail_gb:.2f} "
                       f"GB.", self.tp)
        return elapsed
