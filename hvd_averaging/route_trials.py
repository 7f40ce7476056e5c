"""Choosing the way of rounds left in flight by trying each way on real rounds.

A round left in flight (``delay`` in the averagers) moves one stage per training step: flat
is one stage, node-aware about five on Open MPI (nine with int8), and each stage's host work
runs on the training thread. A timing of blocking rounds on an idle machine
(:mod:`.route_probe`) sees neither: on 2 emulated nodes x 2 ranks it chose node-aware for
such rounds in 5 of 16 race calibrations, where those rounds then kept 0.92-0.93 of compute
against 0.97 flat, their polls took 0.042 of the wall time against 0.002, and their wait at
apply 0.070 against 0.008 (docs/demo.md). So the first rounds left in flight over a set try
each way in turn, ``TRIALS_PER_WAY`` rounds each, flat first; what each round cost the
training thread (its launches, its polls and its wait at the apply step) is reported at its
apply step, and once every way has been tried the members agree (the slowest member's best
round per way) and keep the cheaper way for the world. The trial rounds average exactly as
any round (both ways give the average within float reassociation).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import horovod.torch as hvd
import torch

from .deadlines import bounded_collective
from .process_sets import members
from .route import RouteChoice

__all__ = ["TRIALS_PER_WAY", "WAYS", "next_way", "cheaper_way", "Trial", "RouteTrials"]

TRIALS_PER_WAY = 2  # the first round of a way pays its first-time costs (buffers, caches)
WAYS = ("flat", "node-aware")


def next_way(tried: Mapping[str, int], per_way: int = TRIALS_PER_WAY) -> Optional[str]:
    """The way the next trial round takes: the one tried least (rounds reported or in flight),
    flat first on a tie; None once every way has ``per_way``.

    Example::

        >>> next_way({"flat": 0, "node-aware": 0})
        'flat'
        >>> next_way({"flat": 1, "node-aware": 0})
        'node-aware'
        >>> next_way({"flat": 2, "node-aware": 2}) is None
        True
    """
    fewest = min(WAYS, key=lambda way: tried.get(way, 0))
    return fewest if tried.get(fewest, 0) < per_way else None


def cheaper_way(costs: Mapping[str, float]) -> str:
    """The way whose round cost training less; flat on a tie (fewer stages, less host work).

    Example::

        >>> cheaper_way({"flat": 0.004, "node-aware": 0.05})
        'flat'
        >>> cheaper_way({"flat": 0.3, "node-aware": 0.05})
        'node-aware'
    """
    return "node-aware" if costs["node-aware"] < costs["flat"] else "flat"


class Trial:
    """One round on trial: the way it takes; :meth:`report` at its apply step, or
    :meth:`abandon` when it is dropped unapplied."""

    def __init__(self, trials: "RouteTrials", way: str) -> None:
        self._trials = trials
        self.way = way
        self._open = True

    @property
    def node_aware(self) -> bool:
        return self.way == "node-aware"

    def report(self, cost_seconds: float) -> None:
        """What the round cost the training thread. Collective over the set when it is the
        last trial (every member applies the same round at the same step)."""
        if self._open:
            self._open = False
            self._trials.reported(self.way, cost_seconds)

    def abandon(self) -> None:
        """The round ends without being applied (a checkpoint replaces it): try its way again."""
        if self._open:
            self._open = False
            self._trials.abandoned(self.way)


class RouteTrials:
    """The trials of one set, size class and wire format: rounds launched per way, the costs
    reported, and the agreement that ends them (``decide(choice)`` keeps the way).

    Every member launches, applies and abandons the same rounds in the same order, so every
    member hands out the same ways and agrees at the same round.
    """

    def __init__(self, process_set: hvd.ProcessSet, name: str,
                 decide: Callable[[RouteChoice], None]) -> None:
        self.process_set = process_set
        self.name = name
        self._decide = decide
        self.costs: dict[str, list[float]] = {way: [] for way in WAYS}  # this member's
        self.handed: list[str] = []  # the way of each round handed a trial, in order
        self._in_flight = {way: 0 for way in WAYS}

    def next_trial(self) -> Trial:
        """The next round's trial: the way tried least, counting rounds in flight (once every
        trial is handed out, a further round in flight before the agreement takes the way
        with the fewest reports, flat first)."""
        way = next_way({w: len(self.costs[w]) + self._in_flight[w] for w in WAYS})
        if way is None:
            way = next_way({w: len(self.costs[w]) for w in WAYS}) or "flat"
        self._in_flight[way] += 1
        self.handed.append(way)
        return Trial(self, way)

    def abandoned(self, way: str) -> None:
        self._in_flight[way] -= 1

    def reported(self, way: str, cost_seconds: float) -> None:
        self._in_flight[way] -= 1
        self.costs[way].append(cost_seconds)
        if next_way({w: len(self.costs[w]) for w in WAYS}) is None:
            self._agree()

    def _agree(self) -> None:
        best = torch.tensor([min(self.costs[way]) for way in WAYS], dtype=torch.float64)
        what = f"route trials over process set {members(self.process_set)}: the costs"
        with bounded_collective(what) as collective:
            slowest = collective.wait([hvd.allreduce_async(
                best, op=hvd.Max, process_set=self.process_set,
                name=f"hva.trials.{self.process_set.process_set_id}.{self.name}")])[0]
        seconds = dict(zip(WAYS, slowest.tolist()))
        way = cheaper_way(seconds)
        why = (f"tried as it runs, {TRIALS_PER_WAY} rounds each: a round cost training "
               f"node-aware {seconds['node-aware']:.4f} s, flat {seconds['flat']:.4f} s")
        self._decide(RouteChoice(way == "node-aware", why, seconds))
