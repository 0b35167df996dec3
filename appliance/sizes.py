"""The one formatting module for quantities an operator reads: sizes, rates, times, counts.

The console's filters (appliance/ui/templating.py), the CLI and event messages all format
through these functions, so the same files never read "96.2 MiB" on one screen, "0.10 GB" on
another and "100.92 MB" on a third. The unit system, decided once:

- Byte quantities (disks, downloads, weights on disk, RAM, the daemon's memory) are SI
  decimal: B, kB, MB, GB, TB, as disk vendors and the Hugging Face Hub show them
  (`bytes_text`). Rates likewise: MB/s, GB/s (`rate_text`).
- GPU memory, and SGLang's memory-pool figures, are binary GiB (2**30 bytes), because
  nvidia-smi and SGLang speak them (`gib_text`). SGLang's own log prints "GB" for GiB; a page
  that shows its figures says so once.
- Times are UTC to the second, labelled: 2026-05-01 12:00:00 UTC (`when_text`). Durations are
  words: "2 hours 5 minutes" (`duration_text`).
- Counts take their plural: "1 check", "2 checks" (`plural`).
- Token counts (KV capacity, context lengths, request lengths) are binary K and M, as context
  lengths are quoted: 128K, 9.7M, 16M (`tokens_text`); a page that shows one keeps the exact
  count in a `title` for support. Speeds are "tokens/s", never "tok/s".

Every function is pure and total: a None or non-positive input gives a dash where a reading
is missing, never an exception.
"""

from __future__ import annotations

import datetime as dt

GIB = 1 << 30
TOKENS_K = 1 << 10
TOKENS_M = 1 << 20
DASH = "—"
_SI_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def bytes_text(n: int | float) -> str:
    """`n` bytes in SI decimal units with two decimals: 512 B, 96.21 MB, 1.56 TB.

    1 kB is 1,000 bytes. Bytes are whole (no decimals); a negative count keeps its sign."""
    amount = float(n)
    for unit in _SI_UNITS:
        if abs(amount) < 1000 or unit == _SI_UNITS[-1]:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.2f} {unit}"
        amount /= 1000
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns at the last unit


def gib_text(n: int | float) -> str:
    """`n` bytes as GiB (2**30) with one decimal and thousands separators: 1,700.0 GiB.

    For GPU memory only, as nvidia-smi and SGLang report it."""
    return f"{n / GIB:,.1f} GiB"


def rate_text(bytes_per_second: float | None) -> str:
    """A transfer or hashing rate in SI units: 2.50 GB/s, 12.3 MB/s, 0.25 MB/s; a dash when
    nothing moves (None, zero or negative)."""
    if bytes_per_second is None or bytes_per_second <= 0:
        return DASH
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    megabytes = bytes_per_second / 1e6
    if megabytes < 0.01:
        return "< 0.01 MB/s"
    return f"{megabytes:.1f} MB/s" if megabytes >= 1 else f"{megabytes:.2f} MB/s"


def when_text(value: dt.datetime | None) -> str:
    """A moment as `YYYY-MM-DD HH:MM:SS UTC` (no microseconds); a dash when unknown.

    A naive datetime is taken as UTC (the database stores UTC without a zone)."""
    if value is None:
        return DASH
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n` and the word in the right number, with thousands separators: "1 check",
    "2 checks", "1,024 tokens". `many` is the plural when it is not `word` + "s"."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def percent_text(part: int, whole: int) -> str:
    """`part` of `whole` as a percentage with one decimal ("96.2 %"); a dash for no whole."""
    return "—" if whole <= 0 else f"{100 * part / whole:.1f} %"


def duration_text(seconds: int | float | None) -> str:
    """A span in words, its two largest units: "45 seconds", "5 minutes 3 seconds",
    "2 hours 5 minutes", "3 days 4 hours". A dash when unknown; under a second is
    "0 seconds"."""
    if seconds is None:
        return DASH
    total = max(0, int(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "day"), (hours, "hour"), (minutes, "minute"), (secs, "second")]
    for index, (amount, unit) in enumerate(parts):
        if amount or unit == "second":
            text = plural(amount, unit)
            following, next_unit = parts[index + 1] if index + 1 < len(parts) else (0, "")
            return f"{text} {plural(following, next_unit)}" if following else text
    raise AssertionError("unreachable")  # pragma: no cover - "second" always returns


def tokens_text(tokens: int | float) -> str:
    """A token count in binary K and M: 131072 -> 128K, 10190336 -> 9.7M, 17114112 -> 16M,
    900 -> 900 (one decimal below 10, none above; a whole .0 is dropped)."""
    value = float(tokens)
    for unit, scale in (("M", TOKENS_M), ("K", TOKENS_K)):
        if value >= scale:
            scaled = value / scale
            text = f"{scaled:.1f}" if scaled < 10 else f"{scaled:.0f}"
            return f"{text.removesuffix('.0')}{unit}"
    return f"{value:.0f}"
