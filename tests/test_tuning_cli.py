"""`appliance tune predict` as a real subprocess: no daemon, no database, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.test_server import write_config

DATA = Path(__file__).parent / "data"
K3 = DATA / "tuning" / "kimi-k3.config.json"
DRAFT = DATA / "tuning" / "k3-dspark-draft.config.json"
LOG = DATA / "engine_logs" / "k3_startup.sample.log"
DSPARK_LOG = DATA / "engine_logs" / "dspark_startup.log"


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """A configuration whose state directory has no database at all (never migrated)."""
    return write_config(tmp_path / "box")


def predict(box: Path, *args: str) -> tuple[int, str, str]:
    result = run_cli("--config", str(box), "tune", "predict", *args)
    return result.returncode, result.stdout, result.stderr


def test_predict_from_the_sample_log_reproduces_its_numbers(box: Path) -> None:
    """tp, dcp, KV dtype, ratio and max_running_requests come from the log's server_args."""
    code, out, err = predict(box, "--model-config", str(K3), "--from-log", str(LOG))
    assert code == 0, err
    assert "state slots (max_mamba_cache_size)      332" in out
    assert "KV rows per GPU (max_total_num_tokens)  2,708,160" in out
    assert "max_running_requests                    64  (limited by requested)" in out
    assert "logical KV tokens (rows x DCP 8)        21,665,280" in out
    for line in ("conv state", "0.59"), ("ssm state", "16.83"), ("MLA KV", "34.87"):
        assert any(line[0] in row and row.endswith(line[1]) for row in out.splitlines())
    assert "measured from" in out
    assert not (box.parent / "box" / "state" / "appliance.db").exists()


def test_predict_dspark_without_the_drafts_config_prices_it_as_sglang_does(box: Path) -> None:
    """The DSPARK startup log, no --draft-config: the draft's KV is priced the way SGLang
    prices it when it cannot resolve the draft's geometry (draft_kv_budget.py:49-56, then
    dflash_utils.py:137-175): ceil(13,824 x (24 + 8 layers x DCP 8) / 24) = 50,688 B a row,
    and the output says so.

    From the log's budget (42.54 GiB, 45,682,238,527 B) at ratio 5, 48 requests, 8 draft
    tokens: rest 45,577,380,927 B (less 100 MiB); K = int((37,981,150,772 - 9 x 56,171,520)
    // (56,171,520 x 2.6)) = 256; the snapshots take 56,171,520 x 49 x 8 = 22,019,235,840 B;
    left 45,577,380,927 - 22,019,235,840 - 257 x 56,171,520 = 9,122,064,447 B; rows
    9,122,064,447 // 50,688 = 179,965 -> 179,904. (The log itself prints 66 slots and 65,984
    rows, which no KV pricing reaches at its own budget: 66 slots alone need a pool budget of
    about 11.4 GiB, not 42.54.)
    """
    code, out, err = predict(box, "--model-config", str(K3), "--from-log", str(DSPARK_LOG))
    assert code == 0, err
    assert ("draft KV priced as SGLang does without the draft's config: target cell x "
            "(target layers + 8 draft layers x DCP 8) / target layers") in out
    assert "state slots (max_mamba_cache_size)      256" in out
    assert "KV rows per GPU (max_total_num_tokens)  179,904" in out
    code, out, err = predict(box, "--model-config", str(K3), "--from-log", str(DSPARK_LOG),
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["sizing"]["kv_bytes_per_row"] == 50_688
    assert data["launch"]["draft_layers"] == 8 and data["launch"]["draft"] is None
    assert data["draft_pricing"].startswith("draft KV priced as SGLang does without")
    code, out, err = predict(box, "--model-config", str(K3), "--from-log", str(DSPARK_LOG),
                             "--draft-config", str(DRAFT))
    assert code == 0, err
    assert "draft KV priced from the draft's config (8 layers, 1 KV head x 128+128)" in out


def test_predict_json_has_every_figure(box: Path) -> None:
    code, out, err = predict(box, "--model-config", str(K3), "--tp", "8", "--dcp", "8",
                             "--budget-gib", "52.38", "--ratio", "5", "--kv-dtype", "bf16",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    sizing = data["sizing"]
    for key in ("max_mamba_cache_size", "mamba_slots_per_request", "max_running_requests",
                "mla_rows_per_rank", "logical_tokens", "conv_state_gib", "ssm_state_gib",
                "replayssm_gib", "kv_gib", "draft_kv_gib", "state_gib", "total_gib"):
        assert key in sizing
    assert sizing["logical_tokens"] == sizing["mla_rows_per_rank"] * 8
    assert sizing["kv_bytes_per_row"] == 27_648
    assert data["budget"]["measured"] is False
    assert data["launch"]["kv_dtype"] == "bf16"
    assert data["geometry"]["linear_layers"] == 69


def test_predict_dspark_with_replayssm(box: Path) -> None:
    """The golden case of test_tuning_calculator, through the command line."""
    code, out, err = predict(box, "--model-config", str(K3), "--budget-gib", "48", "--ratio",
                             "2", "--spec", "dspark", "--draft-config", str(DRAFT),
                             "--replayssm", "--json")
    assert code == 0, err
    sizing = json.loads(out)["sizing"]
    assert (sizing["max_mamba_cache_size"], sizing["mla_rows_per_rank"],
            sizing["max_running_requests"], sizing["kv_bytes_per_row"]) == \
        (446, 569_536, 48, 30_208)
    assert json.loads(out)["launch"]["draft_tokens"] == 8  # the draft's gamma 7 + 1


def test_predict_works_with_the_dev_profile() -> None:
    result = run_cli("--dev", "tune", "predict", "--model-config", str(K3), "--budget-gib",
                     "52.38", "--ratio", "0.5", "--max-running-requests", "64")
    assert result.returncode == 0, result.stderr
    assert "max_running_requests" in result.stdout


def test_flags_left_out_come_from_the_configuration(box: Path) -> None:
    text = box.read_text() + ("\n[engine]\ntp_size = 4\ndcp_size = 4\n"
                              "mamba_full_memory_ratio = 2.5\nkv_cache_dtype = \"bf16\"\n")
    box.write_text(text)
    code, out, err = predict(box, "--model-config", str(K3), "--budget-gib", "50", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["launch"]["tp"], data["launch"]["dcp"], data["launch"]["kv_dtype"],
            data["sizing"]["ratio"]) == (4, 4, "bf16", 2.5)


@pytest.mark.parametrize(("args", "exit_code", "words"), [
    (["--model-config", "/nonexistent/config.json", "--budget-gib", "50"], 64,
     "/nonexistent/config.json: no such file"),
    (["--model-config", str(K3), "--budget-gib", "50", "--ratio", "0"], 64,
     "--mamba-full-memory-ratio 0.0 is not a positive number"),
    (["--model-config", str(K3), "--budget-gib", "50", "--ratio", "-1"], 64,
     "is not a positive number"),
    (["--model-config", str(K3), "--budget-gib", "50", "--tp", "7", "--dcp", "7"], 64,
     "linear_attn_config.num_heads (96) is not divisible by --tp 7"),
    (["--model-config", str(K3), "--budget-gib", "50", "--spec", "dspark", "--draft-layers",
      "0"], 64, "--draft-layers 0 must be at least 1"),
    (["--model-config", str(K3)], 64, "no budget: the engine has not started on this box yet"),
    (["--model-config", str(K3), "--budget-gib", "0"], 64, "--budget-gib 0.0 is not a positive"),
    (["--model-config", str(K3), "--from-log", "/nonexistent.log"], 64,
     "/nonexistent.log: cannot be read"),
    (["--model-config", str(K3), "--budget-gib", "0.2"], 65,
     "Not enough GPU memory for hybrid (mamba/linear-attention) state cache"),
])
def test_bad_inputs_are_named(box: Path, args: list[str], exit_code: int, words: str) -> None:
    code, _, err = predict(box, *args)
    assert code == exit_code, err
    assert words in err
    assert "hint:" in err


def test_a_config_lacking_a_field_is_a_data_error(box: Path, tmp_path: Path) -> None:
    data = json.loads(K3.read_text())
    del data["text_config"]["linear_attn_config"]["kda_layers"]
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps(data))
    code, _, err = predict(box, "--model-config", str(broken), "--budget-gib", "50")
    assert code == 65
    assert f"{broken}: text_config.linear_attn_config.kda_layers is missing" in err


def test_a_log_without_weight_lines_is_a_data_error(box: Path, tmp_path: Path) -> None:
    log = tmp_path / "short.log"
    log.write_text(LOG.read_text().split("Multi-thread loading shards")[0])
    code, _, err = predict(box, "--model-config", str(K3), "--from-log", str(log))
    assert code == 65
    assert "no 'Load weight begin/end ... avail mem' lines" in err


def with_runner(box: Path, runner: str) -> Path:
    box.write_text(box.read_text() + f'\n[engine]\nrunner = "{runner}"\n')
    return box


def test_recommend_takes_the_budget_and_current_ratio_from_this_boxs_last_start(
        box: Path) -> None:
    """The README's `tune recommend --profile coding-agent` on a box that has started its
    engine: budget and launch from the latest start in the engine log, and "current" is the
    ratio that engine runs with, not the configuration's default."""
    with_runner(box, "process")
    log = box.parent / "log" / "engine.log"
    log.parent.mkdir(parents=True)
    ratio = LOG.read_text().split("mamba_full_memory_ratio=")[1].split(",")[0]
    log.write_text(LOG.read_text().replace(f"mamba_full_memory_ratio={ratio}",
                                           "mamba_full_memory_ratio=3.5"))
    result = run_cli("--config", str(box), "tune", "recommend", "--profile", "coding-agent",
                     "--model-config", str(K3))
    assert result.returncode == 0, result.stderr
    assert f"the engine's last start on this box ({log})" in result.stdout
    # no engine runs here: the ratio is the last start's, never "the running engine's"
    assert "current ratio            3.5      (the engine's last start here)" in result.stdout
    assert "running engine" not in result.stdout


def test_recommend_on_a_box_that_never_started_says_so(box: Path) -> None:
    with_runner(box, "process")
    result = run_cli("--config", str(box), "tune", "recommend", "--profile", "coding-agent",
                     "--model-config", str(K3))
    assert result.returncode == 64
    assert "the engine has not started on this box yet" in result.stderr
    assert "--budget-gib" in result.stderr


def test_predict_with_every_input_given_needs_no_configuration_file(tmp_path: Path) -> None:
    from appliance.config import DEFAULT_CONFIG_PATH

    if DEFAULT_CONFIG_PATH.exists():
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists on this machine")
    result = run_cli("tune", "predict", "--model-config", str(K3), "--from-log", str(LOG))
    assert result.returncode == 0, result.stderr
    assert "budget" in result.stdout
    assert not DEFAULT_CONFIG_PATH.exists()
