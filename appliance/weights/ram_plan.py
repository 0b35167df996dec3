"""The box's host-RAM plan: the weights' page-cache prewarm against SGLang's hierarchical cache
(a prefill member's prefix KV kept in host DRAM, issue 17). Pure.

Two things want the box's RAM:

- **The weights' page cache.** Before a launch the daemon reads every shard into the page
  cache when RAM holds the weights 1.25 times over (`hashing.should_prewarm`), so the
  engine's 80-minute load reads memory, and a later start finds them still cached.
- **The host cache** (`cell.hierarchical_cache` on a prefill box): pinned host memory that
  mirrors the GPU pools. SGLang 0.5.23 sizes it per rank as `--hicache-ratio` times that
  rank's device pools: the KV pool (`pool_host/base.py`: host tokens = device tokens x
  ratio) and, for a hybrid model such as K3, the recurrent-state pool too
  (`pool_host/mamba.py`, `hybrid_pool_assembler.build_mamba_host_pool`). Without the flag (our
  `cell.hicache_ratio = 0`) a prefill server takes ratio 2.0 (`arg_groups/hicache_hook.py`,
  `handle_hicache_ratio_default`, cache mode) and lowers it until every rank's host pools
  fit in `--hicache-host-memory-fraction` 0.8 of the host memory available after a 10 GiB
  reserve, less 5 % slack (`mem_cache/hicache_auto_size.py`, `pool_host/base.py`). An
  explicit ratio whose pools do not fit in that memory less the reserve is refused at
  startup ("Not enough host memory available ... reduce the size of the hierarchical
  cache").

The order decides who wins: SGLang allocates the host pools after the weights are on the
GPUs (`Scheduler.init_memory_pools` after `init_tp_model_worker`), so the prewarm still serves
the load; the pinned host cache then evicts whatever page cache it needs. What the plan
states is what each holds once the engine runs: the host cache, and what RAM is left for the
weights' pages (the rest go cold: the next start's prewarm reads them from disk again).
"Available" memory is taken as the RAM installed (the page cache counts as available, as
MemAvailable counts it); the engine's own processes and the daemon are inside the reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from appliance.sizes import bytes_text
from appliance.weights.hashing import should_prewarm

SGLANG_DEFAULT_RATIO = 2.0            # handle_hicache_ratio_default, cache mode
HOST_MEMORY_FRACTION = 0.8            # --hicache-host-memory-fraction default
HOST_RESERVE_BYTES = 10 * (1 << 30)   # HICACHE_HOST_MEMORY_RESERVE_BYTES
ALLOCATION_SLACK = 0.05               # hicache_auto_size._ALLOCATION_SLACK_FRACTION

Verdict = Literal["no_cache", "fits", "squeezed", "refused"]


@dataclass(frozen=True)
class HostCache:
    """The host cache SGLang would allocate: `bytes` over all ranks at the `ratio` it ends up
    with (`configured` None: SGLang's default, auto-sized), and how, in words (`basis`)."""

    bytes: int
    ratio: float
    configured: float | None
    basis: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def host_cache_size(device_pool_bytes: int, ranks: int, ratio: float | None,
                    ram_bytes: int) -> HostCache:
    """The host cache for GPU pools of `device_pool_bytes` per rank (KV and state, as SGLang
    mirrors them) on `ranks` ranks of one box; `ratio` None or <= 0 is SGLang's default
    (module docstring). Invariant: the default never exceeds 0.8 x 0.95 of RAM less the
    reserve; an explicit ratio is taken as given (the plan says when SGLang would refuse it)."""
    ranks = max(ranks, 1)
    device = max(device_pool_bytes, 0)
    pools = bytes_text(device * ranks)
    if ratio is not None and ratio > 0:
        return HostCache(int(ratio * device * ranks), ratio, ratio,
                         f"--hicache-ratio {ratio:g} x the GPU pools ({pools} of KV and "
                         "state over the GPUs)")
    budget = max(ram_bytes - HOST_RESERVE_BYTES, 0) // ranks * HOST_MEMORY_FRACTION
    effective = SGLANG_DEFAULT_RATIO
    if device > 0:
        effective = min(SGLANG_DEFAULT_RATIO, budget * (1 - ALLOCATION_SLACK) / device)
    effective = max(effective, 0.0)
    cut = ("" if effective >= SGLANG_DEFAULT_RATIO else
           f", lowered to {effective:.2f} to fit 80% of the RAM left after SGLang's 10 GiB "
           "reserve")
    return HostCache(int(effective * device * ranks), effective, None,
                     f"SGLang's default ratio {SGLANG_DEFAULT_RATIO:g} (cell.hicache_ratio "
                     f"unset){cut}, x the GPU pools ({pools} of KV and state over the GPUs)")


@dataclass(frozen=True)
class RamPlan:
    """What the RAM holds once the engine runs. `warm_bytes` of the weights stay in the page
    cache (`cold_bytes` do not); `prewarm` is whether a launch prewarms at all."""

    ram_bytes: int
    weights_bytes: int
    host_cache: HostCache | None
    warm_bytes: int
    cold_bytes: int
    prewarm: bool
    verdict: Verdict
    sentence: str

    @property
    def cold_percent(self) -> int:
        return _percent(self.cold_bytes, self.weights_bytes)

    def to_dict(self) -> dict[str, Any]:
        body = {k: v for k, v in self.__dict__.items() if k != "host_cache"}
        body["host_cache"] = self.host_cache.to_dict() if self.host_cache else None
        body["cold_percent"] = self.cold_percent
        return body


def plan_ram(ram_bytes: int, weights_bytes: int, host_cache: HostCache | None) -> RamPlan:
    """The plan in the operator's words (SI bytes, appliance.sizes): who gets what of the RAM.

    Verdicts: `no_cache` (no host cache: the prewarm has the RAM, when it is enough),
    `fits` (host cache and weights both stay), `squeezed` (the host cache leaves too little
    for every weight page: the rest go cold), `refused` (an explicit ratio larger than SGLang
    allows: the engine would not start). Invariant: warm + cold == weights."""
    ram, weights = max(ram_bytes, 0), max(weights_bytes, 0)
    prewarm = should_prewarm(weights, ram)
    r, w = bytes_text(ram), bytes_text(weights)
    room = max(ram - HOST_RESERVE_BYTES, 0)
    if host_cache is None or host_cache.bytes <= 0:
        words = (f"no host cache: the weights prewarm ({w}) has the {r} of RAM" if prewarm
                 else f"no host cache; {r} of RAM is less than 1.25 x the weights ({w}), so "
                 "no prewarm: the engine's load reads the disk")
        warm = min(weights, room)
        return RamPlan(ram, weights, host_cache, warm, weights - warm, prewarm, "no_cache",
                       words)
    h = bytes_text(host_cache.bytes)
    if host_cache.configured is not None and host_cache.bytes > room:
        return RamPlan(ram, weights, host_cache, min(weights, room), weights - min(weights, room),
                       prewarm, "refused",
                       f"host cache {h} is more than the {bytes_text(room)} SGLang allows of "
                       f"{r} RAM (it keeps 10 GiB back): the engine would refuse to start; "
                       "lower cell.hicache_ratio")
    left = max(room - host_cache.bytes, 0)
    if weights <= left:
        what = f"weights prewarm {w}" if prewarm else f"weights {w} (not prewarmed)"
        return RamPlan(ram, weights, host_cache, weights, 0, prewarm, "fits",
                       f"host cache {h}, {what} of {r} RAM: both fit")
    cold = weights - left
    return RamPlan(
        ram, weights, host_cache, left, cold, prewarm, "squeezed",
        f"host cache {h} leaves {bytes_text(left)} of {r} RAM for the weights' page cache: "
        f"{_percent(cold, weights)}% of the weights ({bytes_text(cold)}) go cold once the "
        "engine allocates it (after its load, so the prewarm still serves that load), and the "
        "next start reads them from disk again")


def _percent(part: int, whole: int) -> int:
    return round(100 * part / whole) if whole else 0
