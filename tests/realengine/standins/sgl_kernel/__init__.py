"""Test instrument: a pure-torch stand-in for the few ``sgl_kernel`` CPU helpers SGLang imports.

No CPU build of ``sgl_kernel`` exists on PyPI, and SGLang 0.5.23 in CPU mode
(``SGLANG_USE_CPU_ENGINE=1``) imports these names at module load. This package
gives the real-engine test tier exactly those names and nothing more:

- ``assign_req_to_token_pool_cpu`` and ``copy_all_layer_kv_cache_cpu`` do the
  real index operations a dense model's scheduler needs (the Triton kernels
  they replace are in ``srt/mem_cache/allocation.py`` and
  ``kernels/ops/kvcache/cache_move.py``);
- the speculative-decoding helpers the scheduler imports, and the hybrid
  linear-attention models' import-time names
  (``sgl_kernel.mamba.*`` and ``torch.ops.sgl_kernel.*``) exist only so the
  modules import; each raises if it is ever called.

It is never installed into the product or its venv: ``tests/realengine/build-env.sh``
puts it on the engine environment's path only. It deliberately does not define
``torch.ops.sgl_kernel.convert_weight_packed``, so SGLang never believes the
Intel AMX kernels are present.
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import torch

from sgl_kernel import _ops

_ops.register_import_only_ops()

# Speculative-decoding helpers that `scheduler` imports (through eagle_utils,
# spec_tree, cache_locs) on CPU whether or not speculation is on; the tier
# never enables it.
IMPORT_ONLY_FUNCTIONS = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)


def _import_only(name: str) -> Any:
    def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is an import-only stand-in (tests/realengine/standins): "
            "the real-engine tier never enables speculative decoding"
        )

    unavailable.__name__ = name
    return unavailable


for _name in IMPORT_ONLY_FUNCTIONS:
    globals()[_name] = _import_only(_name)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new token slots into its row of the req-to-token table.

    Request i's slots ``out_cache_loc[sum(len_0..len_{i-1}) : +len_i]`` land in
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``, as the
    Triton kernel ``assign_req_to_token_pool`` does (one program per request).
    """
    del pool_len  # the row length; torch indexing knows it from the tensor
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + length].to(req_to_token.dtype)
        taken += length


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc`` onto ``tgt_loc`` in every layer's buffer.

    SGLang hands raw buffer addresses (``data_ptrs``) and each buffer's row
    size in bytes (``strides``), as the tiled Triton kernel takes them; a row is
    moved with ``memmove`` so overlapping source and target rows are safe.
    """
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for target, source in zip(tgt_loc.tolist(), src_loc.tolist(), strict=True):
            if target != source:
                ctypes.memmove(address + target * stride, address + source * stride, stride)
