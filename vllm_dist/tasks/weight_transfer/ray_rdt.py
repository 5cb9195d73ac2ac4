"""The Ray version gate of the Ray Direct Transport path.

Kept in the task package (tasks import no implementation); the NIXL_RDT communicator may import
it from here. Ray is imported only when the check runs.
"""

from __future__ import annotations

RDT_MIN_RAY_VERSION = "2.56.0"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    return tuple(parts)


def check_ray_rdt_version(version: str | None = None) -> str:
    """Refuse a Ray older than ``RDT_MIN_RAY_VERSION``; returns the version found.

    Args:
        version: the version to check; the installed Ray's when None.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: Ray is too old; the message says how to upgrade.
    """
    if version is None:
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                "the Ray Direct Transport path needs Ray >= "
                f"{RDT_MIN_RAY_VERSION}: pip install 'ray[default]>={RDT_MIN_RAY_VERSION}'"
            ) from exc
        version = str(ray.__version__)
    if _version_tuple(version) < _version_tuple(RDT_MIN_RAY_VERSION):
        raise RuntimeError(
            f"Ray {version} is too old for Ray Direct Transport (tensor_transport='nixl'); it "
            f"needs Ray >= {RDT_MIN_RAY_VERSION}. Upgrade with: "
            f"pip install -U 'ray[default]>={RDT_MIN_RAY_VERSION}' (on every node of the cluster)"
        )
    return version
