"""`make demo`: the appliance as it exists today, on this machine, with a dev state dir.

A demo instrument, not production: it initialises `./.appliance/` (the `--dev` profile),
migrates the database, creates the bootstrap admin if there is none, prints how to log in
(including the one-time password, which production never prints), then runs `appliance serve`
in the foreground until Ctrl-C. Later issues add the engine emulator, weights and gateway
here, so `make demo` always shows everything that exists.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import struct
import sys
from pathlib import Path

from sqlalchemy.orm import Session

from appliance.auth.bootstrap import bootstrap_file, ensure_first_admin
from appliance.cli import main as cli_main
from appliance.cli import serve
from appliance.config import load_config
from appliance.db.database import Database
from appliance.engine.records import get_desired, list_runs, set_desired
from appliance.errors import ApplianceError
from appliance.testing.fake_gpus import FakeGpus

DEMO_SHARDS = 12
DEMO_SHARD_BYTES = 8 << 20


def ensure_demo_weights(model_dir: Path) -> None:
    """A tiny stand-in checkpoint (demo only): config.json plus small safetensors files the
    engine emulator reads, so bytes-read progress moves as it would on the real box."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = model_dir / "config.json"
    if not config.exists():
        config.write_text(json.dumps({"model_type": "kimi_k3", "note": "appliance demo stand-in"}))
    header = json.dumps({"__metadata__": {"format": "pt", "demo": "appliance"}}).encode()
    for i in range(DEMO_SHARDS):
        shard = model_dir / f"model-{i + 1:05d}-of-{DEMO_SHARDS:05d}.safetensors"
        if not shard.exists():
            shard.write_bytes(struct.pack("<Q", len(header)) + header
                              + os.urandom(DEMO_SHARD_BYTES))


def want_engine_running_once(db: Database, now: dt.datetime) -> None:
    """On the demo's first run, ask for the engine to run: the supervisor then starts the
    emulator when the daemon starts, exactly as it converges on a real box."""

    def apply(session: Session) -> None:
        if not list_runs(session, 1) and get_desired(session).updated_at is None:
            set_desired(session, running=True, at=now, by="demo")

    db.call(apply)


def main() -> int:
    if cli_main(["--dev", "migrate"]) != 0:
        return 1
    try:
        config = load_config(dev=True)
    except ApplianceError as exc:
        print(f"demo: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code
    db = Database(config.database_url)
    now = dt.datetime.now(dt.UTC)
    db.call(lambda s: ensure_first_admin(s, config.paths.state_dir, now))
    ensure_demo_weights(config.paths.models_dir / config.engine.model.replace("/", "--"))
    want_engine_running_once(db, now)
    db.dispose()
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
    lines += [
        "  Engine:   the Engine page starts the SGLang *emulator* (appliance.testing.fake_sglang)",
        "            on fake GPUs: a 90-minute K3 start plays in about a minute.",
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
        return serve(config, gpus=FakeGpus(state_file=gpu_state))
    except ApplianceError as exc:
        print(f"demo: {exc.as_text()}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
