"""`appliance cell exec-router`: what `appliance-router.service` runs. It reads the router
spec the daemon wrote (appliance/cell/router.py), checks it again, adds the engine API key
from the spec's key file, and execs SGLang's router, so MainPID is the router itself.

The checks, like the engine's exec guard (appliance/engine/exec_guard.py), keep the unit from
running anything but the installer's router:

- **the program** is `-m sglang_router.launch_router` under a Python inside the router
  directory named on the unit's ExecStart (root's unit file, `/opt/appliance/router`), that
  path and every directory above it root's and writable by nobody else (`check_program`);
- **the arguments** are only the flags `router_args` writes, so a hand-edited spec cannot add
  one that reads another file, opens another listener or carries its own key;
- **the environment** is only `HF_*` names (what `ROUTER_ENV` writes);
- **the key file** holds an engine API key and nothing else.

The key never enters the router's command line, which every user of the box can read in
`/proc/PID/cmdline`. sglang-router 0.3.2 takes it only as `--api-key` (no file, no
environment variable), but its launcher is Python that parses `sys.argv`: so the router's
Python runs `KEY_ON_STDIN` (`launch_argv`), a fixed launcher that reads the key from its
stdin, a pipe written and closed before the exec, points stdin at /dev/null, and runs
`sglang_router.launch_router` with `--api-key KEY` added to `sys.argv` in its memory only.
The process's argv holds the launcher and the spec's arguments, never the key. The router
asks every caller for the same key (the head's gateway sends it, as it does to a unified
engine) and sends it to the workers.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Final, NoReturn

from appliance.cell.router import DEFAULT_ROUTER_DIR, ROUTER_MODULE, RouterSpec
from appliance.errors import EX_USAGE, ApplianceError

# The flags router_args writes, with how many values each takes (--prefill: URL and port).
ROUTER_FLAGS = {
    "--pd-disaggregation": 0, "--prefill": 2, "--decode": 1, "--host": 1, "--port": 1,
    "--policy": 1, "--model-path": 1, "--tokenizer-path": 1, "--prometheus-host": 1,
    "--prometheus-port": 1, "--health-check-interval-secs": 1,
    "--health-failure-threshold": 1, "--health-success-threshold": 1,
    "--health-check-timeout-secs": 1, "--retry-max-retries": 1,
    "--retry-initial-backoff-ms": 1, "--retry-max-backoff-ms": 1,
    "--retry-backoff-multiplier": 1, "--retry-jitter-factor": 1,
    "--disable-circuit-breaker": 0, "--worker-startup-timeout-secs": 1,
    "--request-timeout-secs": 1, "--log-level": 1,
}
# Run by the router venv's Python as `-c`: the key from stdin into sys.argv, in memory only,
# then the launcher `-m sglang_router.launch_router` would have run (module docstring).
KEY_ON_STDIN: Final = (
    "import os, runpy, sys\n"
    "key = sys.stdin.readline().strip()\n"
    "null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)\n"
    "if not key: sys.exit('appliance: the router was given no engine key on its stdin')\n"
    "sys.argv = [sys.argv[0], *sys.argv[1:], '--api-key', key]\n"
    f"runpy.run_module({ROUTER_MODULE!r}, run_name='__main__', alter_sys=True)\n")
_ENV_NAME = re.compile(r"HF_[A-Z0-9_]+")
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{31,127}")  # appliance.secrets.ENGINE_KEY_RE


def check_router_spec(spec: RouterSpec) -> list[str]:
    """What is wrong with the spec's module, flags and environment (pure)."""
    problems: list[str] = []
    if list(spec.command[1:]) != ["-m", ROUTER_MODULE]:
        problems.append(f"the router's leading arguments {list(spec.command[1:])!r} are not "
                        f"`-m {ROUTER_MODULE}`")
    args = list(spec.args)
    i = 0
    while i < len(args):
        flag = args[i]
        if flag not in ROUTER_FLAGS:
            problems.append(f"{flag!r} is not a flag the appliance gives the router")
            break
        values = args[i + 1:i + 1 + ROUTER_FLAGS[flag]]
        if len(values) != ROUTER_FLAGS[flag] or any(v.startswith("-") for v in values):
            problems.append(f"{flag} lacks its value")
            break
        i += 1 + len(values)
    for name, _value in spec.env:
        if not _ENV_NAME.fullmatch(name):
            problems.append(f"the environment variable {name!r} is not one the router may be "
                            "given (HF_* only)")
    return problems


def launch_argv(spec: RouterSpec) -> list[str]:
    """What runs: the spec's Python with the key-reading launcher and the spec's arguments
    (the key itself goes to its stdin)."""
    return [spec.command[0], "-c", KEY_ON_STDIN, *spec.args]


def key_pipe(key: str) -> int:
    """A pipe's read end holding `key` and a newline, its write end already closed (the key
    is far below a pipe's buffer, so the write never blocks)."""
    read, write = os.pipe()
    try:
        os.write(write, key.encode() + b"\n")
    finally:
        os.close(write)
    return read


def read_key(path: Path) -> str:
    """The engine API key from its file; ValueError naming the file when it holds none."""
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the engine key {path}: {exc.strerror or exc}") from None
    if not _KEY.fullmatch(key):
        raise ValueError(f"{path} does not hold an engine API key")
    return key


def exec_router(path: Path, router_dir: Path | None = None) -> NoReturn:
    """Become the router the spec describes, after the checks in the module docstring."""
    from appliance.engine.exec_guard import check_program
    from appliance.sdnotify import child_environment

    try:
        spec = RouterSpec.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ApplianceError(
            "router_spec_invalid", f"cannot use the router spec {path}: {exc}",
            "the head's daemon writes it from the cell's members (docs/cell.md, The router); "
            "check `appliance cell members`", exit_code=EX_USAGE) from None
    allowed = router_dir or DEFAULT_ROUTER_DIR
    problems = check_router_spec(spec) + [
        f"router: {p}" for p in check_program(spec.command[0], allowed)]
    key = ""
    if not problems:
        try:
            key = read_key(Path(spec.key_file))
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ApplianceError(
            "router_spec_refused", f"refusing to run the router spec {path}: "
            + "; ".join(problems),
            f"the router runs only sglang-router from {allowed} (the installer's) with the "
            "flags the appliance writes: let the daemon rewrite the spec", exit_code=EX_USAGE)
    env = child_environment()
    env.update(dict(spec.env))
    argv = launch_argv(spec)
    stdin = key_pipe(key)
    os.dup2(stdin, 0)  # the launcher reads the key there; dup2 leaves fd 0 inheritable
    os.close(stdin)
    sys.stdout.flush()
    os.execve(argv[0], argv, env)  # noqa: S606 - the whole point: become the router
