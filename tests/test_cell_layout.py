"""appliance.cell.layout: what must match between a prefill and a decode, read from their
launch argv (the real specs the daemon builds) and compared as a table."""

from __future__ import annotations

import dataclasses

import pytest

from appliance.cell import layout
from appliance.config import CellConfig, Config, EngineConfig
from appliance.engine.args import build_launch_spec, inputs_from_config


def spec_layout(config: Config, role: str) -> layout.Layout:
    spec = build_launch_spec(("sglang",), inputs_from_config(config, role=role))
    return layout.of_argv(spec.serve_args())


def with_engine(extra: tuple[str, ...] = (), **engine: object) -> Config:
    return Config(engine=dataclasses.replace(EngineConfig(), extra_args=extra, **engine))  # type: ignore[arg-type]


def test_the_products_prefill_and_decode_specs_match() -> None:
    config = Config(cell=CellConfig(role="prefill"))
    prefill, decode = spec_layout(config, "prefill"), spec_layout(config, "decode")
    assert layout.compare(prefill, decode) == ()
    assert prefill.kv_cache_dtype == "fp8_e4m3" and prefill.tp_size == "8"
    assert prefill.model == "moonshotai--Kimi-K3"


def test_the_memory_ratio_only_sizes_pools_and_need_not_match() -> None:
    prefill = spec_layout(with_engine(mamba_full_memory_ratio=5.0), "prefill")
    decode = spec_layout(with_engine(mamba_full_memory_ratio=1.5,
                                     mem_fraction_static=0.8), "decode")
    assert layout.compare(prefill, decode) == ()


@pytest.mark.parametrize(("prefill_args", "decode_args", "field", "values"), [
    pytest.param(("--page-size", "64"), (), "page_size", ("64", "SGLang's choice"), id="page"),
    pytest.param((), ("--kv-cache-dtype", "bf16"), "kv_cache_dtype", ("fp8_e4m3", "bf16"),
                 id="dtype"),
    pytest.param(("--disaggregation-decode-allocation-policy", "prefill_complete"), (),
                 "allocation_policy", ("prefill_complete", "early"), id="policy"),
    pytest.param(("--tensor-parallel-size", "4"), (), "tp_size", ("4", "8"), id="tp-alias"),
    pytest.param((), ("--mamba-ssm-dtype=bfloat16",), "ssm_dtype", ("the model's", "bfloat16"),
                 id="ssm-joined"),
    pytest.param(("--attn-cp-size", "2"), ("--dcp-size", "8"), "attn_cp_size",
                 ("2", "--dcp-size 8"), id="dcp-needs-prefill-cp-1"),
    pytest.param(("--enable-kv-cache-sharding",), ("--dcp-size", "8"), "kv_cache_sharding",
                 ("--enable-kv-cache-sharding", "--dcp-size 8"), id="dcp-refuses-sharding"),
])
def test_each_mismatch_names_the_field_and_both_values(
        prefill_args: tuple[str, ...], decode_args: tuple[str, ...], field: str,
        values: tuple[str, str]) -> None:
    prefill = spec_layout(with_engine(prefill_args), "prefill")
    decode = spec_layout(with_engine(decode_args, dcp_size=1), "decode")
    [found] = [m for m in layout.compare(prefill, decode, "this box (the head)",
                                         "member 2 (10.0.0.6)") if m.field == field]
    assert (found.prefill, found.decode) == values
    assert found.message.startswith(f"{found.label} differs: this box (the head) (prefill) has")
    assert "member 2 (10.0.0.6) (decode) has" in found.message


def test_attention_cp_above_one_is_fine_without_dcp_on_the_decode() -> None:
    prefill = spec_layout(with_engine(("--attn-cp-size", "2")), "prefill")
    decode = spec_layout(with_engine(dcp_size=1), "decode")
    assert layout.compare(prefill, decode) == ()


def test_the_cell_compares_every_prefill_with_every_decode_and_skips_the_unknown() -> None:
    good = spec_layout(Config(), "prefill")
    other = dataclasses.replace(good, page_size="32")
    boxes = [layout.Box("this box (the head)", "prefill", good),
             layout.Box("member 1 (a)", "decode", good),
             layout.Box("member 2 (b)", "decode", other),
             layout.Box("member 3 (c)", "decode", None),
             layout.Box("member 4 (d)", "unified", other)]
    found = layout.cell_mismatches(boxes)
    assert [(m.prefill_box, m.decode_box, m.field) for m in found] == [
        ("this box (the head)", "member 2 (b)", "page_size")]
    assert layout.involving(found, "member 1 (a)") == ()
    assert layout.involving(found, "member 2 (b)") == found


def test_a_reported_layout_reads_back_and_a_malformed_one_is_unknown() -> None:
    good = spec_layout(Config(), "decode")
    assert layout.from_json(good.to_json()) == good
    assert layout.from_json({"page_size": "1"}) is None
    assert layout.from_json("nonsense") is None
