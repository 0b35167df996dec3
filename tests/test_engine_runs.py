"""One engine log, several runs: figures are read from one run only, and say which.

Every launch appends to the same engine log. `split_runs` cuts it at each launch, `parse_text`
folds the latest run unless told otherwise, and `appliance engine parse-log FILE --run N|all`
(run here as a real subprocess) labels what it prints with the run it came from. The logs are
the SGLang 0.5.23-format files of `data/engine_logs`, appended the way restarts append them;
expected figures are read off those files by hand (sample: 332 state slots, no warnings, no
draft; DSPARK: 66 slots, a draft of 2 shards, `max_running_requests is capped to 13`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.engine.logparse import parse_runs, parse_text, split_runs
from appliance.engine.logreport import render_json, render_runs_text, render_text
from appliance.tuning.budget import budget_from_log, settings_from_log
from appliance.tuning.service import _last_startup

LOGS = Path(__file__).parent / "data" / "engine_logs"
REPO = Path(__file__).resolve().parent.parent


def _log(name: str) -> str:
    # Bytes decoded as the CLI and the supervisor read them: `\r` stays a tqdm redraw.
    return (LOGS / name).read_bytes().decode("utf-8")


SAMPLE, DSPARK, BAD_ARGUMENT = (_log("k3_startup.sample.log"), _log("dspark_startup.log"),
                                _log("bad_argument.log"))
SAMPLE_LINES, DSPARK_LINES = 93, 131  # `wc -l`


# --- splitting ---------------------------------------------------------------------------------


def test_appended_runs_split_at_each_launch_with_their_number_line_and_start() -> None:
    runs = split_runs(SAMPLE + DSPARK + BAD_ARGUMENT)
    assert [run.number for run in runs] == [1, 2, 3]
    assert [run.origin.of for run in runs] == [3, 3, 3]
    assert [run.origin.start_line for run in runs] == [
        1, SAMPLE_LINES + 1, SAMPLE_LINES + DSPARK_LINES + 1]
    # The DSPARK launch logs two argument warnings before its server_args line: they are its
    # own records, so its run starts (and is dated) at the first of them.
    assert [run.origin.started_at for run in runs] == [
        "2026-11-30 09:00:00", "2026-12-06 08:59:58", None]
    assert [run.text for run in runs] == [SAMPLE, DSPARK, BAD_ARGUMENT]
    assert [run.launched for run in runs] == [True, True, False]  # argparse refused the third
    assert all(run.origin.marked for run in runs)


def test_a_run_killed_mid_load_ends_where_the_next_launch_begins_on_the_same_line() -> None:
    """The killed engine left its bar unterminated; the next launch's first record lands on
    the bar's physical line."""
    cut = SAMPLE.index("Multi-thread loading shards:  42%")
    killed = SAMPLE[:SAMPLE.index("\r", cut)]  # up to and including the 42% state
    first, second = split_runs(killed + DSPARK)
    assert first.text == killed and second.text == DSPARK
    assert parse_text(killed + DSPARK, 1).shards_done == 40
    latest = parse_text(killed + DSPARK)
    assert (latest.shards_done, latest.shards_total) == (96, 96)


def test_text_before_any_launch_is_a_run_of_its_own_and_empty_text_one_empty_run() -> None:
    tail = SAMPLE[SAMPLE.index("[2026-11-30 10:22:33 TP0] Mamba"):]  # head rotated away
    head, latest = split_runs(tail + DSPARK)
    assert not head.origin.marked and head.origin.started_at == "2026-11-30 10:22:33"
    assert latest.origin.marked and latest.text == DSPARK
    assert "begins inside a run" in render_text(parse_text(tail + DSPARK, 1))
    (only,) = split_runs("")
    assert (only.number, only.origin.of, only.text, only.origin.marked) == (1, 1, "", False)


# --- folding one run ---------------------------------------------------------------------------


def test_the_latest_run_alone_gives_the_figures_never_a_mix() -> None:
    # DSPARK first, then a start without speculative decoding: the latest run has no draft,
    # no "capped to 13" warning and its own 332 state slots.
    latest = parse_text(DSPARK + SAMPLE)
    assert latest == parse_text(SAMPLE)
    assert latest.draft_shards_total is None and latest.warnings == ()
    assert {memory.state_slots for memory in latest.ranks} == {332}
    assert latest.phases[1] == (latest.phases[1][0], "2026-11-30 09:00:46")
    # And the other way round: every DSPARK figure, none of the sample's.
    assert parse_text(SAMPLE + DSPARK) == parse_text(DSPARK)
    origin = parse_text(SAMPLE + DSPARK).origin
    assert origin is not None and (origin.number, origin.of) == (2, 2)


def test_any_run_by_number_or_from_the_end_and_a_missing_one_named() -> None:
    text = SAMPLE + DSPARK + BAD_ARGUMENT
    assert parse_text(text, 1) == parse_text(SAMPLE) == parse_text(text, -3)
    assert parse_text(text, 2) == parse_text(DSPARK)
    refused = parse_text(text)
    assert refused.failure is not None and refused.failure.reason == "bad_argument"
    assert parse_text(text, 1).failure is None
    for missing in (0, 4, -4):
        with pytest.raises(ValueError, match="the log holds 3 runs; there is no run"):
            parse_text(text, missing)
    assert [state.origin.number for state in parse_runs(text) if state.origin] == [1, 2, 3]


def test_reports_name_the_run_each_figure_group_came_from() -> None:
    text = render_text(parse_text(DSPARK + SAMPLE))
    assert text.startswith("Log: run 2 of 2, started 2026-11-30 09:00:00 local time, "
                           f"at line {DSPARK_LINES + 1}\n")
    for group in ("Ready (run 2): yes", "Phases (run 2):", "Weights (run 2): 96/96 shards",
                  "Memory per rank (run 2) (MLA KV dtype", "Launch figures (run 2):",
                  "Failure (run 2): none seen"):
        assert group in text, group
    assert "Draft weights" not in text and "capped to" not in text
    # A single-run log keeps its report as it was, plus the label line.
    alone = render_text(parse_text(SAMPLE))
    assert alone.startswith("Log: run 1 of 1, started 2026-11-30 09:00:00 local time, at line 1\n")
    assert "Ready: yes" in alone and "(run 1)" not in alone
    data = render_json(parse_text(DSPARK + SAMPLE, 1))
    assert data["run"] == {"number": 1, "of": 2, "started_at": "2026-12-06 08:59:58",
                           "start_line": 1,
                           "label": "run 1 of 2, started 2026-12-06 08:59:58 local time, "
                                    "at line 1"}
    both = render_runs_text(parse_runs(DSPARK + SAMPLE))
    assert both.count("Log: run ") == 2 and "\n" + "-" * 40 + "\nLog: run 2 of 2" in both


# --- the tuning reads the latest startup -----------------------------------------------------


def test_tuning_measures_the_latest_startup_only(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(DSPARK + SAMPLE + BAD_ARGUMENT)
    # The argparse refusal measured nothing: the startup before it is the last one.
    assert _last_startup(log) == SAMPLE
    log.write_text(SAMPLE + DSPARK)
    assert _last_startup(log) == DSPARK  # from its first record, warnings included
    assert budget_from_log(SAMPLE + DSPARK) == budget_from_log(DSPARK)
    assert settings_from_log(DSPARK + SAMPLE) == settings_from_log(SAMPLE)
    assert _last_startup(tmp_path / "missing.log") == ""


# --- the CLI, as a real process ------------------------------------------------------------------


def _parse_log(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", "engine", "parse-log", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


def test_parse_log_cli_reads_the_latest_run_one_by_number_or_all(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(DSPARK + SAMPLE)

    latest = _parse_log(str(log))
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.startswith("Log: run 2 of 2, started 2026-11-30 09:00:00 local time")
    assert "332 slots" in latest.stdout and "66 slots" not in latest.stdout
    assert "Draft weights" not in latest.stdout and "capped to 13" not in latest.stdout

    first = _parse_log(str(log), "--run", "1", "--json")
    assert first.returncode == 0, first.stderr
    data = json.loads(first.stdout)
    assert data["run"]["number"] == 1 and data["draft_shards"] == {"done": 2, "total": 2}
    assert {rank["state_slots"] for rank in data["ranks"]} == {66}

    every = _parse_log(str(log), "--run", "all")
    assert every.returncode == 0, every.stderr
    assert every.stdout.index("Log: run 1 of 2") < every.stdout.index("Log: run 2 of 2")
    assert "Memory per rank (run 1)" in every.stdout and "Memory per rank (run 2)" in every.stdout
    listed = json.loads(_parse_log(str(log), "--run", "all", "--json").stdout)
    assert [item["run"]["number"] for item in listed] == [1, 2]

    missing = _parse_log(str(log), "--run", "3")
    assert missing.returncode == 64 and missing.stdout == ""
    assert "the log holds 2 runs; there is no run 3" in missing.stderr
    assert "--run all" in missing.stderr
    nonsense = _parse_log(str(log), "--run", "0")
    assert nonsense.returncode == 2 and "is not a run" in nonsense.stderr
