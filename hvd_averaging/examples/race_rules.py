"""The race's rules as plain functions: the wall-clock grid, which snapshot stands for each grid
time, when the ranks stop, and how long a curve took to reach a target (the speed-up).

A curve is a sequence of points ``(seconds, ..., metric)``; snapshots are anything with a
``seconds`` attribute."""

from __future__ import annotations

from typing import Optional, Sequence, TypeVar

__all__ = ["grid_times", "pick_on_grid", "stop_at_sync_point", "time_to_reach", "speedup_at"]

SnapshotT = TypeVar("SnapshotT")


def grid_times(budget_s: float, points: int) -> list[float]:
    """``points + 1`` evenly spaced times from 0 to the budget, both ends included."""
    return [budget_s * i / points for i in range(points + 1)]


def pick_on_grid(snapshots: Sequence[SnapshotT], grid: Sequence[float],
                 final: SnapshotT) -> list[SnapshotT]:
    """For each grid time, the first snapshot taken at or after it (the step that crossed it);
    ``final`` for grid times the run did not reach."""
    picked = []
    for time_s in grid:
        later = [s for s in snapshots if s.seconds >= time_s]
        picked.append(later[0] if later else final)
    return picked


def stop_at_sync_point(steps: int, agreed: Sequence[tuple[float, int]], steps_ahead: int,
                       budget_s: float) -> bool:
    """Whether to stop at the synchronization point after ``steps`` steps, from the slowest
    rank's clock agreed at earlier points, ``agreed`` = [(clock, steps), ...] oldest first (this
    point's own is still travelling). The present is estimated at the pace between the last two
    of them; stop if it is past the budget or the next point, ``steps_ahead`` steps away, would
    be. With one agreed point there is no pace yet (its interval holds start-up costs): stop only
    if that point's pace puts the present past the budget."""
    if not agreed:
        return False
    clock_s, at = agreed[-1]
    if len(agreed) == 1:
        return at > 0 and clock_s + clock_s / at * (steps - at) >= budget_s
    previous_s, previous_at = agreed[-2]
    pace = (clock_s - previous_s) / max(1, at - previous_at)
    now_s = clock_s + pace * (steps - at)
    return now_s >= budget_s or now_s + pace * steps_ahead > budget_s


def time_to_reach(curve: Sequence[tuple], target: float, lower_is_better: bool = True) -> Optional[float]:
    """When the curve (points ``(seconds, ..., metric)``) first reached ``target``: on the line
    between the first point at or beyond it and the point before, where the metric equals it.

    The curve is sampled on a grid; the first point beyond the target alone would date the
    crossing half a grid step late on average (about 0.7 s of a 15 s crossing in the race).
    None if no point reaches it; the first point's time if that one already does."""
    before = None
    for point in curve:
        metric = point[-1]
        if (metric <= target) if lower_is_better else (metric >= target):
            if before is None:
                return point[0]
            # before's metric is short of the target and this one's is not: no zero division
            fraction = (before[-1] - target) / (before[-1] - metric)
            return before[0] + (point[0] - before[0]) * fraction
        before = point
    return None


def speedup_at(baseline_curve: Sequence[tuple], curve: Sequence[tuple], seconds: float,
               lower_is_better: bool = True) -> Optional[float]:
    """The speed-up a user would have seen had both runs stopped at ``seconds``: the baseline's
    time at its first curve point at or after ``seconds``, over the time this ``curve`` took to
    reach the baseline's metric there (:func:`time_to_reach`). None if the baseline never got
    there or the curve never reached it."""
    at = next((point for point in baseline_curve if point[0] >= seconds), None)
    if at is None:
        return None
    reached = time_to_reach(curve, at[-1], lower_is_better)
    return at[0] / reached if reached else None
