"""Jinja filters the console's templates use (formatting only, no logic)."""

from __future__ import annotations

import datetime as dt

from litestar.plugins.jinja import JinjaTemplateEngine

from appliance import __version__


def when(value: dt.datetime | None) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "—"


def size(value: int | float) -> str:
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def duration(seconds: int | float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def configure_templates(engine: JinjaTemplateEngine) -> None:
    env = engine.engine
    env.filters.update(when=when, size=size, duration=duration)
    env.globals["version"] = __version__
    env.autoescape = True
