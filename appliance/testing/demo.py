"""`make demo`: the appliance as it exists today, on this machine, with a dev state dir.

A demo instrument, not production: it initialises `./.appliance/` (the `--dev` profile),
migrates the database, creates the bootstrap admin if there is none, prints how to log in
(including the one-time password, which production never prints), starts a fake Hugging Face
Hub (a child process serving a generated checkpoint) for the weights to be pulled from, then
runs `appliance serve` in the foreground until Ctrl-C. On the first run it asks for the
weights and for the engine, so the daemon pulls and proves the weights and then starts the
engine emulator by itself, as a fresh box does. Beside the daemon it runs the gateway
(`appliance gateway`, a child process, as its own unit would be) with three demo API keys,
and a few pretend users (`appliance.testing.demo_traffic`) chatting through it, so the
Usage page and the rewrite rates have something to show. Later issues add their parts here,
so `make demo` always shows everything that exists.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.orm import Session

from appliance.auth.bootstrap import bootstrap_file, ensure_first_admin
from appliance.cli import main as cli_main
from appliance.cli import serve
from appliance.config import DEV_ROOT, engine_url, load_config
from appliance.db.database import Database
from appliance.engine.records import get_desired, list_runs, set_desired
from appliance.engine.runner import ProcessRunner
from appliance.errors import ApplianceError
from appliance.gateway.keys import create_key, list_keys
from appliance.secrets import server_secret, write_private
from appliance.testing.checkpoint import write_checkpoint
from appliance.testing.demo_accounts import VIEWER, demo_viewer
from appliance.testing.demo_curl import curl_example
from appliance.testing.demo_health import HOT_CELSIUS, HOT_GPU, hot_gpu_episode, webhook_sink
from appliance.testing.fake_gpus import FakeGpus, metrics_activity
from appliance.weights import records as weights_records

DEMO_MODEL = "moonshotai/Kimi-K3"
HUB_ENV = "APPLIANCE_WEIGHTS_ENDPOINT"

DEMO_REPO_SHARDS = 12
DEMO_SHARD_BYTES = 8 << 20
# The fake Hub serves each connection at 1 MB/s, so the ~100 MB "download" takes about
# 15 s with 8 at once, and one shard stalls once, so the watchdog and the resume show too.
# One fake GPU runs hot for a while, so a warning and its recovery show (demo_health).
HOT_AFTER, HOT_LASTS = 240, 180  # seconds
DEMO_HUB_FAULTS = ("rate:1000000", "stall:model-00003-of-00012.safetensors:3MiB:3600")


def ensure_demo_repo(folder: Path) -> None:
    """A small generated checkpoint in K3's layout for the fake Hub to serve (demo only)."""
    if not (folder / "model.safetensors.index.json").exists():
        write_checkpoint(folder, shards=DEMO_REPO_SHARDS, shard_bytes=DEMO_SHARD_BYTES)


@contextlib.contextmanager
def fake_hub(repo_id: str, folder: Path) -> Iterator[str]:
    """The fake Hugging Face Hub (a test and demo instrument) as a child process; its URL."""
    command = [sys.executable, "-m", "appliance.testing.fake_hub", "--repo",
               f"{repo_id}={folder}", "--port", "0"]
    for fault in DEMO_HUB_FAULTS:
        command += ["--fault", fault]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if "listening on" not in line:
            raise ApplianceError("demo_hub", "the fake Hub did not start",
                                 "run `python -m appliance.testing.fake_hub --help`")
        yield line.split("listening on", 1)[1].strip()
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def want_weights_once(db: Database, now: dt.datetime) -> None:
    """On the demo's first run, ask for the weights: the daemon starts the pull by itself,
    as it resumes any pull after a restart."""

    def apply(session: Session) -> None:
        control = weights_records.get_control(session)
        if control.active_set_id is None and not control.job:
            weights_records.set_control(session, at=now, by="demo", job="pull",
                                        job_args={"repo": DEMO_MODEL, "revision": "main",
                                                  "endpoint": os.environ[HUB_ENV]})

    db.call(apply)


def want_engine_running_once(db: Database, now: dt.datetime) -> None:
    """On the demo's first run, ask for the engine to run: the supervisor then starts the
    emulator when the daemon starts, exactly as it converges on a real box."""

    def apply(session: Session) -> None:
        if not list_runs(session, 1) and get_desired(session).updated_at is None:
            set_desired(session, running=True, at=now, by="demo")

    db.call(apply)


DEMO_USERS = ("chat", "agent", "summariser")


def demo_keys(db: Database, state_dir: Path, now: dt.datetime) -> Path:
    """Three demo API keys, created once; their plaintext is kept in a 0600 file because the
    demo prints one and its traffic uses them (production shows a key once, never stores
    it)."""
    path = state_dir / "demo-api-keys.json"
    names = {k.name for k in db.call(list_keys) if k.revoked_at is None}
    if path.exists() and names >= set(DEMO_USERS):
        return path
    secret = server_secret(state_dir)
    def create(session: Session) -> dict[str, str]:
        return {name: create_key(session, secret, name=name, owner="demo", by="demo",
                                 now=now)[0] for name in DEMO_USERS}

    keys = db.call(create)
    write_private(path, json.dumps(keys).encode())
    return path


@contextlib.contextmanager
def children(gateway_url: str, keyfile: Path) -> Iterator[None]:
    """The gateway and the demo traffic, as child processes for as long as the daemon runs."""
    processes = [
        subprocess.Popen([sys.executable, "-m", "appliance", "--dev", "gateway"]),
        subprocess.Popen([sys.executable, "-m", "appliance.testing.demo_traffic", gateway_url,
                          str(keyfile)]),
    ]
    try:
        yield
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=70)


def main() -> int:
    if cli_main(["--dev", "migrate"]) != 0:
        return 1
    repo_folder = DEV_ROOT.absolute() / "fake-hub" / DEMO_MODEL.replace("/", "--")
    ensure_demo_repo(repo_folder)
    alerts = DEV_ROOT.absolute() / "demo-webhook.jsonl"
    with fake_hub(DEMO_MODEL, repo_folder) as hub_url, webhook_sink(alerts) as webhook_url:
        os.environ[HUB_ENV] = hub_url
        os.environ.setdefault("APPLIANCE_WEIGHTS_STALL_SECONDS", "10")
        os.environ.setdefault("APPLIANCE_WEIGHTS_RESERVE_GIB", "1")
        os.environ.setdefault("APPLIANCE_HEALTH_WEBHOOK_URL", webhook_url)
        return run_demo(hub_url, alerts)


def run_demo(hub_url: str, alerts: Path) -> int:
    try:
        config = load_config(dev=True)
    except ApplianceError as exc:
        print(f"demo: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code
    db = Database(config.database_url)
    now = dt.datetime.now(dt.UTC)
    db.call(lambda s: ensure_first_admin(s, config.paths.state_dir, now))
    want_weights_once(db, now)
    want_engine_running_once(db, now)
    keyfile = demo_keys(db, config.paths.state_dir, now)
    viewer_password = demo_viewer(db, config.paths.state_dir, now)
    db.dispose()
    gateway_url = f"http://{config.gateway.host}:{config.gateway.port}"
    chat_key = json.loads(keyfile.read_text())["chat"]
    server = config.server
    credential = bootstrap_file(config.paths.state_dir)
    lines = [
        "",
        "  Kimi K3 appliance — demo (state in ./.appliance/; delete it to start over)",
        f"  Console:  http://{server.host}:{server.port}/",
        f"  API:      http://{server.host}:{server.port}/api/v1/schema/openapi.json",
    ]
    if credential.exists():
        lines += [
            "  Log in with the one-time credential (you will choose a new password):",
            *("      " + line for line in credential.read_text().splitlines()
              if not line.startswith("#")),
        ]
    else:
        lines.append("  Log in as the admin whose password you chose earlier "
                     "(forgot it? .venv/bin/appliance --dev admin reset-password --username admin)")
    lines.append(f"  Roles:    log in as {VIEWER} / {viewer_password} to see what a viewer sees "
                 "(no action; the API answers 403)")
    running = ProcessRunner(config.paths.state_dir).find()
    if running is not None:
        lines += [
            f"  Engine:   the emulator a previous `make demo` started is still running (pid "
            f"{running.pid}):",
            "            this demo adopts it, as the daemon adopts a real engine; nothing is "
            "restarted.",
        ]
    lines += [
        f"  Weights:  pulled from a *fake* Hugging Face Hub at {hub_url} (a demo instrument",
        "            serving a generated 100 MB checkpoint slowly, with one stalled shard); watch",
        "            the Weights page: every file is hashed as it arrives, then proven.",
        "  Engine:   the Engine page starts the SGLang *emulator* (appliance.testing.fake_sglang)",
        "            on fake GPUs: a 90-minute K3 start plays in about a minute. It waits for",
        "            the weights to be proven, then starts by itself.",
        f"  Gateway:  {gateway_url}/v1 (OpenAI-compatible; `appliance gateway`), for example:",
        *curl_example(gateway_url, chat_key),
        "            Three pretend users (demo_traffic) chat through it once the engine is",
        "            ready: see the Usage and API keys pages (\"summariser\" rewrites its",
        "            history, so its rewrite rate is high).",
        "  Health:   the dashboard and the Health page show every GPU, engine and host check;",
        f"            about {HOT_AFTER // 60} minutes in, fake GPU {HOT_GPU} runs at "
        f"{HOT_CELSIUS:.0f} °C for {HOT_LASTS // 60} minutes (a demo",
        "            episode): its warning and recovery are recorded once each, in Events and",
        f"            POSTed to a demo webhook receiver that writes {alerts}.",
        "            `.venv/bin/appliance --dev doctor` runs every check once from a shell (it",
        "            reads the real NVML: with no NVIDIA driver here it says so, CRITICAL).",
        "  Cell:     this box serves alone; `make demo-cell` shows a cell of three boxes here",
        "            (a prefill head, two decode members, SGLang's real router): docs/cell.md.",
        "  Stop with Ctrl-C (the emulated engine keeps running, as a real one would; the next",
        "  `make demo` adopts it; stop it from the Engine page).",
        "",
    ]
    print("\n".join(lines), flush=True)
    # The engine emulator stands in for SGLang (dev profile) and these fake GPUs follow the
    # memory it reports, so the whole lifecycle can be watched without a GPU.
    gpu_state = config.paths.state_dir / "fake-gpus.json"
    os.environ.setdefault("FAKE_SGLANG_GPU_STATE", str(gpu_state))
    os.environ.setdefault("FAKE_SGLANG_LOAD_SECONDS", "60")
    try:
        # Busy as the engine is (its /metrics), not as full as its memory: idle when idle.
        gpus = FakeGpus(state_file=gpu_state,
                        activity=metrics_activity(f"{engine_url(config)}/metrics"))
        with children(gateway_url, keyfile), hot_gpu_episode(
                gpus, after_seconds=HOT_AFTER, lasts_seconds=HOT_LASTS):
            return serve(config, gpus=gpus)
    except ApplianceError as exc:
        print(f"demo: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code
    finally:
        print(farewell(config.paths.state_dir), flush=True)


def farewell(state_dir: Path) -> str:
    """What the demo leaves running when it ends, and how to stop it (said on Ctrl-C)."""
    engine = ProcessRunner(state_dir).find()
    done = "demo stopped: the console, the gateway and the demo traffic have ended."
    if engine is None:
        return f"{done} No engine emulator is running."
    return (f"{done}\nStill running, by design: the engine emulator (pid {engine.pid}), as a "
            "real engine outlives its daemon; the next `make demo` adopts it.\nTo stop it: "
            f"`kill {engine.pid}` (it drains and exits), or stop it from the Engine page of "
            "the next `make demo`.")


if __name__ == "__main__":
    raise SystemExit(main())
