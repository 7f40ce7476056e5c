"""What the benchmark scripts running under Horovod share: the parameters they average, the
slowest rank's time, bytes on a node's link and a timed round's stages (their reports' labels
are in :mod:`labels`)."""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

from hvd_averaging.transports import Transport

__all__ = ["make_params", "equal_shapes", "slowest_rank", "node_link_bytes", "stage_times"]

def make_params(shapes, seed: int) -> list[torch.nn.Parameter]:
    """Random parameters of ``shapes``, each with a gradient (averagers skip those without)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=generator))
        p.grad = torch.zeros_like(p)
        params.append(p)
    return params


def equal_shapes(total_mb: float, tensors: int) -> list[tuple[int]]:
    """``tensors`` flat tensors of float32 adding up to ``total_mb`` MiB."""
    return [(int(total_mb * 2 ** 20 / 4 / tensors),)] * tensors


def slowest_rank(seconds: float, tag: str) -> float:
    """The largest ``seconds`` over all ranks."""
    t = torch.tensor([seconds], dtype=torch.float64)
    return float(hvd.allreduce(t, op=hvd.Max, name=f"bench.time.{tag}"))


def node_link_bytes(fn, ranks_on_node: int, index: int, interface: str = "eth0") -> float:
    """Bytes one call of ``fn`` sent on this node's link (the interface's transmit counter,
    shared by the node's ranks), per rank: the largest node's, TCP/IP headers and Horovod's
    own coordination included."""
    # imported here: bench/compare_revisions.py runs the single-host bench on older revisions
    from hvd_averaging.traffic import interface_tx_bytes
    hvd.barrier()
    before = interface_tx_bytes(interface)
    fn()
    hvd.barrier()
    sent = interface_tx_bytes(interface)
    per_rank = float("nan") if before is None or sent is None else (sent - before) / ranks_on_node
    return slowest_rank(per_rank, f"link.{index}")


def stage_times(transport: Transport, buffer: torch.Tensor, reps: int, tag: str) -> dict:
    """Where a round's time goes, stage by stage (slowest rank, min over ``reps`` after one
    warm-up): the wait for each stage's collectives, and the host work (quantizing, summing,
    launching) done by :meth:`~hvd_averaging.transports.Transfer.advance` after it."""
    per_stage: dict[str, list] = {}
    for rep in range(reps + 1):
        hvd.barrier()
        transfer = transport.start([buffer.clone()], [f"bench.stages.{tag}.{rep}"], "stage timing")
        index = 0
        while transfer.result is None:
            start = time.perf_counter()
            while not transfer.ready():
                time.sleep(1e-5)
            waited = time.perf_counter() - start
            start = time.perf_counter()
            transfer.advance()
            work = time.perf_counter() - start
            if rep:
                per_stage.setdefault(f"stage {index}: wait", []).append(waited)
                per_stage.setdefault(f"stage {index}: host work after it", []).append(work)
            index += 1
    return {label: slowest_rank(min(t), f"{tag}.stage.{i}")
            for i, (label, t) in enumerate(per_stage.items())}
