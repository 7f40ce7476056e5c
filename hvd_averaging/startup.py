"""Starting Horovod for averaging: :func:`init`, and the placement known before it starts.

``hva.init(group_sizes=...)`` registers the hierarchy's groups as Horovod starts, which needs
the node of every rank before Horovod exists: over MPI from a shared-memory split of the
communicator, under ``horovodrun --gloo`` on one host from the launcher's variables.
"""

from __future__ import annotations

import os
import warnings
from typing import Hashable, Optional, Sequence

import horovod.torch as hvd
import torch

from .agreement import config_digest
from .deadlines import bounded_collective, check_environment, exit_after_timeout, timeout
from .env_settings import SETTINGS, route_policy, settings_disagreement
from .gather_text import allgather_text
from .horovod_patch import warn_if_unpatched
from .placement import mpi_placement, rank_to_node, this_host
from .topology import static_groups
from .world import start_world

__all__ = ["init", "elastic_job", "settings_in_effect", "agree_on_settings"]


def elastic_job() -> bool:
    """True inside ``horovodrun`` elastic jobs (Horovod sets ``HOROVOD_ELASTIC=1``)."""
    return os.environ.get("HOROVOD_ELASTIC", "") == "1"


def _gloo_controller() -> bool:
    return os.environ.get("HOROVOD_CONTROLLER", "").strip().lower() == "gloo"


def _world_size_before_start(comm) -> int:
    if _gloo_controller():
        return int(os.environ.get("HOROVOD_SIZE", "1"))
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm.Get_size()


def _placement_before_start(comm) -> tuple[Optional[list[Hashable]], str]:
    """Node of every rank, known before Horovod starts, or (None, why not). The decision is the
    same on every rank: it depends only on what the launcher gave every rank alike."""
    if elastic_job():
        return None, "an elastic job's reset drops every process set registered at start-up"
    if _gloo_controller():
        size = int(os.environ.get("HOROVOD_SIZE", "1"))
        # One host holds every rank exactly when this rank's host does, so all ranks agree.
        if int(os.environ.get("HOROVOD_LOCAL_SIZE", "0")) == size:
            return [this_host()] * size, ""
        return None, ("under horovodrun --gloo over several hosts the placement is known only "
                      "after Horovod starts")
    from mpi4py import MPI

    return mpi_placement(comm if comm is not None else MPI.COMM_WORLD), ""


def settings_in_effect() -> dict[str, str]:
    """Every ``HVA_*`` setting as this process applies it (after ``hva.set_timeout()``), as text.

    Raises:
        ValueError: a malformed value (see :func:`~.deadlines.check_environment`).
    """
    exit_after = exit_after_timeout()
    values = {
        "HVA_TIMEOUT_SECONDS": f"{timeout():g}",
        "HVA_EXIT_AFTER_TIMEOUT_SECONDS": "never" if exit_after is None else f"{exit_after:g}",
        "HVA_ROUTE": route_policy(),
        "HVA_WATCHDOG_RECORD_DIR": os.environ.get("HVA_WATCHDOG_RECORD_DIR") or "",
    }
    assert values.keys() == SETTINGS.keys()  # a new setting is listed in env_settings.SETTINGS
    return {name: repr(value) if value else "(unset)" for name, value in values.items()}


def agree_on_settings() -> None:
    """Compare every ``HVA_*`` setting in effect across all ranks (collective; ``hva.init()``
    calls it right after Horovod starts, except in elastic jobs, where a joining worker's init
    is matched by no call on the others). One allgather of a digest per setting; only when
    some differ, one more of the values that differ, to name them.

    Raises:
        ValueError: on every rank, naming each setting that differs and which ranks hold which
            value.
    """
    settings = settings_in_effect()
    names = list(settings)
    digests = torch.tensor([[config_digest(settings[name]) for name in names]], dtype=torch.int64)
    with bounded_collective("the HVA_* settings (cross-rank check)") as collective:
        gathered = collective.wait([hvd.allgather_async(digests, name="hva.settings")])[0]
    differing = [name for column, name in enumerate(names)
                 if len(set(gathered[:, column].tolist())) > 1]  # the same list on every rank
    if not differing:
        return
    values = {name: allgather_text(settings[name], name=f"hva.settings.{name}",
                                   what=f"the values of {name}")
              for name in differing}
    raise ValueError(settings_disagreement(values))


def init(comm=None, *, group_sizes: Optional[Sequence[int]] = None) -> None:
    """Initialize Horovod so that averagers can have their groups.

    Without ``group_sizes``, Horovod starts with dynamic process sets: any group can be
    registered later. That has a price: every Horovod cycle (about 1 ms) does one more small
    coordination over all ranks, which shows in latency-bound averaging (``make bench``
    compares both modes).

    With ``group_sizes``, the group size of every level the job will average at (the keys of a
    :class:`HierarchicalModelAverager`'s ``period_group_size_dict``, the local group size of
    post-local SGD), the groups of those levels are computed from the node placement and
    registered at start-up, and Horovod runs without dynamic process sets. That needs the
    placement before Horovod starts, which is known over MPI (``Split_type(COMM_TYPE_SHARED)``
    on ``comm``) and under ``horovodrun --gloo`` on one host. Where it is not (Gloo over several
    hosts) or where the sets would not survive (elastic jobs: a reset drops every set), Horovod
    starts with dynamic process sets and a warning says why. Averaging at a group size not in
    ``group_sizes`` then raises ``RuntimeError`` on every rank.

    Over MPI (``mpirun``/``horovodrun`` with MPI) Horovod runs over ``comm`` (an ``mpi4py``
    communicator; default ``MPI.COMM_WORLD``); under ``horovodrun --gloo`` over Gloo. A no-op when
    Horovod is already initialized. If it was initialized without dynamic process sets, the
    averagers can still use sets registered at ``hvd.init(process_sets=[...])``.

    Raises:
        ValueError: ``group_sizes`` is not a list of positive integers, a size does not fit the
            placement, or an ``HVA_*`` environment variable is malformed (raised on every rank,
            before Horovod starts); an ``HVA_*`` setting differs across ranks (raised on every
            rank right after Horovod starts, naming the setting and the ranks; not in elastic
            jobs).

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init(group_sizes=[2])            # pairs registered at start-up
        >>> averager = hva.HierarchicalModelAverager({2: 2, 8: hvd.size()}, warmup_steps=0)
    """
    check_environment()  # before Horovod starts: same outcome on every rank
    warn_if_unpatched()  # once per process: pip's Horovod runs code its rendezvous is sent
    if hvd.is_initialized():
        if group_sizes is not None:
            warnings.warn("hva.init(group_sizes=...) after Horovod was initialized does nothing: "
                          "process sets can be registered statically only at start-up", stacklevel=2)
        return
    static_sets, placement = None, None
    if group_sizes is not None:
        placement, why_not = _placement_before_start(comm)
        if placement is not None:
            static_sets = static_groups(placement, group_sizes)  # ValueError: same on every rank
        else:
            # Same sizes checked against a one-node placement, so a typo still fails fast.
            static_groups(["?"] * _world_size_before_start(comm), group_sizes)
            warnings.warn(f"hva.init(group_sizes={list(group_sizes)}): {why_not}; starting Horovod "
                          "with dynamic process sets instead", stacklevel=2)
    mode = [hvd.ProcessSet(group) for group in static_sets] if static_sets is not None else "dynamic"
    if comm is not None:
        hvd.init(comm=comm, process_sets=mode)
    else:
        hvd.init(process_sets=mode)
    if not elastic_job():
        agree_on_settings()  # ValueError on every rank: a setting differs across ranks
    start_world(comm, placement)
    if placement is None and not elastic_job():
        # Collective like init itself, so traffic counters know which sets cross nodes. Not in
        # elastic jobs: a joining worker's init is matched by no call on the others.
        rank_to_node()
