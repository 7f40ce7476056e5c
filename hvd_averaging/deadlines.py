"""Bounded waits: the timeout of this library's collectives, the watchdog, and the exit after one.

One :class:`Deadlines` object per process owns the timeout, the grace a process has after an
:class:`AveragingTimeoutError` and the watchdog (:mod:`.watchdog`) that ends the process where
polling cannot act. The module functions (:func:`timeout`, :func:`set_timeout`,
:func:`bounded_collective`, :func:`guarded_enqueue`) speak to that one owner.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import horovod.torch as hvd

from .collective_round import AveragingTimeoutError, CollectiveRound
from .env_settings import route_policy
from .watchdog import Watchdog

__all__ = [
    "AveragingTimeoutError",
    "DEFAULT_TIMEOUT_SECONDS",
    "EXIT_CODE_AFTER_TIMEOUT",
    "Deadlines",
    "CollectiveRound",
    "timeout",
    "set_timeout",
    "exit_after_timeout",
    "bounded_collective",
    "guarded_enqueue",
    "blocking_call",
    "check_environment",
    "watchdog_grace",
    "recovered_from_timeout",
]

DEFAULT_TIMEOUT_SECONDS = 45.0
EXIT_CODE_AFTER_TIMEOUT = 75  # EX_TEMPFAIL: the job may succeed when restarted from a checkpoint
_UNSET = object()  # "not given" for set_timeout's exit_after, and "not set" for its value
_STUCK_MESSAGES_KEPT = 256


def _seconds_from_env(variable: str, default: float) -> float:
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not a number of seconds (a positive finite "
                         "number" + (", or 'never'" if variable == "HVA_EXIT_AFTER_TIMEOUT_SECONDS"
                                      else "") + ")") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{variable}={raw!r} must be a positive finite number of seconds")
    return value


def _check_seconds(name: str, seconds) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def _exit_now() -> None:
    """Last atexit handler to run after a timeout: skip Horovod's and MPI's shutdown, which
    would wait for a background thread that is stuck."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE_AFTER_TIMEOUT)


def watchdog_grace(limit: float) -> float:
    """Seconds past a collective's ``limit`` before the watchdog ends a process blocked inside
    Horovod, where the library's own timeout cannot act: a quarter of the limit, at least 2 s."""
    return max(2.0, limit / 4)


def _whoami() -> str:
    # before Horovod starts (the placement split), the launcher's rank
    rank = hvd.rank() if hvd.is_initialized() else os.environ.get(
        "OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "?"))
    return f"rank {rank} (pid {os.getpid()}, host {socket.gethostname()})"


def _stuck_message(what: str, stuck_after: float, limit: float) -> str:
    return (f"hvd_averaging watchdog: {_whoami()}: {what} is still blocked inside Horovod "
            f"{stuck_after:g} s after it started, where the library's own timeout cannot act "
            "(Horovod's background thread is stuck in a collective: a rank, a node or the link "
            "between nodes is gone, or the link is too slow for HVA_TIMEOUT_SECONDS="
            f"{limit:g}). Ending this process so that the launcher sees the rank end. If the link "
            "is only slow, raise HVA_TIMEOUT_SECONDS or hva.set_timeout().")


class Deadlines:
    """The one owner, per process, of the timeout, the exit after a timeout and the watchdog."""

    def __init__(self) -> None:
        self.timeout_seconds: Optional[float] = None  # None: HVA_TIMEOUT_SECONDS or the default
        self.exit_after_seconds: object = _UNSET  # _UNSET: from the environment or timeout / 2
        self.ended_by_timeout = False
        self.watchdog = Watchdog()
        self._exit_tokens: list[int] = []  # the exits armed after timeouts, until recovered
        self._stuck_messages: dict[tuple, str] = {}

    def timeout(self) -> float:
        if self.timeout_seconds is not None:
            return self.timeout_seconds
        return _seconds_from_env("HVA_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS)

    def exit_after_timeout(self) -> Optional[float]:
        if self.exit_after_seconds is not _UNSET:
            return self.exit_after_seconds  # type: ignore[return-value]
        raw = os.environ.get("HVA_EXIT_AFTER_TIMEOUT_SECONDS")
        if raw is not None and raw.strip().lower() == "never":
            return None
        return _seconds_from_env("HVA_EXIT_AFTER_TIMEOUT_SECONDS", self.timeout() / 2)

    def set_timeout(self, seconds: Optional[float], exit_after: object = _UNSET) -> None:
        if seconds is not None:
            seconds = _check_seconds("timeout", seconds)
        if exit_after is not _UNSET and exit_after is not None:
            exit_after = _check_seconds("exit_after", exit_after)
        self.timeout_seconds = seconds
        if exit_after is not _UNSET or seconds is None:
            self.exit_after_seconds = exit_after

    def _stuck_message(self, what: str, stuck_after: float, limit: float) -> str:
        """:func:`_stuck_message`, kept for the rounds that repeat it (every round of a list
        arms the same one: formatting it each time was a tenth of the library's cost of a
        round over a small model)."""
        key = (what, stuck_after, limit, os.getpid(),
               hvd.rank() if hvd.is_initialized() else None)
        message = self._stuck_messages.get(key)
        if message is None:
            if len(self._stuck_messages) >= _STUCK_MESSAGES_KEPT:
                self._stuck_messages.clear()
            message = self._stuck_messages[key] = _stuck_message(what, stuck_after, limit)
        return message

    @contextmanager
    def guarded_enqueue(self, what: str) -> Iterator[None]:
        limit = self.timeout()
        stuck_after = limit + watchdog_grace(limit)
        token = self.watchdog.arm(stuck_after, self._stuck_message(what, stuck_after, limit))
        try:
            yield
        finally:
            self.watchdog.disarm(token)

    @contextmanager
    def bounded_collective(self, what: str, nbytes: int = 0,
                           started_at: Optional[float] = None) -> Iterator[CollectiveRound]:
        limit = self.timeout()
        remaining = limit if started_at is None else max(0.0, started_at + limit - time.monotonic())
        stuck_after = remaining + watchdog_grace(limit)
        message = self._stuck_message(what, stuck_after, limit) if started_at is None \
            else _stuck_message(what, stuck_after, limit)  # a time of its own: nothing to keep
        token = self.watchdog.arm(stuck_after, message)
        try:
            yield CollectiveRound(what, limit, nbytes, started_at)
        except AveragingTimeoutError:
            self._after_timeout(what)  # armed before the round's own deadline is dropped
            self.watchdog.disarm(token)
            raise
        except BaseException:
            self.watchdog.disarm(token)
            raise
        else:
            self.watchdog.disarm(token)

    def _after_timeout(self, what: str) -> None:
        """Arm the exit after a timeout: a deadline of its own, which no later round's disarm
        cancels (only the process's end does)."""
        grace = self.exit_after_timeout()
        if grace is None:
            return
        self._exit_tokens.append(self.watchdog.arm(grace, (
            f"hvd_averaging watchdog: {_whoami()} is still running {grace:g} s after "
            f"AveragingTimeoutError in {what}; ending it so that the job ends "
            "(HVA_EXIT_AFTER_TIMEOUT_SECONDS or hva.set_timeout(..., exit_after=...) gives an "
            "except block more time).")))
        if not self.ended_by_timeout:
            self.ended_by_timeout = True
            atexit.register(_exit_now)  # registered after Horovod's: runs before it


    def recovered(self) -> None:
        """An elastic job took over after the timeout: Horovod is shut down and initialized
        again (under Gloo, whose own timeout bounds the background thread), so the exit armed
        after the timeout, and the skip of Horovod's shutdown at exit, no longer apply."""
        for token in self._exit_tokens:
            self.watchdog.disarm(token)
        self._exit_tokens.clear()
        if self.ended_by_timeout:
            self.ended_by_timeout = False
            atexit.unregister(_exit_now)


# The one owner of this process's deadlines.
DEADLINES = Deadlines()


def timeout() -> float:
    """Seconds a collective of this library may wait for the other ranks: :func:`set_timeout`,
    else the environment variable ``HVA_TIMEOUT_SECONDS``, else 45.

    Raises:
        ValueError: ``HVA_TIMEOUT_SECONDS`` is not a positive number.
    """
    return DEADLINES.timeout()


def exit_after_timeout() -> Optional[float]:
    """Seconds a process may go on after an :class:`AveragingTimeoutError` (its ``except`` block
    saving a checkpoint) before the watchdog ends it; None: never. Default: half the timeout,
    so that a job whose link or node is gone is over within twice the timeout. Set by
    :func:`set_timeout` or ``HVA_EXIT_AFTER_TIMEOUT_SECONDS`` (a number, or ``never``)."""
    return DEADLINES.exit_after_timeout()


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

    Example::

        >>> hva.set_timeout(120)                      # a slow link: rounds may take long
        >>> hva.set_timeout(3, exit_after=None)       # code that recovers from a stalled rank
    """
    DEADLINES.set_timeout(seconds, exit_after)


def guarded_enqueue(what: str):
    """Launch collectives whose wait comes later (a round left in flight while training goes
    on): only the enqueue is bounded here, by the watchdog, since Horovod may block it (its
    process-set lock during dynamic-set coordination); :func:`bounded_collective` with
    ``started_at`` bounds the wait."""
    return DEADLINES.guarded_enqueue(what)


def blocking_call(what: str):
    """Bound a Horovod or MPI call that blocks where polling cannot reach (registering a process
    set, an MPI communicator split, a barrier): the watchdog ends this process, naming ``what``,
    if the call has not returned ``hva.timeout()`` plus a grace (a quarter of it, at least 2 s)
    later. A context manager."""
    return DEADLINES.guarded_enqueue(what)


def check_environment() -> None:
    """Parse every ``HVA_*`` setting now (``hva.init`` and every new world call it), so that a
    malformed value fails at start-up instead of turning a later ``AveragingTimeoutError`` into
    a ``ValueError``.

    Raises:
        ValueError: names the variable, its value and the rule.
    """
    DEADLINES.timeout()
    DEADLINES.exit_after_timeout()
    route_policy()
    record_dir = os.environ.get("HVA_WATCHDOG_RECORD_DIR")
    if record_dir and not os.path.isdir(record_dir):
        raise ValueError(f"HVA_WATCHDOG_RECORD_DIR={record_dir!r} must name an existing folder "
                         "(the watchdog leaves a record there for each rank it ends)")


def bounded_collective(what: str, nbytes: int = 0, started_at: Optional[float] = None):
    """Bound one collective of this library, enqueue included (a context manager yielding a
    :class:`CollectiveRound`).

    Polling (:meth:`CollectiveRound.wait` or :meth:`~CollectiveRound.drive`) raises
    :class:`AveragingTimeoutError` after :func:`timeout` seconds, counted from ``started_at``
    (a ``time.monotonic()`` value: when a round left in flight was launched) or from now.
    Where polling cannot run (the enqueue itself blocked inside Horovod), the watchdog ends
    this process a little later, naming ``what``. After a timeout the process has
    :func:`exit_after_timeout` seconds left (an ``except`` block may save a checkpoint), then
    the watchdog ends it; at a normal exit it skips Horovod's shutdown.
    """
    return DEADLINES.bounded_collective(what, nbytes, started_at)


def recovered_from_timeout() -> None:
    """Say that this process recovers from an :class:`AveragingTimeoutError` by Horovod's
    elastic reset (``hvd.elastic.run`` restoring the last commit): the exit armed after the
    timeout is cancelled. Called by :mod:`hvd_averaging.elastic`'s state handlers at
    ``restore()``; without it, the watchdog ended a survivor waiting in Horovod's rendezvous
    ``exit_after`` seconds after the timeout (measured in the fault soak, docs/reliability.md)."""
    DEADLINES.recovered()
