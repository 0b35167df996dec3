"""`appliance engine exec-spec` runs only SGLang from the installer's engines directory.

The daemon's user writes the launch spec; the engine unit runs it as another user with the
GPUs. These tests plant what a compromised daemon would write (a foreign program, a program
in a directory others can write, `-c CODE`, loader and interpreter variables, a stray flag)
and check that exec-spec refuses each, naming it, and runs nothing: a real subprocess each
time, with a marker file the planted program would write.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest

from appliance.atomic import write_atomic
from appliance.engine.args import (
    ArgSource,
    LaunchInputs,
    LaunchSpec,
    Origin,
    build_launch_spec,
    spec_hash,
)
from appliance.engine.exec_guard import check_program, check_spec
from tests.conftest import run_cli

PROGRAM = """#!{python}
import sys
from pathlib import Path
Path({marker!r}).write_text(" ".join(sys.argv[1:]))
sys.exit(7)
"""


def inputs(**changes: object) -> LaunchInputs:
    base = dict(model_path=Path("/models/k3"), served_model_name="kimi-k3", port=30000,
                tp_size=8, dcp_size=8, mem_fraction_static=0.93, mamba_full_memory_ratio=0.9,
                kv_cache_dtype="fp8_e4m3", speculative=False)
    base.update(changes)
    return LaunchInputs(**base)  # type: ignore[arg-type]


def program_at(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PROGRAM.format(python=sys.executable, marker=str(marker)))
    path.chmod(0o755)
    return path


def exec_spec(tmp_path: Path, spec: LaunchSpec, engines: Path) -> tuple[int, str]:
    spec_file = tmp_path / "launch-spec.json"
    write_atomic(spec_file, spec.to_json().encode())
    done = run_cli("engine", "exec-spec", "--spec", str(spec_file),
                   "--engines-dir", str(engines))
    return done.returncode, done.stderr


@pytest.fixture
def engines(tmp_path: Path) -> Path:
    path = tmp_path / "engines"
    path.mkdir(mode=0o755)
    return path


def test_the_installers_program_runs(tmp_path: Path, engines: Path) -> None:
    marker = tmp_path / "ran"
    program = program_at(engines / "sglang-0.5.23-abc" / "bin" / "sglang", marker)
    code, stderr = exec_spec(tmp_path, build_launch_spec((str(program),), inputs()), engines)
    assert code == 7, stderr  # the program's own status: it was exec'd
    assert marker.read_text().startswith("serve --model-path /models/k3")


def test_a_program_outside_the_engines_directory_is_refused(tmp_path: Path,
                                                             engines: Path) -> None:
    marker = tmp_path / "ran"
    foreign = program_at(tmp_path / "elsewhere" / "sglang", marker)
    for program in (str(foreign), "/bin/echo", "echo",
                    str(engines / ".." / "elsewhere" / "sglang")):
        code, stderr = exec_spec(tmp_path, build_launch_spec((program,), inputs()), engines)
        assert code == 64, stderr
        assert "refusing to run the launch spec" in stderr
        assert "engines directory" in stderr or "absolute path" in stderr
        assert "set engine.command" in stderr  # what to do next
        assert not marker.exists()


def test_a_program_another_user_could_replace_is_refused(tmp_path: Path,
                                                         engines: Path) -> None:
    marker = tmp_path / "ran"
    program = program_at(engines / "sglang-x" / "bin" / "sglang", marker)
    spec = build_launch_spec((str(program),), inputs())
    program.parent.chmod(0o775)  # the group may swap the program
    code, stderr = exec_spec(tmp_path, spec, engines)
    assert code == 64 and "writable by its group or by others" in stderr, stderr
    program.parent.chmod(0o755)
    program.chmod(0o757)
    code, stderr = exec_spec(tmp_path, spec, engines)
    assert code == 64 and f"{program} is writable" in stderr, stderr
    assert not marker.exists()


def test_ownership_by_another_user_is_refused(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    program = engines / "bin" / "sglang"
    real = os.lstat

    def lstat(path: Path) -> os.stat_result:
        st = real(path)
        if path == program.parent:  # as if the daemon's user owned the engine's bin/
            fields = list(st)
            fields[stat.ST_UID] = 4242
            return os.stat_result(fields)
        return st

    program_at(program, tmp_path / "ran")
    problems = check_program(str(program), engines, lstat=lstat, uid=0)
    assert problems == [f"{program.parent} belongs to uid 4242, not root: another user could "
                        "replace the engine program"]
    assert check_program(str(program), engines) == []  # as it is: root's, or this user's


def test_code_injection_through_arguments_or_environment_is_refused(tmp_path: Path,
                                                                    engines: Path) -> None:
    marker = tmp_path / "ran"
    program = program_at(engines / "sglang-x" / "bin" / "python", marker)
    cases = [
        (build_launch_spec((str(program), "-c", "import os"), inputs()),
         "leading arguments ['-c', 'import os'] are not allowed"),
        (build_launch_spec((str(program), "/tmp/evil.py"), inputs()),
         "leading arguments ['/tmp/evil.py'] are not allowed"),
        (build_launch_spec((str(program),), inputs(extra_env=(("LD_PRELOAD", "/tmp/x.so"),))),
         "'LD_PRELOAD' is not one the engine may be given"),
        (build_launch_spec((str(program),), inputs(extra_env=(("PYTHONPATH", "/tmp"),))),
         "'PYTHONPATH' is not one the engine may be given"),
    ]
    for spec, expected in cases:
        code, stderr = exec_spec(tmp_path, spec, engines)
        assert code == 64 and expected in stderr, stderr
    assert not marker.exists()
    # SGLang's own module through the venv's Python is what a `-m` command may run
    ok = build_launch_spec((str(program), "-m", "sglang.launch_server"), inputs())
    assert check_spec(ok) == []


def test_a_hand_made_spec_with_a_stray_flag_is_refused(tmp_path: Path, engines: Path) -> None:
    """A spec whose hash was recomputed to fit a token SGLang does not know (the daemon
    never writes one: it validates first) is refused again at the door."""
    marker = tmp_path / "ran"
    program = program_at(engines / "sglang-x" / "bin" / "sglang", marker)
    good = build_launch_spec((str(program),), inputs())
    args = (*good.args, ArgSource("--exec-this", "now", Origin.OPERATOR))
    stray = dataclasses.replace(good, args=args)
    spec = dataclasses.replace(stray, spec_hash=spec_hash(stray.command, stray.serve_args(),
                                                          stray.env))
    code, stderr = exec_spec(tmp_path, spec, engines)
    assert code == 64 and "--exec-this" in stderr and "unknown flag" in stderr, stderr
    assert not marker.exists()


def test_a_config_file_may_only_be_the_daemons_key_file(tmp_path: Path, engines: Path) -> None:
    """SGLang reads more flags from `--config`: only the daemon's own key file beside the
    spec, holding the engine's API key alone, passes."""
    marker = tmp_path / "ran"
    program = program_at(engines / "sglang-x" / "bin" / "sglang", marker)
    own = tmp_path / "engine-auth.yaml"
    own.write_text('{"api-key": "0123456789abcdef0123456789abcdef"}\n')
    foreign = tmp_path / "elsewhere.yaml"
    foreign.write_text('{"api-key": "x"}\n')

    def spec_with(config: Path) -> LaunchSpec:
        base = build_launch_spec((str(program),), inputs())
        args = (*base.args, ArgSource("--config", str(config), Origin.DEFAULT))
        spec = dataclasses.replace(base, args=args)
        return dataclasses.replace(spec, spec_hash=spec_hash(spec.command, spec.serve_args(),
                                                             spec.env))

    code, stderr = exec_spec(tmp_path, spec_with(foreign), engines)
    assert code == 64 and "is not the engine's key file" in stderr, stderr
    own.write_text('{"api-key": "k", "trust-remote-code": true}\n')
    code, stderr = exec_spec(tmp_path, spec_with(own), engines)
    assert code == 64 and "holds trust-remote-code" in stderr, stderr
    assert not marker.exists()
    own.write_text('{"api-key": "0123456789abcdef0123456789abcdef"}\n')
    code, stderr = exec_spec(tmp_path, spec_with(own), engines)
    assert code == 7, stderr
