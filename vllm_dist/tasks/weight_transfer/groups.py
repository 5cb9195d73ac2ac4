"""Gather groups: the unit in which producers materialise, pack and release weights.

A group is one layer of one stack: every name whose outermost integer is that layer and whose
prefix before it (the stack: ``model.layers``, ``visual.blocks``) is that stack. A leading group
holds what comes before the first layer (embeddings), a trailing group what comes after (final
norm, LM head). Producers walk groups in order, so a sharded trainer gathers one layer at a time
and frees it once every consumer has it. Rejected alternative: keying on the integer alone, which
puts layer 0 of a vision tower and layer 0 of a language model into one group.
"""

from __future__ import annotations

from collections.abc import Iterable


def layer_index(name: str) -> int | None:
    """The outermost integer component of a dotted name (``layers.3.experts.7`` -> 3), or None."""
    key = layer_key(name)
    return None if key is None else key[1]


def layer_key(name: str) -> tuple[str, int] | None:
    """(stack, layer) of a dotted name: ``visual.blocks.3.mlp`` -> ``("visual.blocks", 3)``.

    The stack is the prefix before the outermost integer component; None for an un-indexed name.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def layerwise_groups(names: Iterable[str]) -> list[list[str]]:
    """Cut ``names`` into gather groups, one per (stack, layer).

    Returns a leading group of un-indexed names seen before any indexed one, one group per layer
    (stacks in the order they first appear, layers of a stack in increasing order), and a
    trailing group of the other un-indexed names; empty groups are left out. Names keep their
    input order within a group.
    """
    leading: list[str] = []
    trailing: list[str] = []
    stacks: dict[str, dict[int, list[str]]] = {}
    for name in names:
        key = layer_key(name)
        if key is not None:
            stacks.setdefault(key[0], {}).setdefault(key[1], []).append(name)
        elif stacks:
            trailing.append(name)
        else:
            leading.append(name)
    groups = [leading] if leading else []
    for layers in stacks.values():
        groups.extend(layers[i] for i in sorted(layers))
    if trailing:
        groups.append(trailing)
    return groups
