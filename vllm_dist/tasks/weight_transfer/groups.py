"""Gather groups: the unit in which producers materialise, pack and release weights.

A group is one transformer layer (every name whose outermost integer is that layer), plus a
leading group for what comes before the first layer (embeddings) and a trailing group for what
comes after (final norm, LM head). Producers walk groups in order, so a sharded trainer gathers
one layer at a time and frees it once every consumer has it.
"""

from __future__ import annotations

from collections.abc import Iterable


def layer_index(name: str) -> int | None:
    """The outermost integer component of a dotted name (``layers.3.experts.7`` -> 3), or None."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def layerwise_groups(names: Iterable[str]) -> list[list[str]]:
    """Cut ``names`` into gather groups keyed on the outermost integer of each name.

    Returns a leading group of un-indexed names seen before any indexed one, one group per layer
    in increasing layer order, and a trailing group of the other un-indexed names; empty groups
    are left out. Names keep their input order within a group.
    """
    leading: list[str] = []
    trailing: list[str] = []
    layers: dict[int, list[str]] = {}
    for name in names:
        idx = layer_index(name)
        if idx is not None:
            layers.setdefault(idx, []).append(name)
        elif layers:
            trailing.append(name)
        else:
            leading.append(name)
    groups = [leading] if leading else []
    groups.extend(layers[i] for i in sorted(layers))
    if trailing:
        groups.append(trailing)
    return groups
