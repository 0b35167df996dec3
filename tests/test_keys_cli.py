"""`appliance keys create|list|revoke|limits` as real subprocesses, on a migrated box with no
daemon running: the key printed once (the gateway's store accepts it under the box's server
secret), never listed; limits changed one at a time and cleared with `none`; refusals that
explain themselves, exit non-zero and change nothing; every change audited as `cli:<user>`.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pytest

from appliance.config import load_config
from appliance.db.database import Database
from appliance.db.journal import list_audit
from appliance.errors import EX_DATAERR
from appliance.gateway.keys import KEY_RE, KeyLimits, list_keys, load_entries
from appliance.secrets import server_secret
from tests.conftest import run_cli
from tests.test_server import write_config


@pytest.fixture
def box(tmp_path: Path) -> Path:
    config = write_config(tmp_path / "box")
    assert run_cli("--config", str(config), "migrate").returncode == 0
    return config


@pytest.fixture(scope="module")
def keyless_box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated box for the refusals: each must leave it without keys or audit entries
    (so a refusal that wrongly wrote something also fails the cases after it)."""
    config = write_config(tmp_path_factory.mktemp("keyless") / "box")
    assert run_cli("--config", str(config), "migrate").returncode == 0
    return config


def keys(box: Path, *args: str) -> tuple[int, str, str]:
    result = run_cli("--config", str(box), "keys", *args)
    return result.returncode, result.stdout, result.stderr


def database(box: Path) -> Database:
    return Database(load_config(box, env={}).database_url)


def audit(box: Path) -> list[tuple[str, str, str, dict[str, object]]]:
    db = database(box)
    try:
        entries = db.call(lambda s: list_audit(s, action="keys.", per_page=500)).items
    finally:
        db.dispose()
    return [(a.action, a.actor, a.target, a.detail) for a in reversed(entries)]


def stored(box: Path) -> list:  # type: ignore[type-arg]
    db = database(box)
    try:
        return db.call(list_keys)
    finally:
        db.dispose()


def test_create_list_limits_revoke(box: Path) -> None:
    code, out, err = keys(box, "create", "--name", "support bots", "--owner", "Support team",
                          "--expires", "30d", "--max-concurrency", "4", "--rpm", "60",
                          "--tokens-per-day", "5_000_000_000")
    assert code == 0, err
    key = out.strip()
    match = KEY_RE.match(key)
    assert match, out
    prefix = match.group(1)
    assert "It is shown only now" in err and key not in err
    assert f"key {prefix} (support bots) created" in err
    # The gateway's store accepts it under this box's server secret.
    config = load_config(box, env={})
    db = database(box)
    [entry] = db.call(load_entries)
    db.dispose()
    now = dt.datetime.now(dt.UTC)
    assert entry.accepts(server_secret(config.paths.state_dir), key, now)
    [info] = stored(box)
    assert info.limits == KeyLimits(4, 60, 5_000_000_000, None)
    assert info.created_by.startswith("cli:") and info.owner == "Support team"
    assert info.expires_at is not None
    assert dt.timedelta(days=29, hours=23) < info.expires_at - now <= dt.timedelta(days=30)

    code, out, err = keys(box, "list")
    assert code == 0, err
    assert key not in out
    header, row = out.splitlines()
    assert header.split() == ["PREFIX", "NAME", "OWNER", "STATUS", "CLASS", "EXPIRES", "LAST",
                              "USED", "LIMITS"]
    assert row.startswith(f"{prefix}  support bots  Support team  active  interactive  ")
    assert re.search(r"  never +4 concurrent, 60 requests/min, 5000000000 tokens/day$", row)

    code, out, err = keys(box, "limits", prefix, "--rpm", "none", "--max-tokens", "4096")
    assert code == 0, err
    assert out.strip() == (f"appliance: key {prefix} (support bots): 4 concurrent, "
                           "5000000000 tokens/day, 4096 max_tokens")
    assert stored(box)[0].limits == KeyLimits(4, None, 5_000_000_000, 4096)

    code, out, err = keys(box, "revoke", prefix)
    assert code == 0, err
    assert out.startswith(f"appliance: key {prefix} (support bots) revoked ")
    code, out, _ = keys(box, "revoke", prefix)  # idempotent
    assert code == 0
    [info] = stored(box)
    assert info.revoked_at is not None and info.revoked_by.startswith("cli:")

    trail = audit(box)
    assert [(action, actor.startswith("cli:"), target, detail["via"])
            for action, actor, target, detail in trail] == [
        ("keys.create", True, prefix, "cli"), ("keys.limits", True, prefix, "cli"),
        ("keys.revoke", True, prefix, "cli"), ("keys.revoke", True, prefix, "cli")]
    assert trail[3][3].get("already_revoked") is True
    assert key not in json.dumps(trail)


def test_json_output(box: Path) -> None:
    code, out, err = keys(box, "create", "--name", "ci", "--expires", "2099-01-31",
                          "--max-tokens", "512", "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert KEY_RE.match(answer["key"])
    assert answer["expires_at"] == "2099-01-31T00:00:00Z"
    assert answer["limits"] == {"max_concurrency": None, "requests_per_minute": None,
                                "tokens_per_day": None, "max_tokens": 512}
    assert answer["status"] == "active"
    assert "shown only now" in err
    code, out, err = keys(box, "list", "--json")
    assert code == 0, err
    [listed] = json.loads(out)
    assert listed == {k: v for k, v in answer.items() if k != "key"}


@pytest.mark.parametrize(("args", "code", "message"), [
    (["create", "--name", "<bad>"], EX_DATAERR, "key name '<bad>' is not allowed"),
    (["create", "--name", "ok", "--expires", "2020-01-01"], EX_DATAERR, "is in the past"),
    (["create", "--name", "ok", "--expires", "soon"], EX_DATAERR,
     "is not a date, a time or a number of days"),
    (["create", "--name", "ok", "--expires", "0d"], EX_DATAERR, "in 0 days is not allowed"),
    (["create", "--name", "ok", "--rpm", "0"], 2, "0 is below 1"),
    (["create", "--name", "ok", "--max-tokens", "-3"], 2, "-3 is below 1"),
    (["create", "--name", "ok", "--max-concurrency", "2.5"], 2, "'2.5' is not a whole number"),
    (["create", "--name", "ok", "--max-tokens", "99999999999"], EX_DATAERR,
     "max_tokens must be a whole number from 1 to 2147483647"),
    (["revoke", "0123abcd"], EX_DATAERR, "there is no API key with prefix '0123abcd'"),
    (["limits", "0123abcd", "--rpm", "5"], EX_DATAERR, "no API key with prefix '0123abcd'"),
])
def test_bad_input_is_explained_and_changes_nothing(keyless_box: Path, args: list[str],
                                                    code: int, message: str) -> None:
    result_code, out, err = keys(keyless_box, *args)
    assert result_code == code, err
    assert message in err
    assert "sk-" not in out
    assert stored(keyless_box) == [] and audit(keyless_box) == []


def test_limits_needs_a_limit_and_keeps_the_key_unchanged(box: Path) -> None:
    code, out, _ = keys(box, "create", "--name", "k", "--rpm", "10")
    assert code == 0
    prefix = out.strip().split("-")[1]
    code, _, err = keys(box, "limits", prefix)
    assert code == EX_DATAERR
    assert "no limit was given to change" in err and "--rpm N|none" in err
    assert stored(box)[0].limits == KeyLimits(None, 10, None, None)
    assert [a for a, *_ in audit(box)] == ["keys.create"]


def test_keys_needs_a_migrated_database(tmp_path: Path) -> None:
    config = write_config(tmp_path / "bare")
    code, _, err = keys(config, "list")
    assert code != 0
    assert "appliance migrate" in err
