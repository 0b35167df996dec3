"""The support bundle: every secret planted in the state stays out of it, it indexes itself,
it is bounded, it needs no daemon, it is audited, and the console's button downloads it.

Real files, a real migrated SQLite, the real CLI as a subprocess (`python -m appliance
--config X support-bundle --out F`) with no daemon running; the console through the live
server.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from appliance.auth.accounts import create_admin
from appliance.auth.sessions import SessionPolicy, open_session
from appliance.auth.tokens import create_token
from appliance.config import SECTIONS, load_config
from appliance.db.database import Database
from appliance.db.journal import add_event, list_audit
from appliance.db.models import AdminUser
from appliance.db.schema import migrate
from appliance.engine.records import open_run, update_run
from appliance.gateway.keys import create_key
from appliance.ops.bundle import FILE_CAP, LOG_LINES, build, parse_since
from appliance.ops.cli import live_parts
from appliance.ops.redact import Redactor, for_box, secret_keys
from appliance.resources import migrations_dir
from appliance.runtime import Runtime
from appliance.secrets import engine_api_key, server_secret
from tests.conftest import PASSWORD, Console, add_admin, csrf, free_port, run_cli, wait_for

NOW = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
HUB_TOKEN = "hf_PlantedHubTokenAbcdefghijklmnop1234"
WEBHOOK = "https://hooks.example.com/services/T0PLANT/B0PLANT/PlantedWebhookSecret99"
ENGINE_PROMPT = "PLANTED ENGINE PROMPT about the quarterly merger"
DAEMON_PROMPT = "PLANTED DAEMON PROMPT with a patient's name"


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile()}


def _write_config(root: Path, **sections: dict[str, object]) -> Path:
    body: dict[str, dict[str, object]] = {
        "paths": {"state_dir": str(root / "state"), "models_dir": str(root / "models"),
                  "log_dir": str(root / "log")},
        "server": {"port": free_port()}, "gateway": {"port": free_port(), "host": "127.0.0.1"},
        "engine": {"runner": "process", "command": [sys.executable, "-m",
                                                    "appliance.testing.fake_sglang"]},
        "weights": {"token": HUB_TOKEN},
        "health": {"webhook_url": WEBHOOK},
    }
    for name, values in sections.items():
        body.setdefault(name, {}).update(values)

    def value(v: object) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(json.dumps(x) for x in v) + "]"
        return json.dumps(v)

    text = "".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items())
                   + "\n" for name, keys in body.items())
    path = root / "appliance.toml"
    path.write_text(text)
    return path


def _plant(root: Path) -> tuple[Path, dict[str, str]]:
    """A box with every kind of secret in its state and in its logs; returns the config file
    and the planted values by name."""
    path = _write_config(root)
    config = load_config(path, env={})
    state = config.paths.state_dir
    db = Database(config.database_url)
    migrate(db, migrations_dir(), state / "backups", NOW)
    secret = server_secret(state)
    policy = SessionPolicy(idle=dt.timedelta(hours=1), absolute=dt.timedelta(hours=12))

    def plant(s: Session) -> dict[str, str]:
        admin = create_admin(s, "alice", PASSWORD, NOW)
        key, _ = create_key(s, secret, name="ci", owner="bob", by="alice",
                            now=NOW)
        token, _ = create_token(s, secret, admin, "automation", NOW)
        cookie = open_session(s, admin, NOW, policy, address="10.0.0.9",
                              user_agent="test")
        pw_hash = s.scalar(select(AdminUser.password_hash))
        run = open_run(s, at=NOW, runner="process", spec_hash="abc123", spec_json="{}",
                       attempt=1, state="LOADING_WEIGHTS",
                       log_path=str(config.paths.log_dir / "engine.log"))
        # The state's own text can carry secrets too (a reason quoting a request, an event).
        update_run(s, run.id, phase=("FAILED", NOW), reason=f"crashed serving {key}",
                   exit_code=1)
        add_event(s, at=NOW, severity="warning", source="gateway",
                  message=f"refused token {token}", detail={"cookie": cookie})
        return {"gateway key": key, "admin token": token, "session": cookie,
                "password hash": str(pw_hash)}

    values = db.call(plant)
    db.dispose()
    values["server.key"] = (state / "secrets" / "server.key").read_text().strip()
    values["engine-api.key"] = engine_api_key(state)
    values["hub token"] = HUB_TOKEN
    values["webhook"] = WEBHOOK
    values["webhook secret"] = "PlantedWebhookSecret99"
    values["engine prompt"] = ENGINE_PROMPT
    values["daemon prompt"] = DAEMON_PROMPT

    (state / "engine").mkdir(parents=True, exist_ok=True)
    (state / "engine" / "launch-spec.json").write_text(json.dumps(
        {"argv": ["sglang", "serve"], "env": {"HF_TOKEN": HUB_TOKEN},
         "args": [{"flag": "--tp-size", "value": "8", "origin": "appliance"}]}))
    log_dir = config.paths.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    # A huge engine log (about 20 MB): the bundle keeps a bounded tail of it.
    filler = "".join(f"[2026-05-01 10:00:00 TP0] Load weight step {i:07d} " + "x" * 60 + "\n"
                     for i in range(1000))
    with (log_dir / "engine.log").open("w") as log:
        log.write("FIRST LINE OF THE ENGINE LOG\n")
        for _ in range(220):
            log.write(filler)
        log.write(f"[2026-05-01 11:59:00 TP0] Receive: obj=GenerateReqInput(rid='r1', "
                  f"text='{ENGINE_PROMPT}', sampling_params={{'max_new_tokens': 8}})\n")
        log.write(f"[2026-05-01 11:59:01] engine key in use {values['engine-api.key']}\n")
        log.write("LAST LINE OF THE ENGINE LOG\n")
    lines = [
        f'INFO appliance.gateway: body {{"model": "kimi-k3", "messages": [{{"role": "user", '
        f'"content": "{DAEMON_PROMPT}"}}]}}',
        f"DEBUG upstream: Authorization: Bearer {values['gateway key']}",
        f"DEBUG api: curl -H 'Authorization: Bearer {values['admin token']}' /api/v1/engine",
        f"DEBUG console: Cookie: appliance_session={values['session']}; appliance_csrf=x",
        f"DEBUG auth: stored {values['password hash']}",
        f"DEBUG secrets: server key {values['server.key']} engine key "
        f"{values['engine-api.key']}",
        f"DEBUG weights: token {HUB_TOKEN} and alerts to {WEBHOOK}",
        f"DEBUG gateway: key={values['gateway key']} token={values['admin token']}",
    ]
    (log_dir / "daemon.log").write_text("\n".join(lines) + "\n")
    return path, values


def test_cli_bundle_redacts_every_planted_secret_without_a_daemon(tmp_path: Path) -> None:
    config_path, planted = _plant(tmp_path)
    out = tmp_path / "out" / "bundle.tar.gz"

    done = run_cli("--config", str(config_path), "support-bundle", "--since", "3650d",
                   "--out", str(out), timeout=240)

    assert done.returncode == 0, done.stderr
    assert out.is_file() and (out.stat().st_mode & 0o077) == 0  # not for other users' eyes
    members = _members(out)
    for name, data in members.items():
        for what, value in planted.items():
            assert value.encode() not in data, f"{what} leaked into {name}"
    # What the bundle holds, and that the redacted parts are there (not merely absent).
    for expected in ("README.txt", "versions.txt", "config/settings.txt",
                     "config/appliance.toml", "engine/launch-spec.json", "engine/runs.json",
                     "logs/daemon.log", "health/transitions.json", "weights/status.json",
                     "tuning/state.json", "gateway/counters.json", "db/audit.json",
                     "host/resources.txt", "gpu/xid.txt"):
        assert expected in members, f"{expected} missing; have {sorted(members)}"
    daemon_log = members["logs/daemon.log"].decode()
    assert "[redacted: prompt text]" in daemon_log and "[redacted: gateway key]" in daemon_log
    runs = json.loads(members["engine/runs.json"])
    assert runs["runs"][0]["state"] == "FAILED"
    assert "[redacted: gateway key]" in runs["runs"][0]["reason"]
    assert json.loads(members["gateway/counters.json"])["keys"] == {"active": 1}
    assert "[redacted: Hub token]" in members["engine/launch-spec.json"].decode()
    # README: every file listed, every skipped part with its reason, how redaction reads.
    readme = members["README.txt"].decode()
    for name in members:
        assert name in readme, f"{name} not in the README"
    assert "nvidia-smi -q: nvidia-smi not found" in readme or "nvidia-smi -q" in members
    assert "[redacted: <what>]" in readme
    # The huge engine log: a bounded tail that ends where the log ends.
    (tail_name,) = [n for n in members if n.startswith("engine/logs/")]
    tail = members[tail_name].decode()
    assert len(members[tail_name]) <= FILE_CAP
    assert len(tail.splitlines()) <= LOG_LINES
    assert "LAST LINE OF THE ENGINE LOG" in tail and "FIRST LINE" not in tail
    assert "Receive: obj=[redacted: request content]" in tail
    assert out.stat().st_size < 2 * 2**20
    # Audited, as the CLI's user.
    config = load_config(config_path, env={})
    db = Database(config.database_url)
    entries = db.call(lambda s: list_audit(s, action="support.bundle")).items
    db.dispose()
    assert len(entries) == 1 and entries[0].actor.startswith("cli:")
    assert entries[0].target == "bundle.tar.gz"


def test_database_password_is_redacted_even_when_the_database_is_down(tmp_path: Path) -> None:
    """A PostgreSQL URL with a password, and nothing listening: the bundle is still written
    (the database's parts say why they are missing) and the password appears nowhere."""
    password = "Planted-DB-Passw0rd"
    url = f"postgresql://appliance:{password}@127.0.0.1:{free_port()}/appliance"
    config_path = _write_config(tmp_path, database={"url": url})
    config = load_config(config_path, env={})
    config.paths.log_dir.mkdir(parents=True, exist_ok=True)
    (config.paths.log_dir / "daemon.log").write_text(
        f"ERROR db: cannot connect to {url}\nERROR db: password {password} refused\n")
    out = tmp_path / "b.tar.gz"

    bundle = build(config, out, actor="test", now=NOW, since=dt.timedelta(days=1))

    members = _members(out)
    for name, data in members.items():
        assert password.encode() not in data, f"the database password leaked into {name}"
    assert any(s.what == "engine runs" for s in bundle.skipped)
    assert bundle.audit_error  # no database to write it to: said, not hidden
    assert password not in bundle.audit_error


def test_every_value_the_settings_page_masks_is_redacted_by_value(tmp_path: Path) -> None:
    """What `describe()` hides (database.url, weights.token, health.webhook_url …) the
    redactor removes wherever it appears, whatever its shape."""
    url = "postgresql://app:Zq9-plain-word@db.lan/appliance"
    path = _write_config(tmp_path, database={"url": url},
                         weights={"token": "plainwordtoken"})
    config = load_config(path, env={})
    masked = {f"{name}.{f.name}" for name, section in SECTIONS.items()
              for f in dataclasses.fields(section) if f.metadata.get("show") is not None
              and f.type in (str, "str")}
    assert {"database.url", "weights.token", "health.webhook_url"} <= masked
    assert {k for k, _ in secret_keys(config)} == {"database.url", "weights.token",
                                                   "health.webhook_url"}
    redact = for_box(config)
    text = redact(f"a {url} b plainwordtoken c Zq9-plain-word d {WEBHOOK}")
    for value in (url, "plainwordtoken", "Zq9-plain-word", "PlantedWebhookSecret99"):
        assert value not in text


def test_patterns_redact_credentials_and_prompts_by_shape() -> None:
    redact = Redactor()
    cases = {
        "Authorization: Bearer sk-0123abcd-" + "A" * 43: "sk-0123abcd",
        "apt_0123abcd_" + "b" * 43: "apt_0123abcd",
        "h=$argon2id$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2hoYXNo": "aGFzaGhhc2hoYXNo",
        "Set-Cookie: appliance_session=SessionValue123; Path=/": "SessionValue123",
        "postgresql://u:pw-in-url@db/x": "pw-in-url",
        "https://x.example/hook?token=QueryTok": "QueryTok",
        '{"prompt": "tell me a secret"}': "tell me a secret",
        "Finish: obj=GenerateReqInput(text='hello there'), out={'text': 'general kenobi'}":
            "general kenobi",
        "input_ids=[101, 2023, 2003]": "2023",
    }
    for text, secret in cases.items():
        assert secret not in redact(text), text
    # Ordinary words around them survive.
    kept = "disk-usage of task-7: prompt_tokens=12 max_tokens=5 token_file=/etc/hf"
    assert redact(kept) == kept


def test_for_box_reads_the_secret_files(tmp_path: Path) -> None:
    path = _write_config(tmp_path)
    config = load_config(path, env={})
    server_secret(config.paths.state_dir)
    key = engine_api_key(config.paths.state_dir)
    redact = for_box(config)
    assert key not in redact(f"x {key} y")
    assert "[redacted: engine API key]" in redact(key)


def test_since_spans_and_dates() -> None:
    assert parse_since("24h", NOW) == NOW - dt.timedelta(hours=24)
    assert parse_since("1d12h", NOW) == NOW - dt.timedelta(hours=36)
    assert parse_since("2026-04-30T08:00", NOW) == dt.datetime(2026, 4, 30, 8, tzinfo=dt.UTC)


def test_console_button_downloads_an_audited_bundle(runtime: Runtime,
                                                     logged_in: Console) -> None:
    page = logged_in.http.get("/settings")
    assert page.status_code == 200
    assert 'action="/settings/support-bundle"' in page.text
    assert 'id="support-bundle-download"' in page.text
    token = logged_in.page_token("/settings")

    response = logged_in.http.post("/settings/support-bundle", data={"_csrf_token": token},
                                   timeout=240)

    assert response.status_code == 200, response.text[:500]
    assert response.headers["content-type"].startswith("application/gzip")
    assert "attachment" in response.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers()}
    assert {"README.txt", "health/current.json", "engine/runs.json"} <= names
    entries = runtime.db.call(lambda s: list_audit(s, action="support.bundle")).items
    assert [e.actor for e in entries] == ["alice"]
    # Nothing is left behind on the box once it was sent (deleted after the last byte).
    wait_for(lambda: not any((runtime.config.paths.state_dir / "support").rglob("*.tar.gz")),
             "the sent bundle to be deleted")


def test_api_builds_a_bundle_and_refuses_without_login(runtime: Runtime,
                                                       logged_in: Console) -> None:
    response = logged_in.http.post("/api/v1/support-bundle?since=2h", headers=csrf(logged_in),
                                   timeout=240)
    assert response.status_code == 200, response.text[:500]
    assert response.content[:2] == b"\x1f\x8b"  # gzip
    anonymous = Console(logged_in.http.base_url.__str__().rstrip("/"))
    try:
        assert anonymous.http.post("/api/v1/support-bundle").status_code in (401, 403)
    finally:
        anonymous.close()


# --- what a compromised service can plant (issue 22) ------------------------------------------


def _readme(members: dict[str, bytes]) -> str:
    return members["README.txt"].decode()


def test_a_link_planted_in_the_log_folder_is_refused_and_said_so(tmp_path: Path) -> None:
    """`x.log -> /root/.ssh/id_ed25519` in the service-owned log folder, a FIFO beside it,
    and an engine run whose record names the key file as its log: none is read, the README
    says each, and the legitimate logs are still there."""
    config_path, _ = _plant(tmp_path)
    config = load_config(config_path, env={})
    private = tmp_path / "root" / ".ssh" / "id_ed25519"
    private.parent.mkdir(parents=True)
    private.write_text("-----BEGIN OPENSSH PRIVATE KEY----- PLANTED-ROOT-KEY\n")
    private.chmod(0o600)
    log_dir = config.paths.log_dir
    (log_dir / "x.log").symlink_to(private)
    os.mkfifo(log_dir / "pipe.log")  # would hang a plain open() for ever
    db = Database(config.database_url)
    db.call(lambda s: open_run(s, at=NOW, runner="process", spec_hash="def456",
                               spec_json="{}", attempt=2, state="LAUNCHING",
                               log_path=str(private)))
    db.dispose()
    out = tmp_path / "b.tar.gz"

    build(config, out, actor="test", now=NOW, since=dt.timedelta(days=3650))

    members = _members(out)
    for name, data in members.items():
        assert b"PLANTED-ROOT-KEY" not in data, f"the planted link was followed into {name}"
    readme = _readme(members)
    assert f"{log_dir / 'x.log'} is a symbolic link (to {private})" in readme
    assert "never follows links" in readme
    assert f"{log_dir / 'pipe.log'} is not a regular file" in readme
    assert f"{private}: an engine run's record names this log, not the configuration" in readme
    assert "logs/daemon.log" in members and "engine/logs/0-engine.log" in members
    assert "logs/x.log" not in members and "logs/pipe.log" not in members


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: reads another user's folder as it")
def test_as_root_a_service_owned_folder_is_read_as_its_owner() -> None:
    """Run as root, the bundle reads the service's log folder as the folder's owner: a hard
    link there to a file only root may read (what `fs.protected_hardlinks=0` would let a
    compromised service make) is refused; the service's own log is read."""
    root = Path(tempfile.mkdtemp(prefix="bundle-owner-"))
    try:
        root.chmod(0o755)  # the service user must reach its folders, as on a real box
        config = load_config(_write_config(root), env={})
        log_dir = config.paths.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        service = 64123  # a uid with no name: the "appliance" user of this box
        os.chown(log_dir, service, service)
        secret = root / "shadow"
        secret.write_text("PLANTED-ROOT-ONLY-LINE\n")
        secret.chmod(0o600)
        os.link(secret, log_dir / "hard.log")
        own = log_dir / "daemon.log"
        own.write_text("the service's own line\n")
        os.chown(own, service, service)
        out = root / "b.tar.gz"

        build(config, out, actor="test", now=NOW, since=dt.timedelta(days=1))

        members = _members(out)
        for name, data in members.items():
            assert b"PLANTED-ROOT-ONLY-LINE" not in data, f"read as root into {name}"
        assert members["logs/daemon.log"] == b"the service's own line\n"
        assert f"{log_dir / 'hard.log'} cannot be read: Permission denied" in _readme(members)
    finally:
        shutil.rmtree(root)


# --- the redaction table: values, not words (issue 22) ----------------------------------------


def test_cell_tokens_and_member_credentials_are_redacted(tmp_path: Path) -> None:
    path = _write_config(tmp_path)
    config = load_config(path, env={})
    cell = config.paths.state_dir / "secrets" / "cell"
    cell.mkdir(parents=True)
    member_key = "MemberCredentialPlanted0123456789abcdef"
    (cell / "member-2.key").write_text(member_key + "\n")
    join = "acj_" + "J" * 43
    peer = "acp_0a1b2c3d_" + "P" * 43
    redact = for_box(config)

    text = redact(f"join {join} peer {peer} sent Authorization: x {member_key}")

    for value in (join, peer, member_key):
        assert value not in text
    assert "[redacted: cell join token]" in text
    assert "[redacted: cell peer credential]" in text
    assert "[redacted: cell member credential]" in text


def test_figures_named_like_tokens_are_kept() -> None:
    redact = Redactor()
    kept = ("Decode batch. #running-req: 3, #token: 4096, #new-token: 6, #cached-token: 120, "
            "#pending-token: 0, token usage: 0.02, gen throughput (token/s): 41.2\n"
            "server_args=ServerArgs(bucket_time_to_first_token=[0.1, 0.5], "
            "kt_max_deferred_experts_per_token=None, enable_streaming_session=False, "
            "api_key=None, max_prefill_tokens=16384)")
    assert redact(kept) == kept
    assert not redact.counts
    # The values beside the same words still go.
    gone = redact("token=Zq81abcdefgh api_key='eng-key-0123' session=abcdef123456")
    assert "Zq81abcdefgh" not in gone and "eng-key-0123" not in gone
    assert "abcdef123456" not in gone
    assert "api_key='[redacted: secret]'" in gone  # still quoted


def test_json_and_toml_are_redacted_structurally() -> None:
    redact = Redactor()
    runs = json.dumps({"runs": [{"reason": "api_key: 'k-0123456789' refused",
                                 "figures": {"api_key": "k-0123456789", "tokens": 12},
                                 "env": {"HF_TOKEN": "plain-value-1"}}]})

    out = json.loads(redact.structured("engine/runs.json", runs))

    run = out["runs"][0]
    assert run["figures"] == {"api_key": "[redacted: secret]", "tokens": 12}
    assert run["env"] == {"HF_TOKEN": "[redacted: secret]"}
    assert "k-0123456789" not in run["reason"]
    toml = 'token = "hf_PlantedHubTokenAbcdefghijklmnop1234"\nkeep = 3\n'
    redacted = redact.structured("config/appliance.toml", toml)
    assert tomllib.loads(redacted) == {"token": "[redacted: Hub token]", "keep": 3}


# --- what the README says is true (issue 23) --------------------------------------------------


def test_the_process_runners_launch_spec_comes_from_the_database(tmp_path: Path) -> None:
    config_path, _ = _plant(tmp_path)
    config = load_config(config_path, env={})
    (config.paths.state_dir / "engine" / "launch-spec.json").unlink()  # never written here
    db = Database(config.database_url)
    db.call(lambda s: open_run(s, at=NOW, runner="process", spec_hash="f00d",
                               spec_json=json.dumps({"argv": ["sglang", "serve", "--api-key",
                                                              "x"], "api_key": "spec-key-1"}),
                               attempt=1, state="READY", log_path=""))
    db.dispose()
    out = tmp_path / "b.tar.gz"

    build(config, out, actor="test", now=NOW, since=dt.timedelta(days=1))

    members = _members(out)
    spec = json.loads(members["engine/launch-spec.json"])
    assert spec["argv"][:2] == ["sglang", "serve"] and spec["api_key"] == "[redacted: secret]"
    readme = _readme(members)
    assert "never launched" not in readme
    assert "from the database: the process runner keeps no spec file" in readme


def test_the_cli_bundle_asks_a_running_daemon_for_its_live_health(
        runtime: Runtime, server: object, tmp_path: Path) -> None:
    from appliance.ops.cli import run as bundle_cli

    add_admin(runtime)
    out = tmp_path / "live.tar.gz"
    args = argparse.Namespace(since="1h", out=out, lines=None)

    assert bundle_cli(args, runtime.config) == 0

    members = _members(out)
    assert "checks" in json.loads(members["health/current.json"])
    assert "made without the daemon" not in _readme(members)


def test_the_cli_bundle_says_why_when_no_daemon_answers(tmp_path: Path) -> None:
    config = load_config(_write_config(tmp_path), env={})
    out = tmp_path / "b.tar.gz"
    extra, note = live_parts(config)
    build(config, out, actor="test", now=NOW, extra=extra, daemon_note=note)
    readme = _readme(_members(out))
    assert "health/current.json" not in readme
    assert f"the daemon does not answer on port {config.server.port}" in readme


PASSPHRASE = "planted passphrase: correct horse battery staple"
PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQCplantedPEMbody"


def _pem(kind: str = "") -> str:
    return (f"-----BEGIN {kind}PRIVATE KEY-----\n{PEM_BODY}\n{PEM_BODY[::-1]}\n"
            f"-----END {kind}PRIVATE KEY-----")


def test_the_backup_passphrase_file_is_never_read_and_its_value_is_redacted(
        tmp_path: Path) -> None:
    """The passphrase file misplaced as `*.log` in the log folder is refused, not collected,
    and a line elsewhere that quotes the passphrase loses it (a value of `secret_files`)."""
    config_path, _ = _plant(tmp_path)
    log_dir = tmp_path / "log"
    secret = log_dir / "backup-passphrase.log"
    secret.write_text(PASSPHRASE + "\n")
    secret.chmod(0o640)
    with config_path.open("a") as handle:
        handle.write(f"[backup]\npassphrase_file = {json.dumps(str(secret))}\n")
    with (log_dir / "daemon.log").open("a") as handle:
        handle.write(f"DEBUG backup: sealed with {PASSPHRASE}\n")
    config = load_config(config_path, env={})
    assert config.backup.passphrase_file == secret
    out = tmp_path / "b.tar.gz"

    build(config, out, actor="test", now=NOW, since=dt.timedelta(days=3650))

    members = _members(out)
    for name, data in members.items():
        assert b"correct horse battery staple" not in data, name
    assert "logs/backup-passphrase.log" not in members and "logs/daemon.log" in members
    assert b"DEBUG backup: sealed with [redacted: backup.passphrase_file]" in (
        members["logs/daemon.log"])
    assert f"{secret}: a configured secret file" in _readme(members)


@pytest.mark.parametrize("kind", ["", "RSA ", "EC ", "ENCRYPTED ", "OPENSSH "])
def test_pem_private_key_blocks_are_redacted_wholesale(kind: str) -> None:
    redactor = Redactor()
    text = (f"INFO tls: loaded the key\n{_pem(kind)}\nINFO tls: listening on :8443\n"
            "-----BEGIN CERTIFICATE-----\nMIIBcertificateIsPublic\n-----END CERTIFICATE-----\n")
    redacted = redactor(text)
    assert PEM_BODY not in redacted and PEM_BODY[::-1] not in redacted
    assert redacted == ("INFO tls: loaded the key\n[redacted: private key]\n"
                        "INFO tls: listening on :8443\n-----BEGIN CERTIFICATE-----\n"
                        "MIIBcertificateIsPublic\n-----END CERTIFICATE-----\n")
    # a tail that cut the END off, and a JSON string holding the block, lose the body too
    cut = redactor(f"INFO dump\n{_pem(kind).rsplit(chr(10), 1)[0]}\n")
    assert cut == "INFO dump\n[redacted: private key]"
    as_json = redactor.structured("x.json", json.dumps({"tls": {"pem": _pem(kind)}}))
    assert PEM_BODY not in as_json and json.loads(as_json)["tls"]["pem"].startswith("[redacted")
