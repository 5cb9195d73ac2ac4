"""By-value pickling of classes whose module a worker does not have, under every launcher.

The real case: ``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` on the head node writes
the model's ``configuration_*.py`` into ``HF_MODULES_CACHE/transformers_modules`` and imports it
from there; a worker on another node has no such module. Workers here get an empty
``HF_MODULES_CACHE`` to be that node.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from tests.utils import distributed_test
from vllm_dist import DistributedTask, LaunchError
from vllm_dist.serialization import (
    HF_DYNAMIC_PACKAGE,
    dumps,
    loads,
    prepare,
    register_by_value,
)

NO_MODULE = f"No module named '{HF_DYNAMIC_PACKAGE}'"

_CONFIGURATION_FOO = """
from transformers import PretrainedConfig


class FooConfig(PretrainedConfig):
    model_type = "foo"
    attribute_map = {"hidden_size": "hidden"}

    def __init__(self, hidden=4, **kwargs):
        self.hidden = hidden
        super().__init__(**kwargs)

    def doubled(self):
        return 2 * self.hidden
"""


@pytest.fixture
def remote_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A ``trust_remote_code`` config loaded offline, whose module exists in this process only.

    Yields ``.config`` and ``.plain[pickler]``: the config pickled without our registration.
    """
    transformers = pytest.importorskip("transformers")
    import transformers.dynamic_module_utils as dynamic

    model_dir = tmp_path / "foo_model"
    model_dir.mkdir()
    (model_dir / "configuration_foo.py").write_text(_CONFIGURATION_FOO)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "foo",
                "hidden": 7,
                "auto_map": {"AutoConfig": "configuration_foo.FooConfig"},
            }
        )
    )
    modules_cache = tmp_path / "hf_modules"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(modules_cache))
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(modules_cache))  # read at import time
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)
    assert type(config).__module__.startswith(f"{HF_DYNAMIC_PACKAGE}.")
    # plain pickle imports the class's module by name: only while the cache is on sys.path
    plain = {"pickle": pickle.dumps(config), "cloudpickle": _plain_cloudpickle(config)}
    # spawned workers inherit sys.path: drop the cache so they are a node that never loaded it
    sys.path[:] = [p for p in sys.path if Path(p) != modules_cache]
    yield types.SimpleNamespace(config=config, plain=plain)
    for name in set(sys.modules) - before:
        if name.split(".")[0] == HF_DYNAMIC_PACKAGE:
            del sys.modules[name]


@pytest.fixture
def empty_modules_cache(tmp_path: Path) -> dict[str, str]:
    """The environment of a worker on a node where ``from_pretrained`` never ran."""
    empty = tmp_path / "empty_hf_modules"
    empty.mkdir()
    return {"HF_MODULES_CACHE": str(empty), "HF_HUB_OFFLINE": "1"}


def _plain_cloudpickle(obj: Any) -> bytes:
    """cloudpickle as it behaves without our registration (by reference for importable modules)."""
    ours = [
        name
        for name in cloudpickle.list_registry_pickle_by_value()
        if name.split(".")[0] == HF_DYNAMIC_PACKAGE
    ]
    for name in ours:  # unregistering reads only the name
        cloudpickle.unregister_pickle_by_value(types.ModuleType(name))
    try:
        return cloudpickle.dumps(obj)
    finally:
        prepare()


class UseConfigTask(DistributedTask):
    """Unpickles what it was given and uses the config's class attribute and method."""

    def run(self, *, config: Any = None, plain: bytes | None = None) -> dict[str, Any]:
        if plain is not None:
            config = pickle.loads(plain)
        cls = type(config)
        return {
            "importable": importlib.util.find_spec(HF_DYNAMIC_PACKAGE) is not None,
            "cache": os.environ.get("HF_MODULES_CACHE"),
            "module": cls.__module__,
            "attribute_map": dict(cls.attribute_map),
            "hidden_size": config.hidden_size,  # resolved through attribute_map
            "doubled": config.doubled(),
        }


@pytest.mark.parametrize("pickler", ["pickle", "cloudpickle"])
def test_plain_pickling_fails_where_the_module_is_missing(
    remote_code: Any, empty_modules_cache: dict[str, str], pickler: str
) -> None:
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=remote_code.plain[pickler],
        env={**os.environ, **empty_modules_cache},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert NO_MODULE in proc.stderr.decode()
    # ... while ours carries the class with the object
    assert loads(dumps(remote_code.config)).doubled() == 14


@distributed_test(timeout=180)
def test_trust_remote_code_config_reaches_workers(
    make_launcher: Any, remote_code: Any, empty_modules_cache: dict[str, str]
) -> None:
    launcher = make_launcher(2, env=empty_modules_cache)
    with pytest.raises(LaunchError) as err:
        launcher.launch(task_type=UseConfigTask, plain=remote_code.plain["pickle"])
    assert err.value.ranks and NO_MODULE in str(err.value)  # the first rank(s) to fail

    config = remote_code.config
    for r in launcher.launch(task_type=UseConfigTask, config=config):
        assert r["importable"] is False, "the worker must not have transformers_modules"
        assert r["cache"] == empty_modules_cache["HF_MODULES_CACHE"]
        assert r["module"] == type(config).__module__
        assert r["attribute_map"] == {"hidden_size": "hidden"}
        assert (r["hidden_size"], r["doubled"]) == (7, 14)


_RUNTIME_SOURCE = textwrap.dedent(
    """
    from vllm_dist import DistributedTask

    SCALE = 3

    class Thing:
        def __init__(self, value):
            self.value = value

        def scaled(self):
            return self.value * SCALE

    class RuntimeTask(DistributedTask):
        def run(self, *, thing):
            import importlib.util
            return (
                thing.scaled() + self.worker_info.rank,
                type(thing).__module__,
                importlib.util.find_spec(__name__) is not None,
            )
    """
)


@pytest.fixture
def runtime_module() -> Iterator[types.ModuleType]:
    """A module that exists only in this process's memory (types.ModuleType + exec)."""
    name = "vllm_dist_test_runtime_module"
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(_RUNTIME_SOURCE, f"<{name}>", "exec"), module.__dict__)
    yield module
    del sys.modules[name]
    cloudpickle.unregister_pickle_by_value(module)


@distributed_test(timeout=120)
def test_register_by_value_for_a_module_made_at_run_time(
    make_launcher: Any, runtime_module: types.ModuleType
) -> None:
    register_by_value(runtime_module)
    results = make_launcher(2).launch(
        task_type=runtime_module.RuntimeTask, thing=runtime_module.Thing(5)
    )
    assert results == [(15, runtime_module.__name__, False), (16, runtime_module.__name__, False)]


def test_register_by_value_refuses_a_module_that_is_not_imported() -> None:
    with pytest.raises(ValueError, match="not imported"):
        register_by_value("no_such_module_anywhere")
