"""Shared fixtures: launchers to parametrise over, and by-value pickling of test modules.

Test modules are not importable in a Ray worker (nor in a spawned worker started from another
directory), so every collected test module is registered by value, the way a user registers a
module created at run time.

MP launches fork their workers from one forkserver that imported torch and vllm_dist once for the
session, instead of starting an interpreter per worker that imports them (``VLLM_DIST_START_METHOD``,
inherited by the CLI and script subprocesses the tests start); tests of spawn itself pass
``start_method="spawn"``. ``VLLM_DIST_START_METHOD=spawn pytest`` runs them all with spawn.

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
from vllm_dist.implementations.launchers.mp import START_METHOD_ENV, start_forkserver
from vllm_dist.interfaces import Launcher
from vllm_dist.serialization import register_by_value

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray replaces 127.0.0.1 with the routable address unless it believes clusters are off; a
# single-node test cluster needs no routable address, and the tests stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
if os.environ.setdefault(START_METHOD_ENV, "forkserver") == "forkserver":
    start_forkserver()  # now, in the session's own environment; it imports torch meanwhile

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


# Soak and repeated-scenario tests: each repeats at scale what a faster test in the default run
# already checks (named after the "#"), so CI's run stays within its time; `pytest -m slow` runs them.
SLOW = {
    "test_ray_multinode.py::test_placement_strategies_and_node_facts_on_a_two_node_cluster": "a 2-node cluster; placement and node facts: test_ray_launcher's local-rank mapping",
    "test_ray_launcher.py::test_twelve_launches_leave_no_actors_or_placement_groups": "12 launches; one launch: test_ray_launcher's failure and timeout tests",
    "test_ray_launcher.py::test_launches_in_one_driver_reuse_one_ray_with_flat_threads_and_fds": "flatness over launches; benchmarks/ray_launches.py measures it over 50",
    "test_ray_cli.py::test_weight_transfer_on_a_private_ray": "the CLI on Ray: test_all_reduce_on_a_private_ray",
    "test_correctness.py::test_remote_code_config_by_value_on_first_ray_launch[kept_cache]": "by value on Ray: the [clean] case",
    "test_faults.py::test_clean_launches_end_with_exit_code_zero": "six launches; exit codes of one: test_a_worker_that_dies_after_returning_is_reported",
    "test_membership.py::test_scale_two_to_four_to_one": "2 -> 4 -> 1 members: test_elastic's fleet drill",
    "test_logs.py::test_a_launch_that_fails_once_is_restarted_as_a_whole[exit]": "a restart: the [raise] case",
    "test_serialization.py::test_trust_remote_code_config_reaches_workers[ray]": "by value on Ray: test_correctness's first-Ray-launch test",
    "test_tasks_and_registry.py::test_grouped_all_reduce_stays_in_group[ray-groups1]": "grouping on Ray: the [ray-groups0] case",
    "test_tasks_and_registry.py::test_grouped_all_reduce_stays_in_group[ray-groups2]": "grouping on Ray: the [ray-groups0] case",
    "test_correctness.py::test_sys_exit_zero_is_a_success_without_a_result[ray]": "exit codes on Ray: test_ray_launcher's failure tests; sys.exit(0): the [mp] case",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests in SLOW (by file::name[params]) with ``slow``."""
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW:
            item.add_marker(pytest.mark.slow)
