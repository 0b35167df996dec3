"""The configuration: every bad input stops the daemon with one clear message and exit 78
(nothing created or changed), good inputs load, layers apply in order, the Settings view hides
database passwords, and docs/configuration.md matches the schema.

Cases are tables. A file case is a dict of TOML sections whose values are TOML literals (with
`{tmp}` standing for the test's temp dir), merged over a base that points every path into
that dir; a case may instead give the file's raw text or bytes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from appliance.config import (
    DEFAULT_CONFIG_PATH,
    SECTIONS,
    Config,
    DatabaseConfig,
    describe,
    load_config,
    mask_url,
)
from appliance.errors import EX_CONFIG, ConfigError
from appliance.gateway.classes import ServiceClass
from tests.conftest import REPO, run_cli

DOC = REPO / "docs" / "configuration.md"
FILE = "<file>"  # in a case's expected source: the config file's path
DIRECTORY = "<directory>"  # as a case's content: --config names a directory

Sections = Mapping[str, Mapping[str, str]]

ALL_KEYS = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
HINTS = {f"{s}.{k}": h for s, cls in SECTIONS.items() for k, h in get_type_hints(cls).items()}
ENV_NAMES = {"APPLIANCE_" + key.replace(".", "_").upper() for key in ALL_KEYS}


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """A temp dir with the props bad cases refer to: a regular file `afile` (so
    `{tmp}/afile/state` cannot be a directory, even for root) and two PEM stand-ins."""
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    return tmp_path


def base_sections(tmp: Path) -> dict[str, dict[str, str]]:
    return {"paths": {"state_dir": f'"{tmp}/state"', "models_dir": f'"{tmp}/models"',
                      "log_dir": f'"{tmp}/log"'}}


def render(tmp: Path, sections: Sections) -> str:
    merged = base_sections(tmp)
    for name, keys in sections.items():
        merged.setdefault(name, {}).update(keys)
    lines: list[str] = []
    for name, keys in merged.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {value.replace('{tmp}', str(tmp))}" for key, value in keys.items()]
        lines.append("")
    return "\n".join(lines)


def write_config(tmp: Path, content: Sections | str | bytes, name: str = "appliance.toml") -> Path:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content.replace("{tmp}", str(tmp)))
    else:
        path.write_text(render(tmp, content))
    return path


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime: equal snapshots mean nothing changed."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# --- bad inputs ----------------------------------------------------------------------------

# id, file content (or None: a path that is not there / a directory), env,
# then the ConfigError: source (FILE or a variable), key, a piece of found, a piece of expected.
BAD: list[Any] = [
    pytest.param("[server]\nport = = 1\n", {}, FILE, "", "line 2, column", "valid TOML syntax",
                 id="toml-syntax"),
    pytest.param({"nope": {"a": "1"}}, {}, FILE, "nope", "unknown section [nope]",
                 "one of server, paths, database, auth, logging, engine, gpu",
                 id="unknown-section"),
    pytest.param("server = 5\n", {}, FILE, "server", "int", "a [server] table",
                 id="section-not-a-table"),
    pytest.param({"server": {"prot": "8080"}}, {}, FILE, "server.prot", "an unknown key",
                 "one of host, port, allowed_hosts, tls_cert, tls_key", id="unknown-key"),
    pytest.param({"paths": {"tmp_dir": '"/tmp"'}}, {}, FILE, "paths.tmp_dir", "an unknown key",
                 "one of state_dir, models_dir, log_dir", id="unknown-key-paths"),
    pytest.param({"server": {"port": '"8080"'}}, {}, FILE, "server.port", "'8080' (str)",
                 "an integer", id="port-string"),
    pytest.param({"server": {"host": "1"}}, {}, FILE, "server.host", "1 (int)", "a string",
                 id="host-int"),
    pytest.param({"server": {"port": "true"}}, {}, FILE, "server.port", "True (bool)",
                 "an integer", id="port-bool"),
    pytest.param({"server": {"port": "80.0"}}, {}, FILE, "server.port", "80.0 (float)",
                 "an integer", id="port-float"),
    pytest.param({"server": {"allowed_hosts": "[1, 2]"}}, {}, FILE, "server.allowed_hosts",
                 "[1, 2] (list)", "a list of strings", id="allowed-hosts-ints"),
    pytest.param({"server": {"allowed_hosts": '"localhost"'}}, {}, FILE,
                 "server.allowed_hosts", "'localhost' (str)", "a list of strings",
                 id="allowed-hosts-not-list"),
    pytest.param({"server": {"port": "0"}}, {}, FILE, "server.port", "0",
                 "an integer from 1 to 65535", id="port-0"),
    pytest.param({"server": {"port": "70000"}}, {}, FILE, "server.port", "70000",
                 "an integer from 1 to 65535", id="port-70000"),
    pytest.param({"auth": {"session_idle_minutes": "0"}}, {}, FILE,
                 "auth.session_idle_minutes", "0", "a positive integer", id="idle-zero"),
    pytest.param({"auth": {"login_max_failures": "-3"}}, {}, FILE, "auth.login_max_failures",
                 "-3", "a positive integer", id="failures-negative"),
    pytest.param({"paths": {"state_dir": '"var/lib/appliance"'}}, {}, FILE, "paths.state_dir",
                 "'var/lib/appliance'", "an absolute path", id="state-dir-relative"),
    pytest.param({"paths": {"state_dir": '""'}}, {}, FILE, "paths.state_dir", "''",
                 "an absolute path", id="state-dir-empty"),
    pytest.param({"paths": {"state_dir": "7"}}, {}, FILE, "paths.state_dir", "7 (int)",
                 "a path string", id="state-dir-int"),
    pytest.param({"paths": {"state_dir": '"{tmp}/afile/state"'}}, {}, FILE, "paths.state_dir",
                 "Not a directory", "a directory the daemon's user can create and write",
                 id="state-dir-unwritable"),
    pytest.param({"paths": {"log_dir": '"{tmp}/afile/log"'}}, {}, FILE, "paths.log_dir",
                 "Not a directory", "a directory the daemon's user can create and write",
                 id="log-dir-unwritable"),
    pytest.param({"server": {"tls_cert": '"{tmp}/cert.pem"'}}, {}, FILE,
                 "server.tls_cert/server.tls_key", "only one of the two set",
                 "both set (HTTPS) or neither (HTTP)", id="tls-cert-only"),
    pytest.param({"server": {"tls_key": '"{tmp}/key.pem"'}}, {}, FILE,
                 "server.tls_cert/server.tls_key", "only one of the two set",
                 "both set (HTTPS) or neither (HTTP)", id="tls-key-only"),
    pytest.param({"server": {"tls_cert": '"{tmp}/missing.pem"', "tls_key": '"{tmp}/key.pem"'}},
                 {}, FILE, "server.tls_cert", "missing.pem (missing)", "a readable PEM file",
                 id="tls-cert-missing"),
    pytest.param({"server": {"tls_cert": '"{tmp}/cert.pem"', "tls_key": '"{tmp}/nokey.pem"'}},
                 {}, FILE, "server.tls_key", "nokey.pem (missing)", "a readable PEM file",
                 id="tls-key-missing"),
    pytest.param({"server": {"tls_cert": '"cert.pem"', "tls_key": '"{tmp}/key.pem"'}}, {},
                 FILE, "server.tls_cert", "'cert.pem'", "an absolute path",
                 id="tls-cert-relative"),
    pytest.param({"database": {"url": '"mysql://app:hunter2@db/app"'}}, {}, FILE,
                 "database.url", "'mysql://app:***@db/app'", "postgresql://", id="db-scheme"),
    pytest.param({"database": {"url": '"postgres://app@db/app"'}}, {}, FILE, "database.url",
                 "postgres://", "sqlite:////absolute/path.db", id="db-postgres-alias"),
    pytest.param({"database": {"url": '"postgresql:garbage"'}}, {}, FILE, "database.url",
                 "'postgresql:garbage'", "postgresql://", id="db-unparseable"),
    pytest.param({"database": {"url": '"sqlite:///relative.db"'}}, {}, FILE, "database.url",
                 "relative.db", "an absolute file path", id="db-sqlite-relative"),
    pytest.param({"database": {"url": '"sqlite://"'}}, {}, FILE, "database.url", "sqlite://",
                 "an absolute file path", id="db-sqlite-memory"),
    pytest.param({"logging": {"level": '"LOUD"'}}, {}, FILE, "logging.level", "'LOUD'",
                 "one of DEBUG, INFO, WARNING, ERROR", id="log-level"),
    pytest.param(None, {}, FILE, "", "no such file", "a TOML file", id="file-missing"),
    pytest.param(b'[server]\nhost = "\xff\xfe"\n', {}, FILE, "", "bytes that are not UTF-8",
                 "UTF-8 text", id="file-not-utf8"),
    pytest.param(DIRECTORY, {}, FILE, "", "a path that cannot be read", "a readable TOML file",
                 id="file-is-directory"),
    pytest.param({}, {"APPLIANCE_SERVER_PORT": "abc"}, "APPLIANCE_SERVER_PORT", "server.port",
                 "'abc' (str)", "an integer", id="env-port-abc"),
    pytest.param({}, {"APPLIANCE_SERVER_PORT": "70000"}, "APPLIANCE_SERVER_PORT", "server.port",
                 "'70000'", "an integer from 1 to 65535", id="env-port-range"),
    pytest.param({}, {"APPLIANCE_SERVER_NOPE": "1"}, "APPLIANCE_SERVER_NOPE", "",
                 "an unknown setting", "APPLIANCE_SERVER_PORT, APPLIANCE_SERVER_ALLOWED_HOSTS",
                 id="env-unknown-key"),
    pytest.param({}, {"APPLIANCE_NOPE_PORT": "1"}, "APPLIANCE_NOPE_PORT", "",
                 "an unknown setting", "APPLIANCE_LOGGING_LEVEL", id="env-unknown-section"),
    pytest.param({}, {"APPLIANCE_PATHS_LOG_DIR": "log"}, "APPLIANCE_PATHS_LOG_DIR",
                 "paths.log_dir", "'log'", "an absolute path", id="env-relative-path"),
    pytest.param({}, {"APPLIANCE_DATABASE_URL": "postgresql://app:hunter2@db:x/app"},
                 "APPLIANCE_DATABASE_URL", "database.url", "'postgresql://***@db:x/app'",
                 "postgresql://", id="env-db-url-bad-port"),
    # [engine] and [gpu]
    pytest.param({"engine": {"runner": '"docker"'}}, {}, FILE, "engine.runner", "'docker'",
                 "systemd or process", id="engine-runner-docker"),
    pytest.param({"engine": {"runner": '"Process"'}}, {}, FILE, "engine.runner", "'Process'",
                 "systemd or process", id="engine-runner-case"),
    pytest.param({"engine": {"command": "[]"}}, {}, FILE, "engine.command", "[]",
                 "a non-empty list", id="engine-command-empty"),
    pytest.param({"engine": {"command": '["", "serve"]'}}, {}, FILE, "engine.command",
                 "['', 'serve']", "a non-empty list", id="engine-command-blank-program"),
    pytest.param({"engine": {"command": '"/opt/sglang"'}}, {}, FILE, "engine.command",
                 "'/opt/sglang' (str)", "a list of strings", id="engine-command-string"),
    pytest.param({"engine": {"venv": '"opt/engine"'}}, {}, FILE, "engine.venv",
                 "'opt/engine'", "an absolute path", id="engine-venv-relative"),
    pytest.param({"engine": {"mem_fraction_static": "0"}}, {}, FILE,
                 "engine.mem_fraction_static", "0", "a number between 0 and 1 (exclusive)",
                 id="mem-fraction-0"),
    pytest.param({"engine": {"mem_fraction_static": "1"}}, {}, FILE,
                 "engine.mem_fraction_static", "1", "a number between 0 and 1 (exclusive)",
                 id="mem-fraction-1"),
    pytest.param({"engine": {"mem_fraction_static": "1.5"}}, {}, FILE,
                 "engine.mem_fraction_static", "1.5", "a number between 0 and 1 (exclusive)",
                 id="mem-fraction-1.5"),
    pytest.param({"engine": {"mem_fraction_static": '"x"'}}, {}, FILE,
                 "engine.mem_fraction_static", "'x' (str)", "a number", id="mem-fraction-str"),
    pytest.param({"engine": {"mem_fraction_static": '"0.9"'}}, {}, FILE,
                 "engine.mem_fraction_static", "'0.9' (str)", "a number",
                 id="mem-fraction-quoted"),
    pytest.param({"engine": {"mem_fraction_static": "true"}}, {}, FILE,
                 "engine.mem_fraction_static", "True (bool)", "a number",
                 id="mem-fraction-bool"),
    pytest.param({"engine": {"mamba_full_memory_ratio": "0"}}, {}, FILE,
                 "engine.mamba_full_memory_ratio", "0", "a positive number",
                 id="mamba-ratio-0"),
    pytest.param({"engine": {"mamba_full_memory_ratio": "-1"}}, {}, FILE,
                 "engine.mamba_full_memory_ratio", "-1", "a positive number",
                 id="mamba-ratio-negative"),
    pytest.param({"engine": {"speculative": '"yes"'}}, {}, FILE, "engine.speculative",
                 "'yes' (str)", "true or false", id="speculative-string-in-toml"),
    pytest.param({"engine": {"speculative": "1"}}, {}, FILE, "engine.speculative",
                 "1 (int)", "true or false", id="speculative-int-in-toml"),
    pytest.param({"engine": {"port": "70000"}}, {}, FILE, "engine.port", "70000",
                 "an integer from 1 to 65535", id="engine-port-70000"),
    pytest.param({"engine": {"tp_size": "0"}}, {}, FILE, "engine.tp_size", "0",
                 "a positive integer", id="engine-tp-size-0"),
    pytest.param({"engine": {"max_retries": "-1"}}, {}, FILE, "engine.max_retries", "-1",
                 "zero or a positive integer", id="engine-max-retries-negative"),
    pytest.param({"engine": {"kill_after_seconds": "0"}}, {}, FILE,
                 "engine.kill_after_seconds", "0", "a positive integer",
                 id="engine-kill-after-0"),
    pytest.param({"gpu": {"expected_count": "-1"}}, {}, FILE, "gpu.expected_count", "-1",
                 "zero or a positive integer", id="gpu-count-negative"),
    pytest.param({"gpu": {"expected_count": "8.0"}}, {}, FILE, "gpu.expected_count",
                 "8.0 (float)", "an integer", id="gpu-count-float"),
    pytest.param({"gpu": {"expected_model": "300"}}, {}, FILE, "gpu.expected_model",
                 "300 (int)", "a string", id="gpu-model-int"),
    pytest.param({}, {"APPLIANCE_ENGINE_SPECULATIVE": "maybe"}, "APPLIANCE_ENGINE_SPECULATIVE",
                 "engine.speculative", "'maybe' (str)", "true or false", id="env-bool-maybe"),
    pytest.param({}, {"APPLIANCE_ENGINE_SPECULATIVE": ""}, "APPLIANCE_ENGINE_SPECULATIVE",
                 "engine.speculative", "'' (str)", "true or false", id="env-bool-empty"),
    pytest.param({}, {"APPLIANCE_ENGINE_MEM_FRACTION_STATIC": "x"},
                 "APPLIANCE_ENGINE_MEM_FRACTION_STATIC", "engine.mem_fraction_static",
                 "'x' (str)", "a number", id="env-float-x"),
    pytest.param({}, {"APPLIANCE_ENGINE_MEM_FRACTION_STATIC": "1.5"},
                 "APPLIANCE_ENGINE_MEM_FRACTION_STATIC", "engine.mem_fraction_static",
                 "'1.5'", "a number between 0 and 1 (exclusive)", id="env-float-range"),
    pytest.param({}, {"APPLIANCE_ENGINE_COMMAND": ""}, "APPLIANCE_ENGINE_COMMAND",
                 "engine.command", "''", "a non-empty list", id="env-command-empty"),
    pytest.param({}, {"APPLIANCE_ENGINE_COMMAND": " , "}, "APPLIANCE_ENGINE_COMMAND",
                 "engine.command", "' , '", "a non-empty list", id="env-command-blanks"),
    pytest.param({}, {"APPLIANCE_ENGINE_RUNNER": "docker"}, "APPLIANCE_ENGINE_RUNNER",
                 "engine.runner", "'docker'", "systemd or process", id="env-runner"),
    pytest.param({}, {"APPLIANCE_GPU_EXPECTED_COUNT": "-1"}, "APPLIANCE_GPU_EXPECTED_COUNT",
                 "gpu.expected_count", "'-1'", "zero or a positive integer",
                 id="env-gpu-count-negative"),
]


def config_path(tmp: Path, content: Sections | str | bytes | None) -> Path:
    if content is None:
        return tmp / "absent.toml"
    if content == DIRECTORY:
        (tmp / "conf.d").mkdir()
        return tmp / "conf.d"
    return write_config(tmp, content)


@pytest.mark.parametrize(("content", "env", "source", "key", "found", "expected"), BAD)
def test_bad_input_is_a_config_error(tmp: Path, content: Sections | str | bytes | None,
                                     env: dict[str, str], source: str, key: str, found: str,
                                     expected: str) -> None:
    path = config_path(tmp, content)
    before = snapshot(tmp)
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env)
    err = caught.value
    source = str(path) if source == FILE else source
    assert (err.source, err.key) == (source, key)
    assert found in err.found
    assert expected in err.expected
    assert err.exit_code == EX_CONFIG == 78
    assert err.message.startswith(f"configuration error in {source}")
    if key:
        assert f"{source}: {key}: found " in err.message
    assert "hunter2" not in err.as_text()
    after = snapshot(tmp)
    if key == "paths.log_dir" and "Not a directory" in found:  # state_dir was made first
        assert set(after) - set(before) == {"state"}
    else:
        assert after == before, "a rejected configuration created or changed files"


# The same failures through the real CLI: exit 78, one message on stderr, nothing created.
CLI_BAD = [
    pytest.param("[server]\nport = = 1\n", {}, FILE, "line 2, column", id="toml-syntax"),
    pytest.param({"server": {"prot": "8080"}}, {}, FILE, "server.prot: found an unknown key",
                 id="unknown-key"),
    pytest.param({"server": {"port": "70000"}}, {}, FILE,
                 "server.port: found 70000, expected an integer from 1 to 65535",
                 id="port-out-of-range"),
    pytest.param({"paths": {"state_dir": '"{tmp}/afile/state"'}}, {}, FILE,
                 "paths.state_dir: found {tmp}/afile/state (Not a directory)",
                 id="state-dir-unwritable"),
    pytest.param({}, {"APPLIANCE_SERVER_PORT": "abc"}, "APPLIANCE_SERVER_PORT",
                 "server.port: found 'abc' (str), expected an integer", id="env-port-abc"),
    pytest.param(None, {}, FILE, "found no such file", id="file-missing"),
    pytest.param({"database": {"url": '"mysql://app:hunter2@db/app"'}}, {}, FILE,
                 "database.url: found 'mysql://app:***@db/app'", id="db-url-masked"),
]


@pytest.mark.parametrize(("content", "env", "source", "detail"), CLI_BAD)
def test_cli_exits_78_with_one_message(tmp: Path, content: Sections | str | None,
                                       env: dict[str, str], source: str, detail: str) -> None:
    path = config_path(tmp, content)
    before = snapshot(tmp)
    result = run_cli("--config", str(path), "serve", env=env, timeout=30)
    source = str(path) if source == FILE else source
    assert result.returncode == 78, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith(f"appliance: configuration error in {source}"), result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[1].startswith("  hint: "), result.stderr
    assert "docs/configuration.md" in lines[1]
    assert detail.replace("{tmp}", str(tmp)) in lines[0]
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr
    assert snapshot(tmp) == before, "nothing (database, lock, state dir) may be created"


def test_cli_bad_env_with_dev_profile_creates_nothing(tmp: Path) -> None:
    """`--dev` writes under ./.appliance/ of the working directory: a bad override must
    stop it before it creates that folder."""
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env["APPLIANCE_SERVER_PORT"] = "0"
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-m", "appliance", "--dev", "serve"], cwd=work,
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 78, result.stderr
    assert result.stderr.startswith("appliance: configuration error in APPLIANCE_SERVER_PORT")
    assert list(work.iterdir()) == []


# --- generated bad values, per key type ----------------------------------------------------

WRONG_TYPE: dict[Any, list[str]] = {  # TOML literals no key of that type may accept
    int: ['"x"', '"8080"', "1.5", "[]", "{}", "true", "false", "[1]", "1979-05-27",
          "07:32:00"],
    str: ["1", "1.5", "[]", "{}", "true", '["a"]', "1979-05-27T07:32:00Z"],
    tuple[str, ...]: ['"x"', '""', "1", "[1]", '["a", 1]', "{}", "true", '[["a"]]', "[{}]",
                '["a", true]'],
    Path: ["1", "1.5", "[]", "{}", "true", '["/x"]', '"relative"', '"./x"', '""'],
    Path | None: ["1", "1.5", "[]", "{}", "true", '["/x"]', '"relative"', '"./x"'],
    float: ['"x"', '"0.5"', '""', "[]", "{}", "true", "false", "[0.5]", "1979-05-27",
            "07:32:00"],
    bool: ['"yes"', '"true"', '"on"', '""', "1", "0", "1.0", "[]", "{}", "[true]",
           "1979-05-27"],
    Mapping[str, str]: ['"x"', '""', "1", "[]", '["a"]', "true", "{ a = 1 }", '{ a = ["b"] }'],
    Mapping[str, ServiceClass]: ['"x"', "1", "[]", "{ a = 1 }", "{ Big = {} }",
                                 "{ a = { share = 0 } }", "{ a = { colour = 1 } }",
                                 "{ batch = { share = 1.0 } }",
                                 "{ interactive = { ttft_slo_seconds = -1 } }",
                                 '{ interactive = { priority = "high" } }',
                                 "{ interactive = { preemptible = true } }"],
}
POSITIVE_INT = ["0", "-1", "-9999"]
NON_NEGATIVE_INT = ["-1", "-9999"]
PORT = ["0", "-1", "65536", "70000", str(2**63)]
# Right type, outside what the key's check allows. A pattern (fnmatch) names the keys.
OUT_OF_RANGE: dict[str, list[str]] = {
    "*.port": PORT,
    "auth.*": POSITIVE_INT,
    "logging.level": ['"LOUD"', '""', '"INFO "', '"trace"'],
    "database.url": ['"x"', '"mysql://a@b/c"', '"sqlite:"', '"sqlite:///rel.db"',
                     '"sqlite:///:memory:"', '"postgresql+psycopg2://a@b/c"', '"http://x"'],
    "engine.runner": ['"docker"', '""', '"Systemd"', '"process "', '"systemd,process"'],
    "engine.command": ["[]", '[""]', '["", "serve"]'],
    "engine.tp_size": POSITIVE_INT,
    "engine.dcp_size": POSITIVE_INT,
    "engine.hung_after_minutes": POSITIVE_INT,
    "engine.kill_after_seconds": POSITIVE_INT,
    "engine.max_retries": NON_NEGATIVE_INT,
    "engine.drain_seconds": NON_NEGATIVE_INT,
    "engine.mem_fraction_static": ["0", "0.0", "-0.0", "1", "1.0", "1.5", "-0.5", "nan",
                                   "inf", "-inf"],
    "engine.mamba_full_memory_ratio": ["0", "0.0", "-0.0", "-1", "-0.5", "nan", "-inf"],
    "gpu.expected_count": NON_NEGATIVE_INT,
}


def generated_bad_values() -> list[tuple[str, str]]:
    cases = []
    for key in ALL_KEYS:
        cases += [(key, literal) for literal in WRONG_TYPE[HINTS[key]]]
        for pattern, literals in OUT_OF_RANGE.items():
            if fnmatch.fnmatchcase(key, pattern):
                cases += [(key, literal) for literal in literals]
    return cases


def test_out_of_range_patterns_name_real_keys() -> None:
    """A typo in OUT_OF_RANGE would silently test nothing."""
    unmatched = [p for p in OUT_OF_RANGE if not fnmatch.filter(ALL_KEYS, p)]
    assert not unmatched


def test_generated_bad_values_name_their_key(tmp: Path) -> None:
    cases = generated_bad_values()
    assert len(cases) > 100
    failures = []
    for key, literal in cases:
        section, name = key.split(".")
        path = write_config(tmp, {section: {name: literal}})
        try:
            load_config(path, env={}, check_dirs=False)
        except ConfigError as err:
            if key not in err.key or key not in str(err) or err.exit_code != 78:
                failures.append(f"{key} = {literal}: {err}")
        else:
            failures.append(f"{key} = {literal}: accepted")
    assert not failures, "\n".join(failures)


def test_generated_bad_env_values_name_the_variable(tmp: Path) -> None:
    bad = {int: ["x", "1.5", "", "true", "0x10", "8080a"], Path: ["", "relative", "./x"],
           Path | None: ["relative", "./x"],
           float: ["x", "", "true", "0,5", "0.5.1", "0x1", "1/2", "nan"],
           bool: ["", "maybe", "2", "-1", "y", "n", "t", "f", "truee", "enabled", "1.0"]}
    failures = []
    for key in ALL_KEYS:
        var = "APPLIANCE_" + key.replace(".", "_").upper()
        for value in bad.get(HINTS[key], []):
            try:
                load_config(write_config(tmp, {}), env={var: value}, check_dirs=False)
            except ConfigError as err:
                if err.source != var or err.key != key or not str(err).startswith(
                        f"configuration error in {var}: {key}"):
                    failures.append(f"{var}={value!r}: {err}")
            else:
                failures.append(f"{var}={value!r}: accepted")
    assert not failures, "\n".join(failures)


# --- good inputs ---------------------------------------------------------------------------


def test_defaults(tmp: Path) -> None:
    config = load_config(write_config(tmp, {}), env={})
    assert config.server == type(config.server)()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8080)
    assert config.server.allowed_hosts == ("127.0.0.1", "localhost", "::1")
    assert not config.tls and config.server.tls_key is None
    assert config.auth == type(config.auth)() and config.logging.level == "INFO"
    assert config.paths.state_dir == tmp / "state"
    assert config.database_url == f"sqlite:///{tmp / 'state' / 'appliance.db'}"
    assert config.source == str(tmp / "appliance.toml") and not config.dev
    assert (tmp / "state").is_dir() and (tmp / "log").is_dir()
    assert not (tmp / "models").exists()  # only state and log are created
    assert not list((tmp / "state").iterdir())  # the probe file is gone


GOOD: list[Any] = [
    pytest.param({"server": {"host": '"10.0.0.5"', "port": "1"}}, {},
                 {"server.host": "10.0.0.5", "server.port": 1}, id="port-1"),
    pytest.param({"server": {"port": "65535"}}, {}, {"server.port": 65535}, id="port-65535"),
    pytest.param({"server": {"allowed_hosts": "[]"}}, {}, {"server.allowed_hosts": ()},
                 id="no-hosts"),
    pytest.param({"server": {"tls_cert": '"{tmp}/cert.pem"', "tls_key": '"{tmp}/key.pem"'}},
                 {}, {"server.tls_cert": "{tmp}/cert.pem", "tls": True}, id="tls"),
    pytest.param({"server": {"tls_cert": '""', "tls_key": '""'}}, {},
                 {"server.tls_cert": None, "tls": False}, id="tls-empty"),
    pytest.param({"server": {"tls_cert": '"{tmp}/cert.pem"', "tls_key": '"{tmp}/key.pem"'}},
                 {"APPLIANCE_SERVER_TLS_CERT": "", "APPLIANCE_SERVER_TLS_KEY": ""},
                 {"server.tls_cert": None, "tls": False}, id="env-unsets-tls"),
    pytest.param({"server": {"port": "8000"}}, {"APPLIANCE_SERVER_PORT": "9090"},
                 {"server.port": 9090}, id="env-port-wins"),
    pytest.param({}, {"APPLIANCE_SERVER_PORT": " 9090 "}, {"server.port": 9090},
                 id="env-port-spaces"),
    pytest.param({}, {"APPLIANCE_SERVER_ALLOWED_HOSTS": "a,b"},
                 {"server.allowed_hosts": ("a", "b")}, id="env-list"),
    pytest.param({}, {"APPLIANCE_SERVER_ALLOWED_HOSTS": " a , b,,c "},
                 {"server.allowed_hosts": ("a", "b", "c")}, id="env-list-blanks"),
    pytest.param({}, {"APPLIANCE_LOGGING_LEVEL": "debug"}, {"logging.level": "debug"},
                 id="env-level-any-case"),
    pytest.param({}, {"PATH": "/bin", "APPLIANCEX_SERVER_PORT": "1"}, {"server.port": 8080},
                 id="env-other-variables-ignored"),
    pytest.param({"logging": {"level": '"warning"'}}, {}, {"logging.level": "warning"},
                 id="level-lowercase"),
    pytest.param({"database": {"url": '"postgresql://app:pw@db.lan:5432/app"'}}, {},
                 {"database.url": "postgresql://app:pw@db.lan:5432/app"}, id="db-postgres"),
    pytest.param({"database": {"url": '"postgresql+psycopg://app@db/app"'}}, {},
                 {"database.url": "postgresql+psycopg://app@db/app"}, id="db-psycopg"),
    pytest.param({"database": {"url": '"sqlite:///{tmp}/other.db"'}}, {},
                 {"database.url": "sqlite:///{tmp}/other.db"}, id="db-sqlite-absolute"),
    pytest.param({"auth": {"session_idle_minutes": "1", "login_window_seconds": "86400"}}, {},
                 {"auth.session_idle_minutes": 1, "auth.login_window_seconds": 86400},
                 id="auth"),
    pytest.param("# only comments\n[paths]\nstate_dir = '{tmp}/s'\nlog_dir = '{tmp}/l'\n", {},
                 {"paths.state_dir": "{tmp}/s", "server.port": 8080}, id="partial-file"),
    # [engine] and [gpu]
    pytest.param({}, {}, {"engine.runner": "systemd",
                          "engine.command": ("/opt/appliance/engine/bin/sglang",),
                          "engine.venv": Path("/opt/appliance/engine"),
                          "engine.mem_fraction_static": 0.93, "engine.speculative": False,
                          "engine.extra_args": (), "gpu.expected_count": 8,
                          "gpu.expected_model": "B300"}, id="engine-defaults"),
    pytest.param({"engine": {"runner": '"process"', "command": '["/usr/bin/python3", "-m", "x"]',
                             "venv": '""'}}, {},
                 {"engine.runner": "process", "engine.command": ("/usr/bin/python3", "-m", "x"),
                  "engine.venv": None}, id="engine-process"),
    pytest.param({"engine": {"extra_args": '["--context-length", "65536", "--enable-metrics"]'}},
                 {}, {"engine.extra_args": ("--context-length", "65536", "--enable-metrics")},
                 id="engine-extra-args"),
    pytest.param({}, {"APPLIANCE_ENGINE_COMMAND": "a,b"}, {"engine.command": ("a", "b")},
                 id="env-command"),
    pytest.param({}, {"APPLIANCE_ENGINE_EXTRA_ARGS": "--enable-metrics, --page-size,64"},
                 {"engine.extra_args": ("--enable-metrics", "--page-size", "64")},
                 id="env-extra-args"),
    pytest.param({}, {"APPLIANCE_ENGINE_VENV": ""}, {"engine.venv": None}, id="env-unsets-venv"),
    pytest.param({"engine": {"mamba_full_memory_ratio": "2", "mem_fraction_static": "0.5"}},
                 {}, {"engine.mamba_full_memory_ratio": 2.0, "engine.mem_fraction_static": 0.5},
                 id="float-from-toml-integer"),
    pytest.param({"engine": {"mamba_full_memory_ratio": "1e-3",
                             "mem_fraction_static": "0.999"}}, {},
                 {"engine.mamba_full_memory_ratio": 0.001,
                  "engine.mem_fraction_static": 0.999}, id="float-edges"),
    pytest.param({}, {"APPLIANCE_ENGINE_MEM_FRACTION_STATIC": " 0.85 ",
                      "APPLIANCE_ENGINE_MAMBA_FULL_MEMORY_RATIO": "3"},
                 {"engine.mem_fraction_static": 0.85, "engine.mamba_full_memory_ratio": 3.0},
                 id="env-floats"),
    pytest.param({"engine": {"speculative": "true"}}, {}, {"engine.speculative": True},
                 id="bool-true"),
    pytest.param({"engine": {"speculative": "false"}}, {}, {"engine.speculative": False},
                 id="bool-false"),
    pytest.param({"engine": {"speculative": "false"}}, {"APPLIANCE_ENGINE_SPECULATIVE": "yes"},
                 {"engine.speculative": True}, id="env-bool-yes-wins"),
    pytest.param({"engine": {"port": "30001", "max_retries": "0", "drain_seconds": "0"},
                  "gpu": {"expected_count": "0", "expected_model": '"H200"'}}, {},
                 {"engine.port": 30001, "engine.max_retries": 0, "engine.drain_seconds": 0,
                  "gpu.expected_count": 0, "gpu.expected_model": "H200"}, id="zeros-allowed"),
]

ENV_BOOLS = [("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True),
             (" on ", True), ("0", False), ("false", False), ("False", False), ("no", False),
             ("OFF", False), ("\tno\n", False)]


@pytest.mark.parametrize(("value", "want"), ENV_BOOLS)
def test_env_bool_spellings(tmp: Path, value: str, want: bool) -> None:
    opposite = "false" if want else "true"
    path = write_config(tmp, {"engine": {"speculative": opposite}})
    config = load_config(path, env={"APPLIANCE_ENGINE_SPECULATIVE": value}, check_dirs=False)
    assert config.engine.speculative is want


def test_floats_are_floats(tmp: Path) -> None:
    """A TOML integer (or an env integer) given for a number key is held as a float."""
    path = write_config(tmp, {"engine": {"mamba_full_memory_ratio": "2"}})
    config = load_config(path, env={}, check_dirs=False)
    assert type(config.engine.mamba_full_memory_ratio) is float
    assert config.engine.mamba_full_memory_ratio == 2.0
    config = load_config(path, env={"APPLIANCE_ENGINE_MAMBA_FULL_MEMORY_RATIO": "4"},
                         check_dirs=False)
    assert type(config.engine.mamba_full_memory_ratio) is float
    assert config.engine.mamba_full_memory_ratio == 4.0


@pytest.mark.parametrize(("content", "env"), [
    pytest.param({"engine": {"mamba_full_memory_ratio": "inf"}}, {}, id="toml-inf"),
    pytest.param({}, {"APPLIANCE_ENGINE_MAMBA_FULL_MEMORY_RATIO": "inf"}, id="env-inf"),
    pytest.param({}, {"APPLIANCE_ENGINE_MAMBA_FULL_MEMORY_RATIO": "1e400"}, id="env-1e400"),
])
def test_infinite_ratio_is_rejected(tmp: Path, content: Sections, env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp, content), env=env, check_dirs=False)
    assert caught.value.key == "engine.mamba_full_memory_ratio"


def get_value(config: Config, key: str) -> Any:
    if "." not in key:
        return getattr(config, key)
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


@pytest.mark.parametrize(("content", "env", "expected"), GOOD)
def test_good_input_loads(tmp: Path, content: Sections | str, env: dict[str, str],
                          expected: dict[str, Any]) -> None:
    config = load_config(write_config(tmp, content), env=env)
    for key, want in expected.items():
        got = get_value(config, key)
        if isinstance(want, str) and "{tmp}" in want:
            want = want.replace("{tmp}", str(tmp))
            got = str(got)
        assert got == want, key


def test_dev_profile_puts_everything_under_its_root(tmp: Path) -> None:
    config = load_config(dev=True, dev_root=tmp / "dev", env={})
    root = tmp / "dev"
    assert config.dev and config.source == "built-in defaults"
    assert config.paths.state_dir == root / "state"
    assert config.paths.models_dir == root / "models"
    assert config.paths.log_dir == root / "log"
    assert config.database_url == f"sqlite:///{root / 'state' / 'appliance.db'}"
    assert (root / "state").is_dir() and (root / "log").is_dir()


def test_dev_profile_runs_the_engine_emulator(tmp: Path) -> None:
    config = load_config(dev=True, dev_root=tmp / "dev", env={}, check_dirs=False)
    assert config.engine.runner == "process"
    assert config.engine.command == (sys.executable, "-m", "appliance.testing.fake_sglang")
    assert config.engine.command[-1] == "appliance.testing.fake_sglang"
    assert config.engine.venv is None
    # the rest of [engine] and all of [gpu] keep their defaults
    defaults = type(config.engine)()
    for field in dataclasses.fields(config.engine):
        if field.name not in ("runner", "command", "venv"):
            assert getattr(config.engine, field.name) == getattr(defaults, field.name)
    assert config.gpu == type(config.gpu)()
    # without --dev, the production values
    prod = load_config(write_config(tmp, {}), env={}, check_dirs=False)
    assert (prod.engine.runner, prod.engine.venv) == ("systemd", Path("/opt/appliance/engine"))


def test_file_and_env_override_dev_engine_values(tmp: Path) -> None:
    path = write_config(tmp, '[engine]\nrunner = "systemd"\nvenv = "{tmp}/venv"\n'
                             'command = ["{tmp}/venv/bin/sglang"]\n')
    config = load_config(path, dev=True, dev_root=tmp / "dev", env={}, check_dirs=False)
    assert config.engine.runner == "systemd"
    assert config.engine.venv == tmp / "venv"
    assert config.engine.command == (str(tmp / "venv" / "bin" / "sglang"),)
    assert config.paths.state_dir == tmp / "dev" / "state"  # the dev paths stay
    # a file setting only one engine key leaves the dev profile's others
    path = write_config(tmp, '[engine]\ncommand = ["python3", "-m", "other"]\n', "one.toml")
    config = load_config(path, dev=True, dev_root=tmp / "dev", env={}, check_dirs=False)
    assert config.engine.command == ("python3", "-m", "other")
    assert (config.engine.runner, config.engine.venv) == ("process", None)
    # and the environment beats both
    config = load_config(path, dev=True, dev_root=tmp / "dev", check_dirs=False,
                         env={"APPLIANCE_ENGINE_RUNNER": "systemd",
                              "APPLIANCE_ENGINE_COMMAND": "/opt/sglang,--verbose"})
    assert config.engine.runner == "systemd"
    assert config.engine.command == ("/opt/sglang", "--verbose")


def test_dev_profile_relative_root_is_made_absolute(tmp: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp)
    config = load_config(dev=True, env={})  # default root: ./.appliance
    assert config.paths.state_dir == tmp / ".appliance" / "state"
    assert config.paths.state_dir.is_absolute()


def test_production_default_file_is_required(tmp: Path) -> None:
    if DEFAULT_CONFIG_PATH.exists():
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists on this machine")
    with pytest.raises(ConfigError) as caught:
        load_config(env={})
    assert caught.value.source == str(DEFAULT_CONFIG_PATH)
    assert caught.value.found == "no such file"


def test_config_is_frozen(tmp: Path) -> None:
    config = load_config(write_config(tmp, {}), env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dev = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.paths = config.paths  # type: ignore[misc]


# --- precedence: defaults < --dev profile < file < env -------------------------------------

# Which layers set paths.log_dir and server.port, and which value must win.
PRECEDENCE = [
    pytest.param(False, False, False, "default", id="defaults"),
    pytest.param(True, False, False, "dev", id="dev-over-defaults"),
    pytest.param(False, True, False, "file", id="file-over-defaults"),
    pytest.param(True, True, False, "file", id="file-over-dev"),
    pytest.param(False, False, True, "env", id="env-over-defaults"),
    pytest.param(True, False, True, "env", id="env-over-dev"),
    pytest.param(False, True, True, "env", id="env-over-file"),
    pytest.param(True, True, True, "env", id="env-over-all"),
]


@pytest.mark.parametrize(("dev", "file", "env", "winner"), PRECEDENCE)
def test_precedence(tmp: Path, dev: bool, file: bool, env: bool, winner: str) -> None:
    log_dirs = {"default": Path("/var/log/appliance"), "dev": tmp / "dev" / "log",
                "file": tmp / "file-log", "env": tmp / "env-log"}
    ports = {"default": 8080, "dev": 8080, "file": 8001, "env": 8002}
    venvs = {"default": Path("/opt/appliance/engine"), "dev": None, "file": tmp / "file-venv",
             "env": tmp / "env-venv"}
    body = (f'[paths]\nlog_dir = "{log_dirs["file"]}"\n[server]\nport = 8001\n'
            f'[engine]\nvenv = "{venvs["file"]}"\n')
    path = write_config(tmp, body if file else "# sets nothing\n")
    variables = {"APPLIANCE_PATHS_LOG_DIR": str(log_dirs["env"]),
                 "APPLIANCE_SERVER_PORT": "8002",
                 "APPLIANCE_ENGINE_VENV": str(venvs["env"])} if env else {}
    config = load_config(path, env=variables, dev=dev, dev_root=tmp / "dev", check_dirs=False)
    assert config.paths.log_dir == log_dirs[winner]
    assert config.server.port == ports[winner]
    assert config.engine.venv == venvs[winner]
    # The dev profile's other paths survive a file or env that sets only log_dir.
    if dev:
        assert config.paths.state_dir == tmp / "dev" / "state"


# --- describe(): what the Settings page and /api/v1/settings show -------------------------


def test_describe_masks_database_password(tmp: Path) -> None:
    url = "postgresql://appliance:s3cr%40t-hunter2@db.lan:5432/appliance?sslmode=require"
    config = load_config(write_config(tmp, {"database": {"url": f'"{url}"'}}), env={})
    rows = {key: value for key, value, _doc in describe(config)}
    assert rows["database.url"] == "postgresql://appliance:***@db.lan:5432/appliance?sslmode=require"
    assert config.database.url == url  # the real value is untouched, only the view masks
    text = repr(describe(config))
    assert "hunter2" not in text and "s3cr" not in text


@pytest.mark.parametrize(("url", "shown"), [
    ("", ""),
    ("sqlite:////var/lib/appliance/appliance.db", "sqlite:////var/lib/appliance/appliance.db"),
    ("postgresql://app@db/app", "postgresql://app@db/app"),
    ("postgresql+psycopg://app:hunter2@db/app", "postgresql+psycopg://app:***@db/app"),
    ("postgresql://app@db/app?password=hunter2", "postgresql://app@db/app?password=***"),
    ("postgresql://app:hunter2@db:notaport/app", "postgresql://***@db:notaport/app"),
    ("postgresql:app:hunter2@db/app", "postgresql:***@db/app"),
])
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    # describe() goes through it even for a Config built without load_config
    rows = dict((k, v) for k, v, _ in describe(Config(database=DatabaseConfig(url=url))))
    assert rows["database.url"] == shown


def test_describe_lists_every_key_once(tmp: Path) -> None:
    config = load_config(write_config(tmp, {}), env={"APPLIANCE_SERVER_ALLOWED_HOSTS": "a,b"})
    rows = describe(config)
    assert [key for key, _, _ in rows] == ALL_KEYS
    shown = {key: value for key, value, _ in rows}
    assert shown["server.allowed_hosts"] == "a, b"
    assert shown["server.tls_cert"] == "" and shown["server.port"] == "8080"
    assert shown["engine.command"] == "/opt/appliance/engine/bin/sglang"
    assert shown["engine.mem_fraction_static"] == "0.93"
    assert shown["engine.speculative"] == "False" and shown["engine.extra_args"] == ""
    assert all(doc for _, _, doc in rows)


# --- docs/configuration.md cannot drift ------------------------------------------------------

TYPE_WORDS = {int: "integer", float: "number", bool: "boolean", str: "string",
              tuple[str, ...]: "list of strings", Path: "path", Path | None: "optional path",
              Mapping[str, str]: "table of strings",
              Mapping[str, ServiceClass]: "table of classes"}
NOT_KEYS = {"appliance.toml", "appliance.db", "appliance.lock"}  # dotted names that are files
ROW = re.compile(r"^\|\s*`(?P<key>[a-z_]+\.[a-z_]+)`\s*\|\s*(?P<type>[^|]+?)\s*\|"
                 r"\s*(?P<default>[^|]+?)\s*\|", re.MULTILINE)


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def toml_blocks(text: str) -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_doc_names_every_key_and_no_other() -> None:
    text = doc_text()
    dotted = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", text)) - NOT_KEYS
    assert sorted(set(ALL_KEYS) - dotted) == [], "keys missing from docs/configuration.md"
    assert sorted(dotted - set(ALL_KEYS)) == [], "docs/configuration.md names unknown keys"
    headings = set(re.findall(r"^## `\[([a-z_]+)\]`", text, re.MULTILINE))
    assert headings == set(SECTIONS)
    documented_vars = set(re.findall(r"\bAPPLIANCE_[A-Z_]+[A-Z]\b", text))
    assert documented_vars <= ENV_NAMES, documented_vars - ENV_NAMES


def _as_config_value(literal: Any, like: Any) -> Any:
    """A TOML literal in the form the frozen config holds (paths, tuples)."""
    if isinstance(like, Path):
        return Path(literal)
    return tuple(literal) if isinstance(like, tuple) else literal


def test_doc_tables_give_each_key_its_type_and_default() -> None:
    rows = {m["key"]: m for m in ROW.finditer(doc_text())}
    assert sorted(rows) == sorted(ALL_KEYS)
    defaults = {f"{s}.{f.name}": getattr(cls(), f.name)
                for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    for key, row in rows.items():
        assert row["type"] == TYPE_WORDS[HINTS[key]], key
        shown = row["default"]
        if defaults[key] is None:
            assert shown == "unset", key
            continue
        literal = tomllib.loads(f"v = {shown.strip('`')}")["v"]
        assert _as_config_value(literal, defaults[key]) == defaults[key], key


def test_doc_error_example_is_what_the_daemon_prints(tmp: Path) -> None:
    path = write_config(tmp, {"server": {"port": "70000"}})
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    printed = "appliance: " + caught.value.as_text().replace(str(path), str(DEFAULT_CONFIG_PATH))
    assert printed in doc_text()


def test_doc_example_loads(tmp: Path) -> None:
    blocks = toml_blocks(doc_text())
    assert blocks, "docs/configuration.md has no ```toml example"
    env = {"APPLIANCE_PATHS_STATE_DIR": str(tmp / "state"),
           "APPLIANCE_PATHS_MODELS_DIR": str(tmp / "models"),
           "APPLIANCE_PATHS_LOG_DIR": str(tmp / "log"),
           "APPLIANCE_SERVER_TLS_CERT": str(tmp / "cert.pem"),
           "APPLIANCE_SERVER_TLS_KEY": str(tmp / "key.pem"),
           "APPLIANCE_GATEWAY_TLS_CERT": str(tmp / "cert.pem"),
           "APPLIANCE_GATEWAY_TLS_KEY": str(tmp / "key.pem")}
    complete = []
    for number, block in enumerate(blocks):
        path = write_config(tmp, block, name=f"example{number}.toml")
        config = load_config(path, env=env)
        parsed = tomllib.loads(block)
        keys = {f"{s}.{k}" for s, body in parsed.items() for k in body}
        for key in keys - {k for k in ALL_KEYS if "APPLIANCE_" + k.replace(".", "_").upper()
                           in env}:
            section, name = key.split(".")
            value = get_value(config, key)
            assert value == _as_config_value(parsed[section][name], value), key
        if keys == set(ALL_KEYS):
            complete.append(number)
    assert complete, "no ```toml block in docs/configuration.md sets every key"


@pytest.mark.parametrize(("content", "key"), [
    pytest.param({"engine": {"kv_cache_dtype": '"fp9"'}}, "engine.kv_cache_dtype", id="kv-dtype"),
    pytest.param({"engine": {"port": "8080"}}, "engine.port", id="engine-port-is-console-port"),
])
def test_engine_values_checked_at_load(tmp: Path, content: Sections, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp, content), env={}, check_dirs=False)
    assert caught.value.key == key


@pytest.mark.parametrize("model", ["../etc", "a/b/c", "a/..b", "justone", "/abs/path"])
def test_engine_model_must_be_a_plain_repo_id(tmp: Path, model: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp, {"engine": {"model": f'"{model}"'}}), env={},
                    check_dirs=False)
    assert caught.value.key == "engine.model"
