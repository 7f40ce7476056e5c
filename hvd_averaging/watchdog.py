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
import mmap
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

from .watchdog_process import (SLOT_COUNT, SLOT_FIELDS, SLOT_HEADER, SLOT_MESSAGE_BYTES,
                               SLOT_SEQUENCE, SLOTS_BYTES, message_offset)

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


class _Slots:
    """The parent's side of the shared deadline slots (layout: :mod:`.watchdog_process`)."""

    def __init__(self, fd: int, memory: mmap.mmap) -> None:
        self.fd = fd
        self._memory = memory
        self._sequence = [0] * SLOT_COUNT
        self._free = list(range(SLOT_COUNT - 1, -1, -1))
        self.by_token: dict[int, int] = {}

    @classmethod
    def create(cls) -> Optional["_Slots"]:
        """None where shared memory is not to be had (no memfd, a sandbox refusing it): the
        deadlines then all go by pipe."""
        try:
            fd = os.memfd_create("hva-watchdog", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            return None
        try:
            os.ftruncate(fd, SLOTS_BYTES)
            return cls(fd, mmap.mmap(fd, SLOTS_BYTES))
        except OSError:
            os.close(fd)
            return None

    def _write(self, slot: int, deadline: float, message: bytes) -> None:
        offset = slot * SLOT_HEADER.size
        self._sequence[slot] += 1  # odd: the reader passes over it until the write is whole
        SLOT_SEQUENCE.pack_into(self._memory, offset, self._sequence[slot])
        SLOT_FIELDS.pack_into(self._memory, offset + SLOT_SEQUENCE.size, deadline, len(message))
        if message:
            start = message_offset(slot)
            self._memory[start:start + len(message)] = message
        self._sequence[slot] += 1  # even again, written last: the fields before it are whole
        SLOT_SEQUENCE.pack_into(self._memory, offset, self._sequence[slot])

    def arm(self, token: int, seconds: float, message: bytes) -> bool:
        """False where no slot is free or the message does not fit one."""
        if not self._free or len(message) > SLOT_MESSAGE_BYTES:
            return False
        slot = self._free.pop()
        self._write(slot, time.monotonic() + seconds, message)
        self.by_token[token] = slot
        return True

    def disarm(self, token: int) -> None:
        slot = self.by_token.pop(token)
        self._write(slot, 0.0, b"")
        self._free.append(slot)

    def close(self) -> None:
        self._memory.close()
        os.close(self.fd)


class Watchdog:
    """One helper process per Python process, started on first use. ``arm`` and ``disarm``
    write a slot of memory shared with it (a pipe line where no slot is free or the message is
    longer than one), so a round costs no system call; the helper acts on a deadline within
    0.1 s of it.

    Deadlines are independent: each :meth:`arm` returns a token that only :meth:`disarm` with
    that token cancels, so a collective's disarm never cancels the exit armed after an earlier
    timeout. The earliest pending deadline ends the process."""

    def __init__(self) -> None:
        self._process: Optional[subprocess.Popen] = None
        self._pipe: Optional[int] = None
        self._slots: Optional[_Slots] = None
        self._owner_pid: Optional[int] = None
        self._alive_until = 0.0  # monotonic time until which the helper is taken as running
        self._warned = False  # said once that the helper could not start
        self._tokens = itertools.count(1)

    def _ensure_started(self) -> bool:
        if self._process is not None and self._owner_pid == os.getpid():
            now = time.monotonic()
            if now < self._alive_until:
                return True
            if self._process.poll() is None:  # a system call: at most once a second
                self._alive_until = now + 1.0
                return True
        if self._owner_pid != os.getpid() and self._slots is not None:
            self._slots.close()  # a fork's copy of the parent's slots: this process needs its own
            self._slots = None
        if self._slots is None:
            self._slots = _Slots.create()
        # else a helper that died: the new one reads the same slots, deadlines armed meanwhile too
        if self._pipe is not None:
            os.close(self._pipe)  # the old helper's (or, after a fork, the parent's helper's)
            self._pipe = None
        slots_fd = self._slots.fd if self._slots is not None else -1
        read_end, write_end = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_PROCESS_SCRIPT), str(os.getpid()), str(read_end),
                 str(_openmpi_launcher_pid()), str(slots_fd)],
                pass_fds=(read_end,) + ((slots_fd,) if slots_fd >= 0 else ()),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
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
        self._alive_until = 0.0
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
            encoded = message.encode("utf-8", "replace")
            if self._slots is None or not self._slots.arm(token, seconds, encoded):
                flat = " ".join(message.split())
                self._send(f"arm {token} {seconds:.3f} {flat}\n")
        return token

    def disarm(self, token: int) -> None:
        """Cancel the deadline :meth:`arm` returned ``token`` for (others stay armed)."""
        if self._process is not None and self._owner_pid == os.getpid():
            if self._slots is not None and token in self._slots.by_token:
                self._slots.disarm(token)
            else:
                self._send(f"disarm {token}\n")

