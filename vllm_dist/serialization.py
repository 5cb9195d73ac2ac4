"""Pickling of task types, launch keywords and results for the trip to the workers.

cloudpickle pickles a class *by reference* when its module is importable in the parent; that
breaks on a worker that lacks the module: Hugging Face ``transformers_modules`` (written by
``trust_remote_code`` on the head node only), modules built at run time, test modules. Those are
registered *by value* here, automatically for ``transformers_modules`` and through
``register_by_value`` for anything else, with both ``cloudpickle`` and Ray's bundled
``ray.cloudpickle`` (Ray pickles actor arguments with its own copy). Rejected alternative: copying
the module files to every node, which needs a shared file system and a matching sys.path.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import cloudpickle

HF_DYNAMIC_PACKAGE = "transformers_modules"

_by_value: set[str] = set()  # module names registered through register_by_value


def register_by_value(module: ModuleType | str) -> None:
    """Pickle classes and functions of ``module`` (and its submodules) by value from now on.

    Args:
        module: an imported module or the name of one.

    Raises:
        ValueError: the module is not imported.
    """
    name = module if isinstance(module, str) else module.__name__
    if name not in sys.modules:
        raise ValueError(f"module {name!r} is not imported; import it before registering it")
    _by_value.add(name)
    _apply(name)


def _apply(name: str) -> None:
    module = sys.modules.get(name)
    if module is None:
        return
    for pickler in _picklers():
        pickler.register_pickle_by_value(module)  # idempotent: a set of module names


def _picklers() -> list[Any]:
    picklers: list[Any] = [cloudpickle]
    ray_pickle = sys.modules.get("ray.cloudpickle")  # only when Ray is already in use
    if ray_pickle is not None and hasattr(ray_pickle, "register_pickle_by_value"):
        picklers.append(ray_pickle)
    return picklers


def prepare() -> None:
    """Register every module that must travel by value; called before each dump."""
    if HF_DYNAMIC_PACKAGE in sys.modules:
        _apply(HF_DYNAMIC_PACKAGE)
    for name in sorted(_by_value):
        _apply(name)


def dumps(obj: Any) -> bytes:
    """cloudpickle ``obj``, with dynamic modules pickled by value."""
    prepare()
    return cloudpickle.dumps(obj)


def loads(data: bytes) -> Any:
    """The inverse of ``dumps``."""
    return cloudpickle.loads(data)
