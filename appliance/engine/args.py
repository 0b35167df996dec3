"""The engine's launch spec, built from frozen inputs by pure functions.

A launch spec is everything the engine unit runs: the program (from the config), `serve`, the
flags, and the environment added to the unit's own. Each flag carries its provenance: which
layer set it (built-in K3 default < workload profile < tuning < cell role < operator) and
what it replaced, so the console can answer "why is --mamba-full-memory-ratio 2.5?" without
guessing. The spec is
hashed over what actually runs (command, argv, env), not over provenance: two specs with the
same hash launch the same engine, which is how a running engine is adopted after a restart.

Flags are compared as SGLang 0.5.23's argparse reads them (`appliance.engine.flags.match`): an
alias (`--tensor-parallel-size`) or an unambiguous abbreviation (`--mem-fraction`) is the flag
it names, so it overrides that flag instead of being appended beside it. Nothing here raises on
a bad operator flag: the spec keeps what was asked for, and `appliance.engine.validate` reports
it with a suggestion before anything is launched.

Why the K3 defaults are what they are (SGLang 0.5.23 source, under sglang/srt/):
  --tp-size 8 --dcp-size 8  one box of 8 GPUs; decode context parallel shards the MLA KV cache
                            over the TP ranks (the K3 override, arg_groups/model_overrides/
                            kimi_k3.py:51-54, picks trtllm_mla prefill / cutedsl_mla decode for DCP)
  --trust-remote-code       K3 ships its own configuration/tokenizer code
  --reasoning-parser kimi_k3, --tool-call-parser kimi_k3
                            K3's thinking and tool-call formats (parser/reasoning_parser.py:2287,
                            function_call/function_call_parser.py:93)
  --enable-metrics          the health monitor and capacity views read /metrics
  --enable-cache-report     usage reports cached prompt tokens (prompt_tokens_details), which
                            the gateway records per request (openai/usage_processor.py)
  --enable-mixed-chunk      prefill chunks ride along with decode steps; DSPARK keeps it
                            (speculative/spec_info.py:147-158 lists DSPARK as supporting it)
  --kv-cache-dtype, --mem-fraction-static, --mamba-full-memory-ratio
                            from the config; the ratio is what tuning changes
  --speculative-algorithm DSPARK (config engine.speculative)
                            nothing else is needed on the command line: with --model-path a
                            directory, SGLang finds the draft in the checkpoint itself (bundled
                            dspark_* keys, or a dspark/ subfolder; arg_groups/speculative_hook.py
                            :720-755), the K3 override switches verify to the decode backend under
                            DCP (kimi_k3.py:82) and kimi_k3_hook.py:18-55 pins the KDA verify and
                            draft attention backends. Without such a draft SGLang stops with
                            "DSpark dense speculative decoding requires setting
                            --speculative-draft-model-path": the operator adds that flag.
  --config <state_dir>/engine/engine-auth.yaml
                            the engine port's API key (`appliance.secrets.write_engine_auth`),
                            so nobody on the box can bypass the gateway. SGLang 0.5.23 takes
                            the key only as --api-key or from a YAML --config file (no
                            environment variable); the file keeps it out of the argv that
                            /proc shows everyone, out of the spec hash and out of the Engine
                            page. Exempt from the key: /health*, /ready*, /metrics* (and
                            OPTIONS); everything else answers 401 {"error": "Unauthorized"}
                            without `Authorization: Bearer <key>` (utils/auth.py). Set last,
                            after the operator's flags: an operator --config would drop the
                            key (SGLang reads one config file only).
The role layer (config `[cell]`, `role_args`): a box in a cell of boxes (issue 17) runs as
SGLang's own prefill or decode server; `unified`, the default, adds nothing, so every existing
spec keeps its argv and its hash. Flag names and defaults are 0.5.23's
(srt/arg_groups/fields/disagg.py:55-87, fields/memory.py:98-112):
  --disaggregation-mode prefill|decode
  --disaggregation-transfer-backend mooncake|nixl   (both roles: sender and receiver must match)
  --disaggregation-ib-device DEVS   only when set; absent, the backend picks its devices
  --disaggregation-bootstrap-port P prefill only: the port its bootstrap server binds
                            (managers/disagg_service.py starts it for prefill alone; a decode
                            server learns each request's bootstrap_host/port from the router)
  --enable-hierarchical-cache [--hicache-ratio R]
                            prefill only, when cell.hierarchical_cache: prefix KV also in host
                            DRAM; the ratio only when set (>0): without it SGLang sizes the
                            host pool to fit host memory (arg_groups/hicache_hook.py:100-126)
The classes layer (config `[gateway.classes]`): SGLang's priority scheduling flags for the
service classes, none without configured classes (`appliance.engine.priority` says which and
why), and with them SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 in the environment
(`appliance.gateway.priority.engine_env`), so a /v1/messages request's class priority reaches
the engine in a header. See ENV_REASONS for the environment.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.engine import flags
from appliance.engine.priority import priority_args
from appliance.gateway.priority import engine_env
from appliance.secrets import engine_auth_path

if TYPE_CHECKING:
    from appliance.config import CellConfig, Config

SPEC_FORMAT = 1
DSPARK = "DSPARK"

# Every variable the appliance adds to the engine's environment, and why. The runner adds
# these to a scrubbed copy of its own environment; none of them is the daemon's NOTIFY_SOCKET
# (the engine must never speak for the daemon to systemd), and `build_launch_spec` drops that
# name from operator-supplied variables too.
ENV_REASONS: dict[str, str] = {
    "PYTHONUNBUFFERED": (
        "the supervisor follows the load in the engine's log as it is written; Python "
        "block-buffers stdout to a file otherwise, and progress would arrive in lumps"
    ),
    "SGLANG_RAGGED_VERIFY_MODE": (
        "set to static whenever the algorithm is DSPARK: Kimi K3 with DCP and DSPARK refuses to "
        "start with any other mode (srt/arg_groups/model_overrides/kimi_k3.py:63-75). static "
        "is SGLang's default (srt/environ.py:1572); pinning it keeps an inherited value out"
    ),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": (
        "prefill and decode roles, from cell.bootstrap_timeout_s (60): how long a prefill "
        "holds a request whose decode never takes its KV. SGLang's 300 (srt/environ.py:759) "
        "ties up a dead decode's prefill slots for 5 minutes; a live decode takes a request "
        "within seconds when the head admits no more than the cell's capacity"
    ),
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": (
        "prefill and decode roles, from cell.waiting_timeout_s (120): how long a decode waits "
        "for a request's KV once it has room (srt/environ.py:763, 300 by default). It covers "
        "the prefill's queue and the longest prompt's prefill; a dead prefill is found sooner "
        "by the decode's heartbeat (2 misses of 5 s)"
    ),
    "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES": (
        "set to 1 when the service classes turn priority scheduling on "
        "(appliance.gateway.priority.engine_env): a /v1/messages body has no priority field, "
        "and the header overrides let the gateway's x-override-priority set that request's "
        "priority (srt/entrypoints/request_headers.py, off by default: srt/environ.py). The "
        "gateway never forwards a client's x-override-* headers (OVERRIDE_HEADERS), so no "
        "caller sets another request's rid, bootstrap or priority"
    ),
}
FORBIDDEN_ENV = ("NOTIFY_SOCKET",)

# argparse (3.11, `_negative_number_matcher`): such a token is a value, not an option.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class Origin(enum.Enum):
    """Who set a flag. Later layers override earlier ones, in this order."""

    DEFAULT = "default"
    PROFILE = "profile"
    TUNING = "tuning"
    ROLE = "role"  # the box's part in a cell (config [cell]); nothing for a unified box
    CLASSES = "classes"  # priority scheduling for the service classes (engine/priority.py)
    OPERATOR = "operator"


@dataclass(frozen=True)
class ArgSource:
    """One flag of the argv and where it came from.

    `value` is None for a switch (store_true). `more_values` holds the further values of the
    few multi-value flags (nargs "+"/"*", e.g. `--cuda-graph-bs-decode 1 2 4`). `note` says
    what this one replaced, newest first, e.g. "overrides profile 5, default 0.9".
    """

    flag: str
    value: str | None
    origin: Origin
    note: str = ""
    more_values: tuple[str, ...] = ()

    def tokens(self) -> list[str]:
        if self.value is None:
            return [self.flag, *self.more_values]
        if self.value.startswith("-") and not _NEGATIVE_NUMBER.match(self.value):
            # Separate, argparse would read "-x" as an option; joined it is a value.
            return [f"{self.flag}={self.value}", *self.more_values]
        return [self.flag, self.value, *self.more_values]

    def shown(self) -> str:
        """The value as a person reads it in a note: `0.9`, or the switch itself."""
        if self.value is None and not self.more_values:
            return self.flag
        return " ".join(v for v in (self.value, *self.more_values) if v is not None)


@dataclass(frozen=True, kw_only=True)
class LaunchInputs:
    """Everything the launch spec is built from; `inputs_from_config` fills it from the config.

    `profile_args`, `tuning_args` and `role_args` are (flag, value) pairs, value None for a
    switch, e.g. (("--mamba-full-memory-ratio", "2.5"),). `operator_args` are raw command-line
    tokens from the config (engine.extra_args) or the console, e.g. ("--watchdog-timeout",
    "600").
    """

    model_path: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int
    tp_size: int
    dcp_size: int
    mem_fraction_static: float
    mamba_full_memory_ratio: float
    kv_cache_dtype: str
    speculative: bool
    profile_args: tuple[tuple[str, str | None], ...] = ()
    tuning_args: tuple[tuple[str, str | None], ...] = ()
    role_args: tuple[tuple[str, str | None], ...] = ()
    class_args: tuple[tuple[str, str | None], ...] = ()  # appliance.engine.priority
    operator_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    # The engine's --config file holding its API key (None: an engine without a key, e.g. a
    # hand-made spec in a test); the path goes into the argv and the hash, never the key.
    engine_auth: Path | None = None


@dataclass(frozen=True)
class LaunchSpec:
    """What the engine unit runs: `command` (program and leading args) + `serve` + flags.

    `spec_hash` is sha256 over canonical JSON of command, flags and env (not provenance).
    """

    command: tuple[str, ...]
    args: tuple[ArgSource, ...]
    env: tuple[tuple[str, str], ...]
    spec_hash: str

    def serve_args(self) -> list[str]:
        """The arguments after `serve`: what SGLang's parser reads."""
        return [token for arg in self.args for token in arg.tokens()]

    def argv(self) -> list[str]:
        return [*self.command, "serve", *self.serve_args()]

    def source(self, option: str) -> ArgSource | None:
        """The argument that sets `option` (any alias or abbreviation of it), if any."""
        key = _key(option)
        return next((a for a in self.args if _key(a.flag) == key), None)

    def to_json(self) -> str:
        """The launch file the daemon writes atomically; `argv` and `env` are all a unit
        wrapper needs, the rest is provenance for people. `from_json` reverses it exactly."""
        body = {
            "format": SPEC_FORMAT,
            "sglang_version": flags.SGLANG_VERSION,
            "spec_hash": self.spec_hash,
            "argv": self.argv(),
            "env": [list(pair) for pair in self.env],
            "command": list(self.command),
            "args": [_arg_json(a) for a in self.args],
        }
        return json.dumps(body, indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        """Read a launch file. Raises ValueError naming what is wrong (not JSON, another
        format, a field missing or mistyped, or a hash that does not match its contents)."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"launch spec is not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != SPEC_FORMAT:
            raise ValueError(f"launch spec is not format {SPEC_FORMAT}; rebuild it")
        try:
            spec = cls(
                command=json_strings(body["command"], "command"),
                args=tuple(_arg_from_json(item) for item in body["args"]),
                env=tuple(json_pair(item, "env") for item in body["env"]),
                spec_hash=str(body["spec_hash"]),
            )
        except KeyError as exc:
            raise ValueError(f"launch spec lacks {exc}; rebuild it") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"launch spec is malformed ({exc}); rebuild it") from None
        expected = spec_hash(spec.command, spec.serve_args(), spec.env)
        if spec.spec_hash != expected or body.get("argv") != spec.argv():
            raise ValueError(
                "launch spec does not match its hash (edited or corrupt); rebuild it"
            )
        return spec


def spec_hash(
    command: Sequence[str], serve_args: Sequence[str], env: Sequence[tuple[str, str]]
) -> str:
    canonical = json.dumps(
        {"command": list(command), "argv": list(serve_args), "env": [list(p) for p in env]},
        sort_keys=True, separators=(",", ":"), ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def model_dir(models_dir: Path, repo_id: str) -> Path:
    """Where a Hub repo's files live: `moonshotai/Kimi-K3` -> `<models_dir>/moonshotai--Kimi-K3`."""
    return models_dir / repo_id.replace("/", "--")


def inputs_from_config(
    config: Config,
    *,
    tuning_args: tuple[tuple[str, str | None], ...] = (),
    profile_args: tuple[tuple[str, str | None], ...] = (),
    role: str | None = None,
) -> LaunchInputs:
    """`role`: the box's cell role when a head changed it at run time
    (appliance.cell.role_choice); None: the configuration's `cell.role`."""
    from dataclasses import replace

    from appliance.config import engine_host

    engine = config.engine
    return LaunchInputs(
        model_path=model_dir(config.paths.models_dir, engine.model),
        served_model_name=engine.served_model_name,
        host=engine_host(config),
        port=engine.port,
        tp_size=engine.tp_size,
        dcp_size=engine.dcp_size,
        mem_fraction_static=engine.mem_fraction_static,
        mamba_full_memory_ratio=engine.mamba_full_memory_ratio,
        kv_cache_dtype=engine.kv_cache_dtype,
        speculative=engine.speculative,
        profile_args=profile_args,
        tuning_args=tuning_args,
        role_args=role_args(config.cell if role is None else replace(config.cell, role=role)),
        class_args=priority_args(config.gateway.classes, queue_max=config.gateway.queue_max,
                                 max_concurrency=config.gateway.max_concurrency),
        # The role's variables, the classes' (header overrides, for /v1/messages
        # priorities), then the operator's (engine.extra_env, e.g. CPU mode), which win.
        extra_env=(*role_env(config.cell, role or config.cell.role),
                   *engine_env(config.gateway.classes),
                   *engine.extra_env.items()),
        operator_args=engine.extra_args,
        engine_auth=engine_auth_path(config.paths.state_dir),
    )


def role_args(cell: CellConfig) -> tuple[tuple[str, str | None], ...]:
    """The flags of the box's cell role, in argv order (the module docstring says why each);
    none for a unified box."""
    if cell.role not in ("prefill", "decode"):
        return ()
    pairs: list[tuple[str, str | None]] = [
        ("--disaggregation-mode", cell.role),
        ("--disaggregation-transfer-backend", cell.transfer_backend),
    ]
    if cell.ib_device:
        pairs.append(("--disaggregation-ib-device", cell.ib_device))
    if cell.role == "prefill":
        pairs.append(("--disaggregation-bootstrap-port", str(cell.bootstrap_port)))
        if cell.hierarchical_cache:
            pairs.append(("--enable-hierarchical-cache", None))
            if cell.hicache_ratio > 0:
                pairs.append(("--hicache-ratio", repr(cell.hicache_ratio)))
    return tuple(pairs)


def role_env(cell: CellConfig, role: str) -> tuple[tuple[str, str], ...]:
    """The environment of a prefill or decode engine (ENV_REASONS says why); none for a
    unified one, so its spec and hash stay as they were."""
    if role not in ("prefill", "decode"):
        return ()
    return (("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", str(cell.bootstrap_timeout_s)),
            ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(cell.waiting_timeout_s)))


def default_args(inputs: LaunchInputs) -> list[tuple[str, str | None]]:
    """The built-in K3 flags, in argv order (see the module docstring for why each)."""
    pairs: list[tuple[str, str | None]] = [
        ("--model-path", str(inputs.model_path)),
        ("--served-model-name", inputs.served_model_name),
        ("--host", inputs.host),
        ("--port", str(inputs.port)),
        ("--tp-size", str(inputs.tp_size)),
        ("--dcp-size", str(inputs.dcp_size)),
        ("--trust-remote-code", None),
        ("--reasoning-parser", "kimi_k3"),
        ("--tool-call-parser", "kimi_k3"),
        ("--enable-metrics", None),
        ("--enable-cache-report", None),
        ("--enable-mixed-chunk", None),
        ("--kv-cache-dtype", inputs.kv_cache_dtype),
        ("--mem-fraction-static", repr(inputs.mem_fraction_static)),
        ("--mamba-full-memory-ratio", repr(inputs.mamba_full_memory_ratio)),
    ]
    if inputs.speculative:
        pairs.append(("--speculative-algorithm", DSPARK))
    return pairs


def resolve_program(program: str) -> str:
    """`program` with the symlinks in its directory resolved, when it is an existing absolute path.

    The installer points `/opt/appliance/engine` at the engine venv of the current SGLang pin
    (`/opt/appliance/engines/sglang-<version>`). A venv entered through a symlinked directory
    takes its `sys.path` from that unresolved path, so a running engine would import from
    whatever the link points at later. The spec names the real directory instead: flipping the
    link never changes a running engine, and a new pin gives a new spec hash. The last
    component is kept as it is: a venv's `bin/python` is itself a link to the base interpreter,
    and following it would leave the venv.
    """
    path = Path(program)
    if not path.is_absolute() or not path.exists():
        return program
    return str(Path(os.path.realpath(path.parent)) / path.name)


def build_launch_spec(command: Sequence[str], inputs: LaunchInputs) -> LaunchSpec:
    """The launch spec for `command` (the program and its leading arguments, from the config).

    Layers apply in order default, profile, tuning, role, classes, operator; a later layer's
    value for a flag replaces the earlier one in place (the flag keeps its position) and the
    note records what it replaced. Flags new to the argv are appended in the order they were
    given. The one look at the filesystem: the program's directory is resolved (`resolve_program`).
    """
    if not command or not command[0]:
        raise ValueError("engine command is empty: set engine.command to the sglang program")
    command = (resolve_program(command[0]), *command[1:])
    args: list[ArgSource] = []
    replaced: dict[str, list[ArgSource]] = {}
    layers: list[tuple[Origin, Sequence[tuple[str, tuple[str, ...]]]]] = [
        (Origin.DEFAULT, _pairs(default_args(inputs))),
        (Origin.PROFILE, _pairs(inputs.profile_args)),
        (Origin.TUNING, _pairs(inputs.tuning_args)),
        (Origin.ROLE, _pairs(inputs.role_args)),
        (Origin.CLASSES, _pairs(inputs.class_args)),
        (Origin.OPERATOR, split_args(inputs.operator_args)),
    ]
    if inputs.engine_auth is not None:  # last: the engine must never run without its key
        layers.append((Origin.DEFAULT, [("--config", (str(inputs.engine_auth),))]))
    for origin, items in layers:
        for option, values in items:
            _apply(args, replaced, _spelled(option), values, origin)
    flag_tokens = [token for arg in args for token in arg.tokens()]
    env = _environment(args, inputs.extra_env)
    return LaunchSpec(
        command=tuple(command),
        args=tuple(args),
        env=env,
        spec_hash=spec_hash(command, flag_tokens, env),
    )


def split_args(tokens: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Raw command-line tokens as (option, values) items, as SGLang's argparse groups them.

    An option takes as many following tokens as its flag does (none for a switch, one, or
    all up to the next option for nargs "+"/"*"); an unknown option takes the tokens up to the
    next option. `--flag=value` is split. A token that belongs to no option becomes an item
    with an empty option, kept so that validation can point at it.
    """
    items: list[tuple[str, tuple[str, ...]]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not is_option(token):
            items.append(("", (token,)))
            continue
        option, joined = split_joined(token)
        found = flags.match(option)
        flag = found[0] if len(found) == 1 else None
        values: list[str] = [] if joined is None else [joined]
        if flag is not None and not flag.takes_value:
            wanted = 0
        elif flag is not None and flag.nargs in ("", "?"):
            wanted = 1 - len(values)
        else:
            wanted = len(tokens)
        while wanted > 0 and i < len(tokens) and not is_option(tokens[i]):
            values.append(tokens[i])
            i += 1
            wanted -= 1
        items.append((option, tuple(values)))
    return items


def is_option(token: str) -> bool:
    """Whether argparse (3.11 `_parse_optional`) reads `token` as an option, not a value."""
    return (
        token.startswith("-") and len(token) > 1 and not _NEGATIVE_NUMBER.match(token)
        and " " not in token
    )


def split_joined(token: str) -> tuple[str, str | None]:
    """`--flag=value` -> ("--flag", "value"); anything else -> (token, None)."""
    if token.startswith("--") and "=" in token:
        option, _, value = token.partition("=")
        return option, value
    return token, None


def _key(option: str) -> str:
    """What makes two options the same flag: the canonical name when SGLang's parser would
    resolve the option to one flag, else the option as written."""
    found = flags.match(option)
    return found[0].name if len(found) == 1 else option


def _spelled(option: str) -> str:
    """How an option is written in the argv: the canonical name, except a `--no-...`
    negation (a different value of the same flag) and options SGLang does not know."""
    found = flags.match(option)
    if len(found) != 1 or option in found[0].negations:
        return option
    return found[0].name


def _pairs(pairs: Sequence[tuple[str, str | None]]) -> list[tuple[str, tuple[str, ...]]]:
    return [(flag, () if value is None else (value,)) for flag, value in pairs]


def _apply(
    args: list[ArgSource],
    replaced: dict[str, list[ArgSource]],
    option: str,
    values: tuple[str, ...],
    origin: Origin,
) -> None:
    new = ArgSource(option, values[0] if values else None, origin, more_values=values[1:])
    if not option:  # a stray value: kept in place for validation to report
        args.append(dataclasses.replace(new, flag=values[0], value=None, more_values=()))
        return
    key = _key(option)
    at = next((i for i, a in enumerate(args) if a.flag and _key(a.flag) == key), None)
    if at is None:
        args.append(new)
        return
    history = [args[at], *replaced.get(key, [])]
    replaced[key] = history
    note = "overrides " + ", ".join(f"{a.origin.value} {a.shown()}" for a in history)
    args[at] = dataclasses.replace(new, note=note)


def _environment(
    args: Sequence[ArgSource], extra: Sequence[tuple[str, str]]
) -> tuple[tuple[str, str], ...]:
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    algorithm = next(
        (a.value for a in args if _key(a.flag) == "--speculative-algorithm"), None
    )
    if algorithm is not None and algorithm.upper() == DSPARK:
        env["SGLANG_RAGGED_VERIFY_MODE"] = "static"
    for name, value in extra:
        if name not in FORBIDDEN_ENV:
            env[name] = value
    return tuple(env.items())


def _arg_json(arg: ArgSource) -> dict[str, Any]:
    out: dict[str, Any] = {"flag": arg.flag, "value": arg.value, "origin": arg.origin.value}
    if arg.note:
        out["note"] = arg.note
    if arg.more_values:
        out["more_values"] = list(arg.more_values)
    return out


def _arg_from_json(item: Any) -> ArgSource:
    if not isinstance(item, dict):
        raise TypeError(f"an argument must be an object, got {item!r}")
    value = item["value"]
    if value is not None and not isinstance(value, str):
        raise TypeError(f"value of {item['flag']!r} must be a string or null")
    return ArgSource(
        flag=str(item["flag"]),
        value=value,
        origin=Origin(item["origin"]),
        note=str(item.get("note", "")),
        more_values=json_strings(item.get("more_values", []), "more_values"),
    )


def json_pair(item: Any, what: str) -> tuple[str, str]:
    """A [NAME, VALUE] pair read from a spec file (the launch spec's and the router's env)."""
    items = json_strings(item, what)
    if len(items) != 2:
        raise ValueError(f"{what} entry {item!r} is not a NAME, VALUE pair")
    return items[0], items[1]


def json_strings(items: Any, what: str) -> tuple[str, ...]:
    """A list of strings read from a spec file; TypeError naming `what` otherwise."""
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise TypeError(f"{what} must be a list of strings")
    return tuple(items)
