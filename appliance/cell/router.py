"""The head's router: SGLang's own `sglang-router` (0.3.2, pinned by the installer in
/opt/appliance/router) in PD mode over the members' engines, run by `appliance-router.service`
from a spec file this module builds, like the engine's launch spec.

Pure apart from `write_router_spec` and `read_key`. The spec holds:

- **the program**: the router venv's Python, `-m sglang_router.launch_router`;
- **the argv**: `--pd-disaggregation`, one `--prefill URL BOOTSTRAP_PORT` per prefill member
  and one `--decode URL` per decode member (sorted, so the same members give the same spec
  whatever order they were listed in), the router's host and port (loopback on the head: the
  gateway reaches it), its Prometheus listener (also loopback; the router's default is
  0.0.0.0:29000), `--model-path`/`--tokenizer-path` at the local model directory (by default
  the router downloads the tokenizer from the Hub by model name, which an air-gapped box
  cannot do), and the retry and health-check settings, with the circuit breaker off
  (`RouterInputs` says why);
- **the environment**: `HF_HUB_OFFLINE=1`, so nothing reaches for the Hub anyway;
- **the key file**: the engine API key's path. The router sends the key to every worker
  (`--api-key`: "the api key used for the authorization with the worker"); the members'
  engines require it on every path but /health and /metrics. Only the path is in the spec and
  its hash: `appliance cell exec-router` reads the key as the unit's user and hands it to
  the router on a pipe at exec time (appliance.cell.router_exec), so neither the spec file
  nor the router's command line ever holds it.

`spec_hash` is sha256 over canonical JSON of command, argv, env and key file: the daemon
rewrites the file, and restarts the router, only when the hash changes (a router restart is
cheap and refuses only the requests in flight through it; it never implies an engine
restart).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.atomic import write_atomic
from appliance.engine.args import json_pair, json_strings
from appliance.secrets import engine_key_path

ROUTER_SPEC_FORMAT = "appliance-router-spec/1"
DEFAULT_ROUTER_DIR = Path("/opt/appliance/router")
ROUTER_MODULE = "sglang_router.launch_router"
SGLANG_ROUTER_VERSION = "0.3.2"  # installer/router-requirements.txt pins the same
ROUTER_ENV = (("HF_HUB_OFFLINE", "1"),)
METRICS_PORT = 29000  # the router's own default, moved to loopback


@dataclass(frozen=True, order=True)
class Worker:
    """One member's engine as the router sees it: `role` prefill or decode, `url` its HTTP
    base (`http://10.0.0.5:30000`: the member's cell.listen_address and engine.port), and for a
    prefill its bootstrap port (cell.bootstrap_port there)."""

    role: str
    url: str
    bootstrap_port: int | None = None


def worker_url(host: str, port: int) -> str:
    """`http://HOST:PORT`, an IPv6 address bracketed."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}"


@dataclass(frozen=True, kw_only=True)
class RouterInputs:
    """Everything the router's spec is built from. Each setting below is chosen against what
    sglang-router 0.3.2 does (read in its source, `src/routers/http/pd_router.rs`,
    `src/core/{retry,circuit_breaker}.rs`) and what SGLang 0.5.23's engines do:

    - **Retries** (`retry_attempts`, the router's `--retry-max-retries`, which counts every
      attempt, the first included): 3, not the router's 5. The router retries a 408, 429,
      500, 502, 503 or 504, picking a new prefill/decode pair each time, so a retry after a
      decode that died goes, by round robin, to another decode. Each attempt also sends the
      prompt to a prefill, which computes it and holds its KV for a decode that never comes
      (until SGLang's bootstrap timeout), so more attempts are not free: 3 is enough for
      round robin over two decodes and bounds the waste per user request to 3 prompts. The
      backoff (`retry_initial_backoff_ms`, doubling up to `retry_max_backoff_ms`, 20 %
      jitter) spreads the retries of requests that failed together.
    - **No circuit breaker** (`--disable-circuit-breaker`). In PD mode the router records a
      pair's outcome on BOTH workers' breakers (`prefill.record_outcome(ok);
      decode.record_outcome(ok)` after every attempt): a dead decode's failures count
      against the prefill as well, so with its default threshold two requests' five
      attempts each opened the prefill's circuit and the whole cell answered 503 "No
      available prefill workers" while the prefill was healthy (issue 25). The breaker has
      no way to attribute a failure to one side, so it is off; the health checks below,
      which probe each engine on its own, take a dead engine out. (Disabled, the router sets
      its threshold to u32::MAX: its `smg_worker_cb_state` stays closed.)
    - **Health checks**: `/health` every `health_interval_secs` (the router's default 60 s is
      too slow to notice a lost decode box), out after `health_failure_threshold` failures in
      a row, back after `health_success_threshold` passes. SGLang's `/health` is a one-token
      generation that answers 200 when a token comes back and 503 itself after
      `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s), and a busy prefill may take seconds to fit it in:
      `health_timeout_secs` is 25 s, above the engine's own, so the engine's verdict decides,
      never the router's patience (its 5 s took a busy prefill, the cell's only one, out).
      A dead engine refuses the connection at once, so it is out within
      interval x threshold (30 s), and the retries carry its requests meanwhile.
    - `startup_timeout_secs` is how long the router waits for the workers at its start: a
      member's engine may still be loading (~90 minutes), so it is generous."""

    workers: tuple[Worker, ...]
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 30100
    key_file: Path
    program: Path = DEFAULT_ROUTER_DIR / "bin" / "python"
    policy: str = "round_robin"
    retry_attempts: int = 3
    retry_initial_backoff_ms: int = 100
    retry_max_backoff_ms: int = 1000
    health_interval_secs: int = 10
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_timeout_secs: int = 25
    startup_timeout_secs: int = 7200
    request_timeout_secs: int = 1800
    metrics_port: int = METRICS_PORT
    log_level: str = "warn"


@dataclass(frozen=True)
class RouterSpec:
    """What `appliance-router.service` runs: `command` + `args`, with `env`, the key read from
    `key_file` at exec time. `workers` is provenance (the argv says the same)."""

    command: tuple[str, ...]
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    key_file: str
    workers: tuple[Worker, ...]
    spec_hash: str

    def argv(self) -> list[str]:
        """The argv as the spec says it, without the key (what runs is
        `router_exec.launch_argv`: the same arguments, the key read from a pipe)."""
        return [*self.command, *self.args]

    def to_json(self) -> str:
        body = {
            "format": ROUTER_SPEC_FORMAT,
            "sglang_router_version": SGLANG_ROUTER_VERSION,
            "spec_hash": self.spec_hash,
            "command": list(self.command),
            "args": list(self.args),
            "env": [list(pair) for pair in self.env],
            "key_file": self.key_file,
            "workers": [dataclasses.asdict(w) for w in self.workers],
        }
        return json.dumps(body, indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RouterSpec:
        """Read a router spec. Raises ValueError naming what is wrong (not JSON, another
        format, a field missing or mistyped, a hash that does not match)."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"router spec is not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != ROUTER_SPEC_FORMAT:
            raise ValueError(f"router spec is not format {ROUTER_SPEC_FORMAT}; rebuild it")
        try:
            spec = cls(
                command=json_strings(body["command"], "command"),
                args=json_strings(body["args"], "args"),
                env=tuple(json_pair(item, "env") for item in body["env"]),
                key_file=_string(body["key_file"]),
                workers=tuple(Worker(**item) for item in body["workers"]),
                spec_hash=_string(body["spec_hash"]),
            )
        except KeyError as exc:
            raise ValueError(f"router spec lacks {exc}; rebuild it") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"router spec is malformed ({exc}); rebuild it") from None
        if spec.spec_hash != router_spec_hash(spec.command, spec.args, spec.env, spec.key_file):
            raise ValueError("router spec does not match its hash (edited or corrupt); "
                             "rebuild it")
        return spec


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def router_spec_hash(command: Sequence[str], args: Sequence[str],
                     env: Sequence[tuple[str, str]], key_file: str) -> str:
    canonical = json.dumps(
        {"command": list(command), "args": list(args), "env": [list(p) for p in env],
         "key_file": key_file}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class NoCell(ValueError):
    """The members cannot make a PD router: it needs at least one prefill and one decode."""


def router_args(inputs: RouterInputs) -> list[str]:
    """The router's arguments after `-m sglang_router.launch_router`, workers sorted.
    Raises NoCell without a prefill or without a decode member."""
    workers = sorted(set(inputs.workers))
    prefills = [w for w in workers if w.role == "prefill"]
    decodes = [w for w in workers if w.role == "decode"]
    if not prefills or not decodes:
        raise NoCell(f"a PD router needs at least one prefill and one decode member; the "
                     f"members give {len(prefills)} prefill and {len(decodes)} decode: add "
                     "members, or set their roles (docs/cell.md, Roles)")
    args = ["--pd-disaggregation"]
    for w in prefills:
        args += ["--prefill", w.url, str(w.bootstrap_port) if w.bootstrap_port else "none"]
    for w in decodes:
        args += ["--decode", w.url]
    model = str(inputs.model_path)
    args += [
        "--host", inputs.host, "--port", str(inputs.port),
        "--policy", inputs.policy,
        "--model-path", model, "--tokenizer-path", model,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(inputs.metrics_port),
        "--health-check-interval-secs", str(inputs.health_interval_secs),
        "--health-failure-threshold", str(inputs.health_failure_threshold),
        "--health-success-threshold", str(inputs.health_success_threshold),
        "--health-check-timeout-secs", str(inputs.health_timeout_secs),
        "--retry-max-retries", str(inputs.retry_attempts),
        "--retry-initial-backoff-ms", str(inputs.retry_initial_backoff_ms),
        "--retry-max-backoff-ms", str(inputs.retry_max_backoff_ms),
        "--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.2",
        "--disable-circuit-breaker",
        "--worker-startup-timeout-secs", str(inputs.startup_timeout_secs),
        "--request-timeout-secs", str(inputs.request_timeout_secs),
        "--log-level", inputs.log_level,
    ]
    return args


def build_router_spec(inputs: RouterInputs) -> RouterSpec:
    """The spec for these inputs: the same inputs, in any member order, give the same hash."""
    command = (str(inputs.program), "-m", ROUTER_MODULE)
    args = tuple(router_args(inputs))
    key_file = str(inputs.key_file)
    return RouterSpec(command=command, args=args, env=ROUTER_ENV, key_file=key_file,
                      workers=tuple(sorted(set(inputs.workers))),
                      spec_hash=router_spec_hash(command, args, ROUTER_ENV, key_file))


def router_spec_path(state_dir: Path) -> Path:
    """Where the head's router spec lies (appliance-router.service's ExecStart names it): a
    directory of its own, the one part of the state directory the router unit sees besides
    the weights and the engine key."""
    return state_dir / "router" / "router-spec.json"


def engine_key_file(state_dir: Path) -> Path:
    """The engine API key's file (appliance.secrets.engine_api_key writes it), which the
    router sends to the members' engines."""
    return engine_key_path(state_dir)


def write_router_spec(path: Path, spec: RouterSpec) -> bool:
    """Write the spec atomically (0640 in a 0750 directory) unless the file already holds
    this hash; True when it was written, i.e. the router must be restarted to use it."""
    try:
        current = RouterSpec.from_json(path.read_text()).spec_hash
    except (OSError, ValueError):
        current = None
    if current == spec.spec_hash:
        return False
    write_atomic(path, spec.to_json().encode(), mode=0o640, dir_mode=0o750)
    return True


def workers_of(members: Iterable[tuple[str, str, int, int | None]]) -> tuple[Worker, ...]:
    """Workers from (role, engine host, engine port, bootstrap port) per member; a unified
    member serves alone and is not the router's."""
    return tuple(Worker(role, worker_url(host, port), bootstrap if role == "prefill" else None)
                 for role, host, port, bootstrap in members if role in ("prefill", "decode"))
