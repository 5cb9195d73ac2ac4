"""Shared fixtures: launchers to parametrise over, and by-value pickling of test modules.

Test modules are not importable in a Ray worker (nor in a spawned worker started from another
directory), so every collected test module is registered by value, the way a user registers a
module created at run time.

Ray tests share one local Ray started once per session (``ray_session``), on loopback, without a
dashboard, with its temp dir under the session's tmp dir; the launchers see ``ray.is_initialized()``
and leave it running.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vllm_dist import MPLauncher
from vllm_dist.interfaces import Launcher
from vllm_dist.serialization import register_by_value

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray replaces 127.0.0.1 with the routable address unless it believes clusters are off; a
# single-node test cluster needs no routable address, and the tests stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

LAUNCH_TIMEOUT = 90.0
RAY_NUM_CPUS = 4  # tests use up to 4 ranks of 1 CPU; Ray only counts them, the machine has 2
_MAX_RAY_TEMP_LEN = 40  # Ray puts sockets under <temp>/session_<date>_<pid>/sockets/: 107 bytes max


@pytest.fixture(autouse=True)
def _tests_travel_by_value(request: pytest.FixtureRequest) -> None:
    module = getattr(request, "module", None)
    if module is not None:
        register_by_value(module)


LauncherFactory = Callable[..., Launcher]


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local Ray for the whole session: started on first use, shut down at the end."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray  # somebody else owns it
        return
    temp_dir = str(tmp_path_factory.mktemp("ray"))
    short = None
    if len(temp_dir) > _MAX_RAY_TEMP_LEN:
        temp_dir = short = tempfile.mkdtemp(prefix="ray")
    ray.init(
        address="local",  # a private cluster, whatever RAY_ADDRESS says
        num_cpus=RAY_NUM_CPUS,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
    )
    owner = os.getpid()
    try:
        yield ray
    finally:
        if os.getpid() == owner:  # a pytest-forked child tears fixtures down too: not its Ray
            ray.shutdown()
        if short is not None and os.getpid() == owner:
            shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(params=["mp", pytest.param("ray", marks=pytest.mark.ray)])
def make_launcher(request: pytest.FixtureRequest) -> LauncherFactory:
    """``make_launcher(n_tasks, **options)`` for each launcher kind under test.

    ``env={...}`` (extra worker environment) works for both: Ray gets it as
    ``runtime_env={"env_vars": ...}``. Other options go to the launcher's constructor unchanged.
    """
    kind = request.param
    if kind == "ray":
        request.getfixturevalue("ray_session")

    def factory(n_tasks: int, **options: Any) -> Launcher:
        options.setdefault("timeout", LAUNCH_TIMEOUT)
        if kind == "mp":
            return MPLauncher(n_tasks, **options)
        from vllm_dist import RayLauncher

        env = options.pop("env", None)
        if env:
            runtime_env = dict(options.pop("runtime_env", None) or {})
            runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
            options["runtime_env"] = runtime_env
        return RayLauncher(n_tasks, **options)  # type: ignore[no-any-return]

    return factory
