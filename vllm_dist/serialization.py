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

import io
import sys
import types
from collections import ChainMap
from types import ModuleType
from typing import Any

import cloudpickle

HF_DYNAMIC_PACKAGE = "transformers_modules"

_by_value: set[str] = set()  # module names registered through register_by_value


def register_by_value(module: ModuleType | str) -> None:
    """Pickle classes and functions of ``module`` (and its submodules) by value from now on.

    Args:
        module: an imported module or the name of one; a package counts as imported when any
            of its submodules is (``transformers`` may load only the leaf of a dynamic package).

    Raises:
        ValueError: neither the module nor any submodule of it is imported.
    """
    name = module if isinstance(module, str) else module.__name__
    if not _loaded_under((name,)):
        raise ValueError(f"module {name!r} is not imported; import it before registering it")
    _by_value.add(name)
    prepare()


def _loaded_under(roots: tuple[str, ...]) -> list[ModuleType]:
    """Every module in ``sys.modules`` named ``root`` or ``root.<anything>`` for some root."""
    prefixes = tuple(f"{r}." for r in roots)
    return [
        module
        for name, module in list(sys.modules.items())  # a copy: imports may run meanwhile
        if isinstance(module, ModuleType) and (name in roots or name.startswith(prefixes))
    ]


def _picklers() -> list[Any]:
    picklers: list[Any] = [cloudpickle]
    ray_pickle = sys.modules.get("ray.cloudpickle")  # only when Ray is already in use
    if ray_pickle is not None and hasattr(ray_pickle, "register_pickle_by_value"):
        picklers.append(ray_pickle)
    return picklers


def prepare() -> None:
    """Register every module that must travel by value; called before each dump.

    Each loaded module under ``transformers_modules`` or a ``register_by_value`` name is
    registered itself, not only its package: cloudpickle registers only modules present in
    ``sys.modules``, and with transformers 5 the dynamic package itself may never be imported
    (only ``transformers_modules.<repo>.<hash>.configuration_x`` is). Idempotent.
    """
    modules = _loaded_under((HF_DYNAMIC_PACKAGE, *sorted(_by_value)))
    if not modules:
        return
    for pickler in _picklers():
        for module in modules:
            try:
                pickler.register_pickle_by_value(module)  # a set of module names
            except ValueError:  # sys.modules holds it under another name than __name__
                continue


def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with the real ``co_filename`` kept.

    cloudpickle writes ``<dynamic-code>`` there (for payloads that do not depend on where a
    function was defined); a worker's traceback then cannot name the user's file and line.
    """
    make, args = cloudpickle.cloudpickle._code_reduce(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    return make, args


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler, except that functions pickled by value keep their file name."""

    dispatch_table = ChainMap(
        {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
    )


def dumps(obj: Any) -> bytes:
    """cloudpickle ``obj``, with dynamic modules pickled by value and real file names kept."""
    prepare()
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    except AttributeError:  # a cloudpickle without _code_reduce: its own, as it is
        return cloudpickle.dumps(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """The inverse of ``dumps``."""
    return cloudpickle.loads(data)
