"""When to average: PyTorch's model averagers re-created on Horovod process sets.

Construction is collective over all Horovod ranks (it verifies the configuration across ranks
and may register process sets); ``average_parameters`` is called by every rank once per training
step and averages only at the scheduled steps (:meth:`ModelAverager.level_at`). Rounds left in
flight are :class:`~hvd_averaging.delayed.DelayedRounds`'.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any, Mapping, Optional

import horovod.torch as hvd

from .agreement import check_same_on_all_ranks
from .checkpoint import averager_state_error
from .delayed import AverageTransform, ConstructionOrder, DelayedRounds, start_delayed_average
from .params import TensorsLike, collect_parameters, floating_buffers
from .process_sets import members, process_set as registered_set, registered_process_sets
from .rounds import average_tensors
from .routes import prepare_process_set
from .schedule import check_delay, check_period, check_warmup_steps, periodic_fires
from .startup import elastic_job
from .wire import WireCodec, level_codecs
from .world import WorldFollower, current_world, renew_world

__all__ = ["ModelAverager", "PeriodicModelAverager"]


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
        if not hvd.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs Horovod: call hva.init() (or hvd.init()) first")
        self.check_finite = bool(check_finite)
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        if self.process_set.process_set_id is None:
            raise ValueError(
                f"process_set {self.process_set} is not registered with Horovod: create it with "
                "hva.process_set(ranks) or pass it to hvd.init(process_sets=[...])")
        self.step = 0
        self._number = current_world().component(ConstructionOrder).next()
        self._world = WorldFollower()
        self._delayed = DelayedRounds({})
        self._codecs: dict[int, WireCodec] = {}  # per level: its wire format and that one's state

    # -- the schedule ------------------------------------------------------------------------

    @abstractmethod
    def level_at(self, step: int) -> Optional[int]:
        """The level (a period) that averages at ``step``, or None (pure: same on every rank)."""

    @property
    @abstractmethod
    def top_level(self) -> int:
        """The largest period: the level over the whole process set."""

    @property
    def level_delays(self) -> dict[int, int]:
        """``{period: delay}`` of every level (0: averaged at its firing step)."""
        return dict(self._delayed.delays)

    def transform_delayed_average(self, level: int, transform: AverageTransform, *,
                                  before_send: Optional[AverageTransform] = None) -> None:
        """``transform(tensors, averages)`` may replace in place the average a delayed round of
        ``level`` brings before it is applied (``tensor = average + (tensor - snapshot)``), and
        ``before_send(tensors, wire_views)`` what it sends (a copy of the snapshot): DiLoCo
        sends progress since its global copy and puts its outer step on the average.

        Raises:
            ValueError: ``level`` is not a delayed level of this averager.
        """
        self._delayed.set_transforms(level, transform, before_send)

    # -- one call per training step ----------------------------------------------------------

    def average_parameters(self, params: TensorsLike, *, buffers=None) -> None:
        """Average ``params`` (and the floating-point ``buffers``, if given) in this rank's
        group of the level scheduled now, if any; then advance ``step``.

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups`` (those whose ``.grad``
                is None are skipped).
            buffers: optional ``model.buffers()``; its floating-point tensors (BatchNorm
                statistics) are averaged at the same moments, in the same collective.
        """
        if self._delayed.active:
            self._delayed.advance(self.step, lambda level, saved: self._start_delayed(
                params, buffers, level, saved["fired_at"], saved))
        level = self.level_at(self.step)
        if level is not None:
            self._follow_world()
            process_set = self._level_set(level)
            if self._delayed.delayed(level):
                self._start_delayed(params, buffers, level, self.step, None)
            elif process_set is not None:
                average_tensors(self._tensors(params, buffers), process_set,
                                check_finite=self.check_finite, compression=self._codecs.get(level),
                                context=f"{type(self).__name__} step {self.step}")
        self.step += 1

    @staticmethod
    def _tensors(params: TensorsLike, buffers) -> list:
        return collect_parameters(params) + floating_buffers(buffers)

    def _wire_specs(self) -> dict[int, Any]:
        return {level: codec.spec() for level, codec in self._codecs.items()}

    def _start_delayed(self, params, buffers, level: int, fired_at: int,
                       saved: Optional[dict]) -> None:
        process_set = self._level_set(level)
        if process_set is None:
            return
        round_ = start_delayed_average(
            self._tensors(params, buffers), process_set, op_tag=f".delayed{level}.a{self._number}",
            buffers=self._delayed.buffers.setdefault(level, {}), check_finite=self.check_finite,
            context=f"{type(self).__name__} step {fired_at} (delay {self._delayed.delays[level]})",
            compression=self._codecs.get(level),
            snapshots=None if saved is None else saved["snapshots"],
            snapshot_layout=None if saved is None else saved["layout"],
            before_send=self._delayed.before_send.get(level))
        self._delayed.launched(level, fired_at, round_)

    def _level_set(self, level: int) -> Optional[hvd.ProcessSet]:
        """This rank's set at ``level`` (None: this rank does not average there)."""
        return self.process_set if self.process_set.included() else None

    # -- the world the sets belong to --------------------------------------------------------

    def _agree_and_register(self, local_error: Optional[BaseException] = None) -> None:
        """Check the configuration across ranks and register the process sets (collective). In
        an elastic job this waits for the first firing step: a joining worker constructs its
        averager while the others are inside ``hvd.elastic.run`` (a collective here would hang),
        and every rank reaches a firing step with the same, synchronized, step."""
        if elastic_job():
            if local_error is not None:
                raise local_error
            return
        self._agree(local_error)
        self._register_sets()
        self._world.caught_up()

    def _agree(self, local_error: Optional[BaseException] = None) -> None:
        check_same_on_all_ranks(f"{type(self).__name__} arguments", self._config(),
                                local_error=local_error, name=f"hva.agree.{type(self).__name__}")

    def _register_sets(self) -> None:
        """Register the process sets of every level and prepare their routes (collective)."""
        self._prepare_sets([[members(self.process_set)]])

    def _follow_world(self) -> None:
        """At a firing step: if the world changed since the sets were made (an elastic reset)
        or they were never made (elastic start), agree and make them anew (collective)."""
        if self._sets_dropped():
            renew_world()  # Horovod was started again without an elastic reset announcing it
        if not self._world.behind():
            return
        if self._world.started:
            self._delayed.drop()  # their collectives died with the old world
            self._rebuild_for_world()
        self._agree()
        self._register_sets()
        self._world.caught_up()

    def _process_sets(self) -> list[hvd.ProcessSet]:
        return [self.process_set]

    def _sets_dropped(self) -> bool:
        """True when Horovod no longer holds this averager's sets (it was initialized again,
        which drops every set, horovod#4021)."""
        own = [s for s in self._process_sets() if s is not hvd.global_process_set]
        if not own or not self._world.started:
            return False
        registered = registered_process_sets()
        return any(registered.get(s.process_set_id) != members(s) for s in own)

    def _prepare_sets(self, groups_per_level: list[list[list[int]]]) -> None:
        """Let every group of these levels average node-aware where it spans nodes (collective:
        every rank prepares every group, in the same order)."""
        parent = members(self.process_set)
        for groups in groups_per_level:
            for group in groups:
                prepare_process_set(self.process_set if group == parent else registered_set(group))

    def _rebuild_for_world(self) -> None:
        """Fit the levels to the world after an elastic reset (local; :meth:`_follow_world`
        registers the sets afterwards).

        Raises:
            RuntimeError: the averager runs over a subset of ranks (none in the new world).
        """
        if self.process_set is not hvd.global_process_set:
            raise RuntimeError(
                f"{type(self).__name__} over process set {members(self.process_set)} cannot follow an "
                "elastic reset (the new world may not contain those ranks): average over all ranks")

    # -- state -------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {"process_set_ranks": members(self.process_set), "check_finite": self.check_finite}

    def state_dict(self) -> dict[str, Any]:
        """``step``, the configuration and, while a delayed round is in flight, its snapshot
        (``in_flight``: fired step, layout digest, one tensor per dtype), from which loading
        restarts that round, so the run goes on exactly as if uninterrupted."""
        state: dict[str, Any] = {"step": self.step, "config": self._config()}
        wire = {level: kept for level, kept in
                ((level, codec.state_dict()) for level, codec in self._codecs.items()) if kept}
        if wire:
            state["wire"] = wire  # int8's error feedback residuals, per level
        in_flight = self._delayed.state()
        if in_flight:
            state["in_flight"] = in_flight
        return state

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> Optional[ValueError]:
        """What :meth:`load_state_dict` would reject in ``state_dict`` (local; changes nothing)."""
        return averager_state_error(state_dict, self._delayed.delays,
                                    {level for level, codec in self._codecs.items() if codec.keeps_state})

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (collective: every rank must call it). Every rank checks
        its state, the ranks agree on the outcome and the step, and only then is it applied.

        Raises:
            ValueError: a bad ``step``, a round in flight that does not fit, NaN/Inf in a
                snapshot or residual (on that rank; the others raise ``RuntimeError`` naming it
                and the cause).
            RuntimeError: ranks loaded different steps (the next collective would hang).
        """
        error = self.check_state_dict(state_dict)
        step = state_dict.get("step") if error is None else None
        check_same_on_all_ranks(f"{type(self).__name__}.load_state_dict step", step,
                                local_error=error, name="hva.agree.load_state_dict")
        self.apply_state_dict(state_dict)

    def apply_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put a state in place that :meth:`check_state_dict` accepted on every rank and whose
        step the ranks agreed on (wrappers load their whole state with one agreement)."""
        saved = state_dict.get("config")
        if saved is not None and saved != self._config():
            warnings.warn(
                f"loading averager state saved with config {saved} into one with config "
                f"{self._config()}: the step is restored, the new config is kept",
                UserWarning, stacklevel=3)
        self._delayed.load(state_dict.get("in_flight") or {})
        for level, codec_state in (state_dict.get("wire") or {}).items():
            if level in self._codecs:
                self._codecs[level].load_state_dict(codec_state)
        self.step = state_dict["step"]


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
        compression: ``"fp16"`` (or ``hvd.Compression.fp16``): float16 on the wire, scaled so
            that nothing overflows; ``"int8"`` (or ``hva.Int8(block_size=...)``): int8 with a
            float32 scale per block across the link. Parameters keep their dtype;
            :mod:`hvd_averaging.wire` states the error bounds. Default: none.
        error_feedback (bool): with int8, each rank adds what quantizing lost in one round to
            the next round's values (its state is in :meth:`state_dict`; memory: about one
            float32 copy of what crosses in int8). Default False.

    Raises:
        ValueError: bad ``period``, ``warmup_steps``, ``delay``, ``compression`` or
            ``error_feedback`` (on every rank: ranks with good values raise ``RuntimeError``
            naming the bad ones).
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
                 compression=None, error_feedback: bool = False, check_finite: bool = False):
        super().__init__(process_set, check_finite=check_finite)
        error = None
        self._compression_arg = (compression, error_feedback)  # compared across ranks if bad
        try:
            check_period(period, stacklevel=3)
            check_warmup_steps(warmup_steps)
            check_delay(delay, period)
            codecs = level_codecs({period: compression}, error_feedback, stacklevel=3)
        except ValueError as e:
            error = e
        if error is None:
            self._delayed = DelayedRounds({period: delay})
            self._codecs = codecs
        self.period = period
        self.warmup_steps = warmup_steps
        self.delay = delay
        self.compression = compression
        self._agree_and_register(error)

    def level_at(self, step: int) -> Optional[int]:
        return self.period if periodic_fires(step, self.period, self.warmup_steps) else None

    @property
    def top_level(self) -> int:
        return self.period

    def _config(self) -> dict[str, Any]:
        return {"period": self.period, "warmup_steps": self.warmup_steps, "delay": self.delay,
                "compression": self._wire_specs() or repr(self._compression_arg), **super()._config()}
