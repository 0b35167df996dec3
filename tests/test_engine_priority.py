"""Priorities reach the engine (issue 24): the priority-scheduling flags the service classes
give the launch spec (pure), SGLang's combination rules in the flag-table check, and the
per-request `priority` the gateway puts in a forwarded body (pure)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from appliance.config import Config, GatewayConfig, load_config
from appliance.engine.args import Origin, build_launch_spec, inputs_from_config
from appliance.engine.priority import AUTO_CONCURRENCY, preemption_threshold, priority_args
from appliance.engine.validate import check_argv
from appliance.gateway.classes import BATCH, INTERACTIVE, effective, parse_classes
from appliance.gateway.forward import FORWARDED_HEADERS
from appliance.gateway.priority import (
    HEADER_OVERRIDES_ENV,
    OVERRIDE_HEADERS,
    engine_env,
    priority_headers,
    priority_on,
    request_priority,
    with_priority,
)

SGLANG = ("/opt/appliance/engine/bin/sglang",)


def spec_for(classes: dict[str, dict[str, object]] | None, **gateway: object):
    parsed = parse_classes(classes) if classes is not None else {}
    config = Config(gateway=GatewayConfig(classes=parsed, **gateway))  # type: ignore[arg-type]
    return build_launch_spec(SGLANG, dataclasses.replace(inputs_from_config(config),
                                                         engine_auth=None))


# --- the launch ---------------------------------------------------------------------------------
def test_no_configured_classes_keep_the_argv_and_hash() -> None:
    plain = build_launch_spec(SGLANG, dataclasses.replace(inputs_from_config(Config()),
                                                          engine_auth=None))
    assert spec_for(None).spec_hash == plain.spec_hash
    assert not any(a.origin is Origin.CLASSES for a in plain.args)
    assert priority_args({}, queue_max=512, max_concurrency=0) == ()


def test_configured_classes_launch_priority_scheduling_with_preemption_of_batch() -> None:
    spec = spec_for({"interactive": {"ttft_slo_seconds": 5}}, queue_max=100, max_concurrency=16)
    argv = spec.serve_args()
    at = argv.index("--enable-priority-scheduling")
    assert argv[at:] == ["--enable-priority-scheduling", "--default-priority-value", "10",
                         "--priority-scheduling-preemption-threshold", "0",
                         "--retraction-policy", "priority", "--max-queued-requests", "116"]
    for flag in ("--enable-priority-scheduling", "--max-queued-requests"):
        source = spec.source(flag)
        assert source is not None and source.origin is Origin.CLASSES
    assert check_argv(argv) == []


def test_a_box_without_priorities_keeps_its_environment() -> None:
    """No classes, or classes of one priority: the header overrides stay off (SGLang's
    default), so the spec's environment and hash are what they were before issue 24."""
    for classes in (None, {"batch": {"priority": 10}}):
        spec = spec_for(classes)
        assert spec.env == (("PYTHONUNBUFFERED", "1"),), spec.env
        assert spec.spec_hash == spec_for(None).spec_hash


def test_configured_classes_turn_the_header_overrides_on() -> None:
    """With priorities on, the engine reads the gateway's `x-override-priority` (the one way
    a /v1/messages request's class priority reaches it): the variable is in the spec's
    environment, its hash, its launch file, and the exec guard admits it."""
    from appliance.engine.args import ENV_REASONS, LaunchSpec
    from appliance.engine.exec_guard import check_spec

    spec = spec_for({"interactive": {"ttft_slo_seconds": 5}})
    assert spec.env == (("PYTHONUNBUFFERED", "1"), (HEADER_OVERRIDES_ENV, "1"))
    assert spec.spec_hash != spec_for(None).spec_hash
    assert HEADER_OVERRIDES_ENV in ENV_REASONS
    assert LaunchSpec.from_json(spec.to_json()) == spec
    assert check_spec(spec) == []


def test_the_operators_environment_still_wins_over_the_classes() -> None:
    config = Config(gateway=GatewayConfig(classes=parse_classes({"batch": {"share": 0.5}})))
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, extra_env={HEADER_OVERRIDES_ENV: "0", "SGLANG_USE_CPU_ENGINE": "1"}))
    env = build_launch_spec(SGLANG, inputs_from_config(config)).env
    assert env == (("PYTHONUNBUFFERED", "1"), (HEADER_OVERRIDES_ENV, "0"),
                   ("SGLANG_USE_CPU_ENGINE", "1"))


def test_the_spec_changes_with_priorities_not_with_slos() -> None:
    one = spec_for({"interactive": {"ttft_slo_seconds": 5}})
    two = spec_for({"interactive": {"ttft_slo_seconds": 9}, "batch": {"share": 0.2}})
    three = spec_for({"interactive": {"ttft_slo_seconds": 5, "priority": 20}})
    assert one.spec_hash == two.spec_hash != three.spec_hash
    assert "--max-queued-requests" in one.serve_args()
    assert one.serve_args()[one.serve_args().index("--max-queued-requests") + 1] \
        == str(512 + AUTO_CONCURRENCY)  # max_concurrency 0: the qualified point, unknown yet


def test_no_preemptible_class_disables_preemption() -> None:
    argv = spec_for({"batch": {"preemptible": False}}).serve_args()
    assert "--disable-priority-preemption" in argv
    assert "--priority-scheduling-preemption-threshold" not in argv
    assert check_argv(argv) == []


def test_threshold_never_preempts_a_class_that_is_not_preemptible() -> None:
    classes = effective(parse_classes({"premium": {"priority": 20, "share": 0.2}, "bulk": {
        "priority": 5, "preemptible": True, "share": 0.1}}))
    threshold = preemption_threshold(classes)
    assert threshold == 20 - 10  # premium over interactive: interactive is never preempted
    assert classes["premium"].priority - classes[INTERACTIVE].priority <= threshold
    assert classes["premium"].priority - classes["bulk"].priority > threshold
    assert classes["premium"].priority - classes[BATCH].priority > threshold
    # a preemptible class ranked with a kept one cannot be preempted without preempting it
    assert preemption_threshold(effective(parse_classes(
        {"batch": {"priority": 10}}))) is None


def test_a_single_priority_is_nothing_to_order() -> None:
    classes = parse_classes({"batch": {"priority": 10}})
    assert not priority_on(classes)
    assert request_priority(classes, classes[BATCH]) is None
    assert spec_for({"batch": {"priority": 10}}).spec_hash == spec_for(None).spec_hash


def test_classes_from_the_config_file_reach_the_argv(tmp_path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text("[gateway.classes.batch]\nshare = 0.3\n")
    config = load_config(path, env={}, check_dirs=False)
    assert "--enable-priority-scheduling" in build_launch_spec(
        SGLANG, inputs_from_config(config)).serve_args()
    assert request_priority(config.gateway.classes, config.gateway.classes[BATCH]) == 0


# --- SGLang's combination rules --------------------------------------------------------------
BASE = ["--model-path", "/m"]


def test_retraction_by_priority_needs_priority_scheduling() -> None:
    [problem] = check_argv([*BASE, "--retraction-policy", "priority"])
    assert problem.flag == "--retraction-policy"
    assert "requires --enable-priority-scheduling" in problem.message
    assert "add --enable-priority-scheduling" in problem.hint
    assert check_argv([*BASE, "--retraction-policy", "length"]) == []


@pytest.mark.parametrize("policy", ["lpm", "random", "priority"])
def test_priority_scheduling_needs_fcfs_or_lof(policy: str) -> None:
    [problem] = check_argv([*BASE, "--enable-priority-scheduling", "--schedule-policy", policy])
    assert problem.flag == "--schedule-policy" and "fcfs or lof" in problem.message
    assert "--schedule-policy fcfs" in problem.hint
    assert check_argv([*BASE, "--enable-priority-scheduling", "--schedule-policy", "lof"]) == []


def test_an_operator_flag_breaking_the_rule_is_reported_with_its_layer() -> None:
    from appliance.engine.validate import validate_launch_spec
    config = Config(gateway=GatewayConfig(classes=parse_classes({})))
    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, extra_args=("--schedule-policy", "lpm")))
    spec = build_launch_spec(SGLANG, inputs_from_config(config))
    result = validate_launch_spec(spec, None)
    [problem] = result.problems
    assert problem.flag == "--schedule-policy" and "engine.extra_args" in problem.hint


# --- the per-request field -------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_priority_is_spliced_into_the_body(path: str) -> None:
    body = b'{"model": "k", "messages": [{"role": "user", "content": "hi"}]}  \n'
    out = with_priority(body, path, 10)
    assert out.startswith(body.rstrip()[:-1])  # the rest is kept byte for byte
    assert json.loads(out) == {**json.loads(body), "priority": 10}
    assert json.loads(with_priority(b"{}", path, -3)) == {"priority": -3}


def test_a_clients_own_priority_is_replaced() -> None:
    out = with_priority(b'{"prompt": "x", "priority": 99}', "/v1/completions", 0)
    assert json.loads(out) == {"prompt": "x", "priority": 0}
    assert out.count(b"priority") == 1
    text = b'{"prompt": "say \\"priority\\""}'  # the word in a prompt is not the field
    assert json.loads(with_priority(text, "/generate", 5)) == {"prompt": 'say "priority"',
                                                               "priority": 5}


def test_other_paths_and_priority_off_are_left_alone() -> None:
    body = b'{"model": "k", "priority": 1}'
    assert with_priority(body, "/v1/messages", 10) is body
    assert with_priority(body, "/v1/chat/completions", None) is body
    with pytest.raises(ValueError, match="JSON object"):
        with_priority(b"[1]", "/generate", 1)


def test_a_messages_request_carries_its_priority_in_a_header() -> None:
    """SGLang's Anthropic body has no priority field: the header carries it there, and only
    there (the other paths carry it in the body)."""
    assert priority_headers("/v1/messages", 0) == {"x-override-priority": "0"}
    assert priority_headers("/v1/messages", -7) == {"x-override-priority": "-7"}
    assert priority_headers("/v1/messages", None) == {}  # priority scheduling off
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models"):
        assert priority_headers(path, 10) == {}


def test_the_engine_reads_the_header_exactly_when_the_classes_add_priorities() -> None:
    assert engine_env({}) == ()
    one_priority = parse_classes({"batch": {"priority": 10}})  # interactive's too: nothing
    assert not priority_on(one_priority) and engine_env(one_priority) == ()
    classes = parse_classes({"interactive": {"ttft_slo_seconds": 5}})
    assert priority_on(classes)
    assert engine_env(classes) == ((HEADER_OVERRIDES_ENV, "1"),)


def test_no_client_header_reaches_the_engine_as_an_override() -> None:
    """With the engine's header overrides on, a client's `x-override-rid` or
    `x-override-priority` would set that field of its request: the gateway forwards only the
    headers it names, and none of them is one."""
    assert not {h.decode() for h in FORWARDED_HEADERS} & OVERRIDE_HEADERS
    assert all(h.startswith("x-override-") for h in OVERRIDE_HEADERS)
