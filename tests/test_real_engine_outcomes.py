"""What the real-engine tier taught the product, as pure checks (no engine needed).

- A stop says how SGLang ended: drained (0), or ended on SIGTERM at once because no request
  had ever reached it (its drain is installed lazily: -15 from Popen, 143 from a shell),
  neither of which is a crash.
- `engine.extra_env` reaches the launch spec (and its hash); a bad name is refused with the
  key named, and `NOTIFY_SOCKET` (the daemon's, never the engine's) is refused too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config import load_config
from appliance.engine.args import build_launch_spec, inputs_from_config
from appliance.engine.states import stop_outcome
from appliance.errors import ConfigError


@pytest.mark.parametrize(("code", "words"), [
    (0, "drained and exited cleanly"),
    (-15, "without a drain"),
    (143, "without a drain"),
    (-9, "was killed"),
    (1, "exited with status 1"),
])
def test_a_stop_says_how_the_engine_ended(code: int, words: str) -> None:
    said = stop_outcome(code)
    assert words in said
    assert ("drained" in said) is (code == 0)  # a no-drain exit is never called a drain


def test_an_unknown_exit_adds_nothing() -> None:
    assert stop_outcome(None) == ""


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "appliance.toml"
    path.write_text(text)
    return path


def test_extra_env_reaches_the_launch_spec_and_its_hash(tmp_path: Path) -> None:
    plain = load_config(dev=True, dev_root=tmp_path / "a", env={})
    path = _config(tmp_path, '[engine]\nextra_env = { SGLANG_USE_CPU_ENGINE = "1" }\n')
    cpu = load_config(path, dev=True, dev_root=tmp_path / "a", env={})
    assert dict(cpu.engine.extra_env) == {"SGLANG_USE_CPU_ENGINE": "1"}
    spec = build_launch_spec(cpu.engine.command, inputs_from_config(cpu))
    before = build_launch_spec(plain.engine.command, inputs_from_config(plain))
    assert ("SGLANG_USE_CPU_ENGINE", "1") in spec.env
    assert spec.spec_hash != before.spec_hash  # another engine: never adopted as the same
    assert spec.serve_args() == before.serve_args()


@pytest.mark.parametrize("name", ["NOTIFY_SOCKET", "1BAD", "HAS SPACE"])
def test_a_bad_extra_env_name_is_refused_naming_the_key(tmp_path: Path, name: str) -> None:
    path = _config(tmp_path, f'[engine]\nextra_env = {{ "{name}" = "1" }}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path, dev=True, dev_root=tmp_path / "a", env={})
    text = caught.value.as_text()
    assert "engine.extra_env" in text and "variable name" in text, text


def test_generation_probes_can_be_turned_off(tmp_path: Path) -> None:
    path = _config(tmp_path, "[health]\ngeneration_probes = false\n")
    assert load_config(path, dev=True, dev_root=tmp_path / "a", env={}).health \
        .generation_probes is False
