"""Who averages with whom: averaging groups from a rank -> node placement and a hierarchy.

Pure functions, no communication. The launcher decides where ranks run (block placement
``-H host1:4,host2:4`` puts ranks 0-3 on host1; round-robin placement alternates hosts), so the
groups are built in *node-major order*: the ranks of the first node, then those of the second,
and so on, each node's ranks ascending. A level of size ``s`` splits that order into contiguous
blocks of ``s`` ranks. With one node (or block placement) the size-``s`` group of rank ``r`` is
therefore ``r // s * s ... r // s * s + s - 1``, as PyTorch users expect, and a level whose size
is a node's size is exactly the node-local group whatever the placement.

A group must either stay inside one node or consist of whole nodes: a group straddling part of a
node would send the "cheap" intra-node level over the network, which defeats hierarchical SGD.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Optional, Sequence

__all__ = [
    "node_major_order",
    "level_groups",
    "group_of",
    "hierarchy_groups",
    "static_groups",
    "NodeAwareGroups",
    "node_aware_groups",
]


def node_major_order(rank_to_node: Sequence[Hashable]) -> list[int]:
    """Ranks ordered node by node.

    Nodes come in the order of their lowest rank; inside a node ranks ascend.

    Args:
        rank_to_node: ``rank_to_node[r]`` is the node (host name, node id, ...) of rank ``r``.

    Example::

        >>> node_major_order(["a", "b", "a", "b"])  # round-robin over 2 hosts
        [0, 2, 1, 3]
    """
    by_node: dict[Hashable, list[int]] = {}
    for rank, node in enumerate(rank_to_node):
        by_node.setdefault(node, []).append(rank)
    return [rank for ranks in by_node.values() for rank in ranks]


def _node_sizes(rank_to_node: Sequence[Hashable]) -> dict[Hashable, int]:
    sizes: dict[Hashable, int] = {}
    for node in rank_to_node:
        sizes[node] = sizes.get(node, 0) + 1
    return sizes


def level_groups(rank_to_node: Sequence[Hashable], group_size: int) -> list[list[int]]:
    """Split the ranks into node-aware groups of ``group_size`` ranks.

    Args:
        rank_to_node: ``rank_to_node[r]`` is the node of rank ``r`` (ranks are 0..n-1 here;
            map the members of a process set to 0..n-1 first, see :func:`hierarchy_groups`).
        group_size: ranks per group; must divide the number of ranks.

    Returns:
        The groups, each a sorted list of ranks, in node-major order.

    Raises:
        ValueError: ``group_size`` does not divide the number of ranks, or a group would hold
            part of a node together with ranks of another node.

    Example::

        >>> level_groups(["a", "a", "b", "b"], 2)
        [[0, 1], [2, 3]]
        >>> level_groups(["a", "b", "a", "b"], 2)  # round-robin: pairs stay inside a node
        [[0, 2], [1, 3]]
    """
    world = len(rank_to_node)
    if world == 0:
        raise ValueError("rank_to_node is empty: there must be at least one rank")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group size {group_size!r} must be a positive integer")
    if world % group_size != 0:
        raise ValueError(
            f"group size {group_size} does not divide the number of ranks {world}: "
            "every rank must belong to exactly one group of that size"
        )
    order = node_major_order(rank_to_node)
    node_sizes = _node_sizes(rank_to_node)
    groups = []
    for start in range(0, world, group_size):
        block = order[start:start + group_size]
        nodes = {rank_to_node[r] for r in block}
        if len(nodes) > 1:
            partial = sorted(
                (str(n) for n in nodes
                 if sum(rank_to_node[r] == n for r in block) != node_sizes[n]),
            )
            if partial:
                raise ValueError(
                    f"group size {group_size} does not fit the placement: the group of ranks "
                    f"{sorted(block)} would take only part of node(s) {partial} together with "
                    "another node; a group must stay inside one node or be made of whole "
                    f"nodes (node sizes: {dict((str(k), v) for k, v in node_sizes.items())})"
                )
        groups.append(sorted(block))
    return groups


def group_of(groups: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The group in ``groups`` that holds ``rank``.

    Raises:
        ValueError: no group holds ``rank``.
    """
    for group in groups:
        if rank in group:
            return list(group)
    raise ValueError(f"rank {rank} is in none of the groups {list(map(list, groups))}")


def hierarchy_groups(
    members: Sequence[int],
    rank_to_node: Sequence[Hashable],
    group_sizes: Sequence[int],
) -> list[list[list[int]]]:
    """Groups of every level of a hierarchy inside a process set.

    Args:
        members: the global ranks of the process set, ascending.
        rank_to_node: node of every *global* rank (index = global rank).
        group_sizes: the group size of each level.

    Returns:
        ``result[level]`` is the list of groups of that level, in global ranks.

    Example::

        >>> hierarchy_groups([0, 1, 2, 3], ["a"] * 4, [2, 4])
        [[[0, 1], [2, 3]], [[0, 1, 2, 3]]]
    """
    members = list(members)
    local_nodes = [rank_to_node[r] for r in members]
    result = []
    for size in group_sizes:
        local_groups = level_groups(local_nodes, size)
        result.append([[members[i] for i in group] for group in local_groups])
    return result


def static_groups(rank_to_node: Sequence[Hashable], group_sizes: Sequence[int]) -> list[list[int]]:
    """Every group of every level, once, for registering at start-up (``hvd.init(process_sets=...)``).

    After the levels' groups come the node groups and rails (:func:`node_aware_groups`) of every
    set that spans several nodes with more than one rank on each (the world included), so that
    those sets average node-aware without dynamic process sets. The world itself is left out
    (Horovod's global process set is always there); a group listed twice appears once; the order (level by level, groups in node-major order) is a
    function of the arguments only, so every rank computes the same list.

    Raises:
        ValueError: ``group_sizes`` is empty or not a sequence of integers, or a size does not
            fit the placement (see :func:`level_groups`).

    Example::

        >>> static_groups(["a"] * 4, [2, 4])
        [[0, 1], [2, 3]]
    """
    if isinstance(group_sizes, (str, bytes)) or not isinstance(group_sizes, Sequence):
        raise ValueError(f"group_sizes {group_sizes!r} must be a list of positive integers")
    if not group_sizes:
        raise ValueError("group_sizes is empty: give the group size of every level, e.g. [2, 8]")
    world = list(range(len(rank_to_node)))
    levels = hierarchy_groups(world, rank_to_node, group_sizes)
    groups = [group for level in levels for group in level]
    # Then the node groups and rails of every set that averages node-aware across nodes (the
    # world, and each level's groups that span several nodes), so that it can without dynamic sets.
    for spanning in [world] + list(groups):
        staged = node_aware_groups(spanning, rank_to_node)
        if staged is not None:  # single-rank node groups need no set (nothing to do in a node)
            groups += [g for g in staged.nodes + staged.rails if len(g) > 1]
    # dict keys: first occurrence kept, order kept
    unique = dict.fromkeys(tuple(group) for group in groups if group != world)
    return [list(group) for group in unique]


class NodeAwareGroups(NamedTuple):
    """How one set of ranks averages in stages across nodes (see :func:`node_aware_groups`).

    Attributes:
        nodes: the set's ranks on each node (one group per node, node-major order).
        rails: ``rails[i]`` holds the ``i``-th rank of every node (one group per local position).
    """

    nodes: list[list[int]]
    rails: list[list[int]]


def node_aware_groups(members: Sequence[int],
                      rank_to_node: Sequence[Hashable]) -> Optional[NodeAwareGroups]:
    """The node groups and rails for averaging ``members`` node by node, or None when the set
    does not span nodes evenly.

    Averaging node-aware reduces inside each node, then each rank crosses the link with only its
    share (1/ranks-per-node of the buffer) among the ranks of the same local position on the
    other nodes (its *rail*), then gathers inside the node: each node receives one model's worth
    of bytes instead of one per rank. That needs at least two nodes and the same number of the
    set's ranks on every node (rails must line up). With one rank per node the rail is the set
    itself and the node groups are single ranks (nothing to do inside a node).

    Args:
        members: the set's global ranks.
        rank_to_node: node of every global rank.

    Example::

        >>> node_aware_groups([0, 1, 2, 3], ["a", "a", "b", "b"])
        NodeAwareGroups(nodes=[[0, 1], [2, 3]], rails=[[0, 2], [1, 3]])
        >>> node_aware_groups([0, 1, 2, 3], ["a"] * 4) is None  # one node: flat is best
        True
        >>> node_aware_groups([0, 1], ["a", "b"])  # one rank per node
        NodeAwareGroups(nodes=[[0], [1]], rails=[[0, 1]])
    """
    by_node: dict[Hashable, list[int]] = {}
    for rank in sorted(members):
        by_node.setdefault(rank_to_node[rank], []).append(rank)
    nodes = list(by_node.values())
    sizes = {len(group) for group in nodes}
    if len(nodes) < 2 or len(sizes) != 1:
        return None
    per_node = len(nodes[0])
    rails = [[group[i] for group in nodes] for i in range(per_node)]
    return NodeAwareGroups(nodes, rails)
