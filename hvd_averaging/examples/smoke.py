"""Smoke test of an installation: every rank averages its rank and checks the result.

    horovodrun -np 2 python -m hvd_averaging.examples.smoke
"""

import horovod.torch as hvd
import torch

import hvd_averaging as hva
from hvd_averaging.examples.collectives import allgather_rows

__all__ = ["main"]


def main() -> int:
    hva.init()
    weight = torch.nn.Parameter(torch.full((4,), float(hvd.rank())))
    weight.grad = torch.zeros_like(weight)
    hva.average_parameters([weight])
    expected = (hvd.size() - 1) / 2
    everyone = [row[0] for row in allgather_rows([weight.detach()[0].item()], "smoke.result",
                                                 "the smoke test's result")]
    ok = everyone == [expected] * hvd.size()
    if hvd.rank() == 0:
        controller = "MPI" if hvd.mpi_enabled() else "Gloo"
        print(f"hvd_averaging smoke test on {hvd.size()} ranks over {controller}: "
              f"{'ok' if ok else 'FAILED'} (got {everyone}, expected {expected} everywhere)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
