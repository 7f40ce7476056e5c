"""Which way a process set's averaging rounds travel, and the process sets that way needs.

A set whose ranks sit on several nodes, the same number on every node, can average node-aware
(:class:`~hvd_averaging.transports.NodeAware`): it needs its node groups and rails registered
as process sets (with one rank per node under MPI the rail is the set itself: reduce-scatter
plus allgather across the nodes; under Gloo such a set stays flat). Every other set, and every
buffer below ``NODE_AWARE_MIN_BYTES``, takes one flat allreduce. Between the two, ``HVA_ROUTE``
decides: by default the library times both at the set's first round of each size class
(:mod:`.route_probe`) and keeps the faster for the world; ``node-aware`` or ``flat`` fixes
it. Rounds left in flight (``delay``) are chosen apart, by trying each way on real rounds
(:mod:`.route_trials`): they move one stage per training step. Every member takes the same way
(the same placement, the same measured numbers), and the choice is reported in
``hva.traffic().routes`` and the ``hvd_averaging`` log. A :class:`~.route.Route` names the sets
a round crosses and builds the transports in the buffers' own dtype; the wire formats
(:mod:`hvd_averaging.wire`) wrap or replace the stage that crosses the link.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import horovod.torch as hvd
import torch

from .env_settings import route_policy
from .placement import known_rank_to_node, rank_to_node
from .process_sets import ProcessSetNotRegistered, members, register_groups
from .route_probe import probe_seconds
from .route_trials import RouteTrials, Trial
from .startup import elastic_job
from .topology import node_aware_groups
from .traffic import record_route
from .route import MeasuredAs, Route, RouteChoice
from .transports import Transport
from .world import current_world

__all__ = ["NODE_AWARE_MIN_BYTES", "Route", "NodeAwareSets", "Routes", "routes",
           "prepare_process_set", "averaging_route"]

# Below this a round is latency-bound: four stages cost more than they save on the link.
NODE_AWARE_MIN_BYTES = 1 << 20


class NodeAwareSets(NamedTuple):
    """This rank's node group and rail for one set (see :func:`~hvd_averaging.topology.node_aware_groups`)."""

    node_set: Optional[hvd.ProcessSet]  # None with one rank per node
    rail_set: hvd.ProcessSet
    ranks_per_node: int
    nodes: int


class Routes:
    """Per process set: whether it spans nodes and, where it can, its node-aware sets. One per
    world (set ids are the world's); a wire format (:mod:`hvd_averaging.wire`) builds the
    transport that carries its buffers along a :class:`Route`."""

    def __init__(self) -> None:
        self._staged: dict[int, Optional[NodeAwareSets]] = {}
        self._crosses: dict[int, bool] = {}
        # (set id, members, size class, wire format, 0 or pieces left in flight) -> choice
        self._chosen: dict[tuple, RouteChoice] = {}
        self._trials: dict[tuple, RouteTrials] = {}  # same keys: rounds left in flight on trial

    def _placement(self) -> Optional[list]:
        known = known_rank_to_node()
        if known is not None or elastic_job():
            return known  # a joining worker's collective would be matched by no one
        return rank_to_node()

    def prepare(self, process_set: hvd.ProcessSet) -> None:
        """Register ``process_set``'s node groups and rails if it averages node-aware.

        Collective over all ranks (each registers every group), in the same order on every rank;
        a set prepared before costs nothing. Where the sets cannot be registered (Horovod without
        dynamic process sets and not registered at start-up) the set stays flat, on every rank
        alike.
        """
        set_id = process_set.process_set_id
        if set_id in self._staged:
            return
        placement = self._placement()
        ranks = members(process_set)
        groups = node_aware_groups(ranks, placement) if placement is not None else None
        staged = None
        if groups is not None and len(groups.nodes[0]) == 1:
            # One rank per node: the rail is the set, nothing to do inside a node. Worth it over
            # MPI only (OpenMPI's reduce-scatter + allgather beat its allreduce; Gloo's do not).
            if hvd.mpi_enabled():
                staged = NodeAwareSets(None, process_set, 1, len(groups.nodes))
        elif groups is not None:
            try:
                node_set = register_groups(process_set, groups.nodes)
                rail_set = register_groups(process_set, groups.rails)
            except ProcessSetNotRegistered:  # no dynamic process sets: same on every rank
                node_set = rail_set = None
            if node_set is not None and rail_set is not None:
                staged = NodeAwareSets(node_set, rail_set, len(groups.nodes[0]), len(groups.nodes))
        self._staged[set_id] = staged

    def node_aware_sets(self, process_set: hvd.ProcessSet) -> Optional[NodeAwareSets]:
        """The set's node-aware sets, if :meth:`prepare` found any (local)."""
        return self._staged.get(process_set.process_set_id)

    def takes_node_aware(self, process_set: hvd.ProcessSet, nbytes: int,
                         node_aware: Optional[bool] = None,
                         measured_as: Optional[MeasuredAs] = None,
                         device: Optional[torch.device] = None) -> bool:
        """Whether a round of ``nbytes`` over ``process_set`` goes node-aware: the set must have
        node-aware sets and the round at least ``NODE_AWARE_MIN_BYTES``; ``node_aware`` forces
        one way; else ``HVA_ROUTE`` decides, by default by measuring both at the set's first
        round of this size class and wire format (collective then: see :meth:`choice`)."""
        if self.node_aware_sets(process_set) is None:
            return False
        if node_aware is not None:
            return node_aware
        return nbytes >= NODE_AWARE_MIN_BYTES and \
            self.choice(process_set, nbytes, measured_as, device).node_aware

    def choice(self, process_set: hvd.ProcessSet, nbytes: int,
               measured_as: Optional[MeasuredAs] = None,
               device: Optional[torch.device] = None) -> "RouteChoice":
        """How rounds of about ``nbytes`` (the same power of two) over a set that can go
        node-aware travel, and why. ``measured_as``: (the wire format's name, what builds its
        transport along a route; the name is ``str(format.spec())``); None: the buffers' own
        dtype ("none"). Under ``HVA_ROUTE=measure``
        the first call for a size class and format times both ways
        (:func:`~hvd_averaging.route_probe.probe_seconds`; collective over the set, which every
        member reaches at the same round) and keeps the faster for this world."""
        wire, build = measured_as or ("none", Route.float_transport)
        key = _choice_key(process_set, nbytes, wire)
        found = self._chosen.get(key)
        if found is None:
            found = self._choose(process_set, nbytes, build, device)
            self._keep(key, found, nbytes)
        return found

    def _keep(self, key: tuple, found: RouteChoice, nbytes: int) -> None:
        """Keep a choice for the world and report it (traffic counters, log)."""
        self._chosen[key] = found
        _, ranks, _, wire, in_flight_pieces = key
        way = "node-aware" if found.node_aware else "flat"
        where = f"{list(ranks)}, {nbytes / 2 ** 20:.1f} MiB, {wire}" + (
            "" if not in_flight_pieces else ", left in flight" if in_flight_pieces == 1
            else f", left in flight in up to {in_flight_pieces} pieces")
        record_route(where, f"{way} ({found.why})")
        logging.getLogger("hvd_averaging").info("rounds over %s: %s (%s)", where, way, found.why)

    def left_in_flight(self, process_set: hvd.ProcessSet, nbytes: int,
                       node_aware: Optional[bool], measured_as: MeasuredAs,
                       device: Optional[torch.device], keeps_state: bool,
                       pieces: int = 1) -> tuple[Route, Optional[Trial]]:
        """The route of a round left in flight (``delay`` in the averagers; travelling in up
        to ``pieces`` pieces) and, while its way is being tried (:mod:`.route_trials`, under
        ``HVA_ROUTE=measure``; whole rounds and rounds in pieces apart), the trial it reports
        its cost to at its apply step. A wire format that keeps state between rounds (int8's
        error feedback, kept per route) is not tried: it takes the blocking rounds' choice
        (:meth:`choice`). Collective over the set as :meth:`route` is."""
        if process_set.process_set_id == hvd.global_process_set.process_set_id:
            self.prepare(process_set)
        if keeps_state or node_aware is not None or route_policy() != "measure" \
                or self.node_aware_sets(process_set) is None or nbytes < NODE_AWARE_MIN_BYTES:
            return self.route(process_set, nbytes, node_aware, measured_as, device), None
        key = _choice_key(process_set, nbytes, measured_as[0], in_flight_pieces=pieces)
        found = self._chosen.get(key)
        if found is not None:
            return self._route(process_set, found.node_aware), None
        trials = self._trials.get(key)
        if trials is None:
            trials = self._trials[key] = RouteTrials(
                process_set, f"{nbytes.bit_length()}.{measured_as[0]}.{pieces}",
                lambda choice: self._keep(key, choice, nbytes))
        trial = trials.next_trial()
        return self._route(process_set, trial.node_aware), trial

    def _choose(self, process_set: hvd.ProcessSet, nbytes: int,
                build: Callable[[Route], Transport], device: Optional[torch.device]) -> "RouteChoice":
        policy = route_policy()
        if policy != "measure":
            return RouteChoice(policy == "node-aware", f"HVA_ROUTE={policy}")
        candidates = {"flat": build(self._route(process_set, False)),
                      "node-aware": build(self._route(process_set, True))}
        seconds = probe_seconds(candidates, process_set, nbytes, device or torch.device("cpu"))
        why = f"measured: node-aware {seconds['node-aware']:.4f} s, flat {seconds['flat']:.4f} s"
        return RouteChoice(seconds["node-aware"] < seconds["flat"], why, seconds)

    def trials_of(self, process_set: hvd.ProcessSet, nbytes: int, wire: str = "none",
                  in_flight_pieces: int = 1) -> Optional[RouteTrials]:
        """The trials of rounds left in flight of about ``nbytes`` in ``wire`` over the set,
        travelling in up to ``in_flight_pieces`` pieces (the ways handed out, this member's
        costs), if any were made."""
        return self._trials.get(_choice_key(process_set, nbytes, wire, in_flight_pieces))

    def decided(self, process_set: hvd.ProcessSet, nbytes: int, wire: str = "none",
                in_flight_pieces: int = 0) -> Optional["RouteChoice"]:
        """The choice made for rounds of about ``nbytes`` in ``wire`` over the set (0: blocking
        rounds; k >= 1: rounds left in flight in up to k pieces), if any."""
        return self._chosen.get(_choice_key(process_set, nbytes, wire, in_flight_pieces))

    def crosses_nodes(self, process_set: hvd.ProcessSet) -> bool:
        """Whether the set's members sit on several nodes (False while the placement is unknown)."""
        set_id = process_set.process_set_id
        if set_id not in self._crosses:
            placement = known_rank_to_node()
            if placement is None:
                return False
            self._crosses[set_id] = len({placement[r] for r in members(process_set)}) > 1
        return self._crosses[set_id]

    def route(self, process_set: hvd.ProcessSet, nbytes: int, node_aware: Optional[bool] = None,
              measured_as: Optional[MeasuredAs] = None,
              device: Optional[torch.device] = None) -> Route:
        """The sets a round of ``nbytes`` (all its dtype buffers) crosses over ``process_set``.

        The global set is prepared here on first use (every rank is a member, so every rank
        calls this); other sets only by :meth:`prepare` (an averager does it at construction).
        ``node_aware``: None chooses (:meth:`takes_node_aware`), False forces flat, True forces
        node-aware where the set can. ``measured_as`` and ``device``: the round's wire format
        and the buffers' device, for a measurement (:meth:`choice`).
        """
        if process_set.process_set_id == hvd.global_process_set.process_set_id:
            self.prepare(process_set)
        return self._route(process_set, self.takes_node_aware(process_set, nbytes, node_aware,
                                                              measured_as, device))

    def _route(self, process_set: hvd.ProcessSet, node_aware: bool) -> Route:
        ranks = len(members(process_set))
        crosses = self.crosses_nodes(process_set)
        if not node_aware:
            return Route(process_set, ranks, crosses)
        staged = self.node_aware_sets(process_set)
        gloo = not hvd.mpi_enabled()  # measured: Gloo's allreduce and alltoall are its fast ones
        return Route(process_set, ranks, crosses, node_aware=True, node_set=staged.node_set,
                     rail_set=staged.rail_set, ranks_per_node=staged.ranks_per_node,
                     nodes=staged.nodes, rail_allreduce=gloo, scatter_by_alltoall=gloo)


def _choice_key(process_set: hvd.ProcessSet, nbytes: int, wire: str,
                in_flight_pieces: int = 0) -> tuple:
    """Set id and members (ids are reused after an elastic reset), size class, wire format,
    and how the rounds run (0: blocking; k >= 1: left in flight in up to k pieces)."""
    return (process_set.process_set_id, tuple(members(process_set)), nbytes.bit_length(), wire,
            in_flight_pieces)


def routes() -> Routes:
    """The current world's routes."""
    return current_world().component(Routes)


def prepare_process_set(process_set: hvd.ProcessSet) -> None:
    """Make ``process_set`` average node-aware where it can (register its node groups and rails).

    Collective over all ranks, same order on every rank (averagers call it for their levels at
    construction; the global set is prepared at its first round).
    """
    routes().prepare(process_set)


def averaging_route(process_set: Optional[hvd.ProcessSet] = None, nbytes: int = 1 << 30,
                    wire: str = "none", in_flight_pieces: int = 0) -> str:
    """How a buffer of ``nbytes`` in the wire format ``wire`` (``str(format.spec())``) travels
    over ``process_set``: in blocking rounds (``in_flight_pieces`` 0), or in rounds left in
    flight (``delay`` in the averagers; a format without state) in up to ``in_flight_pieces``
    pieces (1: whole) (local; call after the set was prepared or averaged over once): ``"flat"`` (it cannot go node-aware, or chose not to),
    ``"node-aware"``, or ``"to be measured"`` (it can go node-aware and, under
    ``HVA_ROUTE=measure``, no such round has been timed, or tried on each way, yet)."""
    process_set = process_set if process_set is not None else hvd.global_process_set
    table = routes()
    if table.node_aware_sets(process_set) is None or nbytes < NODE_AWARE_MIN_BYTES:
        return "flat"
    found = table.decided(process_set, nbytes, wire, in_flight_pieces)
    if found is None and route_policy() == "measure":
        return "to be measured"
    node_aware = found.node_aware if found is not None else route_policy() == "node-aware"
    return "node-aware" if node_aware else "flat"
