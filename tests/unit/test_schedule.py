"""Single-process tests of the averaging schedules and argument rules."""
import warnings

import pytest

from hvd_averaging.schedule import (
    check_period,
    check_warmup_steps,
    hierarchical_period,
    normalize_hierarchy,
    periodic_fires,
)


@pytest.mark.parametrize("warmup,expected", [
    (12, [12, 16, 20]), (13, [13, 17, 21]), (14, [14, 18, 22]), (15, [15, 19, 23]),
])
def test_periodic_firing_tables(warmup, expected):
    assert [s for s in range(24) if periodic_fires(s, 4, warmup)] == expected


def test_periodic_without_warmup_and_period_one():
    assert [s for s in range(10) if periodic_fires(s, 3, 0)] == [0, 3, 6, 9]
    assert all(periodic_fires(s, 1, 0) for s in range(10))


def test_hierarchical_table_warmup_10():
    fired = {s: hierarchical_period(s, [2, 4], 10) for s in range(26)}
    assert [s for s, p in fired.items() if p == 2] == [10, 14, 18, 22]
    assert [s for s, p in fired.items() if p == 4] == [12, 16, 20, 24]
    assert all(p is None for s, p in fired.items() if s < 10 or s % 2)


def test_hierarchical_largest_dividing_period_wins():
    assert hierarchical_period(24, [2, 3, 8], 0) == 8
    assert hierarchical_period(9, [2, 3, 8], 0) == 3
    assert hierarchical_period(6, [2, 3, 8], 0) == 3
    assert hierarchical_period(7, [2, 3, 8], 0) is None


@pytest.mark.parametrize("bad,match", [
    (0, "period must be >= 1, got 0"), (-3, "period must be >= 1, got -3"),
    (2.5, "period must be an integer, got 2.5"), ("4", "period must be an integer, got '4'"),
    (True, "period must be an integer, got True"),
])
def test_bad_period(bad, match):
    with pytest.raises(ValueError, match=match):
        check_period(bad)


def test_period_one_warns_period_two_does_not():
    with pytest.warns(UserWarning, match="period is 1"):
        check_period(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_period(2) == 2


@pytest.mark.parametrize("bad,match", [
    (-1, "warmup_steps must be >= 0, got -1"), (1.0, "warmup_steps must be an integer, got 1.0"),
    (None, "warmup_steps must be an integer, got None"),
])
def test_bad_warmup(bad, match):
    with pytest.raises(ValueError, match=match):
        check_warmup_steps(bad)
    assert check_warmup_steps(0) == 0


def test_hierarchy_is_sorted_by_period():
    assert normalize_hierarchy({8: 4, 2: 2}, 4) == {2: 2, 8: 4}
    assert list(normalize_hierarchy({16: 8, 2: 2, 4: 4}, 8)) == [2, 4, 16]


@pytest.mark.parametrize("hierarchy,size,match", [
    (None, 4, "must be a non-empty mapping"),
    ({}, 4, "is empty"),
    ([(2, 4)], 4, "must be a non-empty mapping"),
    ({0: 4}, 4, "period 0 in period_group_size_dict must be >= 1, got 0"),
    ({2: 0, 4: 4}, 4, "group size 0 .period 2. in period_group_size_dict must be >= 1"),
    ({2.0: 4}, 4, "must be an integer, got 2.0"),
    ({2: 4, 4: 6}, 12, "group size 4 .period 2. does not divide the size 6"),
    ({2: 3, 4: 4}, 4, "group size 3 .period 2. does not divide the process set size 4"),
    ({2: 4, 4: 2}, 4, "must not decrease as the period grows: period 2 has size 4"),
    ({2: 2, 4: 4}, 8, "largest period 4 has group size 4, but it must equal the process set size 8"),
    ({2: 2, 4: 3, 8: 6}, 6, "group size 2 .period 2. does not divide the size 3"),
])
def test_bad_hierarchy(hierarchy, size, match):
    with pytest.raises(ValueError, match=match):
        normalize_hierarchy(hierarchy, size)


def test_hierarchy_with_largest_period_one_warns():
    with pytest.warns(UserWarning, match="largest period of the hierarchy is 1"):
        assert normalize_hierarchy({1: 4}, 4) == {1: 4}
