"""SGLang 0.5.23's state/KV pool sizing (tuning/calculator.py) and budgets (tuning/budget.py).

Every expected number below was derived by hand from the SGLang 0.5.23 source (paths relative
to the `sglang` package), not by the code under test; the derivation is written next to it.
The formula, in SGLang's order (`srt/mem_cache/kv_cache_configurator.py`):

    rest  = available - pre_model_load * (1 - mfs) - mm            (l.3007, l.3038; GiB floats)
    B     = rest * ratio / (1 + ratio)                                (l.3352)
    K     = int((B - per_slot) // per_slot)                           (l.3385-3391)
    left  = rest - (K + 1) * per_slot                                 (l.3404-3408: +1 padding)
    rows  = left // cell // page * page                               (pool_configurator l.637-647)
    mrr   = min(requested or clamp(rows/context*512, 2048, 4096), rows // 2, K // slots)

K3 per TP8 rank (`srt/configs/mamba_utils.py:323-367`, KimiLinearStateShape, 69 KDA layers):
conv (4-1) x (96*128/8 + 2*96*128/8) = 3 x 4608 bf16 = 27,648 B/layer -> 1,907,712 B;
ssm 96/8 x 128 x 128 fp32 = 786,432 B/layer -> 54,263,808 B; per slot 56,171,520 B.
MLA row (l.3412, pool_configurator l.378-385): (512 + 64) x 24 layers = 13,824 B fp8, 27,648 bf16.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.errors import EX_USAGE
from appliance.tuning.budget import (
    BudgetError,
    budget_from_log,
    estimate_budget,
    pool_budget_interval,
    settings_from_log,
)
from appliance.tuning.calculator import (
    GIB,
    MIB,
    CalculatorError,
    Launch,
    Sizing,
    draft_pricing,
    kv_bytes_per_row,
    layer_scaled_cell,
    mm_reservation_bytes,
    ratio_curve,
    resolve_ssm_dtype,
    size_pools,
    slots_per_request,
    state_bytes_per_slot,
)
from appliance.tuning.geometry import Geometry, load_draft, load_geometry

DATA = Path(__file__).parent / "data"
K3 = load_geometry(DATA / "tuning" / "kimi-k3.config.json")
KIMI_LINEAR = load_geometry(DATA / "tuning" / "kimi-linear-48b-a3b.config.json")
QWEN3_NEXT = load_geometry(DATA / "tuning" / "qwen3-next-80b-a3b.config.json")
DRAFT = load_draft(DATA / "tuning" / "k3-dspark-draft.config.json")
SAMPLE_LOG = (DATA / "engine_logs" / "k3_startup.sample.log").read_text()
DSPARK_LOG = (DATA / "engine_logs" / "dspark_startup.log").read_text()
K3_SLOT = 56_171_520
MM = 100 * MIB  # SGLANG_VLM_CACHE_SIZE_MB default, reserved because K3 is multimodal
SAMPLE_BUDGET = 56_247_858_076  # int((71.07 - 266.93 * (1 - 0.93)) * 2**30)


# --- calibration against the sample startup log -----------------------------------------------


def test_the_sample_log_is_reproduced_exactly() -> None:
    """The sample log's own numbers: max_mamba_cache_size 332, #tokens 2,708,160 and
    max_running_requests 64, from its lines alone.

    The log says (server_args): tp 8, dcp 8, mem_fraction_static 0.93, kv fp8_e4m3, ratio 0.5,
    max_running_requests 64; `Load weight begin. avail mem=266.93 GB` (pre_model_load) and
    `Load weight end. ... avail mem=71.07 GB` (available when the pools are sized; no draft).

    The naive budget 71.07 - 266.93 * 0.07 = 52.3849 GiB gives K 332 but 2,715,712 rows: 7,552
    rows (0.28 %) too many. The missing term is `mm_reservation_gb` (l.202-224, l.3038): K3's
    config has a `text_config`, so SGLang's `hf_config is not hf_text_config` and the model is
    multimodal (model_config.py:809-827) even when served text-only, and 100 MiB
    (SGLANG_VLM_CACHE_SIZE_MB) comes off the budget before the split. With it:

      rest = 52.3849 - 100/1024 = 52.28724375 GiB = 56,143,000,476 B
      B    = rest * 0.5/1.5 = 18,714,333,492 B; / 56,171,520 = 333.16 -> K = 333 - 1 = 332
      left = 56,143,000,476 - 333 * 56,171,520 = 37,437,884,316 B
      rows = 37,437,884,316 // 13,824 = 2,708,180 -> // 64 * 64 = 2,708,160
      mrr  = min(64, 2,708,160 // 2, 332 // 5 = 66) = 64
      and the log's pool sizes: conv 333 x 1,907,712 B = 0.59 GiB, ssm 333 x 54,263,808 B =
      16.83 GiB, KV 2,708,160 x 13,824 B = 34.87 GiB.
    """
    budget = budget_from_log(SAMPLE_LOG)
    assert budget is not None and budget.measured
    assert budget.bytes == SAMPLE_BUDGET
    launch = Launch(**{k: v for k, v in settings_from_log(SAMPLE_LOG).items() if k != "ratio"})
    assert launch == Launch(max_running_requests=64)
    sizing = size_pools(K3, launch, budget.bytes, settings_from_log(SAMPLE_LOG)["ratio"])
    assert (sizing.max_mamba_cache_size, sizing.mla_rows_per_rank,
            sizing.max_running_requests) == (332, 2_708_160, 64)
    assert sizing.running_limited_by == "requested"
    shown = sizing.to_dict()
    assert (shown["conv_state_gib"], shown["ssm_state_gib"], shown["kv_gib"]) == \
        (0.59, 16.83, 34.87)
    assert sizing.mm_reserved_bytes == MM
    naive = size_pools(replace(K3, multimodal=False), launch, budget.bytes, 0.5)
    assert (naive.max_mamba_cache_size, naive.mla_rows_per_rank) == (332, 2_715_712)


def test_the_budgets_that_give_the_sample_numbers_and_where_the_log_lands() -> None:
    """How precisely the log pins the budget down, and that the log-derived one is inside.

    K = 332 needs B in [333, 334) slots, i.e. rest in [333 x 3, 334 x 3) x 56,171,520 B =
    [56,115,348,480, 56,283,863,040). 2,708,160 rows need left in [2,708,160, 2,708,224) x
    13,824 B, i.e. rest in [56,142,720,000, 56,143,604,736): 884,736 B (0.00082 GiB) wide and
    inside the K interval. Plus the 104,857,600 B reservation, the budgets (available - slack)
    giving both numbers are [56,247,577,600, 56,248,462,336). The log-derived 56,247,858,076
    is 280,476 B above the floor.

    Exact reproduction is not *determined* by the rounded figures: 71.07 and 266.93 stand for
    [71.065, 71.075) and [266.925, 266.935) (and `mem usage=195.86` for their difference), so
    available - 0.07 x pre can be anywhere in [52.3799, 52.3899) GiB, 12 times wider than the
    interval: K (332) and max_running_requests (64) are determined, rows only to
    2,707,776 ... 2,708,544. Read at face value, the printed figures land inside, as they would
    for a log assembled from exact values (this one was: its `Memory pool end. avail mem=18.78`
    is exactly 71.07 - 0.59 - 16.83 - 34.87).
    """
    launch = Launch(max_running_requests=64)
    low, high = pool_budget_interval(K3, launch, 0.5, max_mamba_cache_size=332, rows=2_708_160)
    assert (low, high) == (56_247_577_600, 56_248_462_336)
    assert low <= SAMPLE_BUDGET < high
    edges = {b: size_pools(K3, launch, b, 0.5) for b in (low - 1, low, high - 1, high)}
    assert [(s.max_mamba_cache_size, s.mla_rows_per_rank) for s in edges.values()] == \
        [(332, 2_708_096), (332, 2_708_160), (332, 2_708_160), (332, 2_708_224)]
    budget = budget_from_log(SAMPLE_LOG)
    assert budget is not None
    assert budget.uncertainty_bytes == int((0.005 + 0.005 * (1 - 0.93)) * GIB)
    for corner in (52.3799, 52.3899 - 1e-9):
        sizing = size_pools(K3, launch, int(corner * GIB), 0.5)
        assert (sizing.max_mamba_cache_size, sizing.max_running_requests) == (332, 64)
        assert 2_707_776 <= sizing.mla_rows_per_rank <= 2_708_544


# --- golden cases, derived by hand -------------------------------------------------------------


def test_k3_bf16_ratio_5_the_day_one_story() -> None:
    """K3 TP8/DCP8, bf16 KV, ratio 5, no --max-running-requests, on the sample's budget.

      rest = 56,143,000,476 B (as above); B = rest x 5/6 = 46,785,833,730 B
      K    = int(46,785,833,730 / 56,171,520 = 832.91) - 1 = 831
      left = 56,143,000,476 - 832 x 56,171,520 = 9,408,295,836 B
      rows = 9,408,295,836 // 27,648 = 340,288 (a multiple of 64)
      logical = 340,288 x 8 = 2,722,304 tokens
      mrr  = min(clamp(int(340,288 / 1,048,576 x 512) = 166, 2048, 4096) = 2048,
                 170,144, 831 // 5 = 166) = 166, limited by the state pool

    DESIGN.md's "ratio 5 holds ~0.5M tokens of KV" matches neither figure: a rank holds 0.34M
    rows, and DCP 8 spreads each sequence over the 8 ranks, so the box holds 2.7M tokens.
    """
    sizing = size_pools(K3, Launch(kv_dtype="bf16"), SAMPLE_BUDGET, 5)
    assert (sizing.max_mamba_cache_size, sizing.mla_rows_per_rank, sizing.logical_tokens) == \
        (831, 340_288, 2_722_304)
    assert (sizing.max_running_requests, sizing.running_limited_by) == (166, "state")
    assert sizing.kv_bytes_per_row == 27_648


def test_k3_dspark_with_replayssm() -> None:
    """K3 TP8/DCP8, fp8 KV, DSPARK (draft: 8 layers, 1 KV head, 128 + 128, gamma 7 -> 8 draft
    tokens), --enable-linear-replayssm-spec (L = 16), ratio 2, a 48 GiB budget.

    Ring (mamba_utils.py:127-157, KDA): per layer rawv 12x16x128x2 + rawk 12x16x128x2 + beta
    12x16x4 + g 12x16x128x4 + d 12x16x128x2 + k 12x16x128x2 = 295,680 B; x 69 = 20,401,920 B,
    charged per state slot for KDA (l.3279-3291). ReplaySSM drops the speculative state
    reserve (l.3294), so K is the plain split with per_slot = 56,171,520 + 20,401,920 =
    76,573,440 B.
    Row (pool_configurator l.316-338, dflash_utils.py:121-134): 13,824 + max(1, 1 // 8) x
    (128 + 128) x 8 layers x 1 B (the draft follows --kv-cache-dtype) x dcp 8 = 30,208 B.

      rest = 48 GiB - 100 MiB = 51,434,749,952 B; B = rest x 2/3 = 34,289,833,301 B
      K    = int(34,289,833,301 / 76,573,440 = 447.80) - 1 = 446
      left = 51,434,749,952 - 447 x 76,573,440 = 17,206,422,272 B
      rows = 17,206,422,272 // 30,208 = 569,598 -> 569,536; logical 4,556,288
      mrr  = 48 (SGLang's DSPARK default), under 284,768 and 446 // 5 = 89
      pools: conv 852,747,264, ssm 24,255,922,176, ring 9,119,658,240, MLA KV
      569,536 x 13,824 = 7,873,265,664, draft KV 569,536 x 16,384 = 9,331,277,824 B
    """
    launch = Launch(speculative="dspark", draft=DRAFT, replayssm=True)
    assert state_bytes_per_slot(K3, launch) == (1_907_712, 54_263_808, 20_401_920)
    assert kv_bytes_per_row(K3, launch) == 30_208
    sizing = size_pools(K3, launch, 48 * GIB, 2)
    assert (sizing.max_mamba_cache_size, sizing.mla_rows_per_rank, sizing.logical_tokens,
            sizing.max_running_requests) == (446, 569_536, 4_556_288, 48)
    assert (sizing.conv_state_bytes, sizing.ssm_state_bytes, sizing.replayssm_bytes,
            sizing.kv_bytes, sizing.draft_kv_bytes, sizing.spec_state_bytes) == \
        (852_747_264, 24_255_922_176, 9_119_658_240, 7_873_265_664, 9_331_277_824, 0)


def test_a_dspark_draft_without_its_config_is_priced_by_layer_count() -> None:
    """SGLang's fallback when the draft's KV bytes cannot be resolved
    (srt/mem_cache/draft_kv_budget.py:49-56 returns None, so pool_configurator.py:316-338
    calls `scale_kv_cell_size_per_token_for_dflash` without a draft cell,
    dflash_utils.py:137-175): the target's cell scaled by (target layers + draft layers x
    attn_dcp_size) / target layers, rounded up.

    K3 fp8 TP8/DCP8, 8 draft layers: ceil(13,824 x (24 + 64) / 24) = 50,688 B a row, of which
    36,864 is the draft's (the exact price from its config is 16,384).
    """
    launch = Launch(speculative="dspark", draft_layers=8)
    assert kv_bytes_per_row(K3, launch) == 50_688
    assert layer_scaled_cell(1_000, 24, 8) == 1_334  # ceil(1,000 x 32 / 24): SGLang rounds up
    assert layer_scaled_cell(13_824, 24, 0) == 13_824
    sizing = size_pools(K3, launch, 48 * GIB, 2)
    assert sizing.draft_kv_bytes == sizing.mla_rows_per_rank * 36_864
    assert sizing.kv_bytes == sizing.mla_rows_per_rank * 13_824
    # The draft's config wins when there is one; the pricing is named either way.
    assert kv_bytes_per_row(K3, replace(launch, draft=DRAFT)) == 30_208
    assert "target cell x (target layers + 8 draft layers x DCP 8)" in str(
        draft_pricing(launch))
    assert str(draft_pricing(replace(launch, draft=DRAFT))).startswith(
        "draft KV priced from the draft's config")
    assert draft_pricing(Launch()) is None


def test_k3_dspark_without_replayssm_reserves_the_draft_snapshots() -> None:
    """The same launch without ReplaySSM: the joint solve with intermediate_ssm (l.3355-3380),
    D = 8 draft tokens, 5 slots per request:

      K = int((34,289,833,301 - 56,171,520 x 9) // (56,171,520 x (1 + 8/5))) = int(231.33) = 231
      capped = min(48, 231 // 5 = 46) = 46; reserve = 56,171,520 x 47 x 8 = 21,120,491,520 B
      left = 51,434,749,952 - 21,120,491,520 - 232 x 56,171,520 = 17,282,465,792 B
      rows = 17,282,465,792 // 30,208 = 572,115 -> 572,096; mrr = min(48, 286,048, 46) = 46
    """
    sizing = size_pools(K3, Launch(speculative="dspark", draft=DRAFT), 48 * GIB, 2)
    assert (sizing.max_mamba_cache_size, sizing.mla_rows_per_rank,
            sizing.max_running_requests, sizing.running_limited_by) == \
        (231, 572_096, 46, "state")
    assert sizing.spec_state_bytes == 21_120_491_520
    assert sizing.replayssm_bytes == 0


def test_kimi_linear_48b_at_tp2() -> None:
    """Kimi-Linear-48B-A3B (published config), TP2/DCP1, KV bf16, ratio 0.9, 180 GiB; not
    multimodal (no text sub-config), so nothing is reserved.

    State (20 KDA layers, 32 heads x 128 at TP2): conv 3 x (4096/2 + 2 x 4096/2) = 18,432 bf16
    = 36,864 B/layer; ssm 16 x 128 x 128 fp32 = 1,048,576 B/layer; per slot 21,708,800 B.
    Row: (512 + 64) x 7 MLA layers x 2 = 8,064 B.

      B = 193,273,528,320 x 0.9/1.9 = 91,550,618,678; / 21,708,800 = 4,217.2 -> K = 4,216
      left = 193,273,528,320 - 4,217 x 21,708,800 = 101,727,518,720
      rows = // 8,064 = 12,615,019 -> 12,614,976 (DCP 1: logical = rows)
      mrr  = min(clamp(int(12,614,976 / 1,048,576 x 512) = 6,159 -> 4096), 6,307,488,
                 4,216 // 5 = 843) = 843 (context from model_max_length, 1,048,576)
    """
    launch = Launch(tp=2, dcp=1, kv_dtype="auto")
    assert state_bytes_per_slot(KIMI_LINEAR, launch) == (737_280, 20_971_520, 0)
    sizing = size_pools(KIMI_LINEAR, launch, 180 * GIB, 0.9)
    assert (sizing.max_mamba_cache_size, sizing.mla_rows_per_rank, sizing.logical_tokens,
            sizing.max_running_requests, sizing.mm_reserved_bytes) == \
        (4_216, 12_614_976, 12_614_976, 843, 0)


def test_qwen3_next_80b_at_tp4() -> None:
    """Qwen3-Next-80B-A3B (published config), TP4, KV bf16, ratio 0.9, 150 GiB.

    State (Mamba2StateShape, mamba_utils.py:193-241; 36 GDN layers): conv_dim 128 x 32 +
    2 x 16 x 128 = 8,192 -> (2,048, 3) bf16 = 12,288 B/layer; ssm (32/4, 128, 128) fp32 =
    524,288 B/layer; per slot 36 x 536,576 = 19,316,736 B.
    Row (pool_configurator l.487-494): max(1, 2 KV heads // 4) = 1 (replicated) x (256 + 256)
    x 12 layers x 2 = 12,288 B.

      B = 161,061,273,600 x 0.9/1.9 = 76,292,182,232; / 19,316,736 = 3,949.5 -> K = 3,948
      left = 161,061,273,600 - 3,949 x 19,316,736 = 84,779,483,136
      rows = // 12,288 = 6,899,372 -> 6,899,328
      mrr  = min(4096 (clamp of 13,475), 3,449,664, 3,948 // 5 = 789) = 789
    """
    launch = Launch(tp=4, dcp=1, kv_dtype="bf16")
    assert state_bytes_per_slot(QWEN3_NEXT, launch) == (442_368, 18_874_368, 0)
    assert kv_bytes_per_row(QWEN3_NEXT, launch) == 12_288
    sizing = size_pools(QWEN3_NEXT, launch, 150 * GIB, 0.9)
    assert (sizing.max_mamba_cache_size, sizing.mla_rows_per_rank,
            sizing.max_running_requests) == (3_948, 6_899_328, 789)


# --- smaller rules -----------------------------------------------------------------------------


def test_slots_per_request_follow_the_radix_strategy() -> None:
    assert slots_per_request(Launch()) == 5
    assert slots_per_request(Launch(overlap_schedule=False)) == 4
    assert slots_per_request(Launch(mamba_strategy="extra_buffer_lazy")) == 4
    assert slots_per_request(Launch(mamba_strategy="no_buffer")) == 3
    assert slots_per_request(Launch(radix_cache=False)) == 1


def test_ssm_dtype_resolution_ignores_the_config_for_kda() -> None:
    assert resolve_ssm_dtype(K3, None) == "float32"
    assert resolve_ssm_dtype(replace(K3, ssm_dtype="bfloat16"), None) == "float32"
    assert resolve_ssm_dtype(replace(QWEN3_NEXT, ssm_dtype="bfloat16"), None) == "bfloat16"
    assert resolve_ssm_dtype(replace(QWEN3_NEXT, ssm_dtype="bfloat16"), None,
                             replayssm=True) == "float32"
    assert resolve_ssm_dtype(K3, "bfloat16") == "bfloat16"
    assert state_bytes_per_slot(K3, Launch(ssm_dtype="bfloat16"))[1] == 54_263_808 // 2


def test_multimodal_reservation() -> None:
    assert mm_reservation_bytes(K3, Launch()) == 100 * MIB
    assert mm_reservation_bytes(K3, Launch(mm_feature_transport="cuda_ipc")) == 1124 * MIB
    assert mm_reservation_bytes(K3, Launch(language_model_only=True)) == 0
    assert mm_reservation_bytes(KIMI_LINEAR, Launch(tp=2, dcp=1)) == 0


def test_explicit_slot_count_and_the_kv_limit() -> None:
    """--max-mamba-cache-size fixes K (l.3305-3330); a budget that leaves few rows makes the
    KV pool the limit: rows // 2 < requested."""
    sizing = size_pools(K3, Launch(max_mamba_cache_size=10, max_running_requests=64),
                        int(10 * K3_SLOT + 2 * K3_SLOT + MM + 64 * 13_824), 0.5)
    assert sizing.max_mamba_cache_size == 10
    assert (sizing.max_running_requests, sizing.running_limited_by) == (2, "state")
    tiny = size_pools(K3, Launch(max_mamba_cache_size=200, max_running_requests=64),
                      int(201 * K3_SLOT + MM + 64 * 13_824 + 1000), 0.5)
    assert (tiny.mla_rows_per_rank, tiny.max_running_requests, tiny.running_limited_by) == \
        (64, 32, "kv")


def test_without_radix_cache_a_request_is_one_slot() -> None:
    sizing = size_pools(K3, Launch(radix_cache=False, max_running_requests=64), SAMPLE_BUDGET,
                        0.5)
    assert (sizing.mamba_slots_per_request, sizing.max_mamba_cache_size) == (1, 64)


@pytest.mark.parametrize(("launch", "budget", "ratio", "words"), [
    (Launch(), SAMPLE_BUDGET, 0.0, "is not a positive number"),
    (Launch(), SAMPLE_BUDGET, -1.0, "is not a positive number"),
    (Launch(), SAMPLE_BUDGET, float("nan"), "is not a positive number"),
    (Launch(), 2 * K3_SLOT, 0.5,
     "Not enough GPU memory for hybrid (mamba/linear-attention) state cache. Computed "
     "max_mamba_cache_size=-1"),
    (Launch(max_mamba_cache_size=1000), SAMPLE_BUDGET, 0.5,
     "Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.93"),
    (Launch(max_mamba_cache_size=1), 2 * K3_SLOT + MM + 63 * 13_824, 0.5,
     "Not enough memory. Please try to increase --mem-fraction-static."),
    (Launch(max_mamba_cache_size=4), 5 * K3_SLOT + MM + GIB, 0.5,
     "Hybrid (mamba/linear-attention) state cache is too small to serve any requests."),
    (Launch(tp=5, dcp=5), SAMPLE_BUDGET, 0.5, "num_heads (96) is not divisible by --tp 5"),
    (Launch(tp=64, dcp=8), SAMPLE_BUDGET, 0.5, "num_heads (96) is not divisible by --tp 64"),
    (Launch(tp=8, dcp=3), SAMPLE_BUDGET, 0.5, "--dcp 3 must divide --tp 8"),
    (Launch(speculative="dspark"), SAMPLE_BUDGET, 0.5, "neither was given"),
    (Launch(speculative="dspark", draft_layers=0), SAMPLE_BUDGET, 0.5,
     "--draft-layers 0 must be at least 1"),
    (Launch(kv_dtype="nvfp4"), SAMPLE_BUDGET, 0.5, "fp4 KV is not modelled"),
])
def test_refusals_use_sglangs_words(launch: Launch, budget: int, ratio: float,
                                    words: str) -> None:
    with pytest.raises(CalculatorError) as caught:
        size_pools(K3, launch, budget, ratio)
    assert words in caught.value.message
    assert caught.value.hint


def test_tp_that_does_not_divide_heads_is_a_usage_error() -> None:
    with pytest.raises(CalculatorError) as caught:
        size_pools(QWEN3_NEXT, Launch(tp=3, dcp=1), 100 * GIB, 1)
    assert caught.value.exit_code == EX_USAGE
    assert "linear_num_value_heads (32) is not divisible by --tp 3" in caught.value.message


def test_gdn_replayssm_ring_is_per_request_slot() -> None:
    """GDN's ring is fixed request scratch (l.3277-3285): (max_running // dp + 1) rings of
    36 x (8x16x128x2 + 4x16x128x2 + 8x16x4 + the bf16 low parts 8x16x128x2 + 4x16x128x2)."""
    per_layer = 8 * 16 * 128 * 2 + 4 * 16 * 128 * 2 + 8 * 16 * 4 \
        + 8 * 16 * 128 * 2 + 4 * 16 * 128 * 2
    launch = Launch(tp=4, dcp=1, kv_dtype="bf16", speculative="dspark", draft=DRAFT,
                    replayssm=True, max_running_requests=32)
    assert state_bytes_per_slot(QWEN3_NEXT, launch)[2] == 36 * per_layer
    sizing = size_pools(QWEN3_NEXT, launch, 150 * GIB, 0.9)
    assert sizing.replayssm_bytes == 33 * 36 * per_layer
    assert sizing.state_bytes_per_slot == 19_316_736


# --- properties over parametrized sweeps -------------------------------------------------------

RATIOS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0]
CASES = {
    "k3-fp8": (K3, Launch()),
    "k3-bf16-mrr64": (K3, Launch(kv_dtype="bf16", max_running_requests=64)),
    "k3-dspark-replayssm": (K3, Launch(speculative="dspark", draft=DRAFT, replayssm=True)),
    "k3-dspark": (K3, Launch(speculative="dspark", draft=DRAFT)),
    "k3-bf16-state-no-buffer": (K3, Launch(ssm_dtype="bfloat16", mamba_strategy="no_buffer")),
    "kimi-linear-tp2": (KIMI_LINEAR, Launch(tp=2, dcp=1, kv_dtype="auto")),
    "qwen3-next-tp4": (QWEN3_NEXT, Launch(tp=4, dcp=1, kv_dtype="bf16")),
    "qwen3-next-tp4-dcp2": (QWEN3_NEXT, Launch(tp=4, dcp=2, kv_dtype="fp8_e4m3")),
}


def sweep(geometry: Geometry, launch: Launch, budget: int) -> list[Sizing]:
    sized = []
    for ratio in RATIOS:
        try:
            sized.append(size_pools(geometry, launch, budget, ratio))
        except CalculatorError:
            continue  # too little for one side at this ratio; the rest must still hold
    return sized


@pytest.mark.parametrize("budget_gib", [24, 52.38, 120])
@pytest.mark.parametrize("case", sorted(CASES))
def test_properties_hold_across_ratios(case: str, budget_gib: float) -> None:
    geometry, launch = CASES[case]
    budget = int(budget_gib * GIB)
    sized = sweep(geometry, launch, budget)
    assert len(sized) >= 8, "the sweep should size most ratios"
    for low, high in itertools.pairwise(sized):
        assert high.ratio > low.ratio
        assert high.max_mamba_cache_size >= low.max_mamba_cache_size
        assert high.mla_rows_per_rank <= low.mla_rows_per_rank
    for s in sized:
        assert s.total_bytes + s.mm_reserved_bytes <= s.budget_bytes == budget
        assert s.max_running_requests <= s.max_mamba_cache_size // s.mamba_slots_per_request
        assert s.max_running_requests <= s.mla_rows_per_rank // 2
        assert s.logical_tokens == s.mla_rows_per_rank * launch.dcp
        assert s.mla_rows_per_rank % launch.page_size == 0
        assert s.kv_bytes + s.draft_kv_bytes == s.mla_rows_per_rank * s.kv_bytes_per_row
        d = s.to_dict()
        assert d["total_gib"] == round(s.total_bytes / GIB, 2)
        assert {"conv_state_gib", "ssm_state_gib", "replayssm_gib", "kv_gib", "draft_kv_gib",
                "state_gib", "total_gib", "max_mamba_cache_size", "logical_tokens"} <= set(d)


@pytest.mark.parametrize("case", sorted(CASES))
def test_more_budget_never_shrinks_either_pool(case: str) -> None:
    geometry, launch = CASES[case]
    for ratio in (0.5, 2.0):
        sized = [size_pools(geometry, launch, int(gib * GIB), ratio) for gib in (40, 60, 90)]
        for low, high in itertools.pairwise(sized):
            assert high.max_mamba_cache_size >= low.max_mamba_cache_size
            assert high.mla_rows_per_rank >= low.mla_rows_per_rank


def test_ratio_curve_is_size_pools_in_order() -> None:
    curve = ratio_curve(K3, Launch(), SAMPLE_BUDGET, [2.0, 0.5])
    assert [s.ratio for s in curve] == [2.0, 0.5]
    assert curve[1] == size_pools(K3, Launch(), SAMPLE_BUDGET, 0.5)


# --- budgets -----------------------------------------------------------------------------------


def test_budget_from_the_sample_log() -> None:
    budget = budget_from_log(SAMPLE_LOG, source="the startup of run 12")
    assert budget is not None
    assert budget.bytes == int((71.07 - 266.93 * (1 - 0.93)) * GIB) == SAMPLE_BUDGET
    assert budget.available_bytes == int(71.07 * GIB)
    assert budget.pre_load_bytes == int(266.93 * GIB)
    assert budget.mem_fraction_static == 0.93
    assert budget.detail.startswith("measured from the startup of run 12: 71.07 GiB free")
    assert "least of 8 ranks" in budget.detail


def test_budget_from_a_dspark_log_counts_the_draft_weights() -> None:
    """SGLang sizes the pools after loading the draft too: the second `Load weight end`
    (61.23 GB) is what is available, not the target's 71.07."""
    budget = budget_from_log(DSPARK_LOG)
    assert budget is not None
    assert budget.bytes == int((61.23 - 266.93 * (1 - 0.93)) * GIB)
    settings = settings_from_log(DSPARK_LOG)
    assert (settings["speculative"], settings["draft_tokens"], settings["ratio"],
            settings["max_running_requests"]) == ("dspark", 8, 5.0, 48)


def test_budget_needs_the_weight_lines_and_a_fraction() -> None:
    assert budget_from_log("") is None
    head = SAMPLE_LOG.split("Multi-thread loading shards")[0]
    assert budget_from_log(head) is None  # no "Load weight end" yet
    without_args = SAMPLE_LOG.split("\n", 1)[1]
    assert budget_from_log(without_args) is None
    again = budget_from_log(without_args, mem_fraction_static=0.9)
    assert again is not None
    assert again.bytes == int((71.07 - 266.93 * (1 - 0.9)) * GIB)


def test_the_least_rank_counts() -> None:
    text = SAMPLE_LOG.replace("[2026-11-30 10:22:24 TP5] Load weight end. elapsed=4898.40 s, "
                              "type=KimiK3ForConditionalGeneration, quant=compressed-tensors, "
                              "avail mem=71.07 GB",
                              "[2026-11-30 10:22:24 TP5] Load weight end. elapsed=4898.40 s, "
                              "type=KimiK3ForConditionalGeneration, quant=compressed-tensors, "
                              "avail mem=70.07 GB")
    budget = budget_from_log(text)
    assert budget is not None
    assert budget.available_bytes == int(70.07 * GIB)


def test_estimate_budget_is_labelled_and_refuses_overfull_gpus() -> None:
    budget = estimate_budget(288 * GIB, 195 * GIB, 0.93, overhead_bytes=2 * GIB)
    assert not budget.measured
    assert budget.bytes == int((286 - 195 - 286 * (1 - 0.93)) * GIB)
    assert budget.detail.startswith("estimate: ")
    assert json.loads(json.dumps(budget.to_dict()))["measured"] is False
    with pytest.raises(BudgetError, match="Loaded weights leave no GPU memory"):
        estimate_budget(288 * GIB, 280 * GIB, 0.93)


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.9, 2.0, 5.0])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "bf16"])
def test_the_engine_emulator_and_the_calculator_agree(ratio: float, kv: str) -> None:
    """Two implementations of the same split (the emulator's capacity model, written for the
    engine issue, and this calculator) must not drift apart: the demo shows both."""
    from appliance.testing.fake_sglang.args import parse
    from appliance.testing.fake_sglang.memory import plan

    emulated = plan(parse(["/m", "--tp-size", "8", "--dcp-size", "8", "--kv-cache-dtype", kv,
                           "--mem-fraction-static", "0.93", "--mamba-full-memory-ratio",
                           str(ratio), "--max-running-requests", "64"]))
    sizing = size_pools(K3, Launch(kv_dtype=kv, max_running_requests=64), SAMPLE_BUDGET, ratio)
    assert sizing.max_mamba_cache_size == emulated.state_slots
    assert sizing.mla_rows_per_rank == emulated.kv_tokens
    assert sizing.max_running_requests == emulated.max_running_requests
