"""SGLang 0.5.23's log format, written by the engine emulator (a test and demo instrument).

`[%(asctime)s{prefix}] %(message)s` with `%Y-%m-%d %H:%M:%S` (srt/utils/common.py), prefix
` TP{n}` for a scheduler rank when tp_size > 1; real wall-clock time. Everything goes to
stderr, flushed at once, like SGLang's logging handler. tqdm bars are drawn the way the
reference sample shows them: states separated by `\\r` on one line, a newline when the bar
closes.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_DESC = "Multi-thread loading shards"


def stamp(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() if now is None else now))


def format_interval(seconds: float) -> str:
    """tqdm's format_interval: MM:SS, or H:MM:SS from an hour."""
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def bar_state(done: int, total: int, elapsed: float, desc: str = BAR_DESC) -> str:
    """One tqdm state: `{desc}: {percentage:3.0f}% Completed | {n}/{total} [{elapsed}<{remaining},
    {rate_fmt}]` (srt/utils/common.py BAR_FORMAT)."""
    percent = 100.0 * done / total if total else 100.0
    if done <= 0 or elapsed <= 0:
        timing = f"{format_interval(elapsed)}<?, ?it/s"
    else:
        per_item = elapsed / done
        remaining = per_item * (total - done)
        rate = f"{per_item:5.2f}s/it" if per_item >= 1 else f"{1 / per_item:5.2f}it/s"
        timing = f"{format_interval(elapsed)}<{format_interval(remaining)}, {rate}"
    return f"{desc}: {percent:3.0f}% Completed | {done}/{total} [{timing}]"


class LogWriter:
    """Writes SGLang-format lines and tqdm bars to one stream (stderr by default)."""

    def __init__(self, stream: TextIO | None = None, tp_size: int = 1) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._bar_open = False
        # scheduler.py: the ` TP{n}` part is added only when tp_size > 1, so a TP1 engine's
        # scheduler records look like the main process's (seen on the real CPU engine)
        self._ranked = tp_size > 1

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # nobody is reading any more; the emulator's behaviour must not change

    def line(self, message: str, rank: int | None = None) -> None:
        if self._bar_open:
            self._write("\n")
            self._bar_open = False
        prefix = "" if rank is None or not self._ranked else f" TP{rank}"
        self._write(f"[{stamp()}{prefix}] {message}\n")

    def ranks(self, message: str, tp_size: int) -> None:
        for rank in range(tp_size):
            self.line(message, rank)

    def raw(self, text: str) -> None:
        """Unprefixed text (a traceback, as Python prints an uncaught exception)."""
        self.line_break()
        self._write(text if text.endswith("\n") else text + "\n")

    def bar(self, state: str) -> None:
        """A tqdm refresh: the first state opens the line, the next ones follow a `\\r`."""
        self._write(("\r" if self._bar_open else "") + state)
        self._bar_open = True

    def line_break(self) -> None:
        """Closes an open bar (tqdm's close writes the newline)."""
        if self._bar_open:
            self._write("\n")
            self._bar_open = False
