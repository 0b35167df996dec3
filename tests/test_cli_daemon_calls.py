"""A daemon-backed CLI command leaves nothing behind and says where it looked.

Each call mints a short-lived token; it is deleted when the call ends (before, each call left
a revoked "cli root" token in the list for ever), and expired ones a killed command left are
swept too. A daemon that does not answer is named by the address tried and the configuration
it came from, with how to point the command elsewhere. Real subprocesses, a real SQLite."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin
from appliance.auth.tokens import create_token
from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.models import ApiToken
from appliance.db.schema import migrate
from appliance.resources import migrations_dir
from appliance.secrets import server_secret
from tests.conftest import free_port, run_cli
from tests.test_server import write_config


def test_an_unreachable_daemon_is_named_and_no_token_is_left(tmp_path: Path) -> None:
    path = write_config(tmp_path / "box", port=free_port())  # nothing listens there
    config = load_config(path, env={})
    db = Database(config.database_url)
    now = dt.datetime.now(dt.UTC)
    migrate(db, migrations_dir(), config.paths.state_dir / "backups", now)
    secret = server_secret(config.paths.state_dir)

    def seed(s: Session) -> None:
        admin = create_admin(s, "alice", "a long enough password", now)
        create_token(s, secret, admin, "cli root", now - dt.timedelta(hours=3),
                     now - dt.timedelta(hours=2))  # left by a command killed mid-call
        create_token(s, secret, admin, "grafana", now)

    db.call(seed)
    done = run_cli("--config", str(path), "engine", "status")
    assert done.returncode == 75, done.stderr
    assert f"does not answer at http://127.0.0.1:{config.server.port}" in done.stderr
    assert str(path) in done.stderr and "--config" in done.stderr
    names = db.call(lambda s: [t.name for t in s.scalars(select(ApiToken))])
    assert names == ["grafana"]  # the call's own token and the stale one are gone
    db.dispose()
