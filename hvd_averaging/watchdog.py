"""A watchdog outside the Python interpreter for collectives that can block where polling cannot.

The library bounds its waits by polling Horovod's handles (:meth:`hvd_averaging.deadlines.CollectiveRound.wait`).
That cannot bound one case: measured on the emulated cluster with the link between nodes cut,
the main thread blocked *inside* ``hvd.allreduce_async_`` (the enqueue waits for a mutex that
Horovod's background thread holds while it is stuck in MPI), with the GIL held, so neither the
poll loop nor a Python thread could run. PyTorch's NCCL process group has a watchdog thread for
this; here it has to be a separate, tiny process (:mod:`hvd_averaging.watchdog_process`) that
ends its parent when an armed deadline passes, after writing a message that says what was
blocked and what to do. The launcher then sees the rank end.

The same watchdog bounds the life of a process after an :class:`AveragingTimeoutError`: the
user's ``except`` block may still save a checkpoint, but a process whose Horovod is stuck would
otherwise hang in Horovod's or MPI's shutdown at exit.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["Watchdog"]

_PROCESS_SCRIPT = Path(__file__).with_name("watchdog_process.py")
# Parents that are OpenMPI's launcher daemons (see watchdog_process: ended after a fatal timeout).
_OPENMPI_LAUNCHERS = frozenset({"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted"})


def _openmpi_launcher_pid() -> int:
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return 0
    return parent if name in _OPENMPI_LAUNCHERS else 0


class Watchdog:
    """One helper process per Python process, started on first use; ``arm``/``disarm`` cost one
    small pipe write each.

    Deadlines are independent: each :meth:`arm` returns a token that only :meth:`disarm` with
    that token cancels, so a collective's disarm never cancels the exit armed after an earlier
    timeout. The earliest pending deadline ends the process."""

    def __init__(self) -> None:
        self._process: Optional[subprocess.Popen] = None
        self._pipe: Optional[int] = None
        self._owner_pid: Optional[int] = None
        self._warned = False  # said once that the helper could not start
        self._tokens = itertools.count(1)

    def _ensure_started(self) -> bool:
        if self._process is not None and self._owner_pid == os.getpid() \
                and self._process.poll() is None:
            return True
        read_end, write_end = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_PROCESS_SCRIPT), str(os.getpid()), str(read_end),
                 str(_openmpi_launcher_pid())],
                pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True)
        except OSError as error:
            os.close(write_end)
            self._process = None
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"hvd_averaging: the watchdog process could not start ({error}): waits blocked "
                    "inside Horovod (set-up calls, a stuck collective) are not bounded in this "
                    "process; polled rounds still raise AveragingTimeoutError", RuntimeWarning,
                    stacklevel=4)
            return False
        finally:
            os.close(read_end)
        self._pipe = write_end
        self._owner_pid = os.getpid()
        return True

    def _send(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            os.write(self._pipe, line.encode("utf-8", "replace"))
        except OSError:
            self._pipe = None

    def arm(self, seconds: float, message: str) -> int:
        """End this process ``seconds`` from now, writing ``message``, unless :meth:`disarm` with
        the returned token comes first. Other deadlines armed meanwhile do not replace this one."""
        token = next(self._tokens)
        if self._ensure_started():
            flat = " ".join(message.split())
            self._send(f"arm {token} {seconds:.3f} {flat}\n")
        return token

    def disarm(self, token: int) -> None:
        """Cancel the deadline :meth:`arm` returned ``token`` for (others stay armed)."""
        if self._process is not None and self._owner_pid == os.getpid():
            self._send(f"disarm {token}\n")

