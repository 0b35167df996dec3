"""Import-only ``torch.ops.sgl_kernel.*`` names (test instrument; see the package docstring).

SGLang's hybrid linear-attention modules read these ops at import time
(``gdn_backend.py``, ``gdn_triton.py``, ``qwen3_5.py``). Registering them makes the
imports succeed; calling one raises, naming the op, because no CPU kernel
stands behind it: a test that reaches one has asked the CPU engine for work
only the real ``sgl_kernel`` build (or a GPU) can do.
"""

from __future__ import annotations

from typing import NoReturn

import torch

IMPORT_ONLY_OPS = (
    "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_rmsnorm_gated_cpu",
)

_library: torch.library.Library | None = None


def _unavailable(name: str) -> NoReturn:
    raise NotImplementedError(
        f"torch.ops.sgl_kernel.{name} is an import-only stand-in (tests/realengine/standins): "
        "the CPU engine cannot run this kernel; keep this model in no-generation mode"
    )


def register_import_only_ops() -> None:
    """Define each import-only op once per process; a second call is a no-op."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("sgl_kernel", "DEF")
    for name in IMPORT_ONLY_OPS:
        library.define(f"{name}(Tensor[] args) -> Tensor")

        def kernel(args: list[torch.Tensor], _name: str = name) -> torch.Tensor:
            _unavailable(_name)

        library.impl(name, kernel, "CompositeExplicitAutograd")
    _library = library
