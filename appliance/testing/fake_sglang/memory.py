"""The engine emulator's capacity model: SGLang 0.5.23's memory split over K3's per-rank figures.

Part of a test and demo instrument (`appliance.testing.fake_sglang`). Pure.

Base figures, per rank, are the reference startup log's (one B300 under TP8): a 1.12 GB
baseline after distributed init, 266.93 GB free before the weights, 195.86 GB of weights
(so 71.07 GB free after them). They do not change with `--tp-size`, which here only sets how
many ranks (processes, pretend GPUs) there are. From there the split follows
`kv_cache_configurator.py` (shared/reference/sglang-0.5.23.md, section 1), all "GB" GiB:

    slack  = 266.93 * (1 - mem_fraction_static)            (auto: 0.93)
    rest   = 71.07 - slack - 100 MiB                        (the pools' budget; the 100 MiB is
                                                             the multimodal reservation K3 gets
                                                             for its vision tower)
    B      = rest * r / (1 + r)                             (r = --mamba-full-memory-ratio, 0.9)
    K      = int((B - per_slot) // per_slot)                (state slots; or --max-mamba-cache-size)
    state  = (K + 1) * per_slot                             (+1: the pool's padding slot)
    rows   = (rest - state) // cell // page * page          (KV tokens per rank, page 64)
    max_running_requests = min(requested or clamp(rows / context_len * 512, 2048, 4096),
                               rows // 2, K // slots_per_request)

per_slot is K3's KDA state at TP8: conv 1,907,712 B + ssm 54,263,808 B (fp32; half in
bf16/fp16) = 56,171,520 B, plus a 20,401,920 B ReplaySSM ring with
`--enable-linear-replayssm-spec` — the sample's 332 slots are exactly conv 0.59 + ssm 16.83 GB.
cell is MLA's 576 x 24 layers x element size: 13,824 B in fp8 (the sample's 34.87 GB for
2,708,160 tokens), 27,648 B in bf16 (`auto`), 6,912 B in fp4. slots_per_request is 5 for the
`auto`/`extra_buffer` radix strategy, 4 for `extra_buffer_lazy`, 3 for `no_buffer`. So a
higher ratio gives more state slots (and concurrency) and fewer KV tokens. With the sample's
flags this gives its 332 slots, 2,708,160 KV rows and max_running_requests 64, as the
appliance's own calculator (appliance/tuning) does. Not modelled: the DSPARK joint solve and
draft pools, hierarchical cache, DP attention. Also honoured: --max-total-tokens (caps the
rows), --max-prefill-tokens, --cuda-graph-bs-decode and --disable-cuda-graph (what is
captured, and so the graph memory), --context-length (else config.json's
max_position_embeddings, else 1,048,576), --page-size, --mamba-ssm-dtype, --kv-cache-dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.testing.fake_sglang.args import ServeArgs

GIB = 1 << 30
BASELINE_GB = 1.12  # "Memory baseline taken. mem usage=1.12 GB"
PRE_LOAD_AVAIL_GB = 266.93  # "Load weight begin. avail mem=266.93 GB"
WEIGHTS_GB = 195.86  # "Load weight end. ... mem usage=195.86 GB."
PRE_CAPTURE_GB = 0.26  # pool end 18.78 -> capture begin 18.52
GRAPH_GB_PER_BATCH_SIZE = 2.31 / 9  # 9 batch sizes captured for 2.31 GB
CONV_BYTES_PER_SLOT = 1_907_712  # 69 KDA layers x 3 x 4608 x bf16
SSM_BYTES_PER_SLOT_FP32 = 54_263_808  # 69 KDA layers x 12 x 128 x 128 x fp32
REPLAYSSM_RING_BYTES_PER_SLOT = 20_401_920  # --linear-replayssm-cache-len 16
MLA_CELL_ELEMENTS = 576 * 24  # (kv_lora_rank + qk_rope_head_dim) x full-attention layers
MM_RESERVATION_GB = 100 / 1024  # SGLANG_VLM_CACHE_SIZE_MB: K3 is multimodal to SGLang
DEFAULT_CONTEXT_LEN = 1_048_576  # K3's max_position_embeddings
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)
KV_DTYPES: dict[str, tuple[float, str]] = {  # --kv-cache-dtype -> (bytes per element, torch dtype)
    "auto": (2, "torch.bfloat16"),
    "bf16": (2, "torch.bfloat16"),
    "bfloat16": (2, "torch.bfloat16"),
    "fp8_e4m3": (1, "torch.float8_e4m3fn"),
    "fp8_e5m2": (1, "torch.float8_e5m2"),
    "mxfp8": (1, "torch.float8_e4m3fn"),
    "nvfp4": (0.5, "torch.uint8"),
    "fp4_mx_block16": (0.5, "torch.uint8"),
}
SLOTS_PER_REQUEST = {"auto": 5, "extra_buffer": 5, "extra_buffer_lazy": 4, "no_buffer": 3}


class CapacityError(Exception):
    """The flags leave no room (SGLang raises these in the scheduler, during allocation)."""


@dataclass(frozen=True)
class Capacity:
    """Everything the emulator logs and serves about memory, per rank. GB are GiB."""

    mem_fraction_static: float
    ratio: float
    rest_gb: float
    state_slots: int  # max_mamba_cache_size (K)
    slots_per_request: int
    conv_gb: float
    ssm_gb: float
    replayssm_gb: float
    kv_tokens: int  # MLA rows per rank = max_total_num_tokens
    kv_dtype: str
    kv_gb: float
    max_running_requests: int
    capped_by_state: bool
    context_len: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    cuda_graph_batch_sizes: tuple[int, ...]

    @property
    def state_gb(self) -> float:
        return self.conv_gb + self.ssm_gb + self.replayssm_gb

    @property
    def baseline_gb(self) -> float:
        return BASELINE_GB

    @property
    def weights_gb(self) -> float:
        return WEIGHTS_GB

    @property
    def pre_load_avail_gb(self) -> float:
        return PRE_LOAD_AVAIL_GB

    @property
    def after_weights_avail_gb(self) -> float:
        return PRE_LOAD_AVAIL_GB - WEIGHTS_GB

    @property
    def pool_end_avail_gb(self) -> float:
        return self.after_weights_avail_gb - self.state_gb - self.kv_gb

    @property
    def capture_begin_avail_gb(self) -> float:
        return self.pool_end_avail_gb - PRE_CAPTURE_GB

    @property
    def graph_gb(self) -> float:
        return GRAPH_GB_PER_BATCH_SIZE * len(self.cuda_graph_batch_sizes)

    @property
    def ready_avail_gb(self) -> float:
        return self.capture_begin_avail_gb - self.graph_gb

    def used_bytes(self, phase: str, load_fraction: float = 0.0) -> int:
        """GPU memory one rank holds at a phase: baseline, then weights as they load, then
        the pools, then the graphs (for the emulated GPU state file)."""
        used = BASELINE_GB
        if phase == "baseline":
            return int(used * GIB)
        used += WEIGHTS_GB * (load_fraction if phase == "loading" else 1.0)
        if phase in ("loading", "loaded"):
            return int(used * GIB)
        used += self.state_gb
        if phase == "state":
            return int(used * GIB)
        used += self.kv_gb
        if phase == "pools":
            return int(used * GIB)
        return int((used + PRE_CAPTURE_GB + self.graph_gb) * GIB)


def plan(args: ServeArgs, model_context_len: int | None = None) -> Capacity:
    """The split and capacity the flags give; `CapacityError` with SGLang's words when they
    leave nothing for the KV cache or the state cache."""
    mfs = args.mem_fraction_static
    ratio = args.mamba_full_memory_ratio
    rest_gb = (PRE_LOAD_AVAIL_GB - WEIGHTS_GB - PRE_LOAD_AVAIL_GB * (1 - mfs)
               - MM_RESERVATION_GB)
    if rest_gb <= 0:
        raise CapacityError(
            f"Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={mfs}: {PRE_LOAD_AVAIL_GB - WEIGHTS_GB:.2f} GB free after "
            f"weights, {PRE_LOAD_AVAIL_GB * (1 - mfs):.2f} GB reserved. Increase "
            f"--mem-fraction-static."
        )
    ssm_slot = SSM_BYTES_PER_SLOT_FP32 // (1 if args.mamba_ssm_dtype == "float32" else 2)
    ring_slot = REPLAYSSM_RING_BYTES_PER_SLOT * args.replayssm_cache_len // 16 \
        if args.replayssm else 0
    per_slot = CONV_BYTES_PER_SLOT + ssm_slot + ring_slot
    rest_bytes = rest_gb * GIB
    if args.max_mamba_cache_size is not None:
        slots = args.max_mamba_cache_size
    else:
        budget = rest_bytes * ratio / (1 + ratio)
        slots = int((budget - per_slot) // per_slot)
    if slots <= 0:
        raise CapacityError(
            f"Not enough GPU memory for hybrid (mamba/linear-attention) state cache. Computed "
            f"max_mamba_cache_size={slots}. Increase --mamba-full-memory-ratio or "
            f"--mem-fraction-static."
        )
    element_bytes, dtype = KV_DTYPES.get(args.kv_cache_dtype, KV_DTYPES["auto"])
    cell = int(MLA_CELL_ELEMENTS * element_bytes)
    kv_budget = rest_bytes - (slots + 1) * per_slot
    page = args.page_size
    rows = int(kv_budget // cell // page * page) if kv_budget > 0 else 0
    if args.max_total_tokens is not None:
        rows = min(rows, args.max_total_tokens)
    if rows <= 0:
        raise CapacityError(
            f"Not enough memory for the KV cache after the state cache: max_mamba_cache_size="
            f"{slots} leaves {kv_budget / GIB:.2f} GB. Decrease --max-mamba-cache-size or "
            f"--mamba-full-memory-ratio."
        )
    context_len = args.context_length or model_context_len or DEFAULT_CONTEXT_LEN
    per_request = SLOTS_PER_REQUEST.get(args.mamba_radix_cache_strategy, 5)
    requested = args.requested_max_running_requests
    if requested is None:
        wanted = max(min(int(rows / context_len * 512), 4096), 2048)
    else:
        wanted = max(1, requested)
    wanted = min(wanted, rows // 2)
    state_cap = slots // per_request
    if state_cap <= 0:
        raise CapacityError(
            f"Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
            f"max_mamba_cache_size={slots}, mamba_ratio={per_request}, resulting "
            f"max_num_reqs={state_cap}. Try: (1) reduce --max-running-requests, (2) increase "
            f"--mem-fraction-static, or (3) use GPUs with more memory."
        )
    max_running = min(wanted, state_cap)
    if args.disable_cuda_graph:
        sizes: tuple[int, ...] = ()
    else:
        sizes = args.cuda_graph_batch_sizes or tuple(
            bs for bs in CUDA_GRAPH_BATCH_SIZES if bs <= max_running) or (1,)
    return Capacity(
        mem_fraction_static=mfs,
        ratio=ratio,
        rest_gb=rest_gb,
        state_slots=slots,
        slots_per_request=per_request,
        conv_gb=(slots + 1) * CONV_BYTES_PER_SLOT / GIB,
        ssm_gb=(slots + 1) * ssm_slot / GIB,
        replayssm_gb=(slots + 1) * ring_slot / GIB,
        kv_tokens=rows,
        kv_dtype=dtype,
        kv_gb=rows * cell / GIB,
        max_running_requests=max_running,
        capped_by_state=state_cap < wanted,
        context_len=context_len,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graph_batch_sizes=sizes,
    )
