"""When to average: PyTorch's model averagers re-created on Horovod process sets.

Construction is collective over all Horovod ranks (it verifies the configuration across ranks
and may register process sets); ``average_parameters`` is called by every rank once per training
step and averages only at the scheduled steps.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any, Mapping, Optional

import horovod.torch as hvd

from .communication import (DelayedAverage, TensorsLike, average_tensors, collect_parameters,
                            compression_name, floating_buffers, forget_layout_agreements,
                            prepare_process_set, start_delayed_average, wire_is_fp16)
from .runtime import (check_same_on_all_ranks, elastic_job, forget_process_sets, members,
                      process_set as registered_set, rank_to_node, register_groups,
                      registered_process_sets)
from .schedule import (
    check_delay,
    check_period,
    check_warmup_steps,
    hierarchical_period,
    level_delays,
    level_values,
    normalize_hierarchy,
    periodic_fires,
)
from .topology import hierarchy_groups

__all__ = ["ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager"]


def _require_horovod(cls_name: str) -> None:
    if not hvd.is_initialized():
        raise RuntimeError(f"{cls_name} needs Horovod: call hva.init() (or hvd.init()) first")


class ModelAverager(ABC):
    r"""Base class for all model averagers.

    Args:
        process_set: the ``hvd.ProcessSet`` whose members average together. ``None`` means
            Horovod's global process set. Ranks outside it keep their parameters but still
            count steps.
        check_finite: before each averaging, check every tensor for NaN/Inf and raise
            ``NonFiniteError`` naming the tensor and rank (on that rank; ``RuntimeError`` naming
            it on the others) instead of spreading it to every model. Costs one pass over the
            parameters and one small collective per averaging; off by default.

    Attributes:
        step (int): number of ``average_parameters`` calls so far (the training step).
    """

    def __init__(self, process_set: Optional[hvd.ProcessSet] = None, *, check_finite: bool = False):
        _require_horovod(type(self).__name__)
        self.check_finite = bool(check_finite)
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        if self.process_set.process_set_id is None:
            raise ValueError(
                f"process_set {self.process_set} is not registered with Horovod: create it with "
                "hva.process_set(ranks) or pass it to hvd.init(process_sets=[...])"
            )
        self.step = 0
        # The world the sets were made for; None until the first firing step of an elastic job,
        # where construction must not be collective (see _agree_and_register).
        self._world: Optional[int] = None
        # Rounds in flight (delay > 0) by level period, with the step each is applied at; and
        # rounds read from a checkpoint, restarted at the next call.
        self._in_flight: dict[int, tuple[int, DelayedAverage]] = {}
        self._to_restart: dict[int, dict] = {}
        self._delay_buffers: dict[int, dict] = {}
        self._delays: dict[int, int] = {}
        self._fp16: dict[int, bool] = {}

    def _agree_and_register(self, local_error: Optional[BaseException] = None) -> None:
        """Check the configuration across ranks and register this averager's process sets
        (collective). In an elastic job (``HOROVOD_ELASTIC=1``) this waits for the first firing
        step: a worker that joins constructs its averager while the others are inside
        ``hvd.elastic.run``, so a collective here would hang; every rank reaches a firing step
        with the same step (it is synchronized state), so doing it there is safe."""
        if elastic_job():
            if local_error is not None:
                raise local_error
            return
        self._agree(local_error)
        self._register_sets()
        self._world = hvd.size()

    def _agree(self, local_error: Optional[BaseException] = None) -> None:
        check_same_on_all_ranks(f"{type(self).__name__} arguments", self._config(),
                                local_error=local_error, name=f"hva.agree.{type(self).__name__}")

    def _register_sets(self) -> None:
        """Register the process sets beyond ``process_set`` (collective); none here."""

    def _follow_world(self) -> None:
        """At a firing step: if Horovod was (re)initialized since the sets were made (an elastic
        reset drops every process set, horovod#4021) or they were never made (elastic start),
        agree and re-create them for the world as it is now. Collective, same on every rank."""
        if self._world == hvd.size() and not self._sets_dropped():
            return
        if self._world is not None:
            forget_process_sets()
            forget_layout_agreements()
            self._in_flight.clear()  # their collectives died with the old world
            self._to_restart.clear()
            self._rebuild_for_world()
        self._agree()
        self._register_sets()
        self._world = hvd.size()

    @property
    def level_delays(self) -> dict[int, int]:
        """``{period: delay}`` of every level (0: averaged at its firing step)."""
        return dict(self._delays)

    @abstractmethod
    def average_parameters(self, params: TensorsLike, *, buffers=None) -> None:
        """Average ``params`` (and the floating-point ``buffers``, if given) if this step is
        scheduled, then advance ``step``."""
        raise NotImplementedError

    @staticmethod
    def _tensors(params: TensorsLike, buffers) -> list:
        return collect_parameters(params) + floating_buffers(buffers)

    def _config(self) -> dict[str, Any]:
        return {"process_set_ranks": members(self.process_set), "check_finite": self.check_finite}

    def _sets_dropped(self) -> bool:
        """True when Horovod no longer holds this averager's process sets as they were (an
        elastic reset shut Horovod down and initialized it again, horovod#4021)."""
        own = [s for s in self._process_sets() if s is not hvd.global_process_set]
        if not own:
            return False
        registered = registered_process_sets()
        return any(registered.get(s.process_set_id) != members(s) for s in own)

    def _process_sets(self) -> list:
        return [self.process_set]

    def _prepare_sets(self, groups_per_level: list[list[list[int]]]) -> None:
        """Let every group of these levels average node-aware where it spans nodes (collective:
        every rank prepares every group, in the same order)."""
        parent = members(self.process_set)
        for groups in groups_per_level:
            for group in groups:
                prepare_process_set(self.process_set if group == parent else registered_set(group))

    def _average(self, params: TensorsLike, buffers, process_set: hvd.ProcessSet, level: int) -> None:
        """Average now at ``level`` (a period), or start a round left in flight if it is delayed."""
        context = f"{type(self).__name__} step {self.step}"
        compression = hvd.Compression.fp16 if self._fp16.get(level) else None
        if not self._delays.get(level):
            average_tensors(self._tensors(params, buffers), process_set,
                            check_finite=self.check_finite, context=context,
                            compression=compression)
            return
        self._start_delayed(params, buffers, process_set, level, self.step, None)

    def _start_delayed(self, params, buffers, process_set, level: int, fired_at: int,
                       saved: Optional[dict]) -> None:
        context = f"{type(self).__name__} step {fired_at} (delay {self._delays[level]})"
        round_ = start_delayed_average(
            self._tensors(params, buffers), process_set, op_tag=f".delayed{level}",
            buffers=self._delay_buffers.setdefault(level, {}), check_finite=self.check_finite,
            context=context, compression=hvd.Compression.fp16 if self._fp16.get(level) else None,
            snapshots=None if saved is None else saved["snapshots"],
            snapshot_layout=None if saved is None else saved["layout"])
        if round_ is not None:
            self._in_flight[level] = (fired_at + self._delays[level], round_)

    def _rounds_in_flight(self, params: TensorsLike, buffers) -> None:
        """Restart rounds read from a checkpoint, apply those due at this step, keep the others
        moving (a poll each: no waiting)."""
        for level, saved in sorted(self._to_restart.items()):
            del self._to_restart[level]
            process_set = self._level_set(level)
            if process_set is not None:
                self._start_delayed(params, buffers, process_set, level, saved["fired_at"], saved)
        for level, (apply_at, round_) in sorted(self._in_flight.items()):
            if self.step >= apply_at:
                del self._in_flight[level]
                round_.apply()
            else:
                round_.progress()

    def _level_set(self, level: int) -> Optional[hvd.ProcessSet]:
        """This rank's set at ``level`` (None: this rank does not average there)."""
        return self.process_set if self.process_set.included() else None

    def state_dict(self) -> dict[str, Any]:
        """The averager's resumable state: ``step``, the configuration it applies to and, while a
        delayed round is in flight, its snapshot (``in_flight``: fired step, layout digest,
        one tensor per dtype). Loading it restarts that round from the same snapshot, so the
        run goes on exactly as if uninterrupted."""
        state: dict[str, Any] = {"step": self.step, "config": self._config()}
        in_flight = {level: {"fired_at": apply_at - self._delays[level], "layout": r.layout_digest,
                             "snapshots": r.snapshots()}
                     for level, (apply_at, r) in self._in_flight.items()}
        in_flight.update(self._to_restart)
        if in_flight:
            state["in_flight"] = in_flight
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore ``step`` from :meth:`state_dict` (collective: every rank must call it).

        Raises:
            ValueError: ``step`` is missing or not an integer >= 0.
            RuntimeError: ranks loaded different steps (their schedules would diverge and the
                next averaging collective would hang).
        """
        step = state_dict.get("step") if isinstance(state_dict, Mapping) else None
        error = None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            error = ValueError(f"state_dict['step'] must be an integer >= 0, got {step!r}")
        check_same_on_all_ranks(
            f"{type(self).__name__}.load_state_dict step", step, local_error=error,
            name="hva.agree.load_state_dict",
        )
        saved = state_dict.get("config")
        if saved is not None and saved != self._config():
            warnings.warn(
                f"loading averager state saved with config {saved} into one with config "
                f"{self._config()}: the step is restored, the new config is kept",
                UserWarning,
                stacklevel=2,
            )
        for _, round_ in self._in_flight.values():
            round_.finish_without_applying()
        self._in_flight.clear()
        self._to_restart = self._checked_in_flight(state_dict.get("in_flight") or {}, step)
        self.step = step

    def _checked_in_flight(self, in_flight, step: int) -> dict[int, dict]:
        """The checkpoint's in-flight rounds, if they fit this averager's delays and ``step``
        (the same on every rank: checked by the step agreement before)."""
        if not isinstance(in_flight, Mapping):
            raise ValueError(f"state_dict['in_flight'] must be a dict, got {type(in_flight).__name__}")
        checked = {}
        for level, saved in in_flight.items():
            delay = self._delays.get(level, 0)
            fired_at = saved.get("fired_at") if isinstance(saved, Mapping) else None
            if not delay or not isinstance(fired_at, int) or not fired_at < step <= fired_at + delay:
                raise ValueError(
                    f"state_dict['in_flight'][{level!r}] (fired at {fired_at!r}) does not fit this "
                    f"averager at step {step} (delays per level {self._delays})")
            checked[level] = dict(saved)
        return checked

    def _rebuild_for_world(self) -> None:
        """Fit this averager's levels to the world after Horovod was re-initialized (an elastic
        reset). Local; :meth:`_follow_world` registers the sets afterwards.

        Raises:
            RuntimeError: the averager runs over a subset of ranks, which has no counterpart in
                the new world.
        """
        if self.process_set is not hvd.global_process_set:
            raise RuntimeError(
                f"{type(self).__name__} over process set {members(self.process_set)} cannot follow an "
                "elastic reset (the new world may not contain those ranks): average over all ranks")


class PeriodicModelAverager(ModelAverager):
    r"""Averages parameters every ``period`` steps after ``warmup_steps`` steps.

    Averages at step ``s`` iff ``s >= warmup_steps and (s - warmup_steps) % period == 0``.
    With gradient allreduce during warm-up this is `post-local SGD
    <https://arxiv.org/abs/1808.07217>`_ (see :class:`hvd_averaging.PostLocalSGD`).

    Across nodes with several ranks each the set averages node-aware (reduce inside each node,
    cross the link with one model per node, gather inside the node), chosen automatically.

    Args:
        period (int): steps between two averagings, >= 1 (1 only warns: then gradient allreduce
            with ``hvd.DistributedOptimizer`` is cheaper).
        warmup_steps (int): steps before the first averaging, >= 0.
        process_set: the set that averages (default: all ranks).
        delay (int): ``0 <= delay < period``. With ``delay > 0`` (`Streaming DiLoCo
            <https://arxiv.org/abs/2501.18512>`_'s overlap, torchft's ``fragment_sync_delay``)
            a firing step ``s`` snapshots the parameters and starts averaging the snapshot
            without waiting; training goes on, and at step ``s + delay`` the parameters become
            ``average(snapshot) + (parameters - snapshot)``: the models' average at ``s`` plus
            the local progress since. The steps in between only poll (the averaging moves on
            Horovod's background thread). Extra memory while in flight: the snapshot and the
            buffer the average arrives in.
        compression: ``hvd.Compression.fp16`` sends float16 on the wire (half the bytes),
            scaled so that nothing overflows; parameters keep their dtype (error bound in
            :mod:`hvd_averaging.transports.fp16_wire`). Default: none.

    Raises:
        ValueError: bad ``period``, ``warmup_steps``, ``delay`` or ``compression`` (on every
            rank: ranks with good values raise ``RuntimeError`` naming the bad ones).
        RuntimeError: ranks passed different arguments.

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> averager = hva.PeriodicModelAverager(period=4, warmup_steps=100)
        >>> for step in range(200):
        ...     optimizer.zero_grad()
        ...     loss_fn(model(inputs), labels).backward()
        ...     optimizer.step()
        ...     # averages the model over all ranks every 4 steps from step 100 on
        ...     averager.average_parameters(model.parameters())
    """

    def __init__(self, period: int, warmup_steps: int = 0,
                 process_set: Optional[hvd.ProcessSet] = None, *, delay: int = 0,
                 compression=None, check_finite: bool = False):
        super().__init__(process_set, check_finite=check_finite)
        error = None
        self._compression_label = repr(compression)  # compared across ranks, even when bad
        try:
            check_period(period, stacklevel=3)
            check_warmup_steps(warmup_steps)
            check_delay(delay, period)
            self._compression_label = compression_name(compression)
            self._delays = {period: delay}
            self._fp16 = {period: self._compression_label == "fp16"}
        except ValueError as e:
            error = e
        self.period = period
        self.warmup_steps = warmup_steps
        self.delay = delay
        self.compression = compression
        self._agree_and_register(error)

    def _config(self) -> dict[str, Any]:
        return {"period": self.period, "warmup_steps": self.warmup_steps, "delay": self.delay,
                "compression": self._compression_label, **super()._config()}

    def _register_sets(self) -> None:
        self._prepare_sets([[members(self.process_set)]])

    def average_parameters(self, params: TensorsLike, *, buffers=None) -> None:
        """Average ``params`` over the process set if this step is scheduled; advance ``step``.

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups`` (parameters whose
                ``.grad`` is None are skipped).
            buffers: optional ``model.buffers()``; its floating-point tensors (BatchNorm
                running statistics) are averaged at the same moments, in the same collective.
        """
        if self._in_flight or self._to_restart:
            self._rounds_in_flight(params, buffers)
        if periodic_fires(self.step, self.period, self.warmup_steps):
            self._follow_world()
            self._average(params, buffers, self.process_set, self.period)
        self.step += 1


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
            adds ``average(snapshot) - snapshot`` to the parameters. Default 0.
        compression: ``hvd.Compression.fp16`` for every level, or ``{period: compression}`` for
            the levels named (e.g. only the top level, the one that crosses the link).

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
                 delay=0, compression=None, check_finite: bool = False):
        super().__init__(process_set, check_finite=check_finite)
        set_ranks = members(self.process_set)
        error = None
        hierarchy: dict[int, int] = {}
        try:
            hierarchy = normalize_hierarchy(period_group_size_dict, len(set_ranks), stacklevel=3)
            check_warmup_steps(warmup_steps)
            periods = list(hierarchy)
            self._delays = level_delays(delay, periods)
            self._fp16 = {p: wire_is_fp16(c)
                          for p, c in level_values(compression, periods, "compression", None).items()}
        except ValueError as e:
            error = e
        self.warmup_steps = warmup_steps
        self.period_group_size_dict = hierarchy
        self._periods = list(hierarchy)
        self.period_process_set_dict: dict[int, hvd.ProcessSet] = {}
        self._agree_and_register(error)

    def _process_sets(self) -> list:
        return [self.process_set, *self.period_process_set_dict.values()]

    def _register_sets(self) -> None:
        """Register every group of every level (collective) and keep this rank's."""
        set_ranks = members(self.process_set)
        hierarchy = self.period_group_size_dict
        levels = hierarchy_groups(set_ranks, rank_to_node(), list(hierarchy.values()))
        self.period_process_set_dict = {}
        for period, groups in zip(hierarchy, levels):
            mine = register_groups(self.process_set, groups)
            if mine is not None:
                self.period_process_set_dict[period] = mine
        self._prepare_sets(levels)

    def _level_set(self, level: int) -> Optional[hvd.ProcessSet]:
        return self.period_process_set_dict.get(level)

    def _rebuild_for_world(self) -> None:
        """After an elastic reset: the largest level becomes the new world, the smaller levels
        keep their sizes (their groups are registered again by :meth:`_follow_world`).

        Raises:
            ValueError: the smaller levels do not fit the new world size (on every rank).
        """
        super()._rebuild_for_world()
        world = hvd.size()
        resized = dict(self.period_group_size_dict)
        resized[self._periods[-1]] = world
        try:
            hierarchy = normalize_hierarchy(resized, world)
        except ValueError as error:
            raise ValueError(
                f"after the elastic reset the world has {world} ranks and the hierarchy "
                f"{self.period_group_size_dict} does not fit it ({error}); choose group sizes "
                "that divide every world size the job may shrink or grow to") from None
        self.period_group_size_dict = hierarchy

    def _config(self) -> dict[str, Any]:
        return {"period_group_size_dict": self.period_group_size_dict,
                "warmup_steps": self.warmup_steps, "delays": self._delays,
                "compression": {p: "fp16" if f else "none" for p, f in self._fp16.items()},
                **super()._config()}

    def average_parameters(self, params: TensorsLike, *, buffers=None) -> None:
        """Average ``params`` in this rank's group of the level scheduled now; advance ``step``.

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups`` (parameters whose
                ``.grad`` is None are skipped).
            buffers: optional ``model.buffers()``; its floating-point tensors are averaged at
                the same moments, in the same collective.
        """
        if self._in_flight or self._to_restart:
            self._rounds_in_flight(params, buffers)
        period = hierarchical_period(self.step, self._periods, self.warmup_steps)
        if period is not None:
            self._follow_world()
        if period is not None and period in self.period_process_set_dict:
            self._average(params, buffers, self.period_process_set_dict[period], period)
        self.step += 1
