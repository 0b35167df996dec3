"""Checks against the real SGLang 0.5.23 parser, when a venv with it is at hand.

Set TEST_APPLIANCE_SGLANG_VENV to a virtual environment holding `sglang==0.5.23` (its
parser needs no GPU: the CPU torch wheel plus sglang's light dependencies are enough, see
shared/reference/sglang-0.5.23.md §7). Skipped otherwise: CI has no such venv.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from appliance.config import load_config
from appliance.engine.args import build_launch_spec, inputs_from_config
from appliance.engine.flags import FLAGS
from appliance.engine.validate import validate_launch_spec
from appliance.secrets import write_engine_auth

VENV = os.environ.get("TEST_APPLIANCE_SGLANG_VENV", "")
pytestmark = pytest.mark.skipif(not VENV, reason="TEST_APPLIANCE_SGLANG_VENV not set")

LIST_OPTIONS = """
import argparse, json
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
print(json.dumps({o: sorted(map(str, a.choices)) if a.choices else None
                  for a in parser._actions for o in a.option_strings}))
"""


def test_flag_table_is_the_real_parser() -> None:
    out = subprocess.run([str(Path(VENV) / "bin" / "python"), "-c", LIST_OPTIONS],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    real: dict[str, list[str] | None] = json.loads(out.strip().splitlines()[-1])
    real.pop("-h", None)
    real.pop("--help", None)
    ours = {}
    for flag in FLAGS:
        for name in (flag.name, *flag.aliases, *flag.negations):
            ours[name] = sorted(map(str, flag.choices)) if flag.choices else None
    assert set(ours) == set(real)
    assert {k: v for k, v in ours.items() if v} == {k: v for k, v in real.items() if v}


@pytest.mark.parametrize("speculative", [False, True])
def test_default_k3_argv_passes_sglangs_own_parser(tmp_path: Path, speculative: bool) -> None:
    config = load_config(dev=True, dev_root=tmp_path, env={})
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, speculative=speculative))
    write_engine_auth(config.paths.state_dir)  # the --config file SGLang reads the key from
    spec = build_launch_spec(("sglang",), inputs_from_config(config))
    result = validate_launch_spec(spec, Path(VENV), timeout=300)
    assert result.ok, result.problems
    assert result.method.startswith("sglang 0.5.23 parser")


def test_a_typo_is_caught_by_sglangs_own_parser(tmp_path: Path) -> None:
    config = load_config(dev=True, dev_root=tmp_path, env={})
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, extra_args=("--mem-fraction-statc", "0.9")))
    write_engine_auth(config.paths.state_dir)
    result = validate_launch_spec(build_launch_spec(("sglang",), inputs_from_config(config)),
                                  Path(VENV), timeout=300)
    assert not result.ok
    assert "did you mean --mem-fraction-static" in result.problems[0].message
