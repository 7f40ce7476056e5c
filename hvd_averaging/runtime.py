"""Horovod start-up, the shared registry of process sets, node placement and cross-rank checks.

Everything here that talks to other ranks is collective over Horovod's global process set and
must be called by every rank in the same order.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Hashable, Iterable, Iterator, Optional, Sequence

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch.mpi_ops import _basics

from .topology import group_of, level_groups, static_groups
from .watchdog import Watchdog

__all__ = [
    "init",
    "elastic_job",
    "process_set",
    "dynamic_process_sets_enabled",
    "registered_process_sets",
    "rank_to_node",
    "known_rank_to_node",
    "config_digest",
    "check_same_on_all_ranks",
    "members",
    "local_process_set",
    "register_groups",
    "forget_process_sets",
    "timeout",
    "set_timeout",
    "exit_after_timeout",
    "EXIT_CODE_AFTER_TIMEOUT",
    "bounded_collective",
    "guarded_enqueue",
    "CollectiveRound",
    "AveragingTimeoutError",
]

DEFAULT_TIMEOUT_SECONDS = 45.0
_timeout_seconds: Optional[float] = None

# Sets handed out by process_set(), by their sorted ranks. Horovod refuses to register a set twice,
# so averagers and user code share these objects.
_sets_by_ranks: dict[tuple[int, ...], hvd.ProcessSet] = {}
_mpi_comm = None  # the communicator Horovod was initialized over (None: MPI's world or Gloo)
_rank_to_node_cache: Optional[tuple[int, list[Hashable]]] = None


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
        ValueError: ``group_sizes`` is not a list of positive integers, or a size does not fit
            the placement (raised on every rank, before Horovod starts).

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init(group_sizes=[2])            # pairs registered at start-up
        >>> averager = hva.HierarchicalModelAverager({2: 2, 8: hvd.size()}, warmup_steps=0)
    """
    global _mpi_comm, _rank_to_node_cache
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
        _mpi_comm = comm
    else:
        hvd.init(process_sets=mode)
    forget_process_sets()
    if placement is not None:
        _rank_to_node_cache = (len(placement), list(placement))
    elif not elastic_job():
        # Collective like init itself, so traffic counters know which sets cross nodes. Not in
        # elastic jobs: a joining worker's init is matched by no call on the others.
        rank_to_node()


def elastic_job() -> bool:
    """True inside ``horovodrun`` elastic jobs (Horovod sets ``HOROVOD_ELASTIC=1``)."""
    return os.environ.get("HOROVOD_ELASTIC", "") == "1"


def _world_size_before_start(comm) -> int:
    if _gloo_controller():
        return int(os.environ.get("HOROVOD_SIZE", "1"))
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm.Get_size()


def _gloo_controller() -> bool:
    return os.environ.get("HOROVOD_CONTROLLER", "").strip().lower() == "gloo"


def _placement_before_start(comm) -> tuple[Optional[list[Hashable]], str]:
    """Node of every rank, known before Horovod starts, or (None, why not). The decision is the
    same on every rank: it depends only on what the launcher gave every rank alike."""
    if elastic_job():
        return None, "an elastic job's reset drops every process set registered at start-up"
    if _gloo_controller():
        size = int(os.environ.get("HOROVOD_SIZE", "1"))
        # One host holds every rank exactly when this rank's host does, so all ranks agree.
        if int(os.environ.get("HOROVOD_LOCAL_SIZE", "0")) == size:
            return [os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()] * size, ""
        return None, ("under horovodrun --gloo over several hosts the placement is known only "
                      "after Horovod starts")
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    return _mpi_placement(comm), ""


def _mpi_placement(comm) -> list[Hashable]:
    """Node of every rank of ``comm``, each node named by its lowest rank (collective on ``comm``)."""
    from mpi4py import MPI

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        node_leader = node_comm.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node_comm.Free()
    return list(comm.allgather(node_leader))


def forget_process_sets() -> None:
    """Drop the cached process sets and node placement; call after Horovod was shut down and
    initialized again (an elastic reset), which drops every process set (horovod#4021)."""
    global _rank_to_node_cache
    _sets_by_ranks.clear()
    _rank_to_node_cache = None


def dynamic_process_sets_enabled() -> bool:
    """True when Horovod accepts ``hvd.add_process_set`` (initialized with ``"dynamic"``)."""
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower() in ("1", "true", "yes", "on")


def registered_process_sets() -> dict[int, list[int]]:
    """Horovod's registered process sets: ``{process_set_id: sorted ranks}``."""
    return {int(k): sorted(v) for k, v in _basics._get_process_set_ids_and_ranks().items()}


class AveragingTimeoutError(RuntimeError):
    """A collective of this library did not complete within :func:`timeout` seconds."""


# Ends this process when a collective blocks where polling cannot reach (see .watchdog).
_WATCHDOG = Watchdog()
_UNSET = object()  # "not given" for set_timeout's exit_after, and "not set" for its value
_exit_after_timeout_seconds: object = _UNSET
_ended_by_timeout = False


def timeout() -> float:
    """Seconds a collective of this library may wait for the other ranks: :func:`set_timeout`,
    else the environment variable ``HVA_TIMEOUT_SECONDS``, else 45.

    Raises:
        ValueError: ``HVA_TIMEOUT_SECONDS`` is not a positive number.
    """
    if _timeout_seconds is not None:
        return _timeout_seconds
    return _seconds_from_env("HVA_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS)


def exit_after_timeout() -> Optional[float]:
    """Seconds a process may go on after an :class:`AveragingTimeoutError` (its ``except`` block
    saving a checkpoint) before the watchdog ends it; None: never. Default: half the timeout,
    so that a job whose link or node is gone is over within twice the timeout. Set by
    :func:`set_timeout` or ``HVA_EXIT_AFTER_TIMEOUT_SECONDS`` (a number, or ``never``)."""
    if _exit_after_timeout_seconds is not _UNSET:
        return _exit_after_timeout_seconds  # type: ignore[return-value]
    raw = os.environ.get("HVA_EXIT_AFTER_TIMEOUT_SECONDS")
    if raw is not None and raw.strip().lower() == "never":
        return None
    return _seconds_from_env("HVA_EXIT_AFTER_TIMEOUT_SECONDS", timeout() / 2)


def _seconds_from_env(variable: str, default: float) -> float:
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{variable}={raw!r} must be a positive number of seconds")
    return value


def _check_seconds(name: str, seconds) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def set_timeout(seconds: Optional[float], *, exit_after: object = _UNSET) -> None:
    """Set the timeout of this library's collectives, in seconds, for this process (None: back
    to ``HVA_TIMEOUT_SECONDS`` or the default). Raise it when ranks may legitimately arrive far
    apart (one rank writing a large checkpoint while the others reach the next averaging step)
    or when the link between nodes is slow: a round must move its bytes within it.

    ``exit_after``: seconds this process may go on after an :class:`AveragingTimeoutError`
    before the watchdog ends it (None: never, for code that recovers from a stalled rank; the
    default is half the timeout). After a timeout Horovod's background thread may be stuck
    for good, and its shutdown at exit with it; the process then exits with code
    :data:`EXIT_CODE_AFTER_TIMEOUT` as soon as Python finishes.

    Raises:
        ValueError: ``seconds`` or ``exit_after`` is not a positive finite number.
    """
    global _timeout_seconds, _exit_after_timeout_seconds
    if seconds is not None:
        seconds = _check_seconds("timeout", seconds)
    if exit_after is not _UNSET and exit_after is not None:
        exit_after = _check_seconds("exit_after", exit_after)
    _timeout_seconds = seconds
    if exit_after is not _UNSET or seconds is None:
        _exit_after_timeout_seconds = exit_after


EXIT_CODE_AFTER_TIMEOUT = 75  # EX_TEMPFAIL: the job may succeed when restarted from a checkpoint


def _exit_now() -> None:
    """Last atexit handler to run after a timeout: skip Horovod's and MPI's shutdown, which
    would wait for a background thread that is stuck."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE_AFTER_TIMEOUT)


def _stuck_grace(limit: float) -> float:
    return max(2.0, limit / 4)


class CollectiveRound:
    """One bounded collective: enqueue inside :func:`bounded_collective`, then :meth:`wait`."""

    def __init__(self, what: str, limit: float, nbytes: int, started_at: Optional[float] = None):
        self.what = what
        self.limit = limit
        self.nbytes = nbytes
        self.deadline = (time.monotonic() if started_at is None else started_at) + limit

    def drive(self, transfers: list) -> None:
        """Advance every transfer (objects with ``advance() -> bool``, e.g.
        :class:`hvd_averaging.transports.Transfer`) until all are complete, giving up at the
        round's deadline; pauses between polls as in :meth:`wait`.

        Raises:
            AveragingTimeoutError: not done in time.
            HorovodInternalError: Horovod failed or shut down (named by the transfer).
        """
        pause = 5e-5
        while not all([t.advance() for t in transfers]):
            if time.monotonic() > self.deadline:
                raise AveragingTimeoutError(self._timeout_message())
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def wait(self, handles: list) -> list:
        """``hvd.synchronize`` every handle, but give up at the round's deadline.

        Horovod waits forever for a rank that stalls, and warns only after 60 s (its stall
        shutdown is off by default and, measured here, does not act under Gloo), so this polls.
        The pause between polls grows from 50 us to 1 ms: a round that finishes quickly is not
        delayed, a long one costs one poll per millisecond.

        Raises:
            AveragingTimeoutError: not done in time; names the round, this rank and what to change.
            HorovodInternalError: Horovod failed or shut down (re-raised with the round's name
                prepended, same type, so ``hvd.elastic.run`` still resets on it).
        """
        results = []
        for handle in handles:
            pause = 5e-5
            while not hvd.poll(handle):
                if time.monotonic() > self.deadline:
                    raise AveragingTimeoutError(self._timeout_message())
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
            try:
                results.append(hvd.synchronize(handle))
            except HorovodInternalError as error:
                raise HorovodInternalError(f"{self.what}: {error}") from error
        return results

    def _timeout_message(self) -> str:
        rate = ""
        if self.nbytes:
            # a ring allreduce moves about twice the payload through each rank's link
            needed = 2 * self.nbytes * 8 / self.limit / 1e6
            rate = (f" Moving its {self.nbytes / 1e6:.1f} MB within {self.limit:g} s needs a link of "
                    f"at least ~{needed:.1f} Mbit/s between nodes; on a slower link set a timeout "
                    "that fits it (HVA_TIMEOUT_SECONDS or hva.set_timeout()).")
        return (f"{self.what}: not finished after {self.limit:g} s on rank {hvd.rank()}: a rank of "
                "the set died or stalled, a node or the link between nodes is gone, or ranks run "
                "a different sequence of averaging calls or parameter lists (set "
                "HVA_TIMEOUT_SECONDS or hva.set_timeout() if ranks may be this far apart)." + rate)


def _stuck_message(what: str, stuck_after: float, limit: float) -> str:
    return (f"hvd_averaging watchdog: rank {hvd.rank()} (pid {os.getpid()}, host "
            f"{socket.gethostname()}): {what} is still blocked inside Horovod {stuck_after:g} s after "
            "it started, where the library's own timeout cannot act (Horovod's background thread is "
            "stuck in a collective: a rank, a node or the link between nodes is gone, or the link is "
            f"too slow for HVA_TIMEOUT_SECONDS={limit:g}). Ending this process so that the launcher "
            "sees the rank end. If the link is only slow, raise HVA_TIMEOUT_SECONDS or "
            "hva.set_timeout().")


@contextmanager
def guarded_enqueue(what: str) -> Iterator[None]:
    """Launch collectives whose wait comes later (a round left in flight while training goes
    on): only the enqueue is bounded here, by the watchdog, since Horovod may block it (its
    process-set lock during dynamic-set coordination); :func:`bounded_collective` with
    ``started_at`` bounds the wait."""
    limit = timeout()
    stuck_after = limit + _stuck_grace(limit)
    _WATCHDOG.arm(stuck_after, _stuck_message(what, stuck_after, limit))
    try:
        yield
    finally:
        _WATCHDOG.disarm()


@contextmanager
def bounded_collective(what: str, nbytes: int = 0,
                       started_at: Optional[float] = None) -> Iterator[CollectiveRound]:
    """Bound one collective of this library, enqueue included.

    Polling (:meth:`CollectiveRound.wait` or :meth:`~CollectiveRound.drive`) raises
    :class:`AveragingTimeoutError` after :func:`timeout` seconds, counted from ``started_at``
    (a ``time.monotonic()`` value: when a round left in flight was launched) or from now.
    Where polling cannot run (the enqueue itself blocked inside Horovod), the watchdog ends
    this process a little later, naming ``what``. After a timeout the process has
    :func:`exit_after_timeout` seconds left (an ``except`` block may save a checkpoint), then
    the watchdog ends it; at a normal exit it skips Horovod's shutdown.
    """
    global _ended_by_timeout
    limit = timeout()
    remaining = limit if started_at is None else max(0.0, started_at + limit - time.monotonic())
    stuck_after = remaining + _stuck_grace(limit)
    _WATCHDOG.arm(stuck_after, _stuck_message(what, stuck_after, limit))
    try:
        yield CollectiveRound(what, limit, nbytes, started_at)
    except AveragingTimeoutError:
        grace = exit_after_timeout()
        if grace is None:
            _WATCHDOG.disarm()
        else:
            _WATCHDOG.arm(grace, (
                f"hvd_averaging watchdog: rank {hvd.rank()} (pid {os.getpid()}, host "
                f"{socket.gethostname()}) is still running {grace:g} s after AveragingTimeoutError "
                f"in {what}; ending it so that the job ends (HVA_EXIT_AFTER_TIMEOUT_SECONDS or "
                "hva.set_timeout(..., exit_after=...) gives an except block more time)."))
            if not _ended_by_timeout:
                _ended_by_timeout = True
                atexit.register(_exit_now)  # registered after Horovod's: runs before it
        raise
    except BaseException:
        _WATCHDOG.disarm()
        raise
    else:
        _WATCHDOG.disarm()


def _require_initialized(what: str) -> None:
    if not hvd.is_initialized():
        raise RuntimeError(f"{what} needs Horovod: call hva.init() (or hvd.init()) first")


def process_set(ranks: Iterable[int]) -> hvd.ProcessSet:
    """The registered ``hvd.ProcessSet`` for exactly ``ranks``, registering it if needed.

    Collective when the set is new: every rank must call it with the same ranks, in the same
    order as its other calls. A set that exists (registered at init, by an earlier call, or by
    user code through this function) is returned, never registered twice.

    Raises:
        ValueError: ``ranks`` is empty, has duplicates or ranks outside ``0..size-1``.
        RuntimeError: the set does not exist and Horovod runs without dynamic process sets.

    Example::

        >>> # every rank registers every set, in the same order (not only the set it is in):
        >>> pairs = [hva.process_set([0, 1]), hva.process_set([2, 3])]
    """
    _require_initialized("hva.process_set")
    ranks = list(ranks)
    if not ranks:
        raise ValueError("process_set([]) : a process set needs at least one rank")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"process set ranks must be integers, got {r!r} in {ranks}")
    key = tuple(sorted(ranks))
    if len(set(key)) != len(key):
        raise ValueError(f"process set ranks {ranks} contain duplicates")
    size = hvd.size()
    if key[0] < 0 or key[-1] >= size:
        raise ValueError(f"process set ranks {ranks} must lie in 0..{size - 1} (Horovod size {size})")
    if key == tuple(range(size)):
        return hvd.global_process_set
    cached = _sets_by_ranks.get(key)
    if cached is not None and cached.process_set_id is not None:
        return cached
    for set_id, set_ranks in registered_process_sets().items():
        if tuple(set_ranks) == key:
            found = hvd.ProcessSet(list(key))
            found.process_set_id = set_id
            _sets_by_ranks[key] = found
            return found
    if not dynamic_process_sets_enabled():
        raise RuntimeError(
            f"process set for ranks {list(key)} is not registered and Horovod was initialized "
            "without dynamic process sets. Register its level at start-up (hva.init("
            f"group_sizes=[..., {len(key)}]) or hvd.init(process_sets=[hvd.ProcessSet({list(key)}), "
            "...])), or call hva.init() without group_sizes (dynamic process sets)"
        )
    created = hvd.add_process_set(list(key))
    _sets_by_ranks[key] = created
    return created


def known_rank_to_node() -> Optional[list[Hashable]]:
    """The node of every rank if this process knows it already (no collective), else None."""
    if _rank_to_node_cache is not None and hvd.is_initialized() and \
            _rank_to_node_cache[0] == hvd.size():
        return list(_rank_to_node_cache[1])
    return None


def rank_to_node() -> list[Hashable]:
    """Node of every Horovod rank (index = global rank), the same list on every rank.

    Over MPI it comes from splitting the communicator by shared memory
    (``Split_type(COMM_TYPE_SHARED)``): each node is named by its lowest rank. Under Gloo there is
    no MPI world, so it comes from Horovod's own host information (the host names gathered over
    Horovod). Collective on the first call after init; cached afterwards.
    """
    global _rank_to_node_cache
    _require_initialized("hva.rank_to_node")
    size = hvd.size()
    if _rank_to_node_cache is not None and _rank_to_node_cache[0] == size:
        return list(_rank_to_node_cache[1])
    if hvd.mpi_enabled():
        from mpi4py import MPI

        nodes: list[Hashable] = _mpi_placement(_mpi_comm if _mpi_comm is not None else MPI.COMM_WORLD)
    else:
        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        nodes = list(hvd.allgather_object(host, name="hva.rank_to_node"))
    _rank_to_node_cache = (size, nodes)
    return list(nodes)


def config_digest(config) -> int:
    """A stable 63-bit digest of ``repr(config)`` (same on every rank for equal configs)."""
    raw = hashlib.sha256(repr(config).encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)


def check_same_on_all_ranks(
    what: str,
    config,
    *,
    local_error: Optional[BaseException] = None,
    process_set: Optional[hvd.ProcessSet] = None,
    name: str = "hva.agree",
    summary: Optional[str] = None,
) -> None:
    """Verify with one small allgather that every rank of ``process_set`` holds the same config.

    A rank that hit ``local_error`` (e.g. a ``ValueError`` from validating its arguments) joins
    the allgather anyway, so the others learn about it instead of waiting forever; it then
    re-raises its own error while the others raise ``RuntimeError`` naming it. ``summary``
    replaces ``repr(config)`` in the message when the config is long.

    Raises:
        RuntimeError: ranks disagree; the message names which ranks hold which config.
    """
    process_set = process_set if process_set is not None else hvd.global_process_set
    digest = -1 if local_error is not None else config_digest(config)
    with bounded_collective(f"{what} (cross-rank check)") as collective:
        handle = hvd.allgather_async(
            torch.tensor([digest], dtype=torch.int64), name=name, process_set=process_set
        )
        gathered = collective.wait([handle])[0].tolist()
    if local_error is not None:
        raise local_error
    ranks = members(process_set)
    failed = [r for r, d in zip(ranks, gathered) if d == -1]
    if failed:
        raise RuntimeError(f"{what}: rank(s) {failed} raised an error for their arguments (see their output)")
    if len(set(gathered)) > 1:
        mine = [r for r, d in zip(ranks, gathered) if d == digest]
        others = [r for r, d in zip(ranks, gathered) if d != digest]
        raise RuntimeError(
            f"{what} differs across ranks: rank {hvd.rank()} has {summary or repr(config)}, shared by ranks "
            f"{mine}; ranks {others} have something else. Every rank must pass the same "
            "arguments, or the averaging collectives would hang or average different groups"
        )


def members(process_set: hvd.ProcessSet) -> list[int]:
    """Global ranks of ``process_set``, ascending."""
    return sorted(process_set.ranks) if process_set.ranks else list(range(hvd.size()))


def local_process_set(parent: Optional[hvd.ProcessSet] = None,
                      group_size: Optional[int] = None) -> Optional[hvd.ProcessSet]:
    """This rank's node-local group inside ``parent`` (default: all ranks), as a process set.

    ``group_size`` defaults to the number of ``parent``'s ranks on this rank's node (which must
    be the same on every node); a smaller size makes groups inside a node, a larger one groups of
    whole nodes (the same node-major rule as the hierarchical averager). Collective: every rank
    registers every group, in the same order. Returns None on ranks outside ``parent``.

    Raises:
        ValueError: nodes hold different numbers of ``parent``'s ranks and no ``group_size`` was
            given, or ``group_size`` does not fit the placement.
    """
    parent = parent if parent is not None else hvd.global_process_set
    ranks = members(parent)
    nodes = rank_to_node()
    local_nodes = [nodes[r] for r in ranks]
    if group_size is None:
        counts = {n: local_nodes.count(n) for n in local_nodes}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"nodes hold different numbers of ranks {sorted(counts.values())}: give the "
                "local group size explicitly"
            )
        group_size = next(iter(counts.values()))
    groups = [[ranks[i] for i in g] for g in level_groups(local_nodes, group_size)]
    return register_groups(parent, groups)


def register_groups(parent: hvd.ProcessSet, groups: list[list[int]]) -> Optional[hvd.ProcessSet]:
    """Register every group of one level (collective, same order on every rank) and return the
    set of this rank's group, or None on ranks outside ``parent``. A group equal to ``parent``
    is ``parent`` itself."""
    parent_ranks = members(parent)
    sets = [parent if group == parent_ranks else process_set(group) for group in groups]
    if hvd.rank() not in parent_ranks:
        return None
    return sets[groups.index(group_of(groups, hvd.rank()))]
