"""Test instrument: reports the two memory readings real SGLang sizes its pools from.

Put this folder on the ENGINE's PYTHONPATH (never the product's) with
``APPLIANCE_TEST_BUDGET_PROBE=1`` and every SGLang process of that engine (the scheduler runs
in a spawned child, which inherits the environment, so it loads this file too) wraps two
functions of ``sglang.srt`` once they are imported, changing nothing they do:

- ``bootstrap.measure_pre_model_load_memory``: the free-memory figure taken at "Memory
  baseline taken", which the log never prints (its "Load weight begin. avail mem" is a later,
  different reading);
- ``KVCacheConfigurator._profile_available_bytes``: the free memory it measures after loading
  (the log's "Load weight end. avail mem" is again an earlier reading) and the budget it
  hands on, at full precision.

Each is logged on stderr as one line ``appliance-test-probe: NAME=VALUE`` (GiB floats, repr),
so tests/test_real_engine_tuning.py can size the calculator from exactly what SGLang used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_TARGETS = {
    "sglang.srt.distributed.bootstrap",
    "sglang.srt.mem_cache.kv_cache_configurator",
}


def _say(name: str, value: Any) -> None:
    print(f"appliance-test-probe: {name}={value!r}", file=sys.stderr, flush=True)


def _wrap(module: ModuleType) -> None:
    if module.__name__ == "sglang.srt.distributed.bootstrap":
        measure = module.measure_pre_model_load_memory

        def measure_pre_model_load_memory(*args: Any, **kwargs: Any) -> Any:
            value = measure(*args, **kwargs)
            _say("pre_model_load_gib", value)
            return value

        # model_runner calls it as bootstrap.measure_pre_model_load_memory: the attribute
        module.measure_pre_model_load_memory = measure_pre_model_load_memory
        return
    available = module.get_available_gpu_memory

    def get_available_gpu_memory(*args: Any, **kwargs: Any) -> Any:
        value = available(*args, **kwargs)
        _say("available_gib", value)
        return value

    module.get_available_gpu_memory = get_available_gpu_memory
    configurator = module.KVCacheConfigurator
    profile = configurator._profile_available_bytes

    def _profile_available_bytes(self: Any, pre_model_load_memory: Any) -> Any:
        _say("profile_pre_model_load_gib", pre_model_load_memory)
        value = profile(self, pre_model_load_memory)
        _say("rest_after_state_gib", value)
        return value

    configurator._profile_available_bytes = _profile_available_bytes


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _wrap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


if os.environ.get("APPLIANCE_TEST_BUDGET_PROBE") == "1":
    sys.meta_path.insert(0, _Finder())
