"""What `appliance engine exec-spec` agrees to exec: the check at the engine unit's door.

The launch spec is written by the daemon's user (`appliance`), but the engine unit runs it
as another user (`appliance-engine`) with the GPUs. A compromised daemon or gateway must not
be able to turn that into running a program of its choosing, so before the exec this module
checks again, as the engine's own user, everything the spec says:

- **the program** is one the installer put on the box: its path (directory resolved, the
  last component kept, as `args.resolve_program` writes it) lies inside the engines
  directory named on the unit's ExecStart (root's unit file, `/opt/appliance/engines`), and
  that path, and every directory above it, belongs to root (or to the user running this
  check) and is writable by nobody else (a sticky directory such as /tmp excepted, where
  nobody can replace another's entry). A program anywhere else, or one another user could
  swap, is refused;
- **the leading arguments** are none, or `-m sglang…` (a Python interpreter told to run
  SGLang's own module): never `-c CODE` or a script path;
- **the flags** are SGLang 0.5.23's own, checked with the same flag table the daemon uses
  (`validate.check_argv`), so a hand-edited spec cannot smuggle a stray token;
- **the environment** holds only names the daemon writes or an operator may tune the engine
  with (`ENGINE_ENV_PREFIXES`); never the loader's or Python's code-injection variables
  (`LD_PRELOAD`, `PYTHONPATH`, `PYTHONSTARTUP`, …).

- **a `--config` file** (SGLang reads more flags from it) is only the daemon's own
  `engine-auth.yaml` beside the spec, and it holds the engine's API key and nothing else.

`check_spec` is pure; `check_program` (lstat only, no symlink followed but those root placed
inside the checked directory) and `check_config_file` read the file system. Each returns the
problems in words; an empty list means the exec may go ahead.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from appliance.engine.args import LaunchSpec
from appliance.engine.validate import check_argv

DEFAULT_ENGINES_DIR = Path("/opt/appliance/engines")
# Variable families the engine may be given: the daemon's own (PYTHONUNBUFFERED, SGLANG_*)
# and the GPU stack's tuning knobs an operator sets in engine extra env. Nothing that makes a
# loader or an interpreter run other code.
ENGINE_ENV_PREFIXES = ("SGLANG_", "NCCL_", "CUDA_", "TORCH_", "TRITON_", "FLASHINFER_", "NVSHMEM_",
                       "UCX_", "MC_", "MOONCAKE_", "NIXL_", "OMP_", "TOKENIZERS_", "HF_", "NVIDIA_",
                       # the engine emulator's knobs (appliance.testing: tests and the demo)
                       "FAKE_SGLANG_")
ENGINE_ENV_NAMES = frozenset({"PYTHONUNBUFFERED", "TZ"})
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
_MODULE = re.compile(r"sglang(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_spec(spec: LaunchSpec) -> list[str]:
    """What is wrong with the spec's leading arguments, flags and environment (pure)."""
    problems: list[str] = []
    lead = list(spec.command[1:])
    if lead and not (len(lead) == 2 and lead[0] == "-m" and _MODULE.fullmatch(lead[1])):
        problems.append(f"the program's leading arguments {lead!r} are not allowed: only "
                        "none, or `-m sglang…` (SGLang's own module)")
    problems.extend(str(problem) for problem in check_argv(spec.serve_args()))
    for name, _value in spec.env:
        allowed = name in ENGINE_ENV_NAMES or (
            _ENV_NAME.fullmatch(name) is not None and name.startswith(ENGINE_ENV_PREFIXES))
        if not allowed:
            problems.append(f"the environment variable {name!r} is not one the engine may be "
                            f"given (allowed: {', '.join(sorted(ENGINE_ENV_NAMES))} and "
                            f"{', '.join(p + '*' for p in ENGINE_ENV_PREFIXES)})")
    return problems


CONFIG_FILE_NAME = "engine-auth.yaml"  # appliance.secrets.engine_auth_path's name
CONFIG_FILE_KEYS = frozenset({"api-key", "api_key"})


def check_config_file(spec: LaunchSpec, spec_path: Path) -> list[str]:
    """A `--config` flag may name only the daemon's key file beside the spec, holding only
    the engine's API key: any other file could carry flags the table never saw."""
    import yaml

    allowed = Path(os.path.realpath(spec_path.parent)) / CONFIG_FILE_NAME
    problems: list[str] = []
    for arg in spec.args:
        if arg.flag != "--config":
            continue
        given = Path(os.path.realpath(arg.value or ""))
        if given != allowed:
            problems.append(f"--config {arg.value} is not the engine's key file {allowed}")
            continue
        try:
            body = yaml.safe_load(given.read_text())
        except (OSError, yaml.YAMLError) as exc:
            problems.append(f"--config {given} cannot be read: {exc}")
            continue
        keys = set(body) if isinstance(body, dict) else {"(not a mapping)"}
        if not keys <= CONFIG_FILE_KEYS:
            extra = ", ".join(sorted(map(str, keys - CONFIG_FILE_KEYS)))
            problems.append(f"--config {given} holds {extra}: only the engine's api-key may "
                            "be set there")
    return problems


def check_program(program: str, engines_dir: Path, *,
                  lstat: Callable[[Path], os.stat_result] = os.lstat,
                  uid: int | None = None) -> list[str]:
    """Whether `program` is inside `engines_dir` and only root (or `uid`, the caller) could
    have put it there. The directories are resolved (`engines_dir` itself may be reached
    through a link root made); the program's own last component is lstat'ed, not followed:
    a venv's `bin/python` is a link root made to the base interpreter."""
    me = os.geteuid() if uid is None else uid
    path = Path(program)
    if not path.is_absolute():
        return [f"the engine program {program!r} is not an absolute path"]
    try:
        base = Path(os.path.realpath(engines_dir))
        where = Path(os.path.realpath(path.parent))
    except OSError as exc:
        return [f"cannot resolve {program!r}: {exc.strerror or exc}"]
    if base != where and base not in where.parents:
        return [f"the engine program {program} is not inside the engines directory "
                f"{engines_dir} (what the installer builds); refusing to run it"]
    target = where / path.name
    chain = [target, where, *where.parents]
    problems: list[str] = []
    for item in chain:
        try:
            st = lstat(item)
        except OSError as exc:
            return [f"cannot check {item}: {exc.strerror or exc}"]
        if st.st_uid not in (0, me):
            problems.append(f"{item} belongs to uid {st.st_uid}, not root: another user could "
                            "replace the engine program")
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if writable and not stat.S_ISLNK(st.st_mode) and not sticky:
            problems.append(f"{item} is writable by its group or by others "
                            f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could "
                            "replace the engine program")
    return problems
