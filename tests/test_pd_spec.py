"""The launch spec of a prefill or decode engine carries SGLang's disaggregation timeouts from
the configuration (cell.bootstrap_timeout_s, cell.waiting_timeout_s); a unified engine's spec
has neither, so its hash is what it was before cells."""

from __future__ import annotations

import dataclasses

import pytest

from appliance.config import CellConfig, Config
from appliance.engine.args import ENV_REASONS, build_launch_spec, inputs_from_config

NAMES = ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")


def spec_env(config: Config, role: str | None = None) -> dict[str, str]:
    spec = build_launch_spec(("sglang",), inputs_from_config(config, role=role))
    return dict(spec.env)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_engine_gets_the_chosen_timeouts_not_sglangs_300(role: str) -> None:
    env = spec_env(Config(cell=CellConfig(role=role)))
    assert (env[NAMES[0]], env[NAMES[1]]) == ("60", "120")
    tuned = Config(cell=CellConfig(role=role, bootstrap_timeout_s=45, waiting_timeout_s=200))
    assert (spec_env(tuned)[NAMES[0]], spec_env(tuned)[NAMES[1]]) == ("45", "200")
    assert all(name in ENV_REASONS for name in NAMES)


def test_a_role_the_head_chose_sets_them_and_unified_sets_none() -> None:
    config = Config()
    assert not set(NAMES) & set(spec_env(config))
    assert spec_env(config, role="decode")[NAMES[0]] == "60"
    before = build_launch_spec(("sglang",), inputs_from_config(config)).spec_hash
    other = dataclasses.replace(config, cell=CellConfig(bootstrap_timeout_s=5))
    assert build_launch_spec(("sglang",), inputs_from_config(other)).spec_hash == before
