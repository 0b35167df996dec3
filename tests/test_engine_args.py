"""The engine's launch spec (pure), the flag-table check (pure) and the SGLang-parser check,
the last run against fake engine environments: a `bin/python` that is this interpreter with a
stub `sglang` package, so the subprocess path, its timeout and the fallback are real."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from appliance.config import Config, EngineConfig, PathsConfig
from appliance.engine import flags
from appliance.engine.args import (
    ArgSource,
    LaunchInputs,
    LaunchSpec,
    Origin,
    build_launch_spec,
    inputs_from_config,
    model_dir,
)
from appliance.engine.validate import (
    TABLE_METHOD,
    ArgProblem,
    check_argv,
    validate_launch_spec,
    validate_with_sglang,
)

SGLANG = ("/opt/appliance/engine/bin/sglang",)
MODEL = "/var/lib/appliance/models/moonshotai--Kimi-K3"
K3_DEFAULT = [
    "--model-path", MODEL,
    "--served-model-name", "kimi-k3",
    "--host", "127.0.0.1",
    "--port", "30000",
    "--tp-size", "8",
    "--dcp-size", "8",
    "--trust-remote-code",
    "--reasoning-parser", "kimi_k3",
    "--tool-call-parser", "kimi_k3",
    "--enable-metrics",
    "--enable-cache-report",
    "--enable-mixed-chunk",
    "--kv-cache-dtype", "fp8_e4m3",
    "--mem-fraction-static", "0.93",
    "--mamba-full-memory-ratio", "0.9",
]


def inputs(**changes: object) -> LaunchInputs:
    base = inputs_from_config(Config())
    # without the engine key's --config (tests/test_engine_api_key.py covers it)
    return dataclasses.replace(base, **{"engine_auth": None, **changes})  # type: ignore[arg-type]


def spec(**changes: object) -> LaunchSpec:
    return build_launch_spec(SGLANG, inputs(**changes))


# --------------------------------------------------------------------------- defaults


def test_default_k3_argv_exactly() -> None:
    built = spec()
    assert built.argv() == [*SGLANG, "serve", *K3_DEFAULT]
    assert built.serve_args() == K3_DEFAULT
    assert built.env == (("PYTHONUNBUFFERED", "1"),)


def test_every_default_flag_is_a_default_with_no_note() -> None:
    built = spec()
    assert [a.flag for a in built.args] == [t for t in K3_DEFAULT if t.startswith("--")]
    assert {a.origin for a in built.args} == {Origin.DEFAULT}
    assert all(a.note == "" for a in built.args)
    switches = {a.flag for a in built.args if a.value is None}
    assert switches == {"--trust-remote-code", "--enable-metrics", "--enable-cache-report",
                        "--enable-mixed-chunk"}


def test_default_argv_passes_the_flag_table() -> None:
    assert check_argv(spec().serve_args()) == []
    assert check_argv(spec(speculative=True).serve_args()) == []


def test_inputs_from_config_maps_every_engine_setting(tmp_path: Path) -> None:
    config = Config(
        paths=PathsConfig(models_dir=tmp_path),
        engine=EngineConfig(model="acme/Big-Model", served_model_name="big", port=31000,
                            tp_size=4, dcp_size=2, mem_fraction_static=0.8,
                            mamba_full_memory_ratio=2.5, kv_cache_dtype="bf16",
                            speculative=True, extra_args=("--watchdog-timeout", "600")),
    )
    got = inputs_from_config(config, tuning_args=(("--max-mamba-cache-size", "96"),),
                             profile_args=(("--max-running-requests", "64"),))
    assert got == LaunchInputs(
        model_path=tmp_path / "acme--Big-Model", served_model_name="big", port=31000,
        tp_size=4, dcp_size=2, mem_fraction_static=0.8, mamba_full_memory_ratio=2.5,
        kv_cache_dtype="bf16", speculative=True,
        profile_args=(("--max-running-requests", "64"),),
        tuning_args=(("--max-mamba-cache-size", "96"),),
        operator_args=("--watchdog-timeout", "600"),
        engine_auth=config.paths.state_dir / "engine" / "engine-auth.yaml",
    )
    assert model_dir(Path("/m"), "moonshotai/Kimi-K3") == Path("/m/moonshotai--Kimi-K3")


def test_empty_command_is_refused() -> None:
    with pytest.raises(ValueError, match=r"engine\.command"):
        build_launch_spec((), inputs())


# --------------------------------------------------------------------------- speculative


def test_speculative_adds_dspark_and_pins_ragged_verify_mode() -> None:
    built = spec(speculative=True)
    assert built.serve_args() == [*K3_DEFAULT, "--speculative-algorithm", "DSPARK"]
    assert built.source("--speculative-algorithm") == ArgSource(
        "--speculative-algorithm", "DSPARK", Origin.DEFAULT
    )
    assert dict(built.env) == {"PYTHONUNBUFFERED": "1", "SGLANG_RAGGED_VERIFY_MODE": "static"}


def test_ragged_verify_mode_follows_the_effective_algorithm() -> None:
    by_operator = spec(operator_args=("--speculative-algorithm", "dspark"))
    assert ("SGLANG_RAGGED_VERIFY_MODE", "static") in by_operator.env
    overridden = spec(speculative=True, operator_args=("--speculative-algorithm", "EAGLE"))
    assert "SGLANG_RAGGED_VERIFY_MODE" not in dict(overridden.env)


def test_environment_never_carries_notify_socket() -> None:
    built = spec(speculative=True, extra_env=(("NOTIFY_SOCKET", "/run/systemd/notify"),
                                              ("NCCL_DEBUG", "WARN")))
    env = dict(built.env)
    assert "NOTIFY_SOCKET" not in env
    assert env["NCCL_DEBUG"] == "WARN"


# --------------------------------------------------------------------------- precedence


def test_later_layers_override_in_place_and_say_what_they_replaced() -> None:
    built = spec(
        profile_args=(("--mamba-full-memory-ratio", "5"), ("--max-running-requests", "64")),
        tuning_args=(("--mamba-full-memory-ratio", "2.5"), ("--max-mamba-cache-size", "96")),
        operator_args=("--max-running-requests", "32", "--watchdog-timeout", "600"),
    )
    ratio = built.source("--mamba-full-memory-ratio")
    assert ratio == ArgSource("--mamba-full-memory-ratio", "2.5", Origin.TUNING,
                              "overrides profile 5, default 0.9")
    assert built.source("--max-running-requests") == ArgSource(
        "--max-running-requests", "32", Origin.OPERATOR, "overrides profile 64")
    assert built.source("--max-mamba-cache-size") == ArgSource(
        "--max-mamba-cache-size", "96", Origin.TUNING)
    assert built.source("--watchdog-timeout") == ArgSource(
        "--watchdog-timeout", "600", Origin.OPERATOR)
    # Overridden defaults keep their place; new flags follow in layer order.
    args = built.serve_args()
    assert args[: len(K3_DEFAULT)] == [
        "2.5" if t == "0.9" else t for t in K3_DEFAULT
    ]
    assert args[len(K3_DEFAULT):] == [
        "--max-running-requests", "32", "--max-mamba-cache-size", "96",
        "--watchdog-timeout", "600",
    ]
    assert check_argv(args) == []


def test_operator_overrides_everything_including_a_switch() -> None:
    built = spec(operator_args=("--enable-metrics", "--mem-fraction-static", "0.88"))
    assert built.source("--enable-metrics") == ArgSource(
        "--enable-metrics", None, Origin.OPERATOR, "overrides default --enable-metrics")
    assert built.source("--mem-fraction-static") == ArgSource(
        "--mem-fraction-static", "0.88", Origin.OPERATOR, "overrides default 0.93")
    assert built.serve_args().count("--enable-metrics") == 1


def test_aliases_abbreviations_and_equals_collapse_into_the_flag() -> None:
    built = spec(
        profile_args=(("--tensor-parallel-size", "4"),),
        operator_args=("--mem-fraction=0.85", "--model", "/elsewhere", "--enable-hicache"),
    )
    assert built.source("--tp-size") == ArgSource("--tp-size", "4", Origin.PROFILE,
                                                  "overrides default 8")
    assert built.source("--mem-fraction-static") == ArgSource(
        "--mem-fraction-static", "0.85", Origin.OPERATOR, "overrides default 0.93")
    assert built.source("--model-path") == ArgSource(
        "--model-path", "/elsewhere", Origin.OPERATOR, f"overrides default {MODEL}")
    args = built.serve_args()
    assert "--tensor-parallel-size" not in args and args.count("--tp-size") == 1
    assert args[-1] == "--enable-hierarchical-cache"  # the canonical spelling
    assert check_argv(args) == []


def test_negations_and_multi_value_flags_keep_their_meaning() -> None:
    built = spec(operator_args=("--no-dcp-replicate-q-proj", "--cuda-graph-bs-decode",
                                "1", "2", "4", "--host=-odd"))
    assert built.serve_args()[len(K3_DEFAULT) - 1:] == [
        "--no-dcp-replicate-q-proj", "--cuda-graph-bs-decode", "1", "2", "4",
    ]  # one token fewer: "--host=-odd" replaced "--host", "127.0.0.1" in place
    assert built.source("--cuda-graph-bs-decode") == ArgSource(
        "--cuda-graph-bs-decode", "1", Origin.OPERATOR, more_values=("2", "4"))
    host = built.source("--host")
    assert host is not None and host.tokens() == ["--host=-odd"]
    assert "--host=-odd" in built.serve_args()


def test_bad_operator_flags_are_kept_for_validation_to_report() -> None:
    built = spec(operator_args=("--mem-fraction-statc", "0.9", "stray"))
    assert built.serve_args()[len(K3_DEFAULT):] == ["--mem-fraction-statc", "0.9", "stray"]
    messages = [p.message for p in check_argv(built.serve_args())]
    assert messages == ["--mem-fraction-statc: unknown flag; did you mean --mem-fraction-static?"]


# --------------------------------------------------------------------------- json and hash


def test_spec_json_round_trips_exactly() -> None:
    built = spec(speculative=True, profile_args=(("--mamba-full-memory-ratio", "5"),),
                 operator_args=("--cuda-graph-bs-decode", "1", "2"),
                 extra_env=(("NCCL_DEBUG", "WARN"),))
    text = built.to_json()
    again = LaunchSpec.from_json(text)
    assert again == built
    assert again.to_json() == text
    body = json.loads(text)
    assert body["argv"] == built.argv()
    assert body["env"] == [list(p) for p in built.env]
    assert body["spec_hash"] == built.spec_hash and len(built.spec_hash) == 64


def test_same_inputs_same_hash() -> None:
    assert spec().spec_hash == spec().spec_hash
    assert spec(speculative=True).to_json() == spec(speculative=True).to_json()


def test_hash_covers_what_runs_not_who_asked() -> None:
    by_profile = spec(profile_args=(("--watchdog-timeout", "600"),))
    by_operator = spec(operator_args=("--watchdog-timeout", "600"))
    assert by_profile.args != by_operator.args
    assert by_profile.spec_hash == by_operator.spec_hash


@pytest.mark.parametrize("change", [
    {"model_path": Path("/other")}, {"served_model_name": "k3"}, {"host": "::1"},
    {"port": 30001}, {"tp_size": 4}, {"dcp_size": 4}, {"mem_fraction_static": 0.92},
    {"mamba_full_memory_ratio": 5.0}, {"kv_cache_dtype": "bf16"}, {"speculative": True},
    {"profile_args": (("--max-running-requests", "64"),)},
    {"tuning_args": (("--max-mamba-cache-size", "96"),)},
    {"operator_args": ("--watchdog-timeout", "600")},
    {"extra_env": (("NCCL_DEBUG", "WARN"),)},
])
def test_any_change_changes_the_hash(change: dict[str, object]) -> None:
    assert spec(**change).spec_hash != spec().spec_hash


def test_other_command_other_hash() -> None:
    other = build_launch_spec((sys.executable, "-m", "appliance.testing.fake_sglang"), inputs())
    assert other.argv()[:4] == [sys.executable, "-m", "appliance.testing.fake_sglang", "serve"]
    assert other.spec_hash != spec().spec_hash


@pytest.mark.parametrize("mangle, complaint", [
    (lambda b: b.update(spec_hash="0" * 64), "does not match its hash"),
    (lambda b: b["args"][4].update(value="4"), "does not match its hash"),
    (lambda b: b["env"].append(["X", "1"]), "does not match its hash"),
    (lambda b: b.update(format=99), "not format 1"),
    (lambda b: b.pop("command"), "lacks 'command'"),
    (lambda b: b["args"][0].update(origin="nobody"), "malformed"),
])
def test_a_tampered_spec_is_refused(mangle: object, complaint: str) -> None:
    body = json.loads(spec().to_json())
    mangle(body)  # type: ignore[operator]
    with pytest.raises(ValueError, match=complaint):
        LaunchSpec.from_json(json.dumps(body))
    with pytest.raises(ValueError, match="not JSON"):
        LaunchSpec.from_json("{")


# --------------------------------------------------------------------------- the flag table


def test_flag_table_holds_what_sglang_0_5_23_declares() -> None:
    """Spot checks of facts read in the 0.5.23 source (see flags.py for where)."""
    assert flags.SGLANG_VERSION == "0.5.23"
    by = flags.BY_NAME
    assert by["--model"] is by["--model-path"] and by["--model-path"].required
    assert by["--tensor-parallel-size"] is by["--tp-size"] and by["--tp-size"].default == 1
    assert by["--decode-context-parallel-size"] is by["--dcp-size"]
    assert by["--enable-hicache"] is by["--enable-hierarchical-cache"]
    assert by["--mamba-full-memory-ratio"].kind == "float"
    assert by["--mamba-full-memory-ratio"].default is None  # resolved to 0.9 later
    assert by["--mamba-radix-cache-strategy"].default == "auto"
    assert by["--context-length"].kind == "size"
    assert by["--watchdog-timeout"].default == 300
    assert "kimi_k3" in by["--reasoning-parser"].choices
    assert "kimi_k3" in by["--tool-call-parser"].choices
    assert by["--kv-cache-dtype"].choices == flags.KV_CACHE_DTYPES
    assert by["--no-dcp-replicate-q-proj"] is by["--dcp-replicate-q-proj"]
    assert len(flags.FLAGS) == 531  # every option of the 0.5.23 parser but --help
    assert len({f.name for f in flags.FLAGS}) == len(flags.FLAGS)


def test_match_reads_abbreviations_like_argparse() -> None:
    assert [f.name for f in flags.match("--tp-size")] == ["--tp-size"]
    assert [f.name for f in flags.match("--mem-fraction")] == ["--mem-fraction-static"]
    assert len(flags.match("--en")) > 1
    assert flags.match("--nope-nothing") == ()
    assert flags.match("-x") == ()


# --------------------------------------------------------------------------- check_argv

OK = ["--model-path", "/m"]


@pytest.mark.parametrize("argv, message, hint", [
    (["--mem-fraction-statc", "0.9"],
     "--mem-fraction-statc: unknown flag; did you mean --mem-fraction-static?",
     "unrecognized arguments"),
    (["--tp-size"], "--tp-size: missing value", "an integer"),
    (["--tp-size", "--trust-remote-code"], "--tp-size: missing value", "an integer"),
    (["--tp-size", "eight"], "--tp-size: 'eight' is not an integer", "an integer"),
    (["--mem-fraction-static", "most"], "--mem-fraction-static: 'most' is not a number",
     "a number"),
    (["--context-length", "1.5Ki"], "--context-length: '1.5Ki' is not an integer", "suffix"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: 'fp8' is not one of its choices",
     "fp8_e4m3"),
    (["--reasoning-parser", "kimi-k3"],
     "--reasoning-parser: 'kimi-k3' is not one of its choices; did you mean kimi_k3?", "kimi_k3"),
    (["--dsa-triton-union", "3"], "--dsa-triton-union: '3' is not one of its choices", "0, 2, 4"),
    (["--trust-remote-code", "yes"],
     "--trust-remote-code: a switch, takes no value (got 'yes')", "remove the value"),
    (["--enable-metrics=1"], "--enable-metrics: a switch, takes no value (got '1')",
     "remove the value"),
    (["--tp-size", "8", "--tensor-parallel-size", "4"],
     "--tensor-parallel-size: given more than once (first as --tp-size); "
     "SGLang keeps the last one", "keep one"),
    (["--port", "1", "--port", "2"], "--port: given more than once; SGLang keeps the last one",
     "keep one"),
    (["--en", "1"], "--en: ambiguous abbreviation; could be", "in full"),
    (["--log-level", "loud"], "--log-level: 'loud' is not a log level", "debug"),
    (["--cuda-graph-bs-decode"], "--cuda-graph-bs-decode: missing value", "one or more"),
    (["--help"], "--help: prints help and exits", "remove it"),
])
def test_check_argv_catches_each_bad_input(argv: list[str], message: str, hint: str) -> None:
    problems = check_argv([*OK, *argv])
    assert len(problems) == 1, problems
    assert problems[0].message.startswith(message)
    assert hint in problems[0].hint
    assert any(token.partition("=")[0] == problems[0].flag for token in argv)


def test_check_argv_missing_model_path_and_stray_values() -> None:
    assert check_argv(["--tp-size", "8"]) == [ArgProblem(
        "--model-path", "--model-path: required, and missing",
        "give the directory of the model's files (the appliance sets it from engine.model)",
    )]
    assert check_argv(["/models/k3", "--tp-size", "8"]) == []  # `sglang serve <model>`
    (stray,) = check_argv([*OK, "--port", "1", "2"])
    assert stray.flag == "2" and "no flag before it" in stray.message


def test_check_argv_accepts_what_argparse_accepts() -> None:
    argv = [*OK, "--tp", "8", "--port", "-1", "--context-length", "8k", "--max-total-tokens",
            "1Mi", "--host=-odd", "--no-dcp-replicate-q-proj", "--cuda-graph-bs-decode", "1",
            "2", "--lora-paths", "--model-type", "llm", "--json-model-override-args", "{}"]
    assert check_argv(argv) == []


def test_check_argv_is_fast() -> None:
    argv = spec(speculative=True).serve_args() * 1
    started = time.perf_counter()
    for _ in range(100):
        check_argv(argv)
    assert time.perf_counter() - started < 2


# --------------------------------------------------------------------------- SGLang's parser

STUB_SERVER_ARGS = '''
import argparse, logging, os, time

if os.environ.get("STUB_SGLANG_SLEEP"):
    time.sleep(float(os.environ["STUB_SGLANG_SLEEP"]))  # a hung import

def prepare_server_args(argv):
    """Just enough of SGLang 0.5.23's prepare_server_args (server_args.py:668)."""
    parser = argparse.ArgumentParser(prog="sglang serve")
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--reasoning-parser", choices=["auto", "kimi_k3"])
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--nudge")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()))
    if args.nudge == "boom":
        raise ValueError("--nudge boom is not allowed")
    return args
'''


def fake_venv(root: Path, *, version: str = "0.5.23", with_sglang: bool = True,
              env: str = "") -> Path:
    """A directory that looks like the engine's venv to `validate_with_sglang`."""
    venv = root / "venv"
    stub = venv / "stub"
    (venv / "bin").mkdir(parents=True)
    if with_sglang:
        (stub / "sglang" / "srt").mkdir(parents=True)
        (stub / "sglang" / "__init__.py").write_text("")
        (stub / "sglang" / "version.py").write_text(f"__version__ = {version!r}\n")
        (stub / "sglang" / "srt" / "__init__.py").write_text("")
        (stub / "sglang" / "srt" / "server_args.py").write_text(STUB_SERVER_ARGS)
    python = venv / "bin" / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {env} PYTHONPATH="{stub}" exec "{sys.executable}" "$@"
        """))
    python.chmod(0o755)
    return venv


def test_sglang_parser_accepts_a_good_argv(tmp_path: Path) -> None:
    result = validate_with_sglang(fake_venv(tmp_path), ["--model-path", "/m", "--tp-size", "8"])
    assert result.ok and result.problems == ()
    assert result.method == "sglang 0.5.23 parser" and result.note == ""


def test_sglang_parser_reports_a_typo_in_seconds_with_a_suggestion(tmp_path: Path) -> None:
    started = time.monotonic()
    result = validate_with_sglang(
        fake_venv(tmp_path), ["--model-path", "/m", "--mem-fraction-statc", "0.9"])
    assert time.monotonic() - started < 15
    assert not result.ok and result.method == "sglang 0.5.23 parser"
    assert [(p.flag, p.message) for p in result.problems] == [
        ("--mem-fraction-statc",
         "--mem-fraction-statc: unknown flag; did you mean --mem-fraction-static?"),
        ("0.9", "'0.9': a value with no flag before it (unrecognized)"),
    ]
    assert "refused" in result.problems[0].hint


@pytest.mark.parametrize("argv, flag, text", [
    (["--model-path", "/m", "--tp-size", "eight"], "--tp-size", "invalid int value: 'eight'"),
    (["--model-path", "/m", "--reasoning-parser", "nope"], "--reasoning-parser",
     "invalid choice: 'nope'"),
    (["--tp-size", "8"], "--model-path", "the following arguments are required"),
    (["--model-path", "/m", "--log-level", "loud"], "--log-level", "AttributeError"),
    (["--model-path", "/m", "--nudge", "boom"], "--nudge", "ValueError: --nudge boom"),
    (["--model-path", "/m", "--help"], "--help", "prints help"),
    (["--model-path", "/m", "--model-type", "diffusion"], "--model-type", "not a language"),
])
def test_sglang_parser_errors_name_the_flag(tmp_path: Path, argv: list[str], flag: str,
                                            text: str) -> None:
    result = validate_with_sglang(fake_venv(tmp_path), argv)
    assert not result.ok
    assert result.problems[0].flag == flag
    assert text in result.problems[0].message


def test_sglang_serve_normalisation_is_applied(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path)
    assert validate_with_sglang(venv, ["/m", "--model-type", "llm", "--port", "1"]).ok


def test_sglang_parser_timeout_is_a_clear_result(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path, env="STUB_SGLANG_SLEEP=30")
    started = time.monotonic()
    result = validate_with_sglang(venv, ["--model-path", "/m"], timeout=1)
    assert time.monotonic() - started < 10
    assert not result.ok
    (problem,) = result.problems
    assert problem.message == "SGLang's parser did not answer within 1 s"
    assert "broken engine environment" in problem.hint


def test_missing_python_or_sglang_is_no_answer(tmp_path: Path) -> None:
    result = validate_with_sglang(tmp_path / "nowhere", ["--model-path", "/m"])
    assert not result.ok and "no Python at" in result.problems[0].message
    broken = validate_with_sglang(fake_venv(tmp_path, with_sglang=False), ["--model-path", "/m"])
    assert not broken.ok and "cannot import sglang" in broken.problems[0].message


def test_launch_spec_uses_sglang_when_it_can(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path, version="0.5.22")
    built = build_launch_spec(SGLANG, LaunchInputs(
        model_path=Path("/m"), served_model_name="k", port=1, tp_size=8, dcp_size=8,
        mem_fraction_static=0.9, mamba_full_memory_ratio=0.9, kv_cache_dtype="auto",
        speculative=False))
    result = validate_launch_spec(built, venv)
    # The stub knows few flags: its refusal proves it answered, not the table.
    assert result.method == "sglang 0.5.22 parser"
    assert "built for 0.5.23" in result.note
    assert not result.ok and result.problems[0].flag == "--served-model-name"
    assert "set by the default layer" in result.problems[0].hint


def test_launch_spec_falls_back_to_the_table(tmp_path: Path) -> None:
    built = spec(operator_args=("--mem-fraction-statc", "0.9"))
    for venv, why in [
        (None, "engine.venv is empty"),
        (tmp_path / "missing", "no Python at"),
        (fake_venv(tmp_path, with_sglang=False), "cannot import sglang"),
    ]:
        result = validate_launch_spec(built, venv)
        assert result.method == TABLE_METHOD == "flag table of sglang 0.5.23"
        assert why in result.note
        assert not result.ok
        (problem,) = result.problems
        assert problem.message == (
            "--mem-fraction-statc: unknown flag; did you mean --mem-fraction-static?")
        assert "set by the operator layer: fix it in engine.extra_args" in problem.hint
    assert validate_launch_spec(spec(speculative=True), None).ok


# --------------------------------------------------------------------------- program path


def test_the_program_is_named_by_its_resolved_directory(tmp_path: Path) -> None:
    # The installer's layout: /opt/appliance/engine -> engines/sglang-<pin>. A venv reached
    # through that link would take its sys.path from the link, so the spec names the target.
    real = tmp_path / "engines" / "sglang-0.5.23"
    (real / "bin").mkdir(parents=True)
    (real / "bin" / "sglang").write_text("#!/bin/sh\n")
    (tmp_path / "engine").symlink_to(real)
    linked = str(tmp_path / "engine" / "bin" / "sglang")
    built = build_launch_spec((linked, "--x"), inputs())
    assert built.command == (str(real / "bin" / "sglang"), "--x")
    assert built.argv()[0] == str(real / "bin" / "sglang")
    # the hash covers what runs: same as a spec built from the real path, and it round-trips
    assert built.spec_hash == build_launch_spec((str(real / "bin" / "sglang"), "--x"),
                                                inputs()).spec_hash
    assert LaunchSpec.from_json(built.to_json()) == built
    # a new pin behind the same link is a different engine
    newer = tmp_path / "engines" / "sglang-0.6.0"
    (newer / "bin").mkdir(parents=True)
    (newer / "bin" / "sglang").write_text("#!/bin/sh\n")
    (tmp_path / "engine").unlink()
    (tmp_path / "engine").symlink_to(newer)
    assert build_launch_spec((linked, "--x"), inputs()).spec_hash != built.spec_hash


def test_the_program_itself_is_not_followed(tmp_path: Path) -> None:
    # A venv's bin/python links to the base interpreter; following it would leave the venv.
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    python = tmp_path / "venv" / "bin" / "python"
    python.symlink_to(sys.executable)
    assert build_launch_spec((str(python),), inputs()).command == (str(python),)


@pytest.mark.parametrize("program", ["sglang", "/nonexistent/bin/sglang"])
def test_a_relative_or_missing_program_is_kept_as_given(program: str) -> None:
    assert build_launch_spec((program,), inputs()).command == (program,)
