"""Reading the engine log for people: the last lines, or new lines as they come.

SGLang's default format carries no level, so one is inferred from the words (an error,
a warning, or info); the rank comes from the `[time TPn]` prefix. tqdm's `\\r` updates are
split like lines, so a progress bar shows as its latest state.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

RANK = re.compile(r"^\[[^\]]*?\bTP(\d+)\b[^\]]*\]")
ERROR_WORDS = re.compile(r"error|exception|traceback|failed|died|out of memory|killed|fatal", re.I)
WARNING_WORDS = re.compile(r"warn|capped|is reset to|deprecated|retry|timeout", re.I)
LEVELS = ("info", "warning", "error")


def line_level(line: str) -> str:
    if ERROR_WORDS.search(line):
        return "error"
    return "warning" if WARNING_WORDS.search(line) else "info"


def line_rank(line: str) -> int | None:
    match = RANK.match(line)
    return int(match.group(1)) if match else None


def keep(line: str, rank: int | None, level: str) -> bool:
    """The filter: a rank keeps that rank's lines and unranked (main process) lines; a level
    keeps lines at least that severe."""
    if rank is not None and line_rank(line) not in (rank, None):
        return False
    if level in LEVELS and LEVELS.index(line_level(line)) < LEVELS.index(level):
        return False
    return bool(line.strip())


def _split(text: str) -> list[str]:
    return [part for part in re.split(r"\r\n|\r|\n", text) if part]


def _tail_sync(path: Path, count: int, rank: int | None, level: str) -> list[str]:
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            chunk = min(size, max(65536, count * 400))
            while True:
                handle.seek(size - chunk)
                text = handle.read(chunk).decode("utf-8", errors="replace")
                lines = [line for line in _split(text) if keep(line, rank, level)]
                if len(lines) > count or chunk == size:
                    break
                chunk = min(size, chunk * 4)
    except OSError:
        return []
    if chunk < size and lines:
        lines = lines[1:]  # the first piece may be a partial line
    return lines[-count:]


async def tail(path: Path, count: int, *, rank: int | None = None, level: str = "") -> list[str]:
    return await asyncio.to_thread(_tail_sync, path, count, rank, level)


async def follow(
    path: Path, *, rank: int | None = None, level: str = "", interval: float = 0.5
) -> AsyncIterator[str]:
    """New log lines from now on, forever (the caller stops iterating to end it)."""
    offset = path.stat().st_size if path.exists() else 0
    carry = ""
    while True:
        try:
            with path.open("rb") as handle:
                size = handle.seek(0, 2)
                if size < offset:
                    offset, carry = 0, ""  # truncated or rotated
                handle.seek(offset)
                data = handle.read(1 << 20)
        except OSError:
            data = b""
        offset += len(data)
        text = carry + data.decode("utf-8", errors="replace")
        pieces = re.split(r"\r\n|\r|\n", text)
        carry = pieces.pop()
        for line in pieces:
            if keep(line, rank, level):
                yield line
        await asyncio.sleep(interval)
