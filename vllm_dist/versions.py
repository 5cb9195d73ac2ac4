"""Version gates shared across packages: the one place a minimum dependency version lives.

Versions compare in PEP 440 order (``packaging``), so a pre-release of the floor is older than
the floor; rejected alternative: comparing numeric fields, which reads ``2.56.0rc1`` as ``2.56.0``.
Tasks and implementations both need the Ray Direct Transport gate, and tasks may not import
implementations, so it sits here, below both. Ray is imported only when the check runs.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

RDT_MIN_RAY_VERSION = "2.56.0"


class RayRdtUnavailableError(RuntimeError):
    """Ray Direct Transport cannot be used here (Ray missing or too old)."""


def check_ray_rdt_version(version: str | None = None) -> str:
    """Refuse Ray older than ``RDT_MIN_RAY_VERSION``; returns the version found.

    Args:
        version: the version to check; the installed Ray's when None.

    Raises:
        RayRdtUnavailableError: Ray is missing or too old; the message says how to upgrade.
    """
    if version is None:
        try:
            import ray
        except ImportError as exc:
            raise RayRdtUnavailableError(
                f"Ray Direct Transport needs ray>={RDT_MIN_RAY_VERSION}: "
                "pip install 'vllm_dist[ray]'"
            ) from exc
        version = str(ray.__version__)
    try:
        too_old = Version(version) < Version(RDT_MIN_RAY_VERSION)  # 2.56.0rc1 < 2.56.0
    except InvalidVersion as exc:
        raise RayRdtUnavailableError(
            f"Ray version {version!r} is not a PEP 440 version; Ray Direct Transport needs "
            f"ray>={RDT_MIN_RAY_VERSION}: pip install -U 'ray[default]>={RDT_MIN_RAY_VERSION}'"
        ) from exc
    if too_old:
        raise RayRdtUnavailableError(
            f"Ray {version} is too old for Ray Direct Transport (tensor_transport='nixl'); "
            f"it needs ray>={RDT_MIN_RAY_VERSION}: "
            f"pip install -U 'ray[default]>={RDT_MIN_RAY_VERSION}'"
        )
    return version
