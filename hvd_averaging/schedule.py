"""When to average: argument rules and firing schedules of the averagers, as pure functions.

Every rank evaluates the same schedule on the same step counter, so all members of a process
set reach the same collective at the same step without talking to each other.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Optional

__all__ = [
    "delayed_level_pieces",
    "check_int",
    "check_positive_int",
    "check_warmup_steps",
    "check_period",
    "normalize_hierarchy",
    "periodic_fires",
    "hierarchical_period",
    "check_delay",
    "level_delays",
    "level_values",
]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int, unit: str = "") -> int:
    """Return ``value`` if it is an integer >= ``minimum``, else raise ``ValueError`` naming it
    (``unit`` completes "must be an integer", e.g. " number of steps")."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer{unit}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive_int(name: str, value) -> int:
    """Return ``value`` if it is an integer >= 1, else raise ``ValueError`` naming it."""
    return check_int(name, value, 1)


def check_warmup_steps(warmup_steps) -> int:
    """Return ``warmup_steps`` if it is an integer >= 0, else raise ``ValueError``."""
    return check_int("warmup_steps", warmup_steps, 0)


def check_period(period, *, stacklevel: int = 3) -> int:
    """Validate an averaging period; warn when it is 1 (averaging every step is pointless)."""
    check_positive_int("period", period)
    if period == 1:
        warnings.warn(
            "period is 1: averaging parameters every step costs at least as much as "
            "allreducing gradients every step; use hvd.DistributedOptimizer instead",
            UserWarning,
            stacklevel=stacklevel,
        )
    return period


def normalize_hierarchy(
    period_group_size_dict: Optional[Mapping[int, int]],
    process_set_size: int,
    *,
    stacklevel: int = 3,
) -> dict[int, int]:
    """Validate a ``period -> group size`` hierarchy and return it ordered by period.

    Rules (each violation raises ``ValueError`` naming the value and the rule):

    * the hierarchy is a non-empty mapping of integer periods >= 1 to integer sizes >= 1;
    * every group size divides ``process_set_size``;
    * sizes do not decrease as the period grows, and each level's size divides the size of the
      next larger period (so groups nest: a level's group is a union of smaller-level groups);
    * the largest period's size equals ``process_set_size`` (the top level is everyone).

    A hierarchy whose largest period is 1 averages every step and only warns.

    Example::

        >>> normalize_hierarchy({8: 4, 2: 2}, 4)
        {2: 2, 8: 4}
    """
    if period_group_size_dict is None or not isinstance(period_group_size_dict, Mapping):
        raise ValueError(
            "period_group_size_dict must be a non-empty mapping of period -> group size, "
            f"got {period_group_size_dict!r}"
        )
    if len(period_group_size_dict) == 0:
        raise ValueError("period_group_size_dict is empty: give at least one period -> group size")
    for period, size in period_group_size_dict.items():
        check_positive_int(f"period {period!r} in period_group_size_dict", period)
        check_positive_int(f"group size {size!r} (period {period}) in period_group_size_dict", size)
        if process_set_size % size != 0:
            raise ValueError(
                f"group size {size} (period {period}) does not divide the process set size "
                f"{process_set_size}: every rank must belong to exactly one group of that size"
            )
    ordered = dict(sorted(period_group_size_dict.items()))
    periods = list(ordered)
    for smaller, larger in zip(periods, periods[1:]):
        small_size, large_size = ordered[smaller], ordered[larger]
        if large_size < small_size:
            raise ValueError(
                f"group sizes must not decrease as the period grows: period {smaller} has size "
                f"{small_size} but the larger period {larger} has size {large_size}"
            )
        if large_size % small_size != 0:
            raise ValueError(
                f"group size {small_size} (period {smaller}) does not divide the size "
                f"{large_size} of the next larger period {larger}: levels must nest"
            )
    top_period = periods[-1]
    if ordered[top_period] != process_set_size:
        raise ValueError(
            f"the largest period {top_period} has group size {ordered[top_period]}, but it must "
            f"equal the process set size {process_set_size} (the top level averages everyone)"
        )
    if top_period == 1:
        warnings.warn(
            "the largest period of the hierarchy is 1: every step averages over the whole "
            "process set, which costs at least as much as allreducing gradients; use "
            "hvd.DistributedOptimizer instead",
            UserWarning,
            stacklevel=stacklevel,
        )
    return ordered


def periodic_fires(step: int, period: int, warmup_steps: int) -> bool:
    """True iff a periodic averager averages at ``step``.

    Example::

        >>> [s for s in range(20) if periodic_fires(s, 4, 13)]
        [13, 17]
    """
    return step >= warmup_steps and (step - warmup_steps) % period == 0


def hierarchical_period(step: int, periods_ascending, warmup_steps: int) -> Optional[int]:
    """The period whose group averages at ``step``, or None when nobody averages.

    Of the periods that divide ``step`` the largest wins, so at most one collective runs.

    Example::

        >>> [hierarchical_period(s, [2, 4], 10) for s in (9, 10, 11, 12)]
        [None, 2, None, 4]
    """
    if step < warmup_steps:
        return None
    for period in reversed(periods_ascending):
        if step % period == 0:
            return period
    return None


def check_delay(delay, period: int) -> int:
    """Return ``delay`` if it is an integer with ``0 <= delay < period``, else raise ``ValueError``.

    A round started at a firing step ``s`` is applied at ``s + delay``; the level's next firing
    step is ``s + period`` at the earliest, so one round per level is in flight at a time.
    """
    check_int("delay", delay, 0, " number of steps")
    if delay >= period:
        raise ValueError(
            f"delay {delay} must be smaller than the period {period}: a round started at a firing "
            "step is applied `delay` steps later, before the level fires again")
    return delay


def level_values(value, periods, name: str, default) -> dict:
    """Per-level settings of a hierarchy: one value for every level, or ``{period: value}``
    (levels not named get ``default``).

    Raises:
        ValueError: a key is not one of ``periods``.

    Example::

        >>> level_values({8: "fp16"}, [2, 8], "compression", None)
        {2: None, 8: 'fp16'}
    """
    if isinstance(value, Mapping):
        unknown = [p for p in value if p not in periods]
        if unknown:
            raise ValueError(f"{name} names period(s) {unknown} that are not levels of the "
                             f"hierarchy (periods {list(periods)})")
        return {p: value.get(p, default) for p in periods}
    return {p: value for p in periods}


def level_delays(delay, periods) -> dict[int, int]:
    """``delay`` of a hierarchy per level: an integer delays the top level (the largest period,
    the one across nodes), ``{period: delay}`` the levels named. Each must fit its period
    (:func:`check_delay`).

    Example::

        >>> level_delays(3, [2, 8])
        {2: 0, 8: 3}
    """
    if isinstance(delay, Mapping):
        delays = level_values(delay, periods, "delay", 0)
    else:
        delays = {p: 0 for p in periods}
        delays[periods[-1]] = delay
    for period, value in delays.items():
        try:
            check_delay(value, period)
        except ValueError as error:
            raise ValueError(f"level with period {period}: {error}") from None
    return delays


def delayed_level_pieces(delays: Mapping[int, int]) -> dict[int, int]:
    """The stage launches each delayed level's rounds may take in pieces (its ``delay``: one per
    step of its window; see :class:`~hvd_averaging.transports.InPieces`), for a level with a
    smaller level beneath it (whose rounds would otherwise wait behind the whole round on
    Horovod's one background thread); the lowest level travels whole. ``delays``: ``{period: delay}``, periods ascending.

    Example::

        >>> delayed_level_pieces({2: 0, 16: 8})
        {16: 8}
        >>> delayed_level_pieces({16: 8})
        {}
    """
    lowest = min(delays, default=None)
    return {period: delay for period, delay in delays.items() if delay > 1 and period != lowest}

