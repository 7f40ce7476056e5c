"""Choosing a set's way across nodes by measuring it: each candidate transport averages a
scratch buffer of the round's size a few times, alternating, and the slowest member's best
time decides (every member gets the same numbers, so every member takes the same way).

Why measure: which way wins depends on the launcher and the link. On 2 emulated nodes x 2
ranks over Open MPI, whose flat allreduce already sends one model per node across the link,
node-aware stages took 1.03-1.40x the flat allreduce's time; over Gloo they took 0.71x
(docs/performance.md). A rule by bytes alone picks the slower way on one of the two.
"""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

from .deadlines import bounded_collective
from .process_sets import members
from .transports import Transport

__all__ = ["PROBE_REPEATS", "probe_seconds"]

PROBE_REPEATS = 3  # timed rounds per candidate, after one that warms up (buffers, caches)


def probe_seconds(candidates: dict[str, Transport], process_set: hvd.ProcessSet, nbytes: int,
                  device: torch.device) -> dict[str, float]:
    """Per candidate, the slowest member's best time for one round of ``nbytes`` (float32
    zeros, so averaging leaves them as they are). Collective over ``process_set``: every
    member must call it with the same candidates in the same order; each wait is bounded."""
    set_id = process_set.process_set_id
    scratch = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times: dict[str, list[float]] = {kind: [] for kind in candidates}
    for repeat in range(PROBE_REPEATS + 1):
        for kind, transport in candidates.items():
            what = f"route probe over process set {members(process_set)}: {kind}"
            began = time.perf_counter()
            with bounded_collective(what, nbytes) as collective:
                collective.drive([transport.start([scratch], [f"hva.probe.{set_id}.{kind}"], what)])
            if repeat:
                times[kind].append(time.perf_counter() - began)
    best = torch.tensor([min(times[kind]) for kind in candidates], dtype=torch.float64)
    with bounded_collective(f"route probe over process set {members(process_set)}: the times") \
            as collective:
        slowest = collective.wait([hvd.allreduce_async(
            best, op=hvd.Max, process_set=process_set, name=f"hva.probe.{set_id}.times")])[0]
    return dict(zip(candidates, slowest.tolist()))
