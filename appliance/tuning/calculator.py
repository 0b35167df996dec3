"""SGLang 0.5.23's split of GPU memory between recurrent state and full-attention KV, as pure code.

`size_pools(geometry, launch, budget_bytes, ratio)` answers what one launch of SGLang would
allocate per GPU: state slots (`max_mamba_cache_size`), KV rows (`max_total_num_tokens`) and
the running-request limit, from the budget SGLang measures after loading weights. It follows
the source step by step (paths relative to the `sglang` package):

1. `rest = budget - mm_reservation` (`srt/mem_cache/kv_cache_configurator.py:3038`): the
   budget is `available - pre_model_load * (1 - mem_fraction_static)` (l.3007); a multimodal
   model gives 100 MiB of it to post-sizing embedding caches (l.202-224, +1 GiB for the GPU
   feature transports).
2. `_handle_max_mamba_cache` (l.3229-3409): the state pool takes `K` slots of
   `per_slot = conv + ssm (+ KDA ReplaySSM ring)` bytes, with
   `K = int((rest * ratio / (1 + ratio) - fixed - per_slot) // per_slot)` and `K + 1`
   slots allocated (a padding slot); speculative decoding without ReplaySSM solves jointly with
   the per-draft-token snapshots (`intermediate_ssm`) and charges them too.
3. `DefaultPoolConfigurator` (`srt/model_executor/pool_configurator.py:219-655`): what is left
   buys `rows = left // cell // page_size * page_size` KV rows per GPU, `cell` being the
   full-attention bytes per row (+ a DSPARK draft's dense K/V for `dcp` tokens, l.316-338;
   without the draft's geometry, SGLang's layer-count scaling of the target's cell instead).
4. `resolve_max_num_reqs` (kv_cache_configurator.py:3119-3172): running requests are capped by
   `rows // 2` and by `K // slots_per_request`.

Floating-point steps are done in GiB floats in SGLang's own order, so a budget on a boundary
lands on the same side as SGLang's. Failures raise `CalculatorError` with SGLang's wording.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from appliance.errors import EX_DATAERR, EX_USAGE, ApplianceError
from appliance.tuning.geometry import DraftGeometry, Geometry

GIB = 1 << 30
MIB = 1 << 20
VLM_CACHE_BYTES = 100 * MIB            # SGLANG_VLM_CACHE_SIZE_MB default (srt/environ.py:1598)
MM_FEATURE_CACHE_BYTES = 1024 * MIB    # SGLANG_MM_FEATURE_CACHE_MB default (srt/environ.py:1622)
SPEC_DEFAULT_RUNNING = 48              # speculative_hook.py:852-860: DSPARK without the flag
STATE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1, "bf16": 2, "bfloat16": 2, "auto": 2}
SPECULATIVE = ("none", "dspark")
MAMBA_STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")
_BASE_SLOTS = 3                        # MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO (l.227)
# Far past any useful split (the KV pool gets 1/1001 of the memory; the chart stops at 50), and
# low enough that the pool arithmetic stays finite: 1e308 overflowed it to NaN (a 500).
MAX_RATIO = 1000.0


class CalculatorError(ApplianceError):
    """SGLang would refuse this launch (or the inputs cannot describe one); says why."""

    exit_code = EX_DATAERR

    def __init__(self, message: str, hint: str, *, exit_code: int | None = None) -> None:
        super().__init__("sizing_impossible", message, hint, status=422, exit_code=exit_code)


@dataclass(frozen=True)
class Launch:
    """The sizing inputs of one SGLang launch (flags, with SGLang's defaults for K3 on B300).

    `ssm_dtype` is `--mamba-ssm-dtype` as resolved (`resolve_ssm_dtype`); `draft_kv_dtype` None
    follows `kv_dtype`; `mamba_strategy` is what `--mamba-radix-cache-strategy auto` resolves to
    for these models on the triton linear-attention backend (overrides.py:452-486);
    `context_length` None uses the model's. `mem_fraction_static` is not used by `size_pools`
    (it is inside the budget) but travels with the launch for budget estimates. A DSPARK
    launch prices its draft's KV from `draft` (exact) or, without it, from `draft_layers` (the
    fallback SGLang uses when the draft's geometry cannot be resolved, `draft_pricing`).
    """

    tp: int = 8
    dcp: int = 8
    kv_dtype: str = "fp8_e4m3"
    ssm_dtype: str = "float32"
    conv_dtype: str = "bfloat16"
    speculative: str = "none"
    draft: DraftGeometry | None = None
    draft_layers: int | None = None  # DSPARK without `draft`: price its KV by layer count
    draft_tokens: int = 8
    replayssm: bool = False
    replayssm_cache_len: int = 16
    page_size: int = 64
    mem_fraction_static: float = 0.93
    max_running_requests: int | None = None
    max_mamba_cache_size: int | None = None
    radix_cache: bool = True
    draft_kv_dtype: str | None = None
    mamba_strategy: str = "extra_buffer"
    overlap_schedule: bool = True
    context_length: int | None = None
    language_model_only: bool = False
    mm_feature_transport: str = "cpu"


@dataclass(frozen=True)
class Sizing:
    """What one launch allocates per GPU. Byte fields are per rank.

    Invariants: `conv_state_bytes + ssm_state_bytes + replayssm_bytes + spec_state_bytes +
    kv_bytes + draft_kv_bytes <= budget_bytes - mm_reserved_bytes`;
    `max_running_requests <= max_mamba_cache_size // mamba_slots_per_request`;
    `logical_tokens == mla_rows_per_rank * dcp` (each DCP rank holds 1/dcp of every sequence).
    `running_limited_by` is "state" (K // slots), "kv" (rows // 2), "requested" (the flag, or
    48 under speculative decoding) or "estimate" (SGLang's default from rows / context).
    """

    ratio: float
    budget_bytes: int
    max_mamba_cache_size: int
    mamba_slots_per_request: int
    max_running_requests: int
    running_limited_by: str
    mla_rows_per_rank: int
    logical_tokens: int
    state_bytes_per_slot: int
    kv_bytes_per_row: int
    conv_state_bytes: int
    ssm_state_bytes: int
    replayssm_bytes: int
    kv_bytes: int
    draft_kv_bytes: int
    spec_state_bytes: int = 0
    mm_reserved_bytes: int = 0
    dcp: int = 1

    @property
    def state_bytes(self) -> int:
        return self.conv_state_bytes + self.ssm_state_bytes + self.replayssm_bytes \
            + self.spec_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.kv_bytes + self.draft_kv_bytes

    def to_dict(self) -> dict[str, Any]:
        """Every field, plus GiB figures rounded to 0.01 like SGLang's own log lines."""
        out = asdict(self)
        for name, value in (("conv_state", self.conv_state_bytes),
                            ("ssm_state", self.ssm_state_bytes),
                            ("replayssm", self.replayssm_bytes),
                            ("spec_state", self.spec_state_bytes), ("kv", self.kv_bytes),
                            ("draft_kv", self.draft_kv_bytes), ("state", self.state_bytes),
                            ("total", self.total_bytes), ("budget", self.budget_bytes),
                            ("mm_reserved", self.mm_reserved_bytes)):
            out[f"{name}_gib"] = round(value / GIB, 2)
        out["state_bytes"], out["total_bytes"] = self.state_bytes, self.total_bytes
        return out


def resolve_ssm_dtype(geometry: Geometry, flag: str | None, *, replayssm: bool = False) -> str:
    """`--mamba-ssm-dtype` as SGLang resolves it: the flag; else float32 under ReplaySSM
    (attention_hook.py:505-516); else the config's `mamba_ssm_dtype` for GDN models only
    (KDA's cache params never read the config: kimi_linear.py:180-189); else float32."""
    if flag is not None:
        return flag
    if not replayssm and geometry.linear_kind == "gdn" and geometry.ssm_dtype is not None:
        return geometry.ssm_dtype
    return "float32"


def slots_per_request(launch: Launch) -> int:
    """State slots one running request holds (`_calculate_mamba_ratio`, l.3062-3088): 1
    without the radix cache, else 3 + 2 (extra_buffer with overlap), + 1 (lazy or no
    overlap), + 0 (no_buffer)."""
    if not launch.radix_cache:
        return 1
    if launch.mamba_strategy == "no_buffer":
        return _BASE_SLOTS
    if launch.mamba_strategy == "extra_buffer_lazy" or not launch.overlap_schedule:
        return _BASE_SLOTS + 1
    return _BASE_SLOTS + 2


def mm_reservation_bytes(geometry: Geometry, launch: Launch) -> int:
    """Bytes a multimodal model keeps out of the pool budget (`mm_runtime_reservation_gb`)."""
    if not geometry.multimodal or launch.language_model_only:
        return 0
    extra = MM_FEATURE_CACHE_BYTES if launch.mm_feature_transport in ("cuda_ipc", "cuda_vmm") \
        else 0
    return VLM_CACHE_BYTES + extra


def state_bytes_per_slot(geometry: Geometry, launch: Launch) -> tuple[int, int, int]:
    """(conv, ssm, ReplaySSM ring) bytes per state slot on one rank, all linear layers.

    Shapes: KDA `KimiLinearStateShape` (mamba_utils.py:323-367): conv `(K-1, (Hv*dv + 2*Hk*dk)
    / tp)`, ssm `(Hv/tp, dv, dv)`; GDN `Mamba2StateShape` (l.193-241): conv `((dv*Hv + 2*G*dk)
    / tp, K-1)` with G key heads padded up to tp when tp does not divide them, ssm
    `(Hv/tp, dv, dk)`. The ring (l.127-157) is 0 without ReplaySSM; for GDN it is charged per
    request slot, not per state slot (`size_pools` does that).
    """
    _check_launch(geometry, launch)
    tp, g = launch.tp, geometry
    conv_b, ssm_b = STATE_DTYPES[launch.conv_dtype], STATE_DTYPES[launch.ssm_dtype]
    if g.linear_kind == "kda":
        hv = _divide(g.linear_v_heads, tp, "linear_attn_config.num_heads")
        proj = "linear_attn_config.num_heads * head_dim"
        conv_cols = _divide(g.linear_v_heads * g.linear_v_dim, tp, proj) \
            + 2 * _divide(g.linear_k_heads * g.linear_k_dim, tp, proj)
        conv = (g.conv_kernel - 1) * conv_cols
        ssm = hv * g.linear_v_dim * g.linear_v_dim
        hk, k_dim = -(-g.linear_k_heads // tp), g.linear_v_dim
    else:
        hv = _divide(g.linear_v_heads, tp, "linear_num_value_heads")
        groups = g.linear_k_heads
        if groups % tp:
            groups += tp - groups  # extra_groups_for_head_shards, mamba_utils.py:29-38
        conv_dim = g.linear_v_dim * g.linear_v_heads + 2 * groups * g.linear_k_dim
        conv = _divide(conv_dim, tp, "the GDN conv dimension") * (g.conv_kernel - 1)
        ssm = hv * g.linear_v_dim * g.linear_k_dim
        hk, k_dim = -(-g.linear_k_heads // tp), g.linear_k_dim
    ring = _ring_per_layer(g, launch, hv, hk, k_dim) if launch.replayssm else 0
    layers = g.linear_layers
    return conv * conv_b * layers, ssm * ssm_b * layers, ring * layers


def kv_bytes_per_row(geometry: Geometry, launch: Launch) -> int:
    """Bytes one KV row costs a rank: the target's full-attention layers (MLA latent
    `kv_lora_rank + qk_rope_head_dim`, or MHA `heads/(tp/dcp) * (head_dim + v_head_dim)`),
    plus, under DSPARK, the draft's dense K/V for the `dcp` tokens a row stands for."""
    return _target_cell(geometry, launch) + draft_cell_per_row(geometry, launch)


def draft_cell_per_row(geometry: Geometry, launch: Launch) -> int:
    """The DSPARK draft's share of a KV row; 0 without one.

    With the draft's geometry, SGLang's exact price (`_dflash_draft_cell_size` *
    attn_dcp_size, dflash_utils.py:121-134): `max(1, kv_heads // tp) * (head_dim + v_head_dim)
    * layers * dtype`, replicated on every rank for each of the `dcp` tokens of a row.
    Without it, the fallback `resolve_dflash_draft_cell_size` leaves callers on when it cannot
    resolve the draft (srt/mem_cache/draft_kv_budget.py:50-56): the target's cell scaled by
    layer count (`layer_scaled_cell`)."""
    _check_launch(geometry, launch)
    if launch.speculative == "none":
        return 0
    draft = launch.draft
    if draft is None:
        if launch.draft_layers is None:
            raise CalculatorError(
                "DSPARK prices its draft's KV from the draft's config or, without it, from the "
                "draft's layer count, and neither was given",
                "pass the draft's config.json (--draft-config), usually "
                "<model>/dspark/config.json, or its layer count (--draft-layers)",
                exit_code=EX_USAGE)
        target = _target_cell(geometry, launch)
        return layer_scaled_cell(target, geometry.full_layers,
                                 launch.draft_layers * launch.dcp) - target
    dtype = KV_DTYPES[launch.draft_kv_dtype or launch.kv_dtype]
    heads = max(1, draft.kv_heads // launch.tp)
    return heads * (draft.head_dim + draft.v_head_dim) * draft.layers * dtype * launch.dcp


def layer_scaled_cell(target_cell: int, target_layers: int, draft_layers: int) -> int:
    """Target + draft bytes per row when the draft's geometry is unknown, exactly as SGLang:
    `ceil(target_cell * (target_layers + draft_layers) / target_layers)`
    (`scale_kv_cell_size_per_token_for_dflash`, srt/speculative/dflash_utils.py:137-175, with
    no draft cell), where the caller passes the draft's layers times attn_dcp_size and the
    target's full-attention layers on this stage
    (srt/model_executor/pool_configurator.py:225-239, 316-338)."""
    if target_layers <= 0 or draft_layers <= 0:
        return target_cell
    return (target_cell * (target_layers + draft_layers) + target_layers - 1) // target_layers


def draft_pricing(launch: Launch) -> str | None:
    """How the draft's KV was priced, in words (None without speculative decoding)."""
    if launch.speculative == "none":
        return None
    if launch.draft is not None:
        draft = launch.draft
        heads = f"{draft.kv_heads} KV head" + ("" if draft.kv_heads == 1 else "s")
        return (f"draft KV priced from the draft's config ({draft.layers} layers, {heads} x "
                f"{draft.head_dim}+{draft.v_head_dim})")
    return ("draft KV priced as SGLang does without the draft's config: target cell x "
            f"(target layers + {launch.draft_layers} draft layers x DCP {launch.dcp}) / "
            "target layers")


def size_pools(geometry: Geometry, launch: Launch, budget_bytes: int, ratio: float) -> Sizing:
    """SGLang's pools for `budget_bytes` (available after weights minus the mem-fraction slack,
    per rank) and `--mamba-full-memory-ratio ratio`. Raises CalculatorError where SGLang fails."""
    if not (math.isfinite(ratio) and ratio > 0):
        raise CalculatorError(f"--mamba-full-memory-ratio {ratio} is not a positive number",
                              "give the state:KV memory ratio, e.g. 0.9 (SGLang's default)",
                              exit_code=EX_USAGE)
    if ratio > MAX_RATIO:
        raise CalculatorError(f"--mamba-full-memory-ratio {ratio:g} is above {MAX_RATIO:g}",
                              "give the state:KV memory ratio, e.g. 0.9 (SGLang's default); "
                              "the tuning chart shows the ratios that work",
                              exit_code=EX_USAGE)
    conv, ssm, ring = state_bytes_per_slot(geometry, launch)
    per_req = conv + ssm
    slots = slots_per_request(launch)
    requested = launch.max_running_requests
    spec = launch.speculative != "none"
    if spec and requested is None:
        requested = SPEC_DEFAULT_RUNNING
    gdn_ring = launch.replayssm and geometry.linear_kind == "gdn"
    fixed = ring * (max(1, requested or 1) + 1) if gdn_ring else 0
    extra = 0 if gdn_ring else ring
    draft_tokens = launch.draft_tokens
    reserves_spec_state = spec and not launch.replayssm
    mm = mm_reservation_bytes(geometry, launch)
    total_rest = budget_bytes / GIB - mm / GIB  # GiB floats, SGLang's order (l.3038)
    spec_state = 0

    if launch.max_mamba_cache_size is not None:
        k = launch.max_mamba_cache_size
        if reserves_spec_state:
            capped = min(max(1, requested or 1), k // slots)
            spec_state = per_req * (capped + 1) * draft_tokens
    elif not launch.radix_cache and requested is not None:
        k = max(1, requested)
        if reserves_spec_state:
            spec_state = per_req * (k + 1) * draft_tokens
    else:
        mamba_budget = total_rest * ratio / (1 + ratio) * GIB
        if reserves_spec_state:
            k = int((mamba_budget - per_req * (1 + draft_tokens) - extra)
                    // (per_req * (1 + draft_tokens / slots) + extra))
            capped = min(max(1, requested or 1), k // slots)
            spec_state = per_req * (capped + 1) * draft_tokens
        else:
            k = int((mamba_budget - fixed - (per_req + extra)) // (per_req + extra))
    total_rest -= spec_state / GIB
    if k <= 0:
        raise CalculatorError(
            "Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
            f"Computed max_mamba_cache_size={k} (total_rest_memory={total_rest:.2f} GB, "
            f"mamba_cache_per_req={per_req / MIB:.2f} MB)",
            "raise --mamba-full-memory-ratio or --mem-fraction-static, lower "
            "--max-running-requests, or use --mamba-ssm-dtype bfloat16")
    rest = total_rest - ((k + 1) * (per_req + extra) + fixed) / GIB
    if rest <= 0:
        raise CalculatorError(
            "Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={launch.mem_fraction_static}",
            "raise --mem-fraction-static, lower --mamba-full-memory-ratio or "
            "--max-mamba-cache-size")
    cell = kv_bytes_per_row(geometry, launch)
    rows = int(rest * GIB) // cell // launch.page_size * launch.page_size
    if rows <= 0:
        raise CalculatorError(
            "Not enough memory. Please try to increase --mem-fraction-static. Current value: "
            f"mem_fraction_static={launch.mem_fraction_static}",
            f"the KV pool got no whole page of {launch.page_size} rows: lower "
            "--mamba-full-memory-ratio or raise --mem-fraction-static")
    running, limited_by = _running_requests(geometry, launch, rows, k, slots, requested)
    draft_cell = draft_cell_per_row(geometry, launch)
    return Sizing(
        ratio=ratio, budget_bytes=budget_bytes, max_mamba_cache_size=k,
        mamba_slots_per_request=slots, max_running_requests=running,
        running_limited_by=limited_by, mla_rows_per_rank=rows,
        logical_tokens=rows * launch.dcp, state_bytes_per_slot=per_req + extra,
        kv_bytes_per_row=cell, conv_state_bytes=(k + 1) * conv,
        ssm_state_bytes=(k + 1) * ssm, replayssm_bytes=(k + 1) * extra + fixed,
        kv_bytes=rows * (cell - draft_cell), draft_kv_bytes=rows * draft_cell,
        spec_state_bytes=spec_state, mm_reserved_bytes=mm, dcp=launch.dcp)


def ratio_curve(geometry: Geometry, launch: Launch, budget_bytes: int,
                ratios: Sequence[float]) -> list[Sizing]:
    """`size_pools` at each ratio (in the order given); a ratio SGLang would refuse raises."""
    return [size_pools(geometry, launch, budget_bytes, r) for r in ratios]


# --- internals ------------------------------------------------------------------------------


def _running_requests(geometry: Geometry, launch: Launch, rows: int, k: int, slots: int,
                      requested: int | None) -> tuple[int, str]:
    if requested is not None:
        running, by = min(requested, rows // 2), "kv" if rows // 2 < requested else "requested"
    else:
        context = launch.context_length or geometry.context_length
        estimated = max(min(int(rows / context * 512), 4096), 2048)
        running, by = min(estimated, rows // 2), "kv" if rows // 2 < estimated else "estimate"
    if k // slots < running:
        running, by = k // slots, "state"
    if running <= 0:
        raise CalculatorError(
            "Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
            f"max_mamba_cache_size={k}, mamba_ratio={slots}, resulting max_num_reqs={running}",
            "raise --mamba-full-memory-ratio or --max-mamba-cache-size, or reduce "
            "--max-running-requests")
    return running, by


def _target_cell(geometry: Geometry, launch: Launch) -> int:
    _check_launch(geometry, launch)
    dtype = KV_DTYPES[launch.kv_dtype]
    if geometry.attention == "mla":
        return (geometry.kv_lora_rank + geometry.qk_rope_head_dim) * geometry.full_layers * dtype
    heads = max(1, geometry.kv_heads // (launch.tp // launch.dcp))
    per_layer = heads * (geometry.head_dim + geometry.v_head_dim)
    cell = per_layer * geometry.full_layers * dtype
    if launch.kv_dtype == "mxfp8":  # one scale byte per 32 elements (pool_configurator l.519)
        cell += per_layer * geometry.full_layers // 32
    return cell


def _ring_per_layer(geometry: Geometry, launch: Launch, hv: int, hk: int, k_dim: int) -> int:
    length, cb, v_dim = launch.replayssm_cache_len, STATE_DTYPES[launch.conv_dtype], \
        geometry.linear_v_dim
    if geometry.linear_kind == "kda":  # rawv, rawk, beta, vector g, d, k
        return (hv * length * v_dim * cb + hk * length * k_dim * cb + hv * length * 4
                + hv * length * k_dim * 4 + hv * length * v_dim * cb + hk * length * k_dim * cb)
    ring = hv * length * v_dim * cb + hk * length * k_dim * cb + hv * length * 4
    if launch.conv_dtype != "float32":  # the low parts of the d and k rings
        ring += hv * length * v_dim * cb + hk * length * k_dim * cb
    return ring


def _divide(numerator: int, tp: int, what: str) -> int:
    if numerator % tp:
        raise CalculatorError(f"{what} ({numerator}) is not divisible by --tp {tp}; SGLang "
                              "shards these heads evenly over the tensor-parallel ranks",
                              "choose a --tp that divides it", exit_code=EX_USAGE)
    return numerator // tp


def _check_launch(geometry: Geometry, launch: Launch) -> None:
    problems = [
        (launch.tp >= 1, f"--tp {launch.tp} must be at least 1"),
        (launch.dcp >= 1 and launch.tp % launch.dcp == 0,
         f"--dcp {launch.dcp} must divide --tp {launch.tp}"),
        (launch.kv_dtype in KV_DTYPES, f"--kv-dtype {launch.kv_dtype!r} is not one of "
         + ", ".join(KV_DTYPES) + " (fp4 KV is not modelled)"),
        (launch.draft_kv_dtype in (None, *KV_DTYPES),
         f"--draft-kv-dtype {launch.draft_kv_dtype!r} is not one of " + ", ".join(KV_DTYPES)),
        (launch.ssm_dtype in STATE_DTYPES, f"--ssm-dtype {launch.ssm_dtype!r} is not one of "
         + ", ".join(STATE_DTYPES)),
        (launch.conv_dtype in STATE_DTYPES, f"conv dtype {launch.conv_dtype!r} is not one of "
         + ", ".join(STATE_DTYPES)),
        (launch.speculative in SPECULATIVE, f"--spec {launch.speculative!r} is not one of "
         + ", ".join(SPECULATIVE)),
        (launch.mamba_strategy in MAMBA_STRATEGIES,
         f"mamba strategy {launch.mamba_strategy!r} is not one of " + ", ".join(MAMBA_STRATEGIES)),
        (launch.page_size >= 1, f"--page-size {launch.page_size} must be at least 1"),
        (launch.draft_tokens >= 2, f"draft tokens {launch.draft_tokens} must be at least 2 "
         "(gamma + 1)"),
        (launch.draft_layers is None or launch.draft_layers >= 1,
         f"--draft-layers {launch.draft_layers} must be at least 1"),
        (launch.replayssm_cache_len >= 1,
         f"--replayssm-cache-len {launch.replayssm_cache_len} must be at least 1"),
        (launch.max_running_requests is None or launch.max_running_requests >= 1,
         f"--max-running-requests {launch.max_running_requests} must be at least 1"),
        (launch.max_mamba_cache_size is None or launch.max_mamba_cache_size >= 1,
         f"--max-mamba-cache-size {launch.max_mamba_cache_size} must be at least 1"),
        (launch.context_length is None or launch.context_length >= 1,
         f"--context-length {launch.context_length} must be at least 1"),
    ]
    for ok, message in problems:
        if not ok:
            raise CalculatorError(message, "fix the flag and run again", exit_code=EX_USAGE)
