"""Test helpers for backend authors: the communicator conformance suite.

``from vllm_dist.testing import CommunicatorConformance`` loads the suite, which needs pytest;
importing this package alone does not, so ``vllm_dist`` never depends on pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_dist.testing.conformance import (
        CHECKS,
        UNSUPPORTED_PROBES,
        CommunicatorConformance,
        ConformanceTask,
        check,
        run_conformance,
    )

__all__ = [
    "CHECKS",
    "UNSUPPORTED_PROBES",
    "CommunicatorConformance",
    "ConformanceTask",
    "check",
    "run_conformance",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vllm_dist.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'vllm_dist.testing' has no attribute {name!r}")
