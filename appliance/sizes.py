"""Byte sizes as the kernel and NVML report them: binary gibibytes (GiB).

One spelling for every page, check and preflight line, so the same disk or GPU never reads
"1700.0 GiB" in one place and "1,700.0 GiB" in another. Decimal units (GB, GB/s) are for the
weights and the network, where the Hub and network gear use them (appliance/ui/weights.py).
"""

from __future__ import annotations

GIB = 1 << 30


def gib_text(n: int | float) -> str:
    """`n` bytes as GiB with one decimal and thousands separators: 1,700.0 GiB."""
    return f"{n / GIB:,.1f} GiB"
