"""What must match between a cell's prefill and decode engines for the KV to move, compared
from their launch flags before SGLang finds out (at the first request, after two 90-minute
loads). Pure: argv in, frozen values out; the head's watch and its join and restart paths
call it (appliance.cell.layout_guard keeps what it last saw).

What SGLang 0.5.23 refuses, and so what is compared (prefill against decode):
- `--page-size` and `--kv-cache-dtype`: the decode raises "Page size mismatch" / "KV cache
  dtype mismatch" on the prefill's bootstrap info (disaggregation/common/conn.py 1320-1335);
- `--disaggregation-decode-allocation-policy`: "Set ... identically on both roles"
  (common/conn.py 2529-2533);
- each state buffer's per-slot size: mooncake refuses a decode whose item length differs
  from the prefill's (mooncake/conn.py 826-918). For Kimi K3 the KDA recurrent state of a
  slot is split over the tensor-parallel ranks and stored in the SSM state dtype, so the
  per-slot size follows `--tp-size`, `--mamba-ssm-dtype` and the model: all three compared;
- a decode with DCP (`--dcp-size` > 1) needs an MLA or hybrid-MLA pool (K3's is hybrid MLA:
  always so here), a prefill with attention CP 1 (`--attn-cp-size`) and no
  `--enable-kv-cache-sharding` (common/conn.py 1413-1420);
- `--disaggregation-transfer-backend`: sender and receiver speak one protocol.
Not compared: `--mamba-full-memory-ratio` and `--mem-fraction-static` only size each box's
pools, and a prefill and a decode rightly size theirs differently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from appliance.engine import flags
from appliance.engine.args import split_args

# (field, flag, SGLang's default when the flag is absent, the field in words)
FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("page_size", "--page-size", "SGLang's choice", "page size"),
    ("kv_cache_dtype", "--kv-cache-dtype", "auto", "KV cache dtype"),
    ("allocation_policy", "--disaggregation-decode-allocation-policy", "early",
     "decode allocation policy"),
    ("transfer_backend", "--disaggregation-transfer-backend", "mooncake",
     "KV transfer backend"),
    ("tp_size", "--tp-size", "1", "tensor-parallel size (each state slot's size)"),
    ("ssm_dtype", "--mamba-ssm-dtype", "the model's", "SSM state dtype (each state slot's size)"),
    ("model", "--model-path", "", "model"),
)


@dataclass(frozen=True)
class Layout:
    """The launch facts of one engine that decide its KV layout (strings as the flags give
    them; an absent flag is SGLang's default, in FIELDS)."""

    page_size: str
    kv_cache_dtype: str
    allocation_policy: str
    transfer_backend: str
    tp_size: str
    ssm_dtype: str
    model: str
    dcp_size: str = "1"
    attn_cp_size: str = "1"
    kv_cache_sharding: bool = False

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Mismatch:
    """One thing that differs between a prefill and a decode, with both values."""

    field: str
    flag: str
    label: str
    prefill_box: str
    prefill: str
    decode_box: str
    decode: str

    @property
    def message(self) -> str:
        return (f"{self.label} differs: {self.prefill_box} (prefill) has "
                f"{self._shown(self.prefill)}, {self.decode_box} (decode) has "
                f"{self._shown(self.decode)}")

    def _shown(self, value: str) -> str:
        return value if value.startswith("--") else f"{self.flag} {value}"


def of_argv(tokens: Sequence[str]) -> Layout:
    """The layout an engine launched with these serve arguments has (the last value of a
    repeated flag wins, as in argparse)."""
    given: dict[str, str | None] = {}
    for option, values in split_args(list(tokens)):
        found = flags.match(option)  # SGLang's canonical name, as its parser resolves it
        name = found[0].name if len(found) == 1 else option
        given[name] = values[0] if values else None
    values_by_field = {}
    for name, flag, default, _ in FIELDS:
        value = given.get(flag) or default
        values_by_field[name] = value.rstrip("/").rsplit("/", 1)[-1] if name == "model" \
            else value
    return Layout(**values_by_field, dcp_size=given.get("--dcp-size") or "1",
                  attn_cp_size=given.get("--attn-cp-size") or "1",
                  kv_cache_sharding="--enable-kv-cache-sharding" in given)


def from_json(data: Any) -> Layout | None:
    """A layout a member reported (None when it reported none or one of another shape)."""
    if not isinstance(data, Mapping):
        return None
    try:
        return Layout(**{f.name: data[f.name] for f in fields(Layout)})
    except (KeyError, TypeError):
        return None


def compare(prefill: Layout, decode: Layout, prefill_box: str = "the prefill",
            decode_box: str = "the decode") -> tuple[Mismatch, ...]:
    """Everything that must match and does not, in FIELDS order, then the DCP rules."""
    found = [Mismatch(name, flag, label, prefill_box, getattr(prefill, name), decode_box,
                      getattr(decode, name))
             for name, flag, _, label in FIELDS if getattr(prefill, name) != getattr(decode, name)]
    if decode.dcp_size not in ("", "1"):
        if prefill.attn_cp_size not in ("", "1"):
            found.append(Mismatch("attn_cp_size", "--attn-cp-size",
                                  f"attention CP (a decode with --dcp-size {decode.dcp_size} "
                                  "needs a prefill with attention CP 1)", prefill_box,
                                  prefill.attn_cp_size, decode_box,
                                  f"--dcp-size {decode.dcp_size}"))
        if prefill.kv_cache_sharding:
            found.append(Mismatch("kv_cache_sharding", "--enable-kv-cache-sharding",
                                  "KV cache sharding (refused by a decode with DCP)",
                                  prefill_box, "--enable-kv-cache-sharding", decode_box,
                                  f"--dcp-size {decode.dcp_size}"))
    return tuple(found)


@dataclass(frozen=True)
class Box:
    """One engine of the cell as the head knows it: a name for messages ("this box (the
    head)", "member 2 (10.0.0.6)"), the role it launches as, its layout (None: not known)."""

    name: str
    role: str
    layout: Layout | None


def cell_mismatches(boxes: Sequence[Box]) -> tuple[Mismatch, ...]:
    """Every prefill against every decode of the cell; boxes of unknown layout are skipped
    (a member not yet read), unified ones take no part."""
    known = [(b, b.layout) for b in boxes if b.layout is not None]
    return tuple(m for p, p_layout in known if p.role == "prefill"
                 for d, d_layout in known if d.role == "decode"
                 for m in compare(p_layout, d_layout, p.name, d.name))


def involving(mismatches: Sequence[Mismatch], name: str) -> tuple[Mismatch, ...]:
    return tuple(m for m in mismatches if name in (m.prefill_box, m.decode_box))


def summary(mismatches: Sequence[Mismatch]) -> str:
    return "; ".join(m.message for m in mismatches)
