"""When to average: PyTorch's model averagers re-created on Horovod process sets.

Construction is collective over all Horovod ranks (it verifies the configuration across ranks
and may register process sets); ``average_parameters`` is called by every rank once per training
step and averages only at the scheduled steps (:meth:`ModelAverager.level_at`). Rounds left in
flight are :class:`~hvd_averaging.delayed_rounds.DelayedRounds`'.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any, Mapping, Optional

import horovod.torch as hvd

from .agreement import check_same_on_all_ranks
from .delayed import AverageTransform
from .levels import LevelRounds
from .membership import Membership
from .params import TensorsLike, collect_parameters, floating_buffers
from .process_sets import members
from .schedule import check_delay, check_period, check_warmup_steps, periodic_fires
from .wire import level_codecs

__all__ = ["ModelAverager", "PeriodicModelAverager"]


class ModelAverager(ABC):
    r"""Base class for all model averagers.

    Args:
        process_set: the ``hvd.ProcessSet`` whose members average (default: all ranks); ranks
            outside it keep their parameters but still count steps.
        check_finite: before each averaging, raise ``NonFiniteError`` naming a NaN/Inf tensor
            and its rank (``RuntimeError`` naming it on the others) instead of spreading it to
            every model: one pass and one small collective per averaging; off by default.

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
        name = type(self).__name__
        self._levels = LevelRounds(name, self.check_finite)
        self._members = Membership(name, self.process_set, self._config, self._level_groups,
                                   self._fit_world_size)

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
        return self._levels.delays

    def transform_delayed_average(self, level: int, transform: AverageTransform, *,
                                  before_send: Optional[AverageTransform] = None) -> None:
        """``transform(tensors, averages)`` may replace in place the average a delayed round of
        ``level`` brings before it is applied, and ``before_send(tensors, wire_views)`` what it
        sends (a copy of the snapshot): DiLoCo's outer step and its progress since the copy.
        Raises ``ValueError`` if ``level`` is not a delayed level of this averager."""
        self._levels.set_transforms(level, transform, before_send)

    def average_parameters(self, params: TensorsLike, *, buffers=None) -> None:
        """Average ``params`` (and the floating-point ``buffers``, if given) in this rank's
        group of the level scheduled now, if any; then advance ``step``.

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups`` (those whose ``.grad``
                is None are skipped).
            buffers: optional ``model.buffers()``; its floating-point tensors (BatchNorm
                statistics) are averaged at the same moments, in the same collective.
        """
        tensors = lambda: collect_parameters(params) + floating_buffers(buffers)  # noqa: E731
        self._levels.advance(self.step, tensors, self._members.set_at)
        level = self.level_at(self.step)
        if level is not None:
            if self._members.follow_world():
                self._levels.drop_in_flight()  # their collectives died with the old world
            self._levels.average(level, tensors(), self._members.set_at(level), self.step)
        self._levels.keep_moving()
        self.step += 1

    def _level_groups(self, ranks: list[int], placement: list) -> dict[int, list[list[int]]]:
        """Every level's groups (one level, the whole set, unless a subclass has more)."""
        return {self.top_level: [ranks]}

    def _fit_world_size(self, size: int) -> None:
        """Fit the levels to a new world of ``size`` ranks after an elastic reset (local)."""

    def _config(self) -> dict[str, Any]:
        return {"process_set_ranks": members(self.process_set), "check_finite": self.check_finite}

    def state_dict(self) -> dict[str, Any]:
        """``step``, ``config``, ``wire`` (int8's residuals per level) and, while a delayed
        round is in flight, ``in_flight`` (its snapshot, from which loading restarts it)."""
        return {"step": self.step, "config": self._config(), **self._levels.state_dict()}

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> Optional[ValueError]:
        """What :meth:`load_state_dict` would reject in ``state_dict`` (local; changes nothing)."""
        return self._levels.state_error(state_dict)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (collective): every rank checks its state, the ranks agree
        on the outcome and the step, and only then is it applied.

        Raises:
            ValueError: a bad ``step``, a round in flight that does not fit, NaN/Inf in a
                snapshot or residual (on that rank; ``RuntimeError`` naming it on the others).
            RuntimeError: ranks loaded different steps (the next collective would hang).
        """
        error = self.check_state_dict(state_dict)
        check_same_on_all_ranks(f"{type(self).__name__}.load_state_dict step",
                                state_dict.get("step") if error is None else None,
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
        self._levels.load_state_dict(state_dict)
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
            self._levels.configure({period: delay}, codecs)
        self.period = period
        self.warmup_steps = warmup_steps
        self.delay = delay
        self.compression = compression
        self._members.start(error)

    def level_at(self, step: int) -> Optional[int]:
        return self.period if periodic_fires(step, self.period, self.warmup_steps) else None

    @property
    def top_level(self) -> int:
        return self.period

    def _config(self) -> dict[str, Any]:
        return {"period": self.period, "warmup_steps": self.warmup_steps, "delay": self.delay,
                "compression": self._levels.wire_specs() or repr(self._compression_arg), **super()._config()}
