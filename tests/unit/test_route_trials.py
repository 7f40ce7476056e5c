"""How rounds left in flight try each way before one is kept: which way each round takes,
whatever order rounds are launched, applied or dropped in (the agreement itself is
collective: tests/multiprocess/test_transports.py)."""
import itertools

import pytest

from hvd_averaging.route_trials import TRIALS_PER_WAY, WAYS, RouteTrials, cheaper_way, next_way


def test_next_way_takes_the_least_tried_flat_first_until_every_way_has_its_rounds():
    for flat, staged in itertools.product(range(4), repeat=2):
        way = next_way({"flat": flat, "node-aware": staged})
        if min(flat, staged) >= TRIALS_PER_WAY:
            assert way is None
        else:
            assert way == ("flat" if flat <= staged else "node-aware"), (flat, staged)
    assert next_way({}) == "flat"
    assert next_way({"flat": 0, "node-aware": 0}, per_way=0) is None


@pytest.mark.parametrize("flat, staged, want", [
    (0.004, 0.05, "flat"), (0.3, 0.05, "node-aware"), (0.05, 0.05, "flat"), (0.0, 0.0, "flat")])
def test_cheaper_way_and_flat_on_a_tie(flat, staged, want):
    assert cheaper_way({"flat": flat, "node-aware": staged}) == want


class Decided(list):
    def __call__(self, choice):
        self.append(choice)


def test_rounds_alternate_ways_and_a_dropped_round_is_tried_again():
    trials = RouteTrials(process_set=None, name="t", decide=Decided())
    first = trials.next_trial()
    assert first.way == "flat" and not first.node_aware
    second = trials.next_trial()  # launched while the first is in flight
    assert second.node_aware
    first.report(0.01)
    second.abandon()  # a checkpoint replaced it: node-aware is tried again
    second.abandon()  # at most once
    assert [trials.next_trial().way for _ in range(2)] == ["node-aware", "flat"]
    assert trials.costs == {"flat": [0.01], "node-aware": []}
    first.report(5.0)  # a trial reports once
    assert trials.costs["flat"] == [0.01]


def test_rounds_in_flight_beyond_the_trials_take_the_way_with_fewest_reports():
    trials = RouteTrials(process_set=None, name="t", decide=Decided())
    handed = [trials.next_trial() for _ in range(2 * TRIALS_PER_WAY)]
    assert [t.way for t in handed] == list(WAYS) * TRIALS_PER_WAY
    assert trials.next_trial().way == "flat"  # nothing reported yet: flat
    handed[0].report(0.1)
    assert trials.next_trial().way == "node-aware"
