"""Shared fixtures: launchers to parametrise over, and by-value pickling of test modules.

Test modules are not importable in a Ray worker (nor in a spawned worker started from another
directory), so every collected test module is registered by value, the way a user registers a
module created at run time.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from vllm_dist import MPLauncher
from vllm_dist.interfaces import Launcher
from vllm_dist.serialization import register_by_value

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

LAUNCH_TIMEOUT = 90.0


@pytest.fixture(autouse=True)
def _tests_travel_by_value(request: pytest.FixtureRequest) -> None:
    module = getattr(request, "module", None)
    if module is not None:
        register_by_value(module)


LauncherFactory = Callable[..., Launcher]


@pytest.fixture(params=["mp"])
def make_launcher(request: pytest.FixtureRequest) -> LauncherFactory:
    """``make_launcher(n_tasks, **options)`` for each launcher kind under test."""

    def factory(n_tasks: int, **options: object) -> Launcher:
        options.setdefault("timeout", LAUNCH_TIMEOUT)
        return MPLauncher(n_tasks, **options)  # type: ignore[arg-type]

    return factory
