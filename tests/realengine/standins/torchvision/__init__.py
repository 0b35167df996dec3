"""Test instrument: an import-only ``torchvision`` for the CPU engine environment.

PyPI's torchvision does not load beside the CPU build of torch
("operator torchvision::nms does not exist"), yet SGLang 0.5.23 imports
``torchvision.transforms`` unconditionally (configs -> nano_nemotron_vl ->
internvl_utils) and many vision modules import more. Every ``torchvision.*``
module imports here; every name in one is a placeholder that can be read,
chained (``InterpolationMode.BICUBIC``) and subclassed, and raises when called.
The tier's models are text-only, so nothing calls them.

No distribution metadata is installed with it, so ``transformers`` still
reports torchvision as absent and never chooses a torchvision code path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+appliance.standin"


def _unavailable(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is part of an import-only torchvision stand-in (tests/realengine/standins): "
        "the real-engine tier serves text models only"
    )


class _Placeholder:
    """A name read from a stand-in module: attribute access chains, a call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unavailable(self._name)

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        # `class X(torchvision.transforms.Compose)` must still define a class.
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for every ``torchvision.<sub>`` module with a stand-in package."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    try:
        return importlib.import_module(f"{__name__}.{attr}")
    except ImportError:
        return _Placeholder(f"{__name__}.{attr}")
