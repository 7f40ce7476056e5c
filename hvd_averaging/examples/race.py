"""The race's mechanics: one method trained against a wall-clock budget, and the models a user
would have been handed, snapshotted on a wall-clock grid and evaluated afterwards.

- The clock counts training only: snapshots and evaluation pause it (:class:`TrainingClock`).
- Ranks stop together: the decision is taken at the method's synchronization points (every step
  for gradient allreduce, after each top-level round for the averagers) from the slowest rank's
  clock, so no rank is left waiting in a collective the others skipped. That clock is agreed
  without waiting: each point launches its agreement and the next point reads it (long done by
  then) and estimates the present from it, so the race's bookkeeping costs the training next to
  nothing, and a run stops at most one interval early or late.
- "The model a user would be handed" if training stopped there is the average over all ranks
  of their parameters (one final average, its cost not counted), for every method alike:
  DiLoCo's too, whose global copy lags the ranks by up to H + delay steps. Each rank keeps
  its snapshots; afterwards rank 0 averages them over
  the ranks (through files when every rank sees the output folder, as on one host or a shared
  file system; otherwise by allreduce, outside the clock) and evaluates them.
"""

from __future__ import annotations

import math
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import horovod.torch as hvd
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from hvd_averaging.gather_text import broadcast_text
from hvd_averaging.traffic import interface_tx_bytes, traffic

from hvd_averaging.examples.collectives import PendingMax, allgather_rows, allreduce, barrier
from hvd_averaging.examples.race_rules import grid_times, pick_on_grid, stop_at_sync_point

__all__ = ["TrainingClock", "Snapshot", "Trainer", "RaceLimits", "run_method",
           "evaluate_snapshots", "shared_folder"]


class TrainingClock:
    """Wall seconds since it started, without the time spent inside :meth:`paused`."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._paused_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._started - self._paused_s

    @contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - began


@dataclass
class Snapshot:
    """The handed-over model of one rank after ``step`` steps, ``seconds`` into training."""
    seconds: float
    step: int
    link_bytes: float  # sent across the link between nodes per rank so far
    params: torch.Tensor  # flat, float32, on the CPU


class Trainer:
    """One method's training step, seen by the race.

    ``step(x, y)`` trains one step and returns (training loss, compute seconds: forward,
    backward and the inner optimizer step, communication seconds: what the step spent waiting
    for or running its method's communication); ``sync_point(step)`` says whether the ranks are in
    step after ``step`` steps (no round in flight), so that the race may agree to stop there;
    ``handed_params()`` are the tensors a user would take away (averaged over ranks later).
    """

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        raise NotImplementedError

    def sync_point(self, step: int) -> bool:
        raise NotImplementedError

    def handed_params(self) -> Sequence[torch.Tensor]:
        raise NotImplementedError

    def link_bytes(self) -> Optional[float]:
        """Bytes this rank sent across the link so far, where nothing better is measured."""
        return None


@dataclass
class RaceLimits:
    """When a method stops: after ``steps`` steps, or the last synchronization point whose next
    interval would end past ``budget_s`` (whichever is set; ``steps`` wins)."""
    budget_s: Optional[float] = None
    steps: Optional[int] = None
    grid_points: int = 40
    progress_every_s: float = 15.0
    label: str = ""


@dataclass
class MethodRun:
    """What one rank measured for one method."""
    steps: int = 0
    wall_s: float = 0.0
    compute_s: float = 0.0
    communication_s: float = 0.0
    agreement_s: float = 0.0  # the race's own stop agreements
    snapshots: list = field(default_factory=list)
    final: Optional[Snapshot] = None

    def stage_seconds(self) -> dict[str, float]:
        """Where this rank's communication time went, from the library's own counters
        (``hva.traffic()``, reset before the run), and the race's own agreements."""
        counted = traffic()
        return {"node and other local rounds": counted.local_round_s,
                "global rounds (blocking)": counted.global_round_s,
                "delayed rounds: launch": counted.launch_s,
                "delayed rounds: polls": counted.poll_s,
                "delayed rounds: wait at apply": counted.apply_wait_s,
                "the race's stop agreements": self.agreement_s}


def run_method(trainer: Trainer, batches: Iterator, limits: RaceLimits, *,
               link_interface: Optional[str] = None, quiet: bool = False,
               name: str = "race") -> MethodRun:
    """Train until the limits say stop (every rank stops at the same step); returns this rank's
    measurements and its snapshots (every step without a budget, else on the budget's grid)."""
    if limits.budget_s is None and limits.steps is None:
        raise ValueError("run_method needs a budget in seconds or a number of steps")
    ranks_on_node = max(1, hvd.local_size())
    tx_start = interface_tx_bytes(link_interface) if link_interface else None

    def link_bytes() -> float:
        if tx_start is not None:
            return (interface_tx_bytes(link_interface) - tx_start) / ranks_on_node
        counted = trainer.link_bytes()
        return float("nan") if counted is None else counted

    def snapshot(clock_s: float, step: int) -> Snapshot:
        with torch.no_grad():
            flat = parameters_to_vector([p.detach().float().cpu() for p in trainer.handed_params()])
        return Snapshot(clock_s, step, link_bytes(), flat.clone())

    grid = grid_times(limits.budget_s, limits.grid_points) if limits.steps is None else None
    run = MethodRun()
    barrier(f"{name}: start together")
    clock = TrainingClock()
    with clock.paused():
        run.snapshots.append(snapshot(0.0, 0))
    next_grid, next_progress = 1, limits.progress_every_s
    agreed: list[tuple[float, int]] = []  # the slowest clock at earlier sync points
    pending, pending_steps = None, 0  # this point's agreement, read at the next
    while True:
        x, y = next(batches)
        loss, compute_s, communication_s = trainer.step(x, y)
        run.steps += 1
        run.compute_s += compute_s
        run.communication_s += communication_s
        now = clock.now()
        with clock.paused():
            if grid is None:
                run.snapshots.append(snapshot(now, run.steps))
            elif next_grid < len(grid) and now >= grid[next_grid]:
                run.snapshots.append(snapshot(now, run.steps))
                while next_grid < len(grid) and now >= grid[next_grid]:
                    next_grid += 1
            if hvd.rank() == 0 and not quiet and now >= next_progress:
                next_progress += limits.progress_every_s
                if limits.steps is not None:
                    left = now / run.steps * (limits.steps - run.steps)
                    where = f"step {run.steps:>4}/{limits.steps}"
                else:
                    left, where = max(0.0, limits.budget_s - now), f"step {run.steps:>4}"
                print(f"  {limits.label:<24} {where}  training loss {loss:.3f}  "
                      f"{now:6.1f} s  ~{left:.0f} s left", flush=True)
        if limits.steps is not None:
            if run.steps >= limits.steps:
                break
        elif trainer.sync_point(run.steps):
            began = time.perf_counter()
            if pending is not None:
                agreed.append((pending.result(), pending_steps))
            ahead = next(k for k in range(1, 1_000_000) if trainer.sync_point(run.steps + k))
            stop = stop_at_sync_point(run.steps, agreed, ahead, limits.budget_s)
            pending, pending_steps = (None if stop else
                                      PendingMax(now, f"{name}.clock.{run.steps}")), run.steps
            run.agreement_s += time.perf_counter() - began
            if stop:
                break
    run.wall_s = clock.now()
    run.final = snapshot(run.wall_s, run.steps)
    return run


def shared_folder(folder: Path) -> bool:
    """Whether every rank sees ``folder`` (one host or a shared file system): rank 0 writes a
    token there and every rank looks for it. Collective."""
    token = broadcast_text(uuid.uuid4().hex if hvd.rank() == 0 else None, 0,
                           name="race.shared.token", what="the shared-folder token")
    if hvd.rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f".token-{token}").write_text("")
    barrier("the shared-folder token written")
    seen = (folder / f".token-{token}").exists()
    everyone = all(row[0] == 1.0 for row in allgather_rows(
        [float(seen)], "race.shared.seen", "whether every rank sees the shared folder"))
    barrier("the shared-folder token read")
    if hvd.rank() == 0:
        (folder / f".token-{token}").unlink()
    return everyone


def evaluate_snapshots(points: Sequence[Snapshot], model: torch.nn.Module,
                       evaluate: Callable[[torch.nn.Module], float], folder: Optional[Path],
                       name: str) -> Optional[list[tuple[float, int, float, float]]]:
    """Average each rank's snapshots over the ranks and evaluate them (collective; rank 0 gets
    ``[(seconds, step, link MB per rank, metric)]``, the others None). Seconds, steps and bytes
    are the slowest rank's."""
    stacked = torch.stack([p.params for p in points])
    meta = torch.tensor([[p.seconds, p.step, p.link_bytes] for p in points], dtype=torch.float64)
    meta = allreduce(meta, hvd.Max, f"{name}.meta", "the snapshots' times, steps and bytes")
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(stacked, folder / f"rank{hvd.rank()}.pt")
        barrier(f"{name}: snapshots saved")
        averaged = None
        if hvd.rank() == 0:
            averaged = sum(torch.load(folder / f"rank{r}.pt", weights_only=True)
                           for r in range(hvd.size())) / hvd.size()
        barrier(f"{name}: snapshots read")
        (folder / f"rank{hvd.rank()}.pt").unlink()
    else:
        averaged = allreduce(stacked, hvd.Average, f"{name}.params", "the snapshots' average")
    if hvd.rank() != 0:
        return None
    curve = []
    for (seconds, step, sent), flat in zip(meta.tolist(), averaged):
        vector_to_parameters(flat, model.parameters())
        megabytes = sent / 1e6 if math.isfinite(sent) else None
        curve.append((seconds, int(step), megabytes, evaluate(model)))
    return curve
