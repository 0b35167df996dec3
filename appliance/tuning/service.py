"""The tuning service: the pure calculator fed with this box's facts, and the applied choice.

Facts: the model's geometry (its `config.json` in the models folder), the launch the engine
would get now (the supervisor's launch spec, so operator flags count), and the pool budget —
measured from the engine's last startup log when there was one, else estimated from GPU
memory, the weights' size and `--mem-fraction-static`, and labelled as an estimate.

The observed workload prefers the gateway's per-request records (exact lengths and
concurrency) once there are `MIN_RECORDS` successful generations since the engine's latest run
began (the last day when no run is recorded; the newest `MAX_RECORDS` of them); the engine
log's decode lines give the saturation, and the lengths when the records are too few.

Applying a choice records it (`tuning_choice`) and hands the supervisor the flags it adds to
the launch spec's tuning layer (`--mamba-full-memory-ratio`, and `--max-mamba-cache-size` for a
pin); the restart that makes it real is the operator's, now or in a maintenance window.

The box's cell role (the head's choice over `cell.role`, as the launch spec's role layer reads
it) decides what the split is sized for (appliance.tuning.roles): a prefill box for the few
requests it prefills at once, a decode or unified box for the profile's concurrency. A prefill
box with `cell.hierarchical_cache` also gets its RAM plan (appliance.weights.ram_plan): the
host cache its GPU pools imply against the weights' page cache; the same figure goes to the
weights service, whose prewarm before a launch states it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.clock import Clock
from appliance.config import Config
from appliance.db.database import Database
from appliance.db.models import UsageRequest
from appliance.engine.args import LaunchSpec, model_dir
from appliance.engine.logparse import split_runs
from appliance.engine.records import list_runs
from appliance.errors import ApplianceError
from appliance.gateway.usage import OK_OUTCOMES, UsageRecord, records_between
from appliance.gpu.port import GpuPort, snapshot_with_timeout
from appliance.tuning import store
from appliance.tuning.budget import Budget, budget_from_log, estimate_budget, settings_from_log
from appliance.tuning.calculator import Launch, resolve_ssm_dtype, size_pools
from appliance.tuning.geometry import Geometry, load_geometry
from appliance.tuning.observed import Advice, advise, observe
from appliance.tuning.profiles import LengthDistribution, Profile
from appliance.tuning.recommend import Capacity, CurvePoint, Recommendation, curve, recommend
from appliance.tuning.roles import RoleTarget, role_target
from appliance.weights.ram_plan import HostCache, RamPlan, host_cache_size, plan_ram

if TYPE_CHECKING:
    from appliance.engine.supervisor import Supervisor
    from appliance.weights.service import WeightsService

DEFAULT_PROFILE = "balanced"
K3_WEIGHT_BYTES = 1_560 * 10**9  # assumed before a manifest says how big the weights are
B300_BYTES = 288 * 10**9  # an estimate's GPU size when NVML cannot say (the box's B300s)
LOG_TAIL = 8 << 20  # the last startup is in the log's last few MiB
MIN_RECORDS = 50  # gateway records before they, not the log's decode lines, give the lengths
MAX_RECORDS = 20_000  # the newest ones: a page view reads a bounded number of rows
RECORDS_WINDOW = dt.timedelta(hours=24)  # how far back to look when no engine run is recorded
GENERATING = frozenset({"chat", "completions", "messages"})  # endpoints that hold KV


@dataclass(frozen=True)
class TuningView:
    """Everything the Tuning page and `GET /api/v1/tuning/` show for one profile."""

    profile: Profile
    budget: Budget
    geometry_summary: str
    launch: Launch
    current_ratio: float
    current: Capacity
    recommendation: Recommendation
    curve: list[CurvePoint]
    choice: store.Choice | None
    restart_needed: bool
    restart_cost: str
    problems: tuple[str, ...] = field(default=())
    observed: Advice | None = None  # gateway records and/or the engine log, since its start
    role: RoleTarget | None = None  # the cell role the split is sized for
    ram: RamPlan | None = None  # a prefill box's host cache against the weights' page cache

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.to_dict(), "budget": self.budget.to_dict(),
            "geometry": self.geometry_summary, "current_ratio": self.current_ratio,
            "current": self.current.to_dict(),
            "recommendation": self.recommendation.to_dict(),
            "curve": [p.to_dict() for p in self.curve],
            "choice": self.choice.to_dict() if self.choice else None,
            "restart_needed": self.restart_needed, "restart_cost": self.restart_cost,
            "problems": list(self.problems),
            "observed": self.observed.to_dict() if self.observed else None,
            "role": self.role.to_dict() if self.role else None,
            "ram_plan": self.ram.to_dict() if self.ram else None,
        }


@dataclass(frozen=True)
class RoleSizing:
    """This box's facts and its recommendation per cell role (`TuningService.by_role`)."""

    geometry: Geometry
    launch: Launch
    budget: Budget
    recommendations: dict[str, Recommendation]


class TuningService:
    """See the module docstring. Cheap to build; reads happen per call."""

    def __init__(self, config: Config, db: Database, clock: Clock, gpus: GpuPort,
                 supervisor: Supervisor, weights: WeightsService) -> None:
        self.config = config
        self.db = db
        self.clock = clock
        self.gpus = gpus
        self.supervisor = supervisor
        self.weights = weights

    async def start_service(self) -> None:
        """Give the supervisor the applied choice's flags before it builds any spec."""
        choice = await self.db.run(store.get_choice)
        self.supervisor.tuning_args = tuning_args(choice)
        self.weights.host_cache = self.host_cache  # the prewarm states the RAM plan with it

    # --- reads --------------------------------------------------------------------------------

    async def geometry(self) -> Geometry:
        path = model_dir(self.config.paths.models_dir, self.config.engine.model) / "config.json"
        return await asyncio.to_thread(load_geometry, path)

    def launch(self, geometry: Geometry, spec: LaunchSpec | None = None) -> Launch:
        """The sizing inputs of the spec the engine would be launched with now."""
        spec = spec or self.supervisor.current_spec()
        return launch_from_spec(spec, geometry, self.config)

    async def last_startup(self) -> str:
        """The engine log from its last start on ("" before any start)."""
        return await asyncio.to_thread(_last_startup, self.supervisor.log_path)

    async def budget(self, launch: Launch, startup: str | None = None) -> Budget:
        """Measured from `startup` (the last start's log, read here when not given), else
        estimated."""
        log_path = self.supervisor.log_path
        text = await self.last_startup() if startup is None else startup
        if text:
            measured = budget_from_log(text, source=f"the engine's last startup ({log_path})")
            if measured is not None:
                return measured
        snapshot = await asyncio.to_thread(snapshot_with_timeout, self.gpus, 5.0)
        totals = [g.memory_total_bytes for g in snapshot.gpus if g.memory_total_bytes]
        gpu_total = min(totals) if totals else B300_BYTES
        weights = await self.weights.status()
        per_rank = (weights.total_bytes or K3_WEIGHT_BYTES) // max(launch.tp, 1)
        budget = estimate_budget(gpu_total, per_rank, launch.mem_fraction_static)
        if not weights.total_bytes:
            budget = replace(budget, detail=budget.detail + "; no weights manifest is "
                             "recorded yet, so K3's 1.56 TB is assumed")
        return budget

    async def profiles(self) -> list[Profile]:
        return await self.db.run(store.list_profiles)

    def role(self) -> str:
        """The box's cell role for its next launch: the head's choice, else `cell.role`."""
        return self.supervisor.cell_role

    def role_target(self, role: str, profile: Profile, spec: LaunchSpec | None = None
                    ) -> RoleTarget:
        """What `role`'s split is sized for at `profile`, with the spec's
        `--chunked-prefill-size` when the operator set one."""
        chunk = _flag(spec or self.supervisor.current_spec(), "--chunked-prefill-size")
        return role_target(role, profile.lengths, profile.target_concurrency,
                           chunked_prefill=int(chunk) if chunk and chunk.isdigit() else None)

    async def profile(self, name: str | None = None, *,
                      choice: store.Choice | None = None) -> Profile:
        """A profile by name; None: the applied choice's (`choice`, when the caller has
        already read it), else "balanced"."""
        if name is None and choice is None:
            choice = await self.db.run(store.get_choice)
        chosen = name or (choice.profile if choice else DEFAULT_PROFILE)
        return await self.db.run(lambda s: store.find_profile(s, chosen))

    async def by_role(self, profile: Profile, roles: Sequence[str]) -> RoleSizing:
        """The recommendation a box like this one would get in each of `roles` (the cell
        plan's per-box capacities), on this box's geometry, launch and budget."""
        geometry = await self.geometry()
        spec = self.supervisor.current_spec()
        launch = self.launch(geometry, spec)
        budget = await self.budget(launch)
        current = _ratio_of(spec, self.config.engine.mamba_full_memory_ratio)

        def one(role: str) -> Recommendation:
            return recommend(geometry, launch, budget.bytes, profile.lengths,
                             target_concurrency=profile.target_concurrency,
                             current_ratio=current, role=self.role_target(role, profile, spec))

        recs = {role: await asyncio.to_thread(one, role) for role in roles}
        return RoleSizing(geometry, launch, budget, recs)

    async def host_cache(self) -> HostCache | None:
        """The host cache this box's next launch would allocate (None: not a prefill box with
        `cell.hierarchical_cache`, or its pools cannot be sized yet). Never raises: the prewarm
        calls it before a launch and only states the figure."""
        if self.role() != "prefill" or not self.config.cell.hierarchical_cache:
            return None
        try:
            geometry = await self.geometry()
            spec = self.supervisor.current_spec()
            launch = self.launch(geometry, spec)
            budget = await self.budget(launch)
            ratio = _ratio_of(spec, self.config.engine.mamba_full_memory_ratio)
            return await self._host_cache(geometry, launch, budget, ratio)
        except ApplianceError:
            return None

    async def _host_cache(self, geometry: Geometry, launch: Launch, budget: Budget,
                          ratio: float) -> HostCache:
        sizing = await asyncio.to_thread(size_pools, geometry, launch, budget.bytes, ratio)
        device = sizing.kv_bytes + sizing.draft_kv_bytes + sizing.conv_state_bytes \
            + sizing.ssm_state_bytes  # what SGLang's host pools mirror, per rank
        ram = await asyncio.to_thread(lambda: psutil.virtual_memory().total)
        return host_cache_size(device, launch.tp, self.config.cell.hicache_ratio or None, ram)

    async def ram_plan(self, geometry: Geometry, launch: Launch, budget: Budget,
                       ratio: float) -> RamPlan | None:
        """A prefill box's RAM plan (None for other roles); None too when its pools cannot be
        sized (the page states that problem already)."""
        if self.role() != "prefill":
            return None
        host = None
        if self.config.cell.hierarchical_cache:
            try:
                host = await self._host_cache(geometry, launch, budget, ratio)
            except ApplianceError:
                return None
        weights = (await self.weights.status()).total_bytes or K3_WEIGHT_BYTES
        ram = await asyncio.to_thread(lambda: psutil.virtual_memory().total)
        return plan_ram(ram, weights, host)

    async def view(self, profile: str | Profile | None = None) -> TuningView:
        """The figures for a profile: by name, an unsaved draft (a `Profile`), or None for
        the applied choice's profile (else "balanced")."""
        choice = await self.db.run(store.get_choice)
        chosen = profile if isinstance(profile, Profile) else await self.profile(
            profile, choice=choice)
        geometry = await self.geometry()
        spec = self.supervisor.current_spec()
        launch = self.launch(geometry, spec)
        startup = await self.last_startup()  # read once: budget and observed workload
        budget = await self.budget(launch, startup)
        current_ratio = _ratio_of(spec, self.config.engine.mamba_full_memory_ratio)
        role = self.role_target(self.role(), chosen, spec)
        rec = await asyncio.to_thread(
            lambda: recommend(geometry, launch, budget.bytes, chosen.lengths,
                              target_concurrency=chosen.target_concurrency,
                              current_ratio=current_ratio, role=role))
        # A prefill's chart shows its own limit (--max-running-requests at its concurrency).
        charted = launch if role.max_running_requests is None else replace(
            launch, max_running_requests=role.max_running_requests)
        points = await asyncio.to_thread(
            lambda: curve(geometry, charted, budget.bytes, chosen.lengths, _chart_ratios()))
        observed = await self.observed(geometry, launch, budget, current_ratio, startup)
        problems = [] if budget.measured else [
            "no engine startup has been measured on this box yet: the budget is an estimate "
            "(start the engine once and these figures come from its own log)"]
        return TuningView(
            profile=chosen, budget=budget, geometry_summary=describe_geometry(geometry),
            launch=launch, current_ratio=current_ratio, current=rec.current,
            recommendation=rec, curve=points, choice=choice,
            restart_needed=_restart_needed(choice, self.supervisor.running_spec_hash, spec),
            restart_cost=self.supervisor.start_cost(), problems=tuple(problems),
            observed=observed, role=role,
            ram=await self.ram_plan(geometry, launch, budget, current_ratio))

    async def observed(self, geometry: Geometry, launch: Launch, budget: Budget,
                       current_ratio: float, startup: str) -> Advice | None:
        """The workload this box really got since the engine's last start, and what it
        advises: from the gateway's records when there are `MIN_RECORDS` (with the log's
        saturation when it has decode lines), else from the log's `Decode batch` lines; None
        when neither has anything. With fewer than `tuning.min_observed_requests`
        observations it recommends nothing and says how many it has."""
        records = await self.db.run(lambda s: gateway_records(s, self.clock.now()))
        log_text = startup if "Decode batch" in startup else None
        enough = len(records) >= MIN_RECORDS
        if log_text is None and not enough:
            return None
        # Compare with the split the logged run really had, not the one a start would use.
        ran_with = settings_from_log(startup).get("ratio", current_ratio)
        try:
            workload = await asyncio.to_thread(
                lambda: observe(log_text=log_text, records=records if enough else None))
            if workload.samples == 0:
                return None
            if records and not enough:
                workload = replace(workload, source_note=(
                    f"{workload.source_note}; the gateway has recorded only {len(records)} "
                    f"requests in this run so far ({MIN_RECORDS} give exact lengths)"))
            # Below tuning.min_observed_requests the advice states the counts, not a ratio.
            needed = self.config.tuning.min_observed_requests
            return await asyncio.to_thread(lambda: advise(
                workload, geometry, launch, budget.bytes, float(ran_with),
                min_samples=needed))
        except ApplianceError:
            return None

    # --- writes -------------------------------------------------------------------------------

    async def save_profile(self, *, name: str, title: str, description: str,
                           lengths: LengthDistribution, target_concurrency: int, actor: str,
                           create: bool) -> Profile:
        now = self.clock.now()
        if create:
            stored = await self.db.run(lambda s: store.create_profile(
                s, name=name, title=title, description=description, lengths=lengths,
                target_concurrency=target_concurrency, at=now, by=actor))
        else:
            stored = await self.db.run(lambda s: store.update_profile(
                s, name, at=now, by=actor, title=title, description=description,
                lengths=lengths, target_concurrency=target_concurrency))
        return stored.profile

    async def delete_profile(self, name: str, *, actor: str) -> None:
        await self.db.run(lambda s: store.delete_profile(s, name))

    async def apply(self, *, profile: str, ratio: float, pin: int | None,
                    actor: str) -> store.Choice:
        """Record the split and give the supervisor its flags; the next start uses them."""
        geometry = await self.geometry()
        launch = replace(self.launch(geometry), max_mamba_cache_size=pin)
        budget = await self.budget(launch)
        # A split SGLang would refuse (no state slot, or nothing left for KV) is never recorded.
        await asyncio.to_thread(size_pools, geometry, launch, budget.bytes, ratio)
        now = self.clock.now()
        choice = await self.db.run(lambda s: store.set_choice(
            s, profile=profile, ratio=ratio, pin=pin, at=now, by=actor))
        self.supervisor.tuning_args = tuning_args(choice)
        spec_hash = self.supervisor.current_spec().spec_hash
        await self.db.run(lambda s: store.record_spec_hash(s, spec_hash))
        return await self.db.run(store.get_choice) or choice


def gateway_records(session: Session, now: dt.datetime) -> list[UsageRecord]:
    """The gateway's successful generations (`GENERATING` endpoints, outcome ok) since the
    engine's latest recorded run began (else the last `RECORDS_WINDOW`), the newest
    `MAX_RECORDS` of them, oldest first."""
    runs = list_runs(session, 1)
    since = runs[0].started_at if runs else now - RECORDS_WINDOW
    wanted = (UsageRequest.outcome.in_(OK_OUTCOMES), UsageRequest.endpoint.in_(GENERATING))
    # The start of the newest MAX_RECORDS: one indexed row, so the read below stays bounded.
    cutoff = session.scalar(
        select(UsageRequest.started_at).where(UsageRequest.started_at >= since, *wanted)
        .order_by(UsageRequest.started_at.desc()).offset(MAX_RECORDS - 1).limit(1))
    return [r for r in records_between(session, max(since, cutoff or since), now)
            if r.outcome in OK_OUTCOMES and r.endpoint in GENERATING]


# --- pure helpers -----------------------------------------------------------------------------


def tuning_args(choice: store.Choice | None) -> tuple[tuple[str, str | None], ...]:
    """The launch spec's tuning layer for an applied choice (empty: the configuration's)."""
    if choice is None:
        return ()
    args: list[tuple[str, str | None]] = [("--mamba-full-memory-ratio", repr(choice.ratio))]
    if choice.pin is not None:
        args.append(("--max-mamba-cache-size", str(choice.pin)))
    return tuple(args)


def launch_from_spec(spec: LaunchSpec, geometry: Geometry, config: Config) -> Launch:
    """The `Launch` a spec describes, read the way SGLang's `server_args` would print it."""
    values = []
    for arg in spec.args:
        key = arg.flag.lstrip("-").replace("-", "_")
        values.append(f"{key}=True" if arg.value is None else f"{key}={arg.value!r}")
    # The log parser reads stamped records only, as SGLang writes them.
    settings = settings_from_log(
        f"[1970-01-01 00:00:00] server_args=ServerArgs({', '.join(values)})")
    engine = config.engine
    replayssm = bool(settings.get("replayssm", False))
    return Launch(
        tp=settings.get("tp", engine.tp_size), dcp=settings.get("dcp", engine.dcp_size),
        kv_dtype=settings.get("kv_dtype", engine.kv_cache_dtype),
        ssm_dtype=resolve_ssm_dtype(geometry, settings.get("ssm_dtype"), replayssm=replayssm),
        speculative=settings.get("speculative", "dspark" if engine.speculative else "none"),
        replayssm=replayssm,
        page_size=settings.get("page_size", 64),
        mem_fraction_static=settings.get("mem_fraction_static", engine.mem_fraction_static),
        max_running_requests=settings.get("max_running_requests"),
        max_mamba_cache_size=settings.get("max_mamba_cache_size"),
        radix_cache=settings.get("radix_cache", True),
        context_length=settings.get("context_length"))


def describe_geometry(geometry: Geometry) -> str:
    attention = (f"{geometry.full_layers} MLA layers ({geometry.kv_lora_rank}+"
                 f"{geometry.qk_rope_head_dim} latent)" if geometry.attention == "mla" else
                 f"{geometry.full_layers} attention layers ({geometry.kv_heads} KV heads x "
                 f"{geometry.head_dim})")
    return (f"{geometry.model_type}: {geometry.linear_layers} {geometry.linear_kind.upper()} "
            f"layers ({geometry.linear_v_heads} heads x {geometry.linear_v_dim}, conv "
            f"{geometry.conv_kernel}) + {attention}; context {geometry.context_length:,} tokens")


def _flag(spec: LaunchSpec, flag: str) -> str | None:
    """The value of the spec's last `flag` (the last wins, as in SGLang's parser)."""
    values = [arg.value for arg in spec.args if arg.flag == flag and arg.value is not None]
    return values[-1] if values else None


def _ratio_of(spec: LaunchSpec, fallback: float) -> float:
    for arg in spec.args:
        if arg.flag == "--mamba-full-memory-ratio" and arg.value is not None:
            try:
                return float(arg.value)
            except ValueError:
                break
    return fallback


def _restart_needed(choice: store.Choice | None, running_hash: str | None,
                    spec: LaunchSpec) -> bool:
    """An applied choice the running engine was not started with."""
    if choice is None or running_hash is None:
        return False
    return running_hash != spec.spec_hash


def _chart_ratios(points: int = 61, low: float = 0.02, high: float = 50.0) -> Sequence[float]:
    step = (high / low) ** (1 / (points - 1))
    return [round(low * step**i, 4) for i in range(points)]


def _last_startup(path: Path) -> str:
    """The text of the log's newest run that logged its `server_args=` line (the newest
    startup), or "". A later launch refused before that line measured nothing, so the start
    before it still stands."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - LOG_TAIL))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    started = [run for run in split_runs(text) if run.launched]
    return started[-1].text if started else ""
