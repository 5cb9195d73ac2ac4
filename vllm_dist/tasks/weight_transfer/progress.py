"""Set-up progress of a weight-transfer fleet, logged at INFO through the ``vllm_dist`` logger.

Producer 0 speaks for the fleet (index, plans checked, exposures, ready) and consumer 0 for a
consumer (loaders baked, plan, plans sent, ready), each phase as it ends: a fleet of thousands of
ranks logs about a dozen lines, never one per rank or per weight. ``VLLM_DIST_LOG_LEVEL=INFO``
shows them. Rejected: a fleet-wide summary gathered at the end, which would add a collective to
set-up only to log it. Engines call ``phase_done`` from their phase timer; a producer calls
``setup_done`` last, a consumer's last phase (``rings``) stands for it.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_dist.log import get_logger

_log = get_logger(__name__)
_CONSUMER_LAST = "rings"  # the phase that ends a consumer's set-up and join


def _reporter(engine: Any) -> str | None:
    """``"producer 0"`` or ``"consumer 0"`` when ``engine`` reports for its role, else None."""
    for role in ("producer", "consumer"):
        index = getattr(engine, f"{role}_id", None)
        if index is not None:
            return f"{role} 0" if index == 0 else None
    return None


def _n(count: int, noun: str) -> str:
    """``_n(1, "producer")`` -> ``"1 producer"``; ``_n(1200, "weight")`` -> ``"1,200 weights"``."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _describe(engine: Any, who: str, phase: str) -> str | None:
    """What ending ``phase`` means, in words; None for phases not worth a line (those repeated
    per consumer are summed in the next one)."""
    producers = len(engine.fleet.producer_ranks)
    consumers = len(engine.fleet.consumer_ranks)
    producer = who.startswith("producer")
    if phase == "index" and producer:
        names = len(engine.index.names)
        fleet = f"{_n(producers, 'producer')}, {_n(consumers, 'consumer')}"
        return f"index built ({_n(names, 'weight')}, {fleet})"
    if phase == "bake":
        return f"loaders baked ({len(engine.requests):,} weight pieces to receive)"
    if phase == "plan":
        return f"plan made ({len(engine.chunks):,} chunks)"
    return {
        "send plans": f"plans sent to {_n(producers, 'producer')}",
        "verdicts, schedule": f"plans of {_n(consumers, 'consumer')} checked; every rank accepted",
        "verdicts": "every rank accepted the plans",
        "share weights": "weights shared with same-host consumers",
        "expose": "exposures registered",
        "gather parameters": "parameters gathered into arenas",
        "rings": "serve rings ready",
    }.get(phase)


def phase_done(engine: Any, phase: str, seconds: float) -> None:
    """Set-up phase ``phase`` of ``engine`` ended after ``seconds``: one INFO line from the
    role's reporter. Never raises: progress must not fail a set-up."""
    if not _log.isEnabledFor(logging.INFO):
        return
    who = _reporter(engine)
    if who is None:
        return
    try:
        text = _describe(engine, who, phase)
    except (AttributeError, TypeError):
        text = phase
    if text:
        _log.info("weight-transfer set-up, %s: %s (%.2f s)", who, text, seconds)
    if phase == _CONSUMER_LAST and who.startswith("consumer"):
        setup_done(engine, sum(getattr(engine, "setup_phases", {}).values()))


def setup_done(engine: Any, seconds: float | None = None) -> None:
    """``engine``'s set-up finished after ``seconds`` (default: its ``setup_seconds``): the total
    and the time of each phase, from the reporter."""
    if not _log.isEnabledFor(logging.INFO):
        return
    who = _reporter(engine)
    if who is None:
        return
    phases = getattr(engine, "setup_phases", {})
    detail = "; ".join(f"{name} {s:.2f} s" for name, s in phases.items())
    if seconds is None:
        seconds = getattr(engine, "setup_seconds", 0.0)
    _log.info("weight-transfer set-up, %s: ready in %.2f s (%s)", who, seconds, detail)
