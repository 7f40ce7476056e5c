"""One bounded collective: Horovod's handles polled until they finish or the deadline passes.

Horovod waits forever for a rank that stalls, and warns only after 60 s (its stall shutdown is
off by default and, measured here, does not act under Gloo), so every wait of this library
polls; :mod:`.deadlines` owns the timeout and hands out :class:`CollectiveRound` objects.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

__all__ = ["AveragingTimeoutError", "CollectiveRound"]


class AveragingTimeoutError(RuntimeError):
    """A collective of this library did not complete within :func:`timeout` seconds."""


class CollectiveRound:
    """One bounded collective: enqueue inside :func:`bounded_collective`, then :meth:`wait` or
    :meth:`drive`."""

    def __init__(self, what: str, limit: float, nbytes: int, started_at: Optional[float] = None):
        self.what = what
        self.limit = limit
        self.nbytes = nbytes
        self.deadline = (time.monotonic() if started_at is None else started_at) + limit

    def _poll_until(self, done: Callable[[], bool]) -> None:
        """Call ``done`` until it is true, giving up at the deadline. The pause between polls
        is a sixteenth of the time waited so far, from 50 us up to 1 ms: a round of more than
        0.8 ms is noticed at most about 6% after it finished (a shorter one within the 50 us
        pause and the kernel's timer slack), and a long one costs one poll per millisecond.
        (Doubling the pause from 50 us noticed a round that finished after 1.6 ms up to 1 ms
        late: 2 ms rounds over Gloo on one host took 1.27x the floor.)"""
        started = time.monotonic()
        pause = 5e-5
        while not done():
            now = time.monotonic()
            if now > self.deadline:
                raise AveragingTimeoutError(self._timeout_message())
            time.sleep(pause)
            pause = min(max(5e-5, (now - started) / 16), 1e-3)

    def drive(self, transfers: list) -> None:
        """Advance every transfer (objects with ``advance() -> bool``, e.g.
        :class:`hvd_averaging.transports.Transfer`) until all are complete.

        Raises:
            AveragingTimeoutError: not done in time.
            HorovodInternalError: Horovod failed or shut down (named by the transfer).
        """
        self._poll_until(lambda: all([t.advance() for t in transfers]))

    def wait(self, handles: list) -> list:
        """``hvd.synchronize`` every handle, but give up at the round's deadline.

        Raises:
            AveragingTimeoutError: not done in time; names the round, this rank and what to change.
            HorovodInternalError: Horovod failed or shut down (re-raised with the round's name
                prepended, same type, so ``hvd.elastic.run`` still resets on it).
        """
        results = []
        for handle in handles:
            self._poll_until(lambda: hvd.poll(handle))
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
