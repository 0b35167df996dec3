"""The daemon's configuration: one TOML file plus `APPLIANCE_<SECTION>_<KEY>` overrides.

Loaded once in `main()` into frozen values and passed down; nothing reads the file or the
environment anywhere else. Every problem is a `ConfigError` naming the file (or variable), the
key, what was found and what was expected, so the daemon can exit 78 with one clear line.

The schema is the dataclasses below: a section is a dataclass, a key is a field, and the
field's type plus its `check` metadata say what is allowed. docs/configuration.md documents
the same keys; `tests/test_config.py` keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_type_hints

from appliance.errors import ConfigError
from appliance.gateway.classes import ClassProblem, ServiceClass, parse_classes, show_classes

DEFAULT_CONFIG_PATH = Path("/etc/appliance/appliance.toml")
DEV_ROOT = Path(".appliance")
ENV_PREFIX = "APPLIANCE_"

Check = Callable[[Any], str | None]
Show = Callable[[Any], str]

DB_DRIVERS = ("sqlite", "postgresql", "postgresql+psycopg")


def _port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else "an integer from 1 to 65535"


def _positive(value: int) -> str | None:
    return None if value > 0 else "a positive integer"


def _absolute(value: Path) -> str | None:
    return None if value.is_absolute() else "an absolute path"


def _level(value: str) -> str | None:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    return None if value.upper() in levels else "one of " + ", ".join(levels)


def _db_url(value: str) -> str | None:
    """Parse it the way the database layer will, so a bad URL is a config error (exit 78)."""
    from sqlalchemy.engine import make_url  # here: a config error should not wait on SQLAlchemy
    from sqlalchemy.exc import ArgumentError

    if value == "":
        return None
    expected = ("empty (SQLite in the state dir), sqlite:////absolute/path.db or "
                "postgresql://user:password@host/database")
    try:
        url = make_url(value)
    except (ArgumentError, ValueError):
        return expected
    if url.drivername not in DB_DRIVERS:
        return expected
    if url.drivername == "sqlite" and not (
        url.database and url.database != ":memory:" and Path(url.database).is_absolute()
    ):
        return "a SQLite URL naming an absolute file path, e.g. sqlite:////srv/appliance.db"
    return None


def mask_url(value: str) -> str:
    """A database URL fit to show: any password (user info or `?password=`) replaced."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if not value:
        return value
    try:
        url = make_url(value)
    except (ArgumentError, ValueError):
        # Not parseable, so not usable either; still never echo what may be user:password.
        if "@" not in value:
            return value
        scheme = re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/*", value)
        return (scheme.group(0) if scheme else "") + "***@" + value.rpartition("@")[2]
    query = {k: ("***" if k.lower() == "password" else v) for k, v in url.query.items()}
    shown = url.set(query=query).render_as_string(hide_password=True)
    return shown.replace("%2A%2A%2A", "***")


def _key(default: Any, check: Check | None = None, doc: str = "",
         show: Show | None = None) -> Any:
    metadata = {"check": check, "doc": doc, "show": show}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Where the admin console and API listen."""

    host: str = _key("127.0.0.1", doc="address the control plane binds")
    port: int = _key(8080, _port, "TCP port of the admin console and API")
    allowed_hosts: tuple[str, ...] = _key(
        ("127.0.0.1", "localhost", "::1"), doc="Host header values accepted (DNS-rebinding guard)"
    )
    tls_cert: Path | None = _key(None, _absolute, "PEM certificate; enables HTTPS")
    tls_key: Path | None = _key(None, _absolute, "PEM private key for tls_cert")
    cli_token_seconds: int = _key(120, _positive, "lifetime of the CLI's per-call API token; "
                                  "a command following a long job renews it")


@dataclasses.dataclass(frozen=True)
class PathsConfig:
    """Directories the appliance owns."""

    state_dir: Path = _key(
        Path("/var/lib/appliance"), _absolute, "database, launch specs, secrets"
    )
    models_dir: Path = _key(Path("/var/lib/appliance/models"), _absolute, "model weights")
    log_dir: Path = _key(Path("/var/log/appliance"), _absolute, "engine and daemon logs")


@dataclasses.dataclass(frozen=True)
class DatabaseConfig:
    """The one database both planes share."""

    url: str = _key(
        "", _db_url, "empty for SQLite in state_dir, or a PostgreSQL URL", show=mask_url
    )


def _local_login(value: str) -> str | None:
    return None if value in ("all", "break_glass") else '"all" or "break_glass"'


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Admin sessions and login throttling."""

    session_idle_minutes: int = _key(60, _positive, "a session ends after this much idleness")
    session_max_hours: int = _key(12, _positive, "a session ends this long after login")
    login_max_failures: int = _key(5, _positive, "failures per user+address before 429")
    login_window_seconds: int = _key(60, _positive, "window in which failures are counted")
    failed_login_retention_days: int = _key(
        30, _positive, "failed and refused login and cell join/peer audit entries are "
        "deleted after this")
    local_login: str = _key("all", _local_login,
                            '"all", or "break_glass": only break_glass_accounts log in locally')
    break_glass_accounts: tuple[str, ...] = _key(
        (), doc="local accounts that may log in when local_login is break_glass")


ROLES = ("viewer", "operator", "admin")  # the console's roles, least to most (auth/roles.py)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _issuer(value: str) -> str | None:
    """https, or plain http to loopback only (a provider on the box itself, or a test's)."""
    from urllib.parse import urlsplit

    if value == "":
        return None
    parts = urlsplit(value)
    if parts.scheme == "https" and parts.hostname:
        return None
    if parts.scheme == "http" and parts.hostname in LOOPBACK_HOSTS:
        return None
    return "an https:// issuer URL (plain http only on loopback), e.g. " \
           "https://login.microsoftonline.com/<tenant>/v2.0"


def _scopes(value: str) -> str | None:
    return None if "openid" in value.split() else 'space-separated scopes including "openid"'


def _role_map(value: Mapping[str, str]) -> str | None:
    bad = sorted(role for role in value.values() if role not in ROLES)
    if bad or any(not group for group in value):
        return "a table of group = role, each role one of " + ", ".join(ROLES)
    return None


def _show_map(value: Mapping[str, str]) -> str:
    return ", ".join(f"{group}={role}" for group, role in value.items())


@dataclasses.dataclass(frozen=True)
class OidcConfig:
    """Single sign-on to the console with OpenID Connect (auth/oidc.py)."""

    enabled: bool = _key(False, doc="offer 'Sign in with <display_name>' on the login page")
    issuer: str = _key("", _issuer, "the provider's issuer URL (discovery is read from it)")
    client_id: str = _key("", doc="this console's client id at the provider")
    client_secret_file: Path | None = _key(
        None, _absolute, "root-written file holding the client secret")
    scopes: str = _key("openid profile email groups", _scopes, "scopes asked for")
    groups_claim: str = _key("groups", doc="ID token claim holding the user's groups")
    role_map: Mapping[str, str] = dataclasses.field(  # a factory: a mapping is no default
        default_factory=lambda: MappingProxyType({}),
        metadata={"check": _role_map, "show": _show_map,
                  "doc": "table: group (name or id) = viewer, operator or admin"})
    display_name: str = _key("single sign-on", doc="provider name on the login button")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Daemon logging."""

    level: str = _key("INFO", _level, "DEBUG, INFO, WARNING or ERROR")


def _runner(value: str) -> str | None:
    return None if value in ("systemd", "process") else "systemd or process"


def _fraction(value: float) -> str | None:
    return None if 0.0 < value < 1.0 else "a number between 0 and 1 (exclusive)"


def _positive_float(value: float) -> str | None:
    return None if math.isfinite(value) and value > 0 else "a positive number"


def _nonnegative(value: int) -> str | None:
    return None if value >= 0 else "zero or a positive integer"


def _repo_id(value: str) -> str | None:
    part = r"[A-Za-z0-9][\w.-]{0,95}"
    ok = re.fullmatch(f"{part}/{part}", value) and ".." not in value
    return None if ok else "a Hub repo id like moonshotai/Kimi-K3 (org/name, no '..')"


def _kv_dtype(value: str) -> str | None:
    from appliance.engine.flags import KV_CACHE_DTYPES  # the pinned SGLang's choices

    return None if value in KV_CACHE_DTYPES else "one of " + ", ".join(KV_CACHE_DTYPES)


def _env_names(value: Mapping[str, str]) -> str | None:
    bad = [name for name in value if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
           or name == "NOTIFY_SOCKET"]
    return ("a table of NAME = value, each NAME a variable name (letters, digits, _; not "
            "NOTIFY_SOCKET)") if bad else None


def _command(value: tuple[str, ...]) -> str | None:
    return None if value and value[0] else "a non-empty list: the program, then its arguments"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The SGLang engine: how it is launched, where it listens, how it is supervised."""

    runner: str = _key("systemd", _runner,
                       "systemd (appliance-engine.service) or process (dev, demo, CI)")
    command: tuple[str, ...] = _key(
        ("/opt/appliance/engine/bin/sglang",), _command,
        "the engine program and leading arguments; `serve` and the flags follow",
    )
    venv: Path | None = _key(Path("/opt/appliance/engine"), _absolute,
                             "engine virtual environment, used to validate the argv")
    model: str = _key("moonshotai/Kimi-K3", _repo_id,
                      doc="Hub repo id; the files live in models_dir/<org>--<name>")
    served_model_name: str = _key("kimi-k3", doc="model name clients use")
    port: int = _key(30000, _port, "engine port on 127.0.0.1 (internal; the gateway fronts it)")
    tp_size: int = _key(8, _positive, "tensor parallel size (GPUs)")
    dcp_size: int = _key(8, _positive, "decode context parallel size")
    mem_fraction_static: float = _key(0.93, _fraction, "--mem-fraction-static")
    mamba_full_memory_ratio: float = _key(0.9, _positive_float,
                                          "state:KV memory split (the Tuning page sets it)")
    kv_cache_dtype: str = _key("fp8_e4m3", _kv_dtype, "--kv-cache-dtype")
    speculative: bool = _key(False, doc="DSPARK speculative decoding")
    extra_args: tuple[str, ...] = _key((), doc="operator flags appended to the argv")
    extra_env: Mapping[str, str] = dataclasses.field(  # a factory: a mapping is no default
        default_factory=lambda: MappingProxyType({}),
        metadata={"check": _env_names, "show": _show_map,
                  "doc": "table: NAME = value added to the engine's environment (e.g. "
                         "SGLANG_USE_CPU_ENGINE = \"1\" for SGLang on a CPU)"})
    hung_after_minutes: int = _key(15, _positive,
                                   "a load is hung only when no progress signal moved this long")
    max_retries: int = _key(3, _nonnegative, "crash retries before FAILED")
    drain_seconds: int = _key(300, _nonnegative, "how long a stop waits for in-flight requests")
    kill_after_seconds: int = _key(60, _positive, "SIGTERM to SIGKILL of the process group")


def _endpoint(value: str) -> str | None:
    ok = re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+(/[\w.~\-/]*)?", value)
    return None if ok else "an http(s) URL of a Hub-compatible endpoint, e.g. https://huggingface.co"


def _optional_repo_id(value: str) -> str | None:
    return None if value == "" else _repo_id(value)


# The same checks for values given outside the file (API and CLI overrides of one pull).
check_repo_id = _optional_repo_id
check_endpoint = _endpoint


def _secret(value: str) -> str:
    return "(set)" if value else ""


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """Where the model's weights come from and how they are downloaded and verified."""

    repo: str = _key("", _optional_repo_id, "Hub repo id to pull; empty: engine.model")
    revision: str = _key("main", doc="branch, tag or commit; resolved to a commit once")
    endpoint: str = _key("https://huggingface.co", _endpoint,
                         "the Hub or any Hub-compatible mirror")
    token: str = _key("", doc="Hub token (or HF_TOKEN / token_file); never shown",
                      show=_secret)
    token_file: Path | None = _key(None, _absolute, "file holding the Hub token")
    concurrency: int = _key(8, _positive, "files downloaded at once")
    bandwidth_limit_mib_s: int = _key(0, _nonnegative, "download cap in MiB/s; 0: no cap")
    stall_seconds: int = _key(60, _positive,
                              "a connection that delivered no bytes this long is retried")
    min_rate_kib_s: int = _key(64, _nonnegative,
                               "a connection slower than this over min_rate_window_seconds "
                               "is retried; 0: off")
    min_rate_window_seconds: int = _key(120, _positive, "window of the min_rate_kib_s check")
    retry_max_seconds: int = _key(60, _positive, "longest wait between retries (backoff cap)")
    reserve_gib: int = _key(50, _nonnegative, "free space kept on the models volume")
    hash_workers: int = _key(4, _positive, "files hashed at once by a full verification")
    prewarm: bool = _key(True, doc="read the shards into the page cache before a launch "
                                   "when host RAM comfortably exceeds the model")
    auto_refetch: bool = _key(False, doc="fetch files a full verification found damaged "
                                         "again at once (off: verify reports and quarantines; "
                                         "the operator starts the refetch)")


def _version(value: str) -> str | None:
    parts = value.split(".")
    return None if all(p.isdigit() for p in parts) else "a dotted version such as 580.95.05"


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """The box this appliance expects: any deviation is a finding."""

    expected_count: int = _key(8, _nonnegative, "GPUs the engine needs")
    expected_model: str = _key("B300", doc="text every GPU's name must contain")
    min_driver_version: str = _key("580.65.06", _version,
                                  "oldest NVIDIA driver accepted (dotted; CUDA 13 needs 580.65.06)")
    temperature_warn_c: int = _key(85, _positive, "GPU temperature that is a warning")
    temperature_critical_c: int = _key(92, _positive, "GPU temperature that is critical")


def _url_or_empty(value: str) -> str | None:
    ok = value == "" or value.startswith(("http://", "https://"))
    return None if ok else "empty (no webhook) or an http:// or https:// URL"


def mask_webhook(value: str) -> str:
    """A webhook URL fit to show: scheme and host only. Webhook URLs usually carry their secret
    in the path or query (Slack, Teams, ntfy), sometimes as user:password@."""
    from urllib.parse import urlsplit

    if not value:
        return value
    try:
        parts = urlsplit(value)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "***"
    if ":" in host:
        host = f"[{host}]"
    hidden = parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc
    return f"{parts.scheme}://{host}{port}" + ("/***" if hidden else parts.path)


def _percent(value: int) -> str | None:
    return None if 0 <= value <= 100 else "a percentage from 0 to 100"


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """The health monitor: how often each check runs, its thresholds, alerts and policy."""

    gpu_interval_seconds: int = _key(15, _positive, "GPU checks (NVML) every this often")
    engine_interval_seconds: int = _key(10, _positive, "/ready and /metrics every this often")
    host_interval_seconds: int = _key(30, _positive, "disk, memory and load every this often")
    nvml_timeout_seconds: int = _key(10, _positive, "an NVML read slower than this is hung")
    canary_interval_seconds: int = _key(
        300, _positive, "/health_generate and the latency canary at most this often")
    canary_max_load: int = _key(
        2, _nonnegative, "generation probes run only when running+queued requests are at "
        "most this (never on a busy engine)")
    canary_ttft_warn_ms: int = _key(5000, _positive, "canary time to first token that warns")
    generation_probes: bool = _key(
        True, doc="check the engine with generations (/health_generate, the canary); false "
        "for an engine that cannot generate (a hybrid model on a CPU): readiness is then "
        "/ready and no generation is ever sent")
    generate_timeout_seconds: int = _key(
        60, _positive, "a /health_generate or canary slower than this fails")
    restart_degraded_after_minutes: int = _key(
        0, _nonnegative, "restart an engine DEGRADED this long (never one that is loading); "
        "0: never restart automatically")
    models_free_warn_gib: int = _key(100, _nonnegative, "models volume free space that warns")
    models_free_critical_gib: int = _key(20, _nonnegative, "models volume free space, critical")
    state_free_warn_gib: int = _key(5, _nonnegative, "state volume free space that warns")
    state_free_critical_gib: int = _key(1, _nonnegative, "state volume free space, critical")
    memory_available_warn_percent: int = _key(10, _percent, "available RAM (%) that warns")
    shm_free_warn_gib: int = _key(4, _nonnegative, "free /dev/shm that warns")
    daemon_rss_warn_mib: int = _key(2048, _positive, "the daemon's own memory that warns")
    history_fine_hours: int = _key(24, _positive, "fine samples kept this long")
    history_hourly_days: int = _key(30, _positive, "hourly roll-ups kept this long")
    webhook_url: str = _key("", _url_or_empty, "alerts are POSTed here as JSON; empty: none",
                            show=mask_webhook)
    webhook_retries: int = _key(5, _nonnegative, "delivery retries (backoff doubles)")
    metrics_public: bool = _key(True, doc="serve /metrics without a login (for Prometheus); "
                                "false: an admin API token is needed")


def _host(value: str) -> str | None:
    return None if value.strip() else "an address such as 0.0.0.0 or 127.0.0.1"


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """The data plane: the OpenAI-compatible endpoint users reach (`appliance gateway`)."""

    # Users on the LAN reach the gateway; every request needs an API key.
    host: str = _key("0.0.0.0", _host,  # noqa: S104
                     "address the gateway binds (users reach it here)")
    port: int = _key(8000, _port, "TCP port of the OpenAI-compatible endpoint")
    max_concurrency: int = _key(0, _nonnegative, "requests forwarded at once; 0: the running "
                                "spec's qualified point, else the engine's own "
                                "slot count (its /server_info)")
    qualified_margin: int = _key(0, _nonnegative, "requests below the running spec's "
                                 "qualified point the gateway admits at (appliance qualify)")
    queue_max: int = _key(512, _nonnegative, "requests waiting for a slot, over all keys")
    queue_wait_seconds: int = _key(60, _positive, "longest wait for a slot before 429")
    max_body_mib: int = _key(32, _positive, "largest request body accepted (413 above)")
    first_byte_timeout_seconds: int = _key(
        900, _positive, "longest wait for the engine's first byte (prefill of a long prompt)")
    usage_retention_days: int = _key(90, _positive, "per-request usage rows kept; roll-ups "
                                     "are kept for good")
    tls_cert: Path | None = _key(None, _absolute, "PEM certificate; enables HTTPS")
    tls_key: Path | None = _key(None, _absolute, "PEM private key for tls_cert")
    classes: Mapping[str, ServiceClass] = dataclasses.field(  # [gateway.classes.NAME] tables
        default_factory=lambda: MappingProxyType({}),
        metadata={"show": show_classes, "doc": "service classes over the built-in interactive "
                  "and batch (appliance.gateway.classes): SLOs, share, priority"})


BACKUP_SCHEDULE_RE = re.compile(r"daily (?P<hour>[01]\d|2[0-3]):(?P<minute>[0-5]\d)")


def _backup_schedule(value: str) -> str | None:
    ok = value == "off" or BACKUP_SCHEDULE_RE.fullmatch(value)
    return None if ok else '"off" or "daily HH:MM" (24-hour, the box\'s local time)'


CELL_ROLES = ("unified", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl")  # of SGLang's choices, the two that move KV over RDMA


def _cell_role(value: str) -> str | None:
    return None if value in CELL_ROLES else "one of " + ", ".join(CELL_ROLES)


def _transfer_backend(value: str) -> str | None:
    return None if value in TRANSFER_BACKENDS else "one of " + ", ".join(TRANSFER_BACKENDS)


def _listen_address(value: str) -> str | None:
    import ipaddress

    if not value:
        return None
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return "empty (127.0.0.1) or this box's IP address on the cell network, e.g. 10.0.0.5"
    return None


def _router_host(value: str) -> str | None:
    import ipaddress

    try:
        ipaddress.ip_address(value)
    except ValueError:
        return "an IP address (127.0.0.1: the gateway on this box reaches the router)"
    return None


def _ratio_or_unset(value: float) -> str | None:
    ok = math.isfinite(value) and value >= 0
    return None if ok else "0 (SGLang sizes the host pool) or a positive number"


@dataclasses.dataclass(frozen=True)
class CellConfig:
    """This box's part in a cell of boxes: prefill/decode disaggregation on SGLang's own
    router (issue 17). `unified` is a box serving alone and adds nothing to the engine's argv;
    `prefill` and `decode` add SGLang's --disaggregation-* flags (engine/args.py, role layer)."""

    role: str = _key("unified", _cell_role, "unified (serves alone), prefill or decode")
    transfer_backend: str = _key("mooncake", _transfer_backend,
                                 "--disaggregation-transfer-backend: mooncake or nixl")
    ib_device: str = _key("", doc="--disaggregation-ib-device (e.g. mlx5_0,mlx5_1); empty: "
                          "the backend picks")
    bootstrap_port: int = _key(8998, _port, "--disaggregation-bootstrap-port: the prefill's "
                               "bootstrap server (SGLang's default 8998)")
    hierarchical_cache: bool = _key(False, doc="--enable-hierarchical-cache (prefix KV also "
                                    "kept in host DRAM) while the box is a prefill, as "
                                    "configured or as its head chose")
    hicache_ratio: float = _key(0.0, _ratio_or_unset, "--hicache-ratio (host pool : GPU pool); "
                                "0: SGLang sizes it to fit host memory")
    listen_address: str = _key("", _listen_address, "the engine's --host: this box's IP on the "
                                "cell network (set it before the box joins a cell); empty: "
                                "127.0.0.1")
    router_host: str = _key("127.0.0.1", _router_host, "on the head: the address SGLang's "
                            "router listens on (the gateway reaches it there)")
    router_port: int = _key(30100, _port, "on the head: the port SGLang's router listens on")
    router_metrics_port: int = _key(29000, _port, "on the head: the loopback port the router's "
                                    "Prometheus metrics listen on (the Cell page reads them)")
    bootstrap_timeout_s: int = _key(60, _positive, "prefill and decode: seconds a prefill keeps a "
                                    "request's KV waiting for its decode to take it "
                                    "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT; SGLang's 300 ties "
                                    "up a dead decode's prefill slots for 5 minutes)")
    waiting_timeout_s: int = _key(120, _positive, "prefill and decode: seconds a decode waits for "
                                  "a request's KV from its prefill "
                                  "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT; covers the longest "
                                  "prompt's prefill and its queue)")


def engine_host(config: Config) -> str:
    """The address the engine binds (its --host) and the box's own processes reach it at:
    cell.listen_address when set (a box of a cell: SGLang binds its HTTP port and a prefill's
    bootstrap server there, so the other boxes and the head's router can reach them), else
    127.0.0.1. It does not depend on the role: a member's role can change at run time (the head
    asks, appliance.cell.role_choice) without moving the address its daemon reaches the engine
    at. An unspecified address (0.0.0.0, ::) binds every interface, loopback too."""
    return config.cell.listen_address or "127.0.0.1"


def engine_url(config: Config) -> str:
    """http://HOST:PORT where this box's daemon, health probe, qualification and gateway
    reach the engine (`engine_host`, bracketed for IPv6; loopback for an unspecified one)."""
    host = engine_host(config)
    if host in ("0.0.0.0", "::"):  # noqa: S104 - bound to every interface, loopback included
        host = "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{config.engine.port}"


@dataclasses.dataclass(frozen=True)
class BackupConfig:
    """Scheduled backups (`appliance backup` by hand takes the same kind): where, when, how
    many are kept, and the passphrase that lets them include the secrets."""

    dir: Path | None = _key(None, _absolute, "where scheduled backups go; unset: "
                            "<state_dir>/backups")
    schedule: str = _key("daily 03:00", _backup_schedule,
                         '"daily HH:MM" (box time) or "off"')
    keep: int = _key(7, _positive, "scheduled backups kept; older ones are deleted")
    passphrase_file: Path | None = _key(
        None, _absolute, "root-written file holding the passphrase that encrypts the secrets "
        "in scheduled backups; unset: scheduled backups leave the secrets out")


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """The memory-split tuning's use of what the box really served (tuning/observed.py)."""

    min_observed_requests: int = _key(
        200, _positive, "observed requests (or engine-log decode samples) below which no "
        "change of the split is recommended from them")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole configuration; `source` says where it came from, for messages."""

    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    paths: PathsConfig = dataclasses.field(default_factory=PathsConfig)
    database: DatabaseConfig = dataclasses.field(default_factory=DatabaseConfig)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    oidc: OidcConfig = dataclasses.field(default_factory=OidcConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    gpu: GpuConfig = dataclasses.field(default_factory=GpuConfig)
    weights: WeightsConfig = dataclasses.field(default_factory=WeightsConfig)
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)
    backup: BackupConfig = dataclasses.field(default_factory=BackupConfig)
    tuning: TuningConfig = dataclasses.field(default_factory=TuningConfig)
    cell: CellConfig = dataclasses.field(default_factory=CellConfig)
    source: str = "built-in defaults"
    dev: bool = False

    @property
    def database_url(self) -> str:
        return self.database.url or f"sqlite:///{self.paths.state_dir / 'appliance.db'}"

    @property
    def tls(self) -> bool:
        return self.server.tls_cert is not None

    @property
    def weights_repo(self) -> str:
        """The repo `weights pull` fetches: weights.repo, else the engine's model."""
        return self.weights.repo or self.engine.model


SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "paths": PathsConfig,
    "database": DatabaseConfig,
    "auth": AuthConfig,
    "logging": LoggingConfig,
    "engine": EngineConfig,
    "gpu": GpuConfig,
    "weights": WeightsConfig,
    "gateway": GatewayConfig,
    "health": HealthConfig,
    "backup": BackupConfig,
    "tuning": TuningConfig,
    "oidc": OidcConfig,
    "cell": CellConfig,
}


def dev_paths(root: Path) -> dict[str, Path]:
    """The `--dev` profile: everything under one folder (default `./.appliance/`)."""
    root = root.absolute()
    return {"state_dir": root / "state", "models_dir": root / "models", "log_dir": root / "log"}


# The dev profile runs the engine emulator as a detached process (no systemd, no GPU).
DEV_ENGINE: dict[str, Any] = {
    "runner": "process",
    "command": (sys.executable, "-m", "appliance.testing.fake_sglang"),
    "venv": None,
}


def load_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    dev: bool = False,
    dev_root: Path = DEV_ROOT,
    check_dirs: bool = True,
    default_file_optional: bool = False,
) -> Config:
    """Read, merge and validate the configuration. Raises `ConfigError` on the first problem.

    Order (later wins): built-in defaults, the `--dev` profile, the TOML file, environment.
    A missing file is an error only when the path was given explicitly or is the production
    default outside `--dev` (unless `default_file_optional`: commands that need nothing of
    the box, such as `tune predict` with every input given, run on a laptop too).
    """
    env = os.environ if env is None else env
    file_path = path if path is not None else (None if dev else DEFAULT_CONFIG_PATH)
    if path is None and default_file_optional and not DEFAULT_CONFIG_PATH.exists():
        file_path = None
    raw: dict[str, Any] = {}
    source = "built-in defaults"
    if file_path is not None:
        source = str(file_path)
        raw = _read_toml(file_path)

    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if dev:
        values["paths"].update(dev_paths(dev_root))
        values["engine"].update(DEV_ENGINE)
        values["gateway"]["host"] = "127.0.0.1"  # a developer's box: loopback only
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(
                source, section, f"unknown section [{section}]", "one of " + ", ".join(SECTIONS)
            )
        if not isinstance(body, dict):
            raise ConfigError(source, section, type(body).__name__, f"a [{section}] table")
        for key, value in body.items():
            values[section][key] = _convert(source, section, key, value, from_env=False)
    if env.get("HF_TOKEN"):  # the Hub's own convention; config and APPLIANCE_* win
        values["weights"]["token"] = env["HF_TOKEN"]
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        section, key = _env_target(var)
        values[section][key] = _convert(var, section, key, value, from_env=True)

    sections = {name: SECTIONS[name](**values[name]) for name in SECTIONS}
    config = Config(**sections, source=source, dev=dev)
    _cross_check(config)
    if check_dirs:
        ensure_writable_dirs(config)
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(
            str(path), "", "no such file", "a TOML file (the installer writes one; or --dev)"
        ) from None
    except PermissionError:
        raise ConfigError(
            str(path), "", "a file this user may not read", "a readable file"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "", f"invalid TOML ({exc})", "valid TOML syntax") from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), "", "bytes that are not UTF-8", "UTF-8 text") from None
    except OSError as exc:  # a directory, a path through a regular file, an I/O error...
        raise ConfigError(
            str(path), "", f"a path that cannot be read ({exc.strerror or exc})",
            "a readable TOML file",
        ) from None


def _env_target(var: str) -> tuple[str, str]:
    rest = var[len(ENV_PREFIX) :].lower()
    for section in SECTIONS:
        if rest.startswith(section + "_"):
            key = rest[len(section) + 1 :]
            if key in _fields(section):
                return section, key
    known = ", ".join(
        f"{ENV_PREFIX}{s.upper()}_{k.upper()}" for s in SECTIONS for k in _fields(s)
    )
    raise ConfigError(var, "", "an unknown setting", f"one of {known}")


def _fields(section: str) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def _convert(source: str, section: str, key: str, value: Any, *, from_env: bool) -> Any:
    fields = _fields(section)
    dotted = f"{section}.{key}"
    if key not in fields:
        raise ConfigError(source, dotted, "an unknown key", "one of " + ", ".join(fields))
    hint = get_type_hints(SECTIONS[section])[key]
    converted = _coerce(source, dotted, hint, value, from_env)
    check: Check | None = fields[key].metadata.get("check")
    if check is not None and converted is not None:
        problem = check(converted)
        if problem is not None:
            show: Show | None = fields[key].metadata.get("show")
            found = repr(show(value) if show is not None else value)
            raise ConfigError(source, dotted, found, problem)
    return converted


def _coerce(source: str, dotted: str, hint: Any, value: Any, from_env: bool) -> Any:
    def wrong(expected: str) -> ConfigError:
        return ConfigError(source, dotted, f"{value!r} ({type(value).__name__})", expected)

    if hint is int:
        if from_env and isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise wrong("an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if hint is float:
        if from_env and isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise wrong("a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        return float(value)
    if hint is bool:
        if from_env and isinstance(value, str):
            word = value.strip().lower()
            if word in ("1", "true", "yes", "on"):
                return True
            if word in ("0", "false", "no", "off"):
                return False
            raise wrong("true or false")
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if hint == tuple[str, ...]:  # a TOML list, or comma-separated in the environment
        if from_env and isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong("a list of strings")
        return tuple(value)
    if hint == Mapping[str, str]:  # a TOML table, or `key=value,...` in the environment
        if from_env and isinstance(value, str):
            pairs = [item.partition("=") for item in value.split(",") if item.strip()]
            if any(not sep for _, sep, _ in pairs):
                raise wrong("comma-separated group=role pairs")
            return MappingProxyType({k.strip(): v.strip() for k, _, v in pairs})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise wrong("a table of strings")
        return MappingProxyType(dict(value))
    if hint == Mapping[str, ServiceClass]:  # TOML tables, or JSON in the environment
        return _classes(source, dotted, value, from_env)
    if hint in (Path, Path | None):
        if not isinstance(value, str):
            raise wrong("a path string")
        if value == "" and hint != Path:
            return None
        return Path(value)
    raise AssertionError(f"config type {hint!r} for {dotted} has no coercion")  # a schema bug


def _classes(source: str, dotted: str, value: Any, from_env: bool) -> Any:
    """The operator's service classes, validated over the built-in ones (the config keeps
    only those given; `appliance.gateway.classes.effective` adds the rest)."""
    import json

    if from_env and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(source, dotted, repr(value), 'JSON such as {"batch": '
                              '{"deadline_seconds": 600}} (or [gateway.classes.NAME] tables '
                              "in the file)") from None
    try:
        merged = parse_classes(value)
    except ClassProblem as problem:
        raise ConfigError(source, problem.key, problem.found, problem.expected) from None
    return MappingProxyType({name: merged[name] for name in value})


def _cross_check(config: Config) -> None:
    server = config.server
    if config.engine.port == server.port:
        raise ConfigError(
            config.source, "engine.port", f"{config.engine.port}, the same as server.port",
            "a port of its own (the engine listens on 127.0.0.1 beside the console)",
        )
    gateway = config.gateway
    if gateway.port in (server.port, config.engine.port):
        raise ConfigError(
            config.source, "gateway.port", f"{gateway.port}, already server.port or engine.port",
            "a port of its own (8000 by default)",
        )
    if (gateway.tls_cert is None) != (gateway.tls_key is None):
        raise ConfigError(config.source, "gateway.tls_cert/gateway.tls_key",
                          "only one of the two set", "both set (HTTPS) or neither (HTTP)")
    if (server.tls_cert is None) != (server.tls_key is None):
        raise ConfigError(
            config.source,
            "server.tls_cert/server.tls_key",
            "only one of the two set",
            "both set (HTTPS) or neither (HTTP)",
        )
    _cross_check_sso(config)
    _cross_check_cell(config)
    for key, path in (("server.tls_cert", server.tls_cert), ("server.tls_key", server.tls_key),
                      ("gateway.tls_cert", gateway.tls_cert), ("gateway.tls_key", gateway.tls_key)):
        if path is not None and not path.is_file():
            raise ConfigError(config.source, key, f"{path} (missing)", "a readable PEM file")


def _cross_check_cell(config: Config) -> None:
    cell = config.cell
    if cell.role == "prefill" and cell.bootstrap_port in (config.engine.port, config.server.port,
                                                           config.gateway.port):
        raise ConfigError(config.source, "cell.bootstrap_port",
                          f"{cell.bootstrap_port}, already the engine's, console's or gateway's "
                          "port", "a port of its own (SGLang's default 8998)")
    if cell.router_port in (config.engine.port, config.server.port, config.gateway.port):
        raise ConfigError(config.source, "cell.router_port",
                          f"{cell.router_port}, already the engine's, console's or gateway's "
                          "port", "a port of its own (30100 by default)")
    if cell.router_metrics_port in (config.engine.port, config.server.port, config.gateway.port,
                                    cell.router_port):
        raise ConfigError(config.source, "cell.router_metrics_port",
                          f"{cell.router_metrics_port}, already the engine's, console's, "
                          "gateway's or router's port", "a port of its own (29000 by default)")


def _cross_check_sso(config: Config) -> None:
    oidc, auth = config.oidc, config.auth
    if oidc.enabled:
        for key in ("issuer", "client_id", "client_secret_file"):
            if not getattr(oidc, key):
                raise ConfigError(config.source, f"oidc.{key}", "unset while oidc.enabled",
                                  "a value (docs/operations.md, Single sign-on)")
    if auth.local_login == "break_glass" and not auth.break_glass_accounts:
        raise ConfigError(
            config.source, "auth.break_glass_accounts", "empty while auth.local_login is "
            "break_glass", "at least one local account, to log in when the provider is down")


def ensure_writable_dirs(config: Config) -> None:
    """Create the state and log directories if needed and prove they are writable."""
    for key, path in (("paths.state_dir", config.paths.state_dir),
                      ("paths.log_dir", config.paths.log_dir)):
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
        except OSError as exc:
            raise ConfigError(
                config.source, key, f"{path} ({exc.strerror or exc})",
                "a directory the daemon's user can create and write",
            ) from None


def describe(config: Config) -> list[tuple[str, str, str]]:
    """(key, value, doc) rows for the Settings page and `/api/v1/settings`; no secrets here:
    a key with a `show` function (database.url) is rendered through it (password masked)."""
    rows = []
    for name in SECTIONS:
        section = getattr(config, name)
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            show: Show | None = field.metadata.get("show")
            if show is not None:
                shown = show(value)
            elif isinstance(value, tuple):
                shown = ", ".join(value)
            else:
                shown = "" if value is None else str(value)
            rows.append((f"{name}.{field.name}", shown, field.metadata.get("doc", "")))
    return rows
