"""The engine emulator's pretend radix (prefix) cache. A test and demo instrument
(`appliance.testing.fake_sglang`); no KV cache exists here.

SGLang's radix cache lets a prompt reuse the KV of the longest prefix it shares with what was
computed before; the scheduler reports that length as the request's `cached_tokens` (always in
`/generate`'s meta_info; in OpenAI usage as `prompt_tokens_details.cached_tokens`, and in
Anthropic usage as `cache_read_input_tokens`, only with `--enable-cache-report`). Here a prompt
is a tuple of the emulator's tokens (`core.Prompt.ids`: words plus template markers, the same
tokens `prompt_tokens` counts) and the cache is the last `RECENT` admitted prompts. A prompt's
cached count is its longest common prefix with any of them, capped at `prompt_tokens - 1`
(SGLang always computes at least the last prompt token). Deterministic: the same sequence of
prompts always gets the same counts. `POST /flush_cache` empties it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

RECENT = 256


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The last `size` admitted prompts, newest last."""

    def __init__(self, size: int = RECENT) -> None:
        self._recent: deque[tuple[str, ...]] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._recent)

    def match(self, ids: Sequence[str]) -> int:
        """The longest prefix of `ids` any cached prompt shares, uncapped."""
        return max((common_prefix(ids, seen) for seen in self._recent), default=0)

    def admit(self, ids: Sequence[str]) -> int:
        """A prompt reaches prefill: its cached token count (at most `len(ids) - 1`); the
        prompt is then cached for the ones after it."""
        cached = min(self.match(ids), max(0, len(ids) - 1))
        self._recent.append(tuple(ids))
        return cached

    def flush(self) -> None:
        self._recent.clear()
