"""The boxes of `make demo-cell` (appliance.testing.demo_cell), a demo instrument: where each
box lives and on which ports, what is prepared in its database before its daemon starts, and
the daemon itself (the child `python -m appliance.testing.demo_cell box NAME`).

Each box is a folder under the cell's root (`./.appliance-cell/NAME/`) holding its
`appliance.toml` (written once: the `--dev` profile's paths rooted at the folder, its ports
and its role; a re-run keeps the ports, so the head's members keep their addresses), its
state, models and logs. The CLI reaches a box with `appliance --dev --config
ROOT/NAME/appliance.toml ...` from any directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import os
import secrets
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin
from appliance.auth.bootstrap import bootstrap_file, ensure_first_admin
from appliance.auth.roles import Role
from appliance.cli import main as cli_main
from appliance.cli import serve
from appliance.clock import SystemClock
from appliance.config import Config, dev_paths, engine_url, load_config
from appliance.db.database import Database
from appliance.db.models import AdminUser
from appliance.engine.args import model_dir
from appliance.errors import ApplianceError
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.demo import demo_keys, want_engine_running_once
from appliance.testing.demo_accounts import demo_viewer
from appliance.testing.fake_gpus import FakeGpus, metrics_activity
from appliance.weights.importer import manifest_from_dir
from appliance.weights.service import WeightsService

CONFIG_FILE: Final = "appliance.toml"
# The boxes, with the ports `make demo-cell` asks for first (a taken one becomes a free one).
BOXES: Final = (("head", "prefill", 8080, 30000), ("decode-1", "decode", 8081, 30001),
                ("decode-2", "decode", 8082, 30002))
GATEWAY_PORT, BOOTSTRAP_PORT, ROUTER_PORT = 8000, 8998, 30100
# The demo's own admin account (its password is random and kept nowhere): the joins and the
# engine starts go through the daemons' API with short tokens of it, as the CLI's do, since
# the bootstrap admin may act only once its one-time password is changed.
DEMO_ADMIN: Final = "cell-demo"
# Smoke (tests): the daemons poll fast and the router checks its workers every second.
FAST_ROUTER: Final = {"health_interval_secs": 1, "health_failure_threshold": 1,
                      "health_success_threshold": 1}
FAST_POLLS: Final = {"engine_poll_seconds": 0.2, "cell_poll_seconds": 0.5}


# --- the layout (pure) --------------------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    name: str
    role: str
    directory: Path  # absolute
    console_port: int
    engine_port: int

    @property
    def config_path(self) -> Path:
        return self.directory / CONFIG_FILE

    @property
    def state_dir(self) -> Path:
        return dev_paths(self.directory)["state_dir"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.console_port}"


@dataclass(frozen=True)
class Layout:
    root: Path  # absolute
    boxes: tuple[Box, ...]  # the head first
    gateway_port: int
    bootstrap_port: int
    router_port: int

    @property
    def head(self) -> Box:
        return self.boxes[0]

    @property
    def members(self) -> tuple[Box, ...]:
        return self.boxes[1:]

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"


def plan_layout(root: Path, pick: Callable[[int], int]) -> Layout:
    """A new cell's boxes and ports; `pick(preferred)` gives the port to use (the preferred
    one when it is free, else another; 0 asks for any free port)."""
    boxes = tuple(Box(name, role, root / name, pick(console), pick(engine))
                  for name, role, console, engine in BOXES)
    return Layout(root, boxes, pick(GATEWAY_PORT), pick(BOOTSTRAP_PORT), pick(ROUTER_PORT))


def box_toml(layout: Layout, box: Box) -> str:
    """A box's appliance.toml: the `--dev` profile's paths rooted at the box's folder, its
    ports and its role. Every box names the head's gateway, bootstrap and router ports, so
    that no port of the cell repeats within any box's configuration."""
    paths = "\n".join(f"{key} = {json.dumps(str(path))}"
                      for key, path in dev_paths(box.directory).items())
    return (f"# {box.name} of the demo cell (`make demo-cell`): written once; delete "
            f"{layout.root} to start over.\n[paths]\n{paths}\n\n"
            f"[server]\nport = {box.console_port}\n\n[gateway]\nport = {layout.gateway_port}\n\n"
            f"[engine]\nport = {box.engine_port}\n\n[cell]\nrole = \"{box.role}\"\n"
            f"bootstrap_port = {layout.bootstrap_port}\nrouter_port = {layout.router_port}\n")


def read_layout(root: Path) -> Layout | None:
    """The cell an earlier run wrote (its ports stay, so the head's members keep their
    addresses), or None when a box's appliance.toml is missing."""
    boxes, tables = [], []
    for name, _, _, _ in BOXES:
        path = root / name / CONFIG_FILE
        if not path.exists():
            return None
        table = tomllib.loads(path.read_text())
        tables.append(table)
        boxes.append(Box(name, table["cell"]["role"], root / name, table["server"]["port"],
                         table["engine"]["port"]))
    head = tables[0]
    return Layout(root, tuple(boxes), head["gateway"]["port"], head["cell"]["bootstrap_port"],
                  head["cell"]["router_port"])


def port_picker(*, prefer: bool) -> Callable[[int], int]:
    """`pick(preferred)`: the preferred port if it is free and `prefer`, else a free one;
    never the same port twice."""
    taken: set[int] = set()

    def pick(preferred: int) -> int:
        port = preferred if prefer and preferred not in taken and port_free(preferred) else 0
        while port == 0 or port in taken:
            port = free_port()
        taken.add(port)
        return port

    return pick


def moved_ports(layout: Layout) -> list[str]:
    """The ports that were taken, so that others were chosen, in words."""
    asked = [("the gateway", GATEWAY_PORT, layout.gateway_port),
             ("the bootstrap", BOOTSTRAP_PORT, layout.bootstrap_port),
             ("the router", ROUTER_PORT, layout.router_port)]
    for box, (_, _, console, engine) in zip(layout.boxes, BOXES, strict=True):
        asked += [(f"{box.name}'s console", console, box.console_port),
                  (f"{box.name}'s engine", engine, box.engine_port)]
    return [f"{what} {wanted} → {got}" for what, wanted, got in asked if wanted != got]


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:`port`. SO_REUSEADDR as the daemons' servers set
    it: a connection of a demo that just ended, lingering in TIME_WAIT, does not count (`make
    demo-cell` right after `make demo` keeps :8080); a listener does."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- preparing each box (before its daemon starts) ----------------------------------------------

@dataclass(frozen=True)
class Login:
    """How to log in to a box's console: the one-time admin credential while it is unused."""

    one_time_password: str | None
    viewer_password: str


def box_config(box: Box) -> Config:
    return load_config(box.config_path, dev=True)


def prepare_box(layout: Layout, box: Box) -> Login:
    """Write the box's configuration (once), migrate its database, create its accounts, and
    give it proven weights; the head is asked to run its engine on the first start."""
    box.directory.mkdir(parents=True, exist_ok=True)
    if not box.config_path.exists():
        box.config_path.write_text(box_toml(layout, box))
    if cli_main(["--dev", "--config", str(box.config_path), "migrate"]) != 0:
        raise ApplianceError("demo_cell_migrate", f"{box.name}'s database did not migrate",
                             "see the lines above (a demo-cell already running on this "
                             f"folder must be stopped first); or delete {layout.root} to "
                             "start over")
    config = box_config(box)
    db = Database(config.database_url)
    now = dt.datetime.now(dt.UTC)
    try:
        db.call(lambda s: ensure_first_admin(s, config.paths.state_dir, now))
        viewer = demo_viewer(db, config.paths.state_dir, now)
        db.call(lambda s: ensure_demo_admin(s, now))
        prove_weights(config, db)
        if box is layout.head:
            want_engine_running_once(db, now)
            demo_keys(db, config.paths.state_dir, now)
    finally:
        db.dispose()
    credential = bootstrap_file(config.paths.state_dir)
    password = None
    if credential.exists():
        password = next((line.split(":", 1)[1].strip()
                         for line in credential.read_text().splitlines()
                         if line.startswith("password:")), None)
    return Login(password, viewer)


def ensure_demo_admin(session: Session, now: dt.datetime) -> None:
    if session.scalar(select(AdminUser.id).where(AdminUser.username == DEMO_ADMIN)) is None:
        create_admin(session, DEMO_ADMIN, secrets.token_urlsafe(24), now, role=Role.ADMIN)


def prove_weights(config: Config, db: Database) -> None:
    """A small checkpoint in the box's models folder, imported in place with its manifest
    through the real weights service (the engine starts only on proven weights); once."""
    folder = model_dir(config.paths.models_dir, config.engine.model)
    manifest = config.paths.models_dir.parent / "manifest.json"
    if not (folder / "model.safetensors.index.json").exists():
        write_checkpoint(folder, shards=4, shard_bytes=256 * 1024)
        manifest.write_text(manifest_from_dir(folder, config.engine.model).to_json())

    async def run() -> None:
        service = WeightsService(config, db, SystemClock())
        try:
            if not (await service.status()).ready_for_engine:
                await service.import_dir(folder, actor="demo", manifest_file=manifest)
                await service.wait_idle()
            view = await service.status()
        finally:
            await service.stop_service()
        if not view.ready_for_engine:
            raise ApplianceError("demo_cell_weights", f"the demo weights were not proven: "
                                 f"{view.message}", f"delete {folder.parent} and run again")

    asyncio.run(run())


# --- one box's daemon (the child) ---------------------------------------------------------------

def run_box(root: Path, name: str, *, fast: bool, metrics_port: int | None) -> int:
    """`appliance serve` for one box, with its own pretend GPUs: the fake GPU file its engine
    emulator writes (FAKE_SGLANG_GPU_STATE, inherited through ProcessRunner) and its FakeGpus
    read."""
    config = load_config(root / name / CONFIG_FILE, dev=True)
    gpu_state = config.paths.state_dir / "fake-gpus.json"
    os.environ["FAKE_SGLANG_GPU_STATE"] = str(gpu_state)
    router: dict[str, Any] = dict(FAST_ROUTER) if fast else {}
    if metrics_port is not None:  # the router's and the Cell page's (cell.router_metrics_port)
        config = dataclasses.replace(config, cell=dataclasses.replace(
            config.cell, router_metrics_port=metrics_port))
    polls: dict[str, Any] = dict(FAST_POLLS) if fast else {}
    gpus = FakeGpus(state_file=gpu_state,  # busy as its engine is, idle when idle
                    activity=metrics_activity(f"{engine_url(config)}/metrics"))
    return serve(config, gpus=gpus, router_options=router, **polls)
