"""Exhaustive single-process tests of the node-aware grouping (pure functions)."""
import itertools

import pytest

from hvd_averaging.topology import (group_of, hierarchy_groups, level_groups, node_aware_groups,
                                    node_major_order, static_groups)


def contiguous(world, size):
    return [list(range(s, s + size)) for s in range(0, world, size)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16])
def test_one_node_gives_pytorch_contiguous_groups(world):
    for size in range(1, world + 1):
        if world % size:
            with pytest.raises(ValueError, match=f"group size {size} does not divide"):
                level_groups(["n"] * world, size)
            continue
        groups = level_groups(["n"] * world, size)
        assert groups == contiguous(world, size)
        for r in range(world):  # the rule PyTorch users expect
            assert group_of(groups, r) == list(range(r // size * size, r // size * size + size))


def test_single_rank():
    assert level_groups(["only"], 1) == [[0]]
    assert hierarchy_groups([0], ["only"], [1, 1]) == [[[0]], [[0]]]


def test_block_placement_2x4():
    nodes = ["a"] * 4 + ["b"] * 4
    assert level_groups(nodes, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert level_groups(nodes, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert level_groups(nodes, 8) == [list(range(8))]
    assert level_groups(nodes, 1) == [[r] for r in range(8)]


def test_round_robin_2x4_node_size_level_is_node_local():
    nodes = ["a", "b"] * 4  # rank r on node r % 2
    assert node_major_order(nodes) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert level_groups(nodes, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert level_groups(nodes, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    for size in (1, 2, 4, 8):
        for group in level_groups(nodes, size):
            if size <= 4:  # smaller than or equal to a node: inside one node
                assert len({nodes[r] for r in group}) == 1


def test_every_group_stays_in_a_node_or_takes_whole_nodes():
    # all placements of 8 ranks on nodes of 2 or 4 ranks each (as node labels per rank)
    for labels in set(itertools.permutations("aabbccdd")):
        for size in (1, 2, 4, 8):
            groups = level_groups(list(labels), size)
            assert sorted(r for g in groups for r in g) == list(range(8))
            for g in groups:
                nodes = {labels[r] for r in g}
                if len(nodes) > 1:
                    for n in nodes:
                        assert sum(labels[r] == n for r in g) == labels.count(n)


def test_uneven_nodes():
    nodes = ["a"] * 3 + ["b"] * 1  # 3 + 1 ranks
    assert level_groups(nodes, 4) == [[0, 1, 2, 3]]
    assert level_groups(nodes, 1) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"part of node\(s\) \['a'\]"):
        level_groups(nodes, 2)  # [0,1] fine, [2,3] would mix part of a with b


def test_group_larger_than_node_made_of_whole_nodes():
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert level_groups(nodes, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="must stay inside one node or be made of whole nodes"):
        level_groups(["a"] * 3 + ["b"] * 3, 2)


def test_hierarchy_groups_of_a_subset_use_global_ranks():
    nodes = ["a"] * 4 + ["b"] * 4
    assert hierarchy_groups([4, 5, 6, 7], nodes, [2, 4]) == [[[4, 5], [6, 7]], [[4, 5, 6, 7]]]
    assert hierarchy_groups([1, 3, 5, 7], nodes, [2]) == [[[1, 3], [5, 7]]]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, None])
def test_bad_group_size(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        level_groups(["a"] * 4, bad)


def test_empty_placement_and_missing_rank():
    with pytest.raises(ValueError, match="empty"):
        level_groups([], 1)
    with pytest.raises(ValueError, match="rank 9 is in none"):
        group_of([[0, 1]], 9)


# --- static_groups: what hva.init(group_sizes=...) registers at start-up ---

def test_static_groups_one_node_two_levels():
    assert static_groups(["a"] * 8, [2, 4, 8]) == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]


def test_static_groups_round_robin_placement_keeps_pairs_in_nodes():
    # pairs (each a node), then the world's rails (its node groups are the pairs)
    assert static_groups(["a", "b"] * 2, [2]) == [[0, 2], [1, 3], [0, 1], [2, 3]]


def test_static_groups_leaves_out_the_world_and_repeats():
    assert static_groups(["a"] * 4, [4]) == []
    assert static_groups(["a"] * 4, [2, 2, 4]) == [[0, 1], [2, 3]]
    assert static_groups(["a", "a", "b", "b"], [2, 4]) == [[0, 1], [2, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("group_sizes, match", [
    ([], "group_sizes is empty"),
    ("2", "must be a list of positive integers"),
    (2, "must be a list of positive integers"),
    ([0], "group size 0 must be a positive integer"),
    ([True], "group size True must be a positive integer"),
    ([2.0], "group size 2.0 must be a positive integer"),
    ([3], "group size 3 does not divide the number of ranks 4"),
])
def test_static_groups_bad_sizes(group_sizes, match):
    with pytest.raises(ValueError, match=match):
        static_groups(["a"] * 4, group_sizes)


def test_static_groups_straddling_a_node_is_refused():
    with pytest.raises(ValueError, match="does not fit the placement"):
        static_groups(["a", "a", "a", "b", "b", "b"], [2])


# --- node_aware_groups: node groups and rails for averaging across nodes in stages ---

def test_node_aware_groups_block_and_round_robin():
    assert node_aware_groups(range(4), ["a", "a", "b", "b"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert node_aware_groups(range(4), ["a", "b", "a", "b"]) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert node_aware_groups(range(8), list("aaaabbbb")).rails == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert node_aware_groups(range(6), list("aabbcc")).rails == [[0, 2, 4], [1, 3, 5]]


def test_node_aware_groups_of_a_subset_use_its_members_only():
    # members 4..7 of an 8-rank world on nodes c and d
    assert node_aware_groups([4, 5, 6, 7], list("aabbccdd")) == ([[4, 5], [6, 7]], [[4, 6], [5, 7]])


@pytest.mark.parametrize("placement", [["a"] * 4, list("aaab"), list("aabbb"), ["a"]])
def test_node_aware_groups_none_on_one_node_or_where_rails_cannot_line_up(placement):
    assert node_aware_groups(range(len(placement)), placement) is None


def test_node_aware_groups_one_rank_per_node_is_one_rail():
    assert node_aware_groups(range(3), list("abc")) == ([[0], [1], [2]], [[0, 1, 2]])
    # the level's own single ranks stay; node-aware adds nothing (the rail is the world)
    assert static_groups(list("abc"), [1]) == [[0], [1], [2]]
    assert static_groups(list("abc"), [3]) == []


def test_static_groups_register_rails_of_spanning_levels():
    # 3 levels on 2 nodes x 4: pairs, nodes, world; the world's node groups are a level already
    assert static_groups(list("aaaabbbb"), [2, 4]) == [
        [0, 1], [2, 3], [4, 5], [6, 7], [0, 1, 2, 3], [4, 5, 6, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    # a level of 2 nodes out of 4 gets its own rails
    groups = static_groups(list("aabbccdd"), [4])
    assert [0, 2] in groups and [1, 3] in groups and [4, 6] in groups and [0, 1] in groups
