"""The race's settings, resolved once into one frozen object: the command line with ``--full``
and ``--fast`` folded in, then completed for the task and the world (the inner lr, the
hierarchies, the local group size). Nothing changes them afterwards."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional

__all__ = ["RaceSettings", "default_node_period", "default_hierarchy"]


def default_node_period(top_period: int) -> int:
    """The node level's period when the race is given no hierarchy: 4 under a top period of 8 or
    more that 4 divides (16 -> 4), else 2. Against 2, with 3 seeds each on the same day
    (docs/demo.md), 4 kept the same speed-up within the seeds' spread and lowered the wait at
    apply (0.018-0.021 against 0.033-0.034 of the wall time)."""
    return 4 if top_period >= 8 and top_period % 4 == 0 else 2


def default_hierarchy(top_period: int, node_size: int, world_size: int) -> dict[int, int]:
    """``{node period: node_size, top_period: world_size}``: the race's hierarchies unless given."""
    return {default_node_period(top_period): node_size, top_period: world_size}


@dataclasses.dataclass(frozen=True)
class RaceSettings:
    """Every setting of the race (the command line's names; see ``train.py --help``)."""

    task: str
    methods: tuple
    steps: Optional[int]
    target_budget_s: float
    budget_s: Optional[float]
    period: int
    delay: int
    node_delay: int
    hierarchy: Optional[dict]
    outer_period: int
    outer_hierarchy: Optional[dict]
    outer_delay: int
    outer_lr: float
    outer_momentum: float
    outer_momentum_warmup: int
    warmup_percent: int
    local_group_size: int
    lr: Optional[float]
    baseline_fp16: bool
    cross_node_compression: str
    error_feedback: bool
    seeds: int
    grid_points: int
    rate_mbit: Optional[float]
    rate_control: Optional[str]
    link_interface: Optional[str]
    seed: int
    out: Path
    quiet: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RaceSettings":
        """The parsed command line, ``--full`` (3 seeds), ``--long`` (3 seeds of a baseline
        that runs about 5 minutes: does the speed-up at minute 1 hold?) and ``--fast`` (a short
        race, for tests) folded in."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        given["methods"] = tuple(given["methods"])
        if given["seeds"] is None:  # --seeds wins over --full and --long
            given["seeds"] = 3 if args.full or args.long else 1
        if args.long:
            given.update(target_budget_s=300.0, grid_points=100)
        if args.fast:
            given.update(target_budget_s=3.0, grid_points=8, period=4, delay=2, outer_period=4,
                         outer_delay=2)
        return cls(**given)

    def for_world(self, default_lr: float, size: int) -> "RaceSettings":
        """Completed for the task (its lr unless ``--lr``) and a world of ``size`` ranks (pairs
        and everyone, unless the hierarchies were given; a local group no larger than the world)."""
        pair = min(2, size)
        return dataclasses.replace(
            self, lr=default_lr if self.lr is None else self.lr,
            hierarchy=self.hierarchy or default_hierarchy(self.period, pair, size),
            outer_hierarchy=self.outer_hierarchy or default_hierarchy(self.outer_period, pair, size),
            local_group_size=min(self.local_group_size, size))

    def with_wire(self, compression: str, error_feedback: bool) -> "RaceSettings":
        """The same race with another format on the link (bench/int8_quality.py)."""
        return dataclasses.replace(self, cross_node_compression=compression,
                                   error_feedback=error_feedback)

    def as_json(self) -> dict:
        """For ``results.json``: plain values (the handshake folder and the output folder left
        out, hierarchies keyed by strings)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("rate_control", "out")}
        out["methods"] = list(self.methods)
        for key in ("hierarchy", "outer_hierarchy"):
            out[key] = None if out[key] is None else {str(k): v for k, v in out[key].items()}
        return out
