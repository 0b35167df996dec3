"""What this box knows of itself for the cell: its engine as a router worker (the member's
peer status answers with it, and a head counts its own engine with it), a one-line GPU
summary, and which of a head's status reads the member audits.

- **The engine's address** is where the engine listens (`cell.listen_address`, else
  127.0.0.1) on `engine.port`; a prefill also gives its bootstrap port. A loopback address is
  reported as such (`reachable_from_cell` false): no other box can reach it.
- **Capacity** is the running engine's effective `max_running_requests`, summed over its
  data-parallel ranks from `/server_info` (appliance.gateway.engine_gate.engine_capacity),
  read once per engine run while it is READY.
- **Keys** are fingerprints (appliance.cell.engine_key): the key file's, and the key the
  engine accepts, reported only while it serves (before that the engine has not answered
  with this run's key).
"""

from __future__ import annotations

import statistics

from appliance.cell.engine_key import EngineKeys, fingerprint
from appliance.cell.layout import Layout, of_argv
from appliance.cell.router import worker_url
from appliance.cell.view import EngineFacts, GpuSummary
from appliance.config import Config, engine_host
from appliance.engine.states import SERVING, EngineState
from appliance.engine.supervisor import Supervisor
from appliance.gateway.engine_gate import engine_capacity
from appliance.gpu.port import GpuSnapshot
from appliance.secrets import read_engine_api_key

QUIET_PERIOD = 3600.0  # seconds between two audit entries for one head's status reads


class LocalEngine:
    def __init__(self, config: Config, supervisor: Supervisor, keys: EngineKeys) -> None:
        self.config, self.supervisor, self.keys = config, supervisor, keys
        self._capacity: tuple[int | None, int] | None = None  # (run id, capacity)

    @property
    def role(self) -> str:
        """The role the engine launches with: the head's choice, else the configuration's."""
        return self.supervisor.cell_role

    def layout(self) -> Layout:
        """The KV layout of the spec the engine's next launch uses (appliance.cell.layout)."""
        return of_argv(self.supervisor.current_spec().serve_args())

    async def _capacity_of(self, run_id: int | None) -> int | None:
        if self._capacity is not None and self._capacity[0] == run_id:
            return self._capacity[1]
        capacity = engine_capacity(await self.supervisor.client.server_info())
        if capacity is not None:  # an engine that did not say is asked again next time
            self._capacity = (run_id, capacity)
        return capacity

    async def facts(self) -> EngineFacts:
        status = self.supervisor.status
        role = self.role
        key = read_engine_api_key(self.config.paths.state_dir)
        ready = status.state is EngineState.READY
        return EngineFacts(
            role=role, state=status.state.value, message=status.message,
            url=worker_url(engine_host(self.config), self.config.engine.port),
            bootstrap_port=self.config.cell.bootstrap_port if role == "prefill" else None,
            capacity=await self._capacity_of(status.run_id) if ready else None,
            eta_seconds=status.eta_seconds, percent=status.percent,
            spec_hash=self.supervisor.running_spec_hash,
            key=fingerprint(key) if key else None,
            key_running=self.keys.running if status.state in SERVING else None)


def gpu_summary(snapshot: GpuSnapshot | None) -> GpuSummary | None:
    """The health monitor's last GPU reading in one line (None before its first, or when
    NVML did not answer)."""
    if snapshot is None or snapshot.error is not None:
        return None
    gpus = [g for g in snapshot.gpus if g.error is None]
    temperatures = [g.temperature_c for g in gpus if g.temperature_c is not None]
    utilization = [g.utilization_pct for g in gpus if g.utilization_pct is not None]
    return GpuSummary(
        count=len(snapshot.gpus), hottest_c=max(temperatures, default=None),
        utilization_pct=round(statistics.fmean(utilization), 1) if utilization else None,
        memory_used_bytes=sum(g.memory_used_bytes for g in gpus),
        memory_total_bytes=sum(g.memory_total_bytes for g in gpus))


class QuietReads:
    """Which of a head's status reads the member writes to its audit log: a head polls every
    few seconds, so the first read by a credential is audited, and then one read per
    `period` seconds, counting the reads it stands for. Refused reads are audited every time
    (appliance.cell.peer_auth); in memory, so a restarted daemon audits the next read."""

    def __init__(self, period: float = QUIET_PERIOD) -> None:
        self.period = period
        self._last: dict[str, tuple[float, int]] = {}  # prefix -> (audited at, reads since)

    def due(self, prefix: str, now: float) -> int | None:
        """The number of reads this audit entry stands for, or None: not audited."""
        last = self._last.get(prefix)
        if last is not None and now - last[0] < self.period:
            self._last[prefix] = (last[0], last[1] + 1)
            return None
        self._last[prefix] = (now, 0)
        return 1 + (last[1] if last else 0)
