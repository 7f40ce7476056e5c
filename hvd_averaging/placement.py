"""Which node every rank is on, learned once per world.

Over MPI it comes from splitting the communicator by shared memory (``Split_type(COMM_TYPE_SHARED)``),
each node named by its lowest rank; under Gloo, where there is no MPI world, from the host names
Horovod's launcher gave every rank. The result is kept by the current :class:`~.world.World`.
"""

from __future__ import annotations

import os
import socket
from typing import Hashable, Optional

import horovod.torch as hvd

from .deadlines import blocking_call
from .gather_text import allgather_text
from .world import current_world

__all__ = ["mpi_placement", "this_host", "rank_to_node", "known_rank_to_node"]


def mpi_placement(comm) -> list[Hashable]:
    """Node of every rank of ``comm``, each node named by its lowest rank (collective on ``comm``)."""
    from mpi4py import MPI

    with blocking_call("the node placement (MPI shared-memory split and allgather)"):
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            node_leader = node_comm.allreduce(comm.Get_rank(), op=MPI.MIN)
        finally:
            node_comm.Free()
        return list(comm.allgather(node_leader))


def this_host() -> str:
    """This rank's host as the launcher named it (``HOROVOD_HOSTNAME``), else its host name."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def known_rank_to_node() -> Optional[list[Hashable]]:
    """The node of every rank if this process knows it already (no collective), else None."""
    return current_world().placement


def rank_to_node() -> list[Hashable]:
    """Node of every Horovod rank (index = global rank), the same list on every rank.

    Collective on the first call in a world (an MPI split over the communicator Horovod runs
    over, or an allgather of host names over Horovod under Gloo); kept by the world afterwards.
    """
    world = current_world()
    if world.placement is not None:
        return world.placement
    if hvd.mpi_enabled():
        from mpi4py import MPI

        nodes = mpi_placement(world.mpi_comm if world.mpi_comm is not None else MPI.COMM_WORLD)
    else:
        nodes = allgather_text(this_host(), name="hva.rank_to_node",
                               what="the node placement (host names of every rank)")
    world.learn_placement(nodes)
    return list(nodes)
