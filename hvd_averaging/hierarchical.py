"""Hierarchical SGD: groups of different sizes average at different periods."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import horovod.torch as hvd

from .averagers import ModelAverager
from .process_sets import members
from .schedule import (check_warmup_steps, delayed_level_pieces, hierarchical_period, level_delays,
                       level_values, normalize_hierarchy)
from .topology import hierarchy_groups
from .wire import level_codecs

__all__ = ["HierarchicalModelAverager"]


class HierarchicalModelAverager(ModelAverager):
    r"""Hierarchical model averaging (`hierarchical SGD <https://arxiv.org/pdf/2010.12998.pdf>`_).

    Groups of different sizes average with different periods: e.g. ``{2: 4, 16: 8}`` on 8 ranks
    averages each node of 4 every 2 steps and everyone every 16. At step ``s >= warmup_steps``,
    of the periods that divide ``s`` the largest one's group averages (one collective at most).

    Groups follow the nodes: a level's groups are contiguous blocks of ranks in node-major
    order, found with MPI's shared-memory communicator split (or Horovod's host information under
    Gloo), so a level of a node's size is exactly the node-local group. A group must stay inside
    one node or be made of whole nodes. Every group of every level is registered as a Horovod
    process set on every rank (shared through :func:`hvd_averaging.process_set`).

    Args:
        period_group_size_dict: ``period -> group size``, keys in any order. Sizes must not
            decrease with the period, each must divide the next larger one and the process set
            size, and the largest period's size must be the process set size.
        warmup_steps (int): steps before the first averaging, >= 0.
        process_set: the set that averages (default: all ranks).
        delay: an int delays the top level (across nodes) as in :class:`PeriodicModelAverager`;
            ``{period: delay}`` delays the levels named, each ``< period``. A delayed level's
            round stays in flight while lower levels average as scheduled; at its apply step it
            adds ``average(snapshot) - snapshot`` to the parameters. Default 0. A delayed level
            above another travels in pieces of at least 256 KiB that take at most ``delay``
            stages in all, one stage launched per step after that step's own round, so the lower
            levels' rounds wait for one piece at most, not for the whole round on Horovod's
            single background thread (:func:`~hvd_averaging.schedule.delayed_level_pieces`,
            :class:`~hvd_averaging.transports.InPieces`; same averages, piece by piece).
        compression: ``"fp16"``, ``hvd.Compression.fp16`` or ``"int8"`` for every level, or
            ``{period: compression}`` for the levels named (e.g. ``{32: "int8"}``: only the top
            level, the one that crosses the link); see :class:`PeriodicModelAverager`.
        error_feedback (bool): the int8 levels keep their quantization residuals (see
            :class:`PeriodicModelAverager`).

    Attributes:
        period_process_set_dict: ``period -> hvd.ProcessSet`` of this rank's group at that
            level (ascending periods; empty on ranks outside ``process_set``).

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init(group_sizes=[2])  # the pairs registered at start-up (or hva.init(): dynamic)
        >>> # 4 ranks: pairs every 2 steps, everyone every 8, from step 100 on
        >>> averager = hva.HierarchicalModelAverager({2: 2, 8: 4}, warmup_steps=100)
        >>> for step in range(200):
        ...     optimizer.zero_grad()
        ...     loss_fn(model(inputs), labels).backward()
        ...     optimizer.step()
        ...     averager.average_parameters(model.parameters())
    """

    def __init__(self, period_group_size_dict: Optional[Mapping[int, int]] = None,
                 warmup_steps: int = 0, process_set: Optional[hvd.ProcessSet] = None, *,
                 delay=0, compression=None, error_feedback: bool = False,
                 check_finite: bool = False):
        super().__init__(process_set, check_finite=check_finite)
        error = None
        self._compression_arg = (compression, error_feedback)  # compared across ranks if bad
        hierarchy: dict[int, int] = {}
        try:
            hierarchy = normalize_hierarchy(period_group_size_dict, len(members(self.process_set)),
                                            stacklevel=3)
            check_warmup_steps(warmup_steps)
            periods = list(hierarchy)
            delays = level_delays(delay, periods)
            self._levels.configure(
                delays, level_codecs(level_values(compression, periods, "compression", None),
                                     error_feedback, stacklevel=3),
                pieces=delayed_level_pieces(delays))
        except ValueError as e:
            error = e
        self.warmup_steps = warmup_steps
        self.period_group_size_dict = hierarchy
        self._periods = list(hierarchy)
        self._members.start(error)

    @property
    def period_process_set_dict(self) -> dict[int, hvd.ProcessSet]:
        """``period -> hvd.ProcessSet`` of this rank's group at that level."""
        return dict(self._members.level_sets)

    def level_at(self, step: int) -> Optional[int]:
        return hierarchical_period(step, self._periods, self.warmup_steps)

    @property
    def top_level(self) -> int:
        return self._periods[-1]

    def _level_groups(self, ranks: list[int], placement: list) -> dict[int, list[list[int]]]:
        """Every level's groups: contiguous node-major blocks of the level's size."""
        sizes = list(self.period_group_size_dict.values())
        return dict(zip(self.period_group_size_dict, hierarchy_groups(ranks, placement, sizes)))

    def _fit_world_size(self, size: int) -> None:
        """After an elastic reset: the largest level becomes the new world, the smaller levels
        keep their sizes.

        Raises:
            ValueError: the smaller levels do not fit the new world size (on every rank).
        """
        resized = dict(self.period_group_size_dict)
        resized[self._periods[-1]] = size
        try:
            hierarchy = normalize_hierarchy(resized, size)
        except ValueError as error:
            raise ValueError(
                f"after the elastic reset the world has {size} ranks and the hierarchy "
                f"{self.period_group_size_dict} does not fit it ({error}); choose group sizes "
                "that divide every world size the job may shrink or grow to") from None
        self.period_group_size_dict = hierarchy

    def _config(self) -> dict[str, Any]:
        return {"period_group_size_dict": self.period_group_size_dict,
                "warmup_steps": self.warmup_steps, "delays": self._levels.delays,
                "compression": self._levels.wire_specs() or repr(self._compression_arg),
                **super()._config()}
