"""Shared by the benchmarks that profile the event loop: where a profiled function belongs.

Run as scripts (`python benchmarks/<name>.py`), the benchmarks find this module beside them.
"""

from __future__ import annotations

from pathlib import Path


def profile_group(filename: str, function: str, *, idle_label: str | None = None) -> str:
    """A package, asyncio, an appliance module, or the built-in it is. The loop's wait
    (`poll`, uvloop's `run_once`) is named `idle_label` when given, else "loop: <name>"."""
    if filename == "~":
        name = function.strip("{}<>")
        if "poll" in function or (idle_label is None and "run_once" in function):
            return idle_label or "loop: " + name.split(" of ")[0]
        return "built-in " + name.replace("method ", "").split(" of ")[0]
    path = Path(filename)
    if "site-packages" in path.parts:
        return path.parts[path.parts.index("site-packages") + 1]
    if "appliance" in path.parts:
        return ".".join(path.parts[path.parts.index("appliance"):]).removesuffix(".py")
    return path.parent.name if path.parent.name == "asyncio" else path.name
