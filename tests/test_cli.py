"""The `appliance admin` and `appliance token` commands, as real subprocesses; and any
command's output piped into a reader that leaves early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.auth.accounts import authenticate
from appliance.auth.tokens import list_tokens
from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.journal import list_audit
from tests.conftest import REPO, run_cli
from tests.test_server import write_config


@pytest.fixture
def box(tmp_path: Path) -> Path:
    config = write_config(tmp_path / "box")
    assert run_cli("--config", str(config), "migrate").returncode == 0
    return config


def database(config: Path) -> Database:
    return Database(load_config(config, env={}).database_url)


def test_admin_create_list_and_reset(box: Path) -> None:
    created = run_cli("--config", str(box), "admin", "create", "--username", "Ops",
                      "--password-stdin", input="a sturdy passphrase\n")
    assert created.returncode == 0, created.stderr
    assert "admin 'ops' created" in created.stdout
    listed = run_cli("--config", str(box), "admin", "list")
    head, row = listed.stdout.splitlines()
    assert head.split() == ["USERNAME", "ROLE", "CREATED", "STATE"]
    assert row.split()[:2] == ["ops", "admin"] and row.endswith("  active")
    assert row.index("admin") == head.index("ROLE")  # the columns line up under the header
    described = run_cli("admin", "--help").stdout
    for command, words in (("create", "add a console account"),
                           ("reset-password", "end its sessions"), ("list", "username, role"),
                           ("set-role", "another role")):
        assert command in described and words in described, described
    reset = run_cli("--config", str(box), "admin", "reset-password", "--username", "ops",
                    "--password-stdin", input="another sturdy one\n")
    assert reset.returncode == 0, reset.stderr
    db = database(box)
    assert db.call(lambda s: authenticate(s, "ops", "another sturdy one")) is not None
    assert db.call(lambda s: authenticate(s, "ops", "a sturdy passphrase")) is None
    actions = [(a.action, a.actor.startswith("cli:")) for a in
               db.call(lambda s: list_audit(s, action="admin.")).items]
    assert actions == [("admin.reset_password", True), ("admin.create", True)]
    db.dispose()


@pytest.mark.parametrize(("args", "stdin", "message"), [
    (["create", "--username", "x", "--password-stdin"], "long enough pass\n", "is not allowed"),
    (["create", "--username", "ops", "--password-stdin"], "short\n", "at least 12"),
    (["reset-password", "--username", "ghost", "--password-stdin"], "long enough pass\n",
     "no admin named 'ghost'"),
    (["create", "--username", "ops"], "", "pass --password-stdin"),
])
def test_admin_bad_input_is_explained_and_changes_nothing(
    box: Path, args: list[str], stdin: str, message: str
) -> None:
    result = run_cli("--config", str(box), "admin", *args, input=stdin)
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stderr.startswith("appliance: ")
    assert run_cli("--config", str(box), "admin", "list").stdout == ""


def test_duplicate_admin_is_refused(box: Path) -> None:
    args = ["--config", str(box), "admin", "create", "--username", "ops", "--password-stdin"]
    assert run_cli(*args, input="a sturdy passphrase\n").returncode == 0
    again = run_cli(*args, input="a different passphrase\n")
    assert again.returncode != 0
    assert "already exists" in again.stderr
    db = database(box)
    assert db.call(lambda s: authenticate(s, "ops", "a sturdy passphrase")) is not None
    db.dispose()


def test_token_create_list_revoke(box: Path) -> None:
    run_cli("--config", str(box), "admin", "create", "--username", "admin", "--password-stdin",
            input="a sturdy passphrase\n")
    created = run_cli("--config", str(box), "token", "create", "--name", "backup job",
                      "--expires-days", "30")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("apt_")
    assert "shown once" in created.stderr
    prefix = token.split("_")[1]
    listed = run_cli("--config", str(box), "token", "list").stdout
    assert f"{prefix}\tbackup job\towner admin\tactive" in listed
    assert token not in listed
    revoked = run_cli("--config", str(box), "token", "revoke", prefix)
    assert revoked.returncode == 0
    db = database(box)
    assert db.call(list_tokens)[0].revoked_at is not None
    db.dispose()


def test_token_for_unknown_owner_is_refused(box: Path) -> None:
    result = run_cli("--config", str(box), "token", "create", "--name", "x", "--owner", "ghost")
    assert result.returncode == 64
    assert "no admin named 'ghost'" in result.stderr


def test_commands_refuse_an_unmigrated_database(tmp_path: Path) -> None:
    config = write_config(tmp_path / "fresh")
    result = run_cli("--config", str(config), "admin", "list")
    assert result.returncode == 78
    assert "appliance migrate" in result.stderr


SAMPLE_LOG = REPO / "tests" / "data" / "engine_logs" / "k3_startup.sample.log"


def test_a_reader_that_left_ends_the_command_quietly() -> None:
    """`appliance ... --json | head -c 10`, with `head` already gone before the first write
    (so the broken pipe is certain, not a race): no traceback, the shell's SIGPIPE status."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "appliance", "engine", "parse-log",
                               str(SAMPLE_LOG), "--json"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_stdout_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a closed stdout is quiet: a broken socket inside a command is a real failure."""
    from appliance import cli
    from appliance.engine import cli as engine_cli

    def upstream_gone(path: Path, *, as_json: bool, run: int | str = "latest") -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(engine_cli, "parse_log", upstream_gone)
    with pytest.raises(BrokenPipeError):
        cli.main(["engine", "parse-log", str(SAMPLE_LOG), "--json"])
