"""A head's cell on the control plane's `GET /metrics`: appended to the daemon's own
exposition (appliance.health.metrics_route), written only on a box that has members.

Follows the exposition's conventions (appliance.health.metrics_out): `appliance_` names,
gauges only, an unknown value left out rather than sent as 0, low-cardinality labels (a
role; an engine as `member-ID` or `head`, never an address):

- `appliance_cell_active`, `appliance_cell_serving`: the head's watch's verdicts;
- `appliance_cell_engines{role}`, `appliance_cell_engines_ready{role}`: prefill and decode
  engines (the head's own included) and how many the router can use now;
- `appliance_cell_capacity_requests`, `appliance_cell_capacity_total_requests`: running
  requests the ready decode engines admit, and with every decode engine ready;
- `appliance_cell_router_up`: whether the router's metrics port answered;
- `appliance_cell_router_worker_healthy{engine}`, `…_circuit_open{engine}`,
  `…_running_requests{engine}`: the router's view of each engine;
- `appliance_cell_rolling_restart_running`.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from appliance.cell.ops import HEAD_KEY, CellOps
from appliance.cell.rolling import Progress
from appliance.cell.router_metrics import RouterReading, worker_for
from appliance.cell.view import PD_ROLES, READY, CellView


def _gauge(name: str, doc: str, value: float | None = None,
           labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels) or None)
    if value is not None:
        family.add_metric([], float(value))
    return family


def cell_families(view: CellView, router: RouterReading | None,
                  rolling: Progress | None) -> list[Metric]:
    engines = GaugeMetricFamily("appliance_cell_engines", "Prefill and decode engines of the "
                                "cell, the head's own included", labels=["role"])
    ready = GaugeMetricFamily("appliance_cell_engines_ready", "Engines of the role the "
                              "router can use now", labels=["role"])
    own = view.own
    for role in PD_ROLES:
        members = [m for m in view.members if m.role == role]
        mine = own.role == role
        engines.add_metric([role], float(len(members) + mine))
        ready.add_metric([role], float(sum(m.ready for m in members)
                                       + (mine and own.state == READY)))
    families: list[Metric] = [
        _gauge("appliance_cell_active", "1 when the cell has a prefill and a decode engine",
               view.active),
        _gauge("appliance_cell_serving", "1 when the cell serves through its router",
               view.serving),
        engines, ready,
        _gauge("appliance_cell_capacity_requests", "Running requests the ready decode "
               "engines admit", view.capacity),
        _gauge("appliance_cell_capacity_total_requests", "Running requests the decode "
               "engines admit when every one is ready", view.capacity_total),
        _gauge("appliance_cell_router_up", "1 when the router's metrics port answered",
               None if router is None else router.up),
        _gauge("appliance_cell_rolling_restart_running", "1 while a rolling restart runs",
               rolling is not None and rolling.state == "running"),
    ]
    scrape = router.scrape if router is not None else None
    if scrape is not None:
        healthy = _gauge("appliance_cell_router_worker_healthy", "1 when the router's health "
                         "checks pass for the engine", labels=("engine",))
        circuit = _gauge("appliance_cell_router_worker_circuit_open", "1 while the router's "
                         "circuit breaker keeps requests from the engine", labels=("engine",))
        running = _gauge("appliance_cell_router_worker_running_requests", "Requests running "
                         "through the router on the engine", labels=("engine",))
        named: list[tuple[str, tuple[str | None, ...]]] = [
            (f"member-{m.id}", (m.worker_url, m.engine_url)) for m in view.members]
        named.append((HEAD_KEY, (own.url,)))
        for key, urls in named:
            figures = worker_for(scrape, urls)
            if figures is None:
                continue
            if figures.healthy is not None:
                healthy.add_metric([key], float(figures.healthy))
            if figures.circuit is not None:
                circuit.add_metric([key], float(figures.circuit == "open"))
            if figures.running is not None:
                running.add_metric([key], float(figures.running))
        families += [healthy, circuit, running]
    return families


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


async def cell_exposition(ops: CellOps) -> bytes:
    """The cell's families in Prometheus text, or nothing on a box with no members."""
    view = await ops.view()
    if not view.members:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(cell_families(view, await ops.read_router(view), ops.rolling)))
    return generate_latest(registry)
