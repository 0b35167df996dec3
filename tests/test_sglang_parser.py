"""The flag table and the launch-spec check against the real SGLang 0.5.23 parser, in the
real-engine tier: `make test` builds the tier's environment (tests/realengine/build-env.sh)
and these run in it every time. SGLang's parser needs no GPU (argparse plus the ServerArgs
record; shared/reference/sglang-0.5.23.md §7).

TEST_APPLIANCE_SGLANG_VENV, when set, names another virtual environment with
`sglang==0.5.23` to use instead (a box's own engine env, say); without it the tier's env is
used, and the tests skip only where the tier skips (no env built, outside CI).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance.config import load_config
from appliance.engine.args import build_launch_spec, inputs_from_config
from appliance.engine.flags import FLAGS
from appliance.engine.validate import check_argv, validate_launch_spec
from appliance.secrets import write_engine_auth

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def venv(request: pytest.FixtureRequest) -> Path:
    """The environment whose SGLang answers: the override, else the tier's."""
    override = os.environ.get("TEST_APPLIANCE_SGLANG_VENV", "")
    if override:
        return Path(override)
    return Path(request.getfixturevalue("real_sglang_env"))


# One import of sglang (seconds, tens of them on a loaded box) answers both questions: its
# parser's options with their choices, and its verdict on each argv of AGREEMENT.
ASK_THE_PARSER = """
import argparse, contextlib, io, json, sys
from sglang.srt.server_args import ServerArgs, prepare_server_args
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
options = {o: sorted(map(str, a.choices)) if a.choices else None
           for a in parser._actions for o in a.option_strings}
verdicts = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            prepare_server_args(argv)
        verdicts.append({"ok": True, "error": ""})
    except SystemExit:
        verdicts.append({"ok": False, "error": err.getvalue()})
    except Exception as exc:
        verdicts.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
print(json.dumps({"options": options, "verdicts": verdicts}))
"""
# Each argv once through the flag table (`check_argv`, what the daemon uses where the engine
# env cannot answer) and once through SGLang's parser: they must agree on what is refused.
AGREEMENT = [
    (["--model-path", "/m", "--tp-size", "8", "--mamba-full-memory-ratio", "5"], True),
    (["--model-path", "/m", "--speculative-algorithm", "DSPARK",
      "--speculative-dspark-block-size", "7", "--max-running-requests", "48"], True),
    (["--model-path", "/m", "--max-total-tokens", "4096", "--kv-cache-dtype", "fp8_e4m3"], True),
    (["--model-path", "/m", "--enable-hicache", "--hicache-ratio", "2.0"], True),
    (["--model-path", "/m", "--no-such-flag"], False),
    (["--model-path", "/m", "--tp-size", "eight"], False),
    (["--model-path", "/m", "--reasoning-parser", "nope"], False),
    (["--model-path", "/m", "--kv-cache-dtype", "fp9"], False),
    (["--model-path", "/m", "--mamba-full-memory-ratio"], False),
]


@pytest.fixture(scope="module")
def real_parser(venv: Path) -> dict[str, Any]:
    argvs = json.dumps([argv for argv, _ in AGREEMENT])
    result = subprocess.run([str(venv / "bin" / "python"), "-c", ASK_THE_PARSER, argvs],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    answer: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer


def test_flag_table_is_the_real_parser(real_parser: dict[str, Any]) -> None:
    real: dict[str, list[str] | None] = dict(real_parser["options"])
    real.pop("-h", None)
    real.pop("--help", None)
    ours = {}
    for flag in FLAGS:
        for name in (flag.name, *flag.aliases, *flag.negations):
            ours[name] = sorted(map(str, flag.choices)) if flag.choices else None
    assert set(ours) == set(real)
    assert {k: v for k, v in ours.items() if v} == {k: v for k, v in real.items() if v}


@pytest.mark.parametrize("case", range(len(AGREEMENT)))
def test_the_flag_table_refuses_what_sglangs_parser_refuses(
        real_parser: dict[str, Any], case: int) -> None:
    argv, accepted = AGREEMENT[case]
    verdict = real_parser["verdicts"][case]
    table = check_argv(argv)
    assert verdict["ok"] is accepted, verdict["error"]
    assert (not table) is accepted, table
    if not accepted:  # the table names the flag SGLang's own message names
        assert table[0].flag in verdict["error"], (table, verdict["error"])


@pytest.mark.parametrize("speculative", [False, True])
def test_default_k3_argv_passes_sglangs_own_parser(venv: Path, tmp_path: Path,
                                                   speculative: bool) -> None:
    config = load_config(dev=True, dev_root=tmp_path, env={})
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, speculative=speculative))
    write_engine_auth(config.paths.state_dir)  # the --config file SGLang reads the key from
    spec = build_launch_spec(("sglang",), inputs_from_config(config))
    result = validate_launch_spec(spec, venv, timeout=300)
    assert result.ok, result.problems
    assert result.method.startswith("sglang 0.5.23 parser")


def test_a_typo_is_caught_by_sglangs_own_parser(venv: Path, tmp_path: Path) -> None:
    config = load_config(dev=True, dev_root=tmp_path, env={})
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, extra_args=("--mem-fraction-statc", "0.9")))
    write_engine_auth(config.paths.state_dir)
    result = validate_launch_spec(build_launch_spec(("sglang",), inputs_from_config(config)),
                                  venv, timeout=300)
    assert not result.ok
    assert "did you mean --mem-fraction-static" in result.problems[0].message

