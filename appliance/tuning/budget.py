"""The memory SGLang 0.5.23 gives its pools, per GPU: measured from a startup log, or estimated.

SGLang's budget (`_profile_available_bytes`, `srt/mem_cache/kv_cache_configurator.py:2990-3060`)
is `available - pre_model_load * (1 - mem_fraction_static)`, in GiB floats:

- `available`: the least free memory over all ranks once target *and* draft weights are loaded
  (the scheduler sizes the pools after loading the draft). Its log form is the last
  `Load weight end. ... avail mem=X GB` a rank prints before its first pool line.
- `pre_model_load`: the least free memory over all ranks before any weight
  (`srt/distributed/bootstrap.py:193-223`), printed as `Load weight begin. avail mem=X GB`.

`calculator.size_pools` takes this figure and does the rest (the multimodal reservation, then
the split). The log prints every figure rounded to 0.01 GiB, so a measured budget is known to
`uncertainty_bytes` (±0.005 GiB on each of the two figures); `Budget.detail` says so in words.
`pool_budget_interval` turns the other way: the exact budgets that give a log's pool sizes.
Pure: the caller reads the log.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.engine.logparse import parse_text, split_runs
from appliance.errors import EX_DATAERR, ApplianceError
from appliance.tuning.calculator import (
    GIB,
    MIB,
    CalculatorError,
    Launch,
    kv_bytes_per_row,
    mm_reservation_bytes,
    state_bytes_per_slot,
)
from appliance.tuning.geometry import Geometry

# CUDA context, NCCL and allocator state already resident when the weights start to load: the
# sample K3 log's 266.93 GiB free against the 275,040 MiB NVML total of a B300 (fake_gpus).
DEFAULT_OVERHEAD_BYTES = 1700 * MIB
_HALF_CENT = 0.005  # GiB: half the last digit SGLang prints

_PREFIX = (r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d{1,6})?"
           r"(?P<parts>(?: [A-Z][A-Z_]{0,15}\d{1,6}){0,8})\] ?")
_NUM = r"(\d{1,9}(?:\.\d{1,6})?)"
_EVENT = re.compile(
    _PREFIX + r"(?:Load weight begin\. avail mem=" + _NUM + r" GB"
    r"|Load weight end\. [^\r\n]{0,400}?avail mem=" + _NUM + r" GB"
    r"|(Mamba Cache is allocated|KV Cache is allocated))"
)
_RANK = re.compile(r" TP(\d{1,6})\b")


class BudgetError(ApplianceError):
    """A budget that leaves nothing for the pools."""

    exit_code = EX_DATAERR

    def __init__(self, message: str, hint: str) -> None:
        super().__init__("budget_empty", message, hint, status=422)


@dataclass(frozen=True)
class Budget:
    """Bytes per GPU for the state and KV pools (before the multimodal reservation).

    `measured` is True when it came from a real startup; `detail` says how it was obtained, in
    words; `uncertainty_bytes` bounds the error from the log's rounding (0 for an estimate,
    whose error is its assumptions).
    """

    bytes: int
    measured: bool
    detail: str
    available_bytes: int | None = None
    pre_load_bytes: int | None = None
    mem_fraction_static: float | None = None
    uncertainty_bytes: int = 0

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "gib": round(self.gib, 3), "measured": self.measured,
                "detail": self.detail, "available_bytes": self.available_bytes,
                "pre_load_bytes": self.pre_load_bytes,
                "mem_fraction_static": self.mem_fraction_static,
                "uncertainty_bytes": self.uncertainty_bytes}


def budget_from_log(text: str, *, source: str = "the startup log",
                    mem_fraction_static: float | None = None) -> Budget | None:
    """The budget an SGLang startup log shows; None when its weight-load lines (or the
    `server_args` line's mem_fraction_static, unless given) are absent.

    Only the latest run of `text` counts (each launch appends to the same log). Ranks are
    reduced with `min`, as SGLang's all-reduce does. `source` names the log in `detail` (e.g.
    "the startup of run 12").
    """
    text = split_runs(text)[-1].text  # an appended log: the latest run's figures only
    mfs = mem_fraction_static
    if mfs is None:
        mfs = _float(parse_text(text).server_arg("mem_fraction_static"))
    if mfs is None or not 0 < mfs <= 1:
        return None
    pre: dict[int, float] = {}
    after: dict[int, float] = {}
    sized: set[int] = set()
    for match in _EVENT.finditer(text):
        rank_match = _RANK.search(match.group("parts") or "")
        rank = int(rank_match.group(1)) if rank_match else 0
        if rank in sized:
            continue
        begin, end, pool = match.group(2), match.group(3), match.group(4)
        if begin is not None:
            pre.setdefault(rank, float(begin))
        elif end is not None:
            after[rank] = float(end)  # the draft's end line, when there is one, wins
        elif pool is not None:
            sized.add(rank)
    if not pre or not after:
        return None
    pre_gib, avail_gib = min(pre.values()), min(after.values())
    slack_gib = pre_gib * (1 - mfs)
    value = avail_gib - slack_gib
    uncertainty = _HALF_CENT + _HALF_CENT * (1 - mfs)
    ranks = len(after)
    detail = (f"measured from {source}: {avail_gib:.2f} GiB free after loading weights "
              f"(least of {ranks} rank{'s' if ranks != 1 else ''}) minus the "
              f"--mem-fraction-static {mfs:g} slack {pre_gib:.2f} GiB x {1 - mfs:.2f} = "
              f"{slack_gib:.2f} GiB leaves {value:.2f} GiB for the pools; the log rounds to "
              f"0.01 GiB, so this is good to about ±{uncertainty:.3f} GiB")
    return Budget(int(value * GIB), True, detail, available_bytes=int(avail_gib * GIB),
                  pre_load_bytes=int(pre_gib * GIB), mem_fraction_static=mfs,
                  uncertainty_bytes=int(uncertainty * GIB))


def estimate_budget(gpu_total_bytes: int, weight_bytes_per_rank: int,
                    mem_fraction_static: float,
                    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> Budget:
    """A labelled estimate of the same figure before any startup: free memory before the
    weights is `gpu_total - overhead`; the weights (target and draft, per rank) come out of it.
    Raises BudgetError, in SGLang's words, when the weights leave nothing."""
    if not 0 < mem_fraction_static <= 1:
        raise BudgetError(f"--mem-fraction-static {mem_fraction_static} is outside (0, 1]",
                          "give a fraction such as 0.93")
    pre_gib = (gpu_total_bytes - overhead_bytes) / GIB
    avail_gib = pre_gib - weight_bytes_per_rank / GIB
    slack_gib = pre_gib * (1 - mem_fraction_static)
    value = avail_gib - slack_gib
    if value <= 0:
        minimum = 1 - avail_gib / pre_gib if pre_gib > 0 else 1.0
        raise BudgetError(
            "Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={mem_fraction_static} (estimated: {avail_gib:.2f} GiB "
            f"free after {weight_bytes_per_rank / GIB:.2f} GiB of weights per GPU)",
            f"raise --mem-fraction-static above {minimum:.3f}, or spread the weights over "
            "more GPUs")
    detail = (f"estimate: {gpu_total_bytes / GIB:.2f} GiB per GPU minus "
              f"{overhead_bytes / GIB:.2f} GiB runtime overhead minus "
              f"{weight_bytes_per_rank / GIB:.2f} GiB of weights leaves {avail_gib:.2f} GiB; "
              f"the --mem-fraction-static {mem_fraction_static:g} slack of {slack_gib:.2f} GiB "
              f"leaves {value:.2f} GiB for the pools (a real startup's log measures it)")
    return Budget(int(value * GIB), False, detail, available_bytes=int(avail_gib * GIB),
                  pre_load_bytes=int(pre_gib * GIB), mem_fraction_static=mem_fraction_static)


def pool_budget_interval(geometry: Geometry, launch: Launch, ratio: float, *,
                         max_mamba_cache_size: int, rows: int) -> tuple[int, int]:
    """The budgets (bytes, half-open `[low, high)`) for which SGLang allocates exactly
    `max_mamba_cache_size` slots and `rows` KV rows: how precisely a log's pool sizes pin the
    budget down; empty (`low >= high`) when no budget gives both. Plain launches only (no
    speculative state reserve, no explicit K, no GDN ReplaySSM request rings)."""
    if launch.speculative != "none" or launch.max_mamba_cache_size is not None \
            or not launch.radix_cache or (launch.replayssm and geometry.linear_kind == "gdn"):
        raise CalculatorError("pool_budget_interval inverts the plain ratio split only",
                              "drop speculative decoding and explicit slot counts")
    conv, ssm, ring = state_bytes_per_slot(geometry, launch)
    per_slot = conv + ssm + ring
    cell = kv_bytes_per_row(geometry, launch)
    state = (max_mamba_cache_size + 1) * per_slot
    mm = mm_reservation_bytes(geometry, launch)
    kv_low, kv_high = state + rows * cell, state + (rows + launch.page_size) * cell
    k_low = math.ceil((max_mamba_cache_size + 1) * per_slot * (1 + ratio) / ratio)
    k_high = math.ceil((max_mamba_cache_size + 2) * per_slot * (1 + ratio) / ratio)
    return max(kv_low, k_low) + mm, min(kv_high, k_high) + mm


# server_args key -> (Launch field or "ratio", parser). Values SGLang printed as None are skipped.
_LOGGED: dict[str, tuple[str, Callable[[str], Any]]] = {
    "tp_size": ("tp", int), "dcp_size": ("dcp", int), "kv_cache_dtype": ("kv_dtype", str),
    "mamba_ssm_dtype": ("ssm_dtype", str), "page_size": ("page_size", int),
    "mamba_full_memory_ratio": ("ratio", float),
    "max_running_requests": ("max_running_requests", int),
    "max_mamba_cache_size": ("max_mamba_cache_size", int),
    "speculative_algorithm": ("speculative", lambda v: v.lower()),
    "speculative_num_draft_tokens": ("draft_tokens", int),
    "speculative_draft_kv_cache_dtype": ("draft_kv_dtype", str),
    "enable_linear_replayssm_spec": ("replayssm", lambda v: v == "True"),
    "linear_replayssm_cache_len": ("replayssm_cache_len", int),
    "disable_radix_cache": ("radix_cache", lambda v: v != "True"),
    # the state slots a request takes depend on it (calculator.slots_per_request)
    "disable_overlap_schedule": ("overlap_schedule", lambda v: v != "True"),
    "mamba_radix_cache_strategy": ("mamba_strategy", str),
    "context_length": ("context_length", int),
    "mem_fraction_static": ("mem_fraction_static", float),
}


def settings_from_log(text: str) -> dict[str, Any]:
    """The sizing flags a startup log's `server_args` line states, keyed by `Launch` field
    (and "ratio"), parsed; flags the line leaves out or prints as None are absent. A strategy
    of "auto" is left out (the caller's resolution of it stands). Only the latest run of an
    appended log counts (`parse_text`'s default)."""
    state = parse_text(text)
    out: dict[str, Any] = {}
    for key, (field, convert) in _LOGGED.items():
        raw = state.server_arg(key)
        if raw is None or raw in ("None", "") or (key == "mamba_radix_cache_strategy"
                                                  and raw == "auto"):
            continue
        try:
            out[field] = convert(raw)
        except ValueError:
            continue
    return out


def _float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None
