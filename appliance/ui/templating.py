"""Jinja filters the console's templates use (formatting only, no logic).

Every filter delegates to appliance/sizes.py, the one formatting module the CLI and event
messages use too, so a page never says a size differently from the terminal:

- `size`: bytes in SI decimal units (96.21 MB, 1.56 TB): disks, downloads, RAM.
- `gib`: bytes in GiB, for GPU memory only (nvidia-smi's and SGLang's unit).
- `rate`: bytes per second (MB/s, GB/s).
- `when`: a UTC time to the second, labelled; `duration`: a span in words.
- `plural`: `n | plural("check")` gives "1 check" / "2 checks".
- `tokens`: a token count in binary K and M (9.7M, 128K), the Tuning page's form too.
- `action_words`, `detail_words`, `job_words`: an audit action, an audit detail and a
  scheduled job in the operator's words (appliance/ui/words.py); `detail_raw` the detail as
  recorded, kept one click away for support.
- `ticks`: a hint's `command` spans (backticks, as the CLI prints them) as <code>, so a page
  never shows a literal backtick.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable

from jinja2 import pass_context
from jinja2.runtime import Context
from litestar.plugins.jinja import JinjaTemplateEngine
from markupsafe import Markup, escape

from appliance import __version__
from appliance.auth.roles import Role
from appliance.sizes import (
    bytes_text,
    duration_text,
    gib_text,
    plural,
    rate_text,
    tokens_text,
    when_text,
)
from appliance.ui.words import action_text, detail_raw, detail_text, job_text


def when(value: dt.datetime | None) -> str:
    return when_text(value)


def size(value: int | float) -> str:
    return bytes_text(value)


def gib(value: int | float) -> str:
    return gib_text(value)


def rate(bytes_per_second: float | None) -> str:
    return rate_text(bytes_per_second)


def duration(seconds: int | float | None) -> str:
    return duration_text(seconds)


def filters() -> dict[str, Callable[..., str]]:
    """Every filter by name: for the console's engine and for a test's bare Environment."""
    return {"when": when, "size": size, "gib": gib, "rate": rate, "duration": duration,
            "plural": plural, "ticks": ticks, "tokens": tokens_text, "action_words": action_text,
            "detail_words": detail_text, "detail_raw": detail_raw, "job_words": job_text}


_TICKED = re.compile(r"`([^`]+)`")


def ticks(text: object) -> Markup:
    """Escape `text`, then show each `span` in backticks as <code>span</code>."""
    escaped = str(escape("" if text is None else text))
    coded = _TICKED.sub(r"<code>\1</code>", escaped).replace("`", "")
    return Markup(coded)  # noqa: S704 - built from escaped text


@pass_context
def can(context: Context, needed: str) -> bool:
    """`{% if can("operator") %}`: whether the signed-in account's role reaches `needed`. The
    console hides what a role cannot do; the app's role guard refuses it all the same."""
    request = context.get("request")
    user = request.scope.get("user") if request is not None else None
    role = getattr(user, "role", None)
    return role is not None and Role(role).allows(needed)


def configure_templates(engine: JinjaTemplateEngine) -> None:
    env = engine.engine
    env.filters.update(filters())
    env.globals["version"] = __version__
    env.globals["can"] = can
    env.autoescape = True
