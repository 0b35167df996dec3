"""Import-only ``sgl_kernel.mamba`` names (test instrument; see the package docstring).

KDA and GDN modules import these at load; the KDA prefill itself is Triton-only
in 0.5.23, so the hybrid cannot generate on CPU whatever stands here.
"""

from __future__ import annotations

from typing import Any, NoReturn


def _unavailable(name: str) -> NoReturn:
    raise NotImplementedError(
        f"sgl_kernel.mamba.{name} is an import-only stand-in (tests/realengine/standins): "
        "the CPU engine cannot run this kernel; keep this model in no-generation mode"
    )


def causal_conv1d_fn_cpu(*args: Any, **kwargs: Any) -> NoReturn:
    _unavailable("causal_conv1d_fn_cpu")


def causal_conv1d_update_cpu(*args: Any, **kwargs: Any) -> NoReturn:
    _unavailable("causal_conv1d_update_cpu")


def chunk_gated_delta_rule_cpu(*args: Any, **kwargs: Any) -> NoReturn:
    _unavailable("chunk_gated_delta_rule_cpu")
