"""Who averages with whom: an averager's process sets per level, kept in step with the world.

A :class:`Membership` is owned by one averager. It checks the averager's configuration across
ranks, registers every group of every level as a Horovod process set (and the node groups and
rails their routes need), keeps this rank's set per level, and at each firing step makes them
anew if the world changed (an elastic reset, or Horovod started again). In an elastic job
nothing collective happens at construction: a joining worker constructs its averager while the
others are inside ``hvd.elastic.run``, so agreement and registration wait for the first firing
step, which every rank reaches with the same, synchronized, step.
"""

from __future__ import annotations

from typing import Callable, Optional

import horovod.torch as hvd

from .agreement import check_same_on_all_ranks
from .placement import rank_to_node
from .process_sets import members, process_set as registered_set, register_groups, registered_process_sets
from .routes import prepare_process_set
from .startup import elastic_job
from .world import WorldFollower, renew_world

__all__ = ["LevelGroups", "Membership"]

# (the set's ranks, rank -> node) -> {level: that level's groups, each a list of ranks}
LevelGroups = Callable[[list[int], list], dict[int, list[list[int]]]]


class Membership:
    """The process sets of one averager's levels (see the module docstring).

    Args:
        owner: the averager's name, for messages and the agreement's collective name.
        process_set: the set the averager averages over (a registered ``hvd.ProcessSet``).
        config: the averager's arguments as ranks compare them.
        level_groups: the groups of every level for the set's ranks and placement.
        refit: called with the new world size after an elastic reset, before the groups are made
            anew; may raise ``ValueError`` when the levels do not fit that world.
    """

    def __init__(self, owner: str, process_set: hvd.ProcessSet, config: Callable[[], dict],
                 level_groups: LevelGroups, refit: Optional[Callable[[int], None]] = None):
        self.owner = owner
        self.process_set = process_set
        self.level_sets: dict[int, hvd.ProcessSet] = {}  # this rank's set per level (ascending)
        self._config = config
        self._level_groups = level_groups
        self._refit = refit
        self._world = WorldFollower()

    def start(self, local_error: Optional[BaseException] = None) -> None:
        """Agree on the configuration and register the sets (collective; deferred to the first
        firing step in an elastic job). ``local_error``: this rank's bad argument, raised on
        every rank (the others name it)."""
        if elastic_job():
            if local_error is not None:
                raise local_error
            return
        self.agree(local_error)
        self._register()

    def agree(self, local_error: Optional[BaseException] = None) -> None:
        """Check that every rank has the same configuration (collective)."""
        check_same_on_all_ranks(f"{self.owner} arguments", self._config(),
                                local_error=local_error, name=f"hva.agree.{self.owner}")

    def set_at(self, level: int) -> Optional[hvd.ProcessSet]:
        """This rank's set at ``level`` (None: this rank does not average there)."""
        return self.level_sets.get(level)

    def follow_world(self) -> bool:
        """At a firing step: make the sets anew if the world changed since they were made (or
        they were never made). Collective then. True when sets made before were dropped (the
        rounds in flight over them died with the old world)."""
        # Sets made for the current world and gone: Horovod was started again without an
        # elastic reset announcing it. (Made for an older world: a reset's sync already began a
        # new one, on every rank alike; renewing again here would do it on the old ranks only.)
        if not self._world.behind() and self._sets_dropped():
            renew_world()
        if not self._world.behind():
            return False
        renewed = self._world.started
        if renewed:
            self._fit_new_world()
        self.agree()
        self._register()
        return renewed

    def _register(self) -> None:
        """Register every group of every level and prepare their routes (collective: every rank
        registers every group, in the same order), keeping this rank's set per level."""
        ranks = members(self.process_set)
        levels = self._level_groups(ranks, rank_to_node())
        self.level_sets = {}
        for level, groups in levels.items():
            mine = register_groups(self.process_set, groups)
            if mine is not None:
                self.level_sets[level] = mine
        for groups in levels.values():
            for group in groups:
                prepare_process_set(self.process_set if group == ranks else registered_set(group))
        self._world.caught_up()

    def _sets_dropped(self) -> bool:
        """True when Horovod no longer holds these sets (it was initialized again, which drops
        every set, horovod#4021)."""
        own = [s for s in [self.process_set, *self.level_sets.values()]
               if s is not hvd.global_process_set]
        if not own or not self._world.started:
            return False
        registered = registered_process_sets()
        return any(registered.get(s.process_set_id) != members(s) for s in own)

    def _fit_new_world(self) -> None:
        """After an elastic reset: only an averager over all ranks can follow it.

        Raises:
            RuntimeError: the averager runs over a subset of ranks (maybe none in the new world).
        """
        if self.process_set is not hvd.global_process_set:
            raise RuntimeError(
                f"{self.owner} over process set {members(self.process_set)} cannot follow an "
                "elastic reset (the new world may not contain those ranks): average over all ranks")
        if self._refit is not None:
            self._refit(hvd.size())
