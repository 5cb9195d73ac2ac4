"""The ``vllm_dist`` logger hierarchy: how library code logs, and how its records are shown.

Library modules log through ``get_logger(__name__)`` (``logging.getLogger("vllm_dist.<module>")``)
and never print. ``configure`` sets the level of the ``vllm_dist`` logger from
``VLLM_DIST_LOG_LEVEL`` and gives it one handler of its own that writes to stderr only while
nothing else would show the record (no handler on the root logger or on ours): Python's
last-resort handler, but at our level, with our format and, in a worker, the rank. The root logger
is never touched, so once an application configures logging its own handlers decide. Rejected:
``logging.basicConfig`` in library code (it configures the user's root logger) and a bare
``NullHandler`` (it hides our warnings from every program that configures no logging).

``interfaces`` and ``memory`` may not import this module (the layering rule); they call
``logging.getLogger(__name__)``, which names a logger of the same hierarchy.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

ROOT_LOGGER = "vllm_dist"
LOG_LEVEL_ENV = "VLLM_DIST_LOG_LEVEL"
LEVEL_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """The logger for ``name`` in the ``vllm_dist`` hierarchy (pass ``__name__``); a name outside
    the package is placed under it (``"mytool"`` -> ``vllm_dist.mytool``)."""
    if name != ROOT_LOGGER and not name.startswith(ROOT_LOGGER + "."):
        name = f"{ROOT_LOGGER}.{name}"
    return logging.getLogger(name)


def log_level(environ: Mapping[str, str] | None = None) -> int | None:
    """The level ``VLLM_DIST_LOG_LEVEL`` asks for, or None when it is unset or empty (the
    ``vllm_dist`` logger then follows the application's logging, WARNING without any).

    Raises:
        ValueError: the value is not a level name; the message lists the valid ones.
    """
    raw = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV, "").strip()
    if not raw:
        return None
    if raw.upper() not in LEVEL_NAMES:
        raise ValueError(
            f"{LOG_LEVEL_ENV}={raw!r} is not a log level: set it to one of "
            f"{', '.join(LEVEL_NAMES)} (any case), or unset it for WARNING"
        )
    return int(getattr(logging, raw.upper()))


def configure(rank: int | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Set the ``vllm_dist`` logger's level from ``VLLM_DIST_LOG_LEVEL`` and install its
    fallback handler once; ``rank`` puts ``[rankN]:`` before each line a worker writes (for
    output nobody else prefixes). Safe to call again: the handler is updated, not added twice.

    Raises:
        ValueError: ``VLLM_DIST_LOG_LEVEL`` is not a level name.
    """
    level = log_level(environ)
    logger = logging.getLogger(ROOT_LOGGER)
    if level is not None:
        logger.setLevel(level)
    handler = next((h for h in logger.handlers if isinstance(h, _FallbackHandler)), None)
    if handler is None:
        handler = _FallbackHandler()
        logger.addHandler(handler)
    prefix = "" if rank is None else f"[rank{rank}]:"
    handler.setFormatter(logging.Formatter(prefix + _FORMAT))


class _FallbackHandler(logging.Handler):
    """Writes a record to the current ``sys.stderr`` unless another handler will show it."""

    def handle(self, record: logging.LogRecord) -> bool:
        ours = logging.getLogger(ROOT_LOGGER)
        others = [h for h in ours.handlers if h is not self]
        if others or (ours.propagate and logging.getLogger().handlers):
            return False
        return bool(super().handle(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy for a failing handler
            self.handleError(record)
