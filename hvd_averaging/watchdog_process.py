"""The watchdog's own process: ends its parent when an armed deadline passes.

Started by :mod:`hvd_averaging.watchdog` as
``python -I -S watchdog_process.py PARENT_PID FD LAUNCHER_PID SLOTS_FD`` (standard library
only, so it starts in milliseconds and imports neither torch nor Horovod), in a session of its
own so that a launcher stopping the rank's process group does not stop it too.

Deadlines reach it two ways. Every round arms and disarms one, so those go through
:data:`SLOT_COUNT` slots of shared memory (``SLOTS_FD``, a memfd; -1: none) that the parent
writes and this process reads every :data:`POLL_SECONDS`: no system call and no wake-up per
round (a pipe write per arm and disarm woke this process: 56 us each under cProfile on a
2-core host, the largest part of a small round's cost). A slot's header holds a sequence number
(odd while the parent writes the slot: this process passes over it until the next poll), the
deadline as a ``time.monotonic()`` value (0: free) and the message's length; the headers sit
together, so one poll reads them in one call. Deadlines that find no free slot, or whose message is longer than a slot, go as
lines on the pipe ``FD``:

* ``arm TOKEN SECONDS MESSAGE``: a deadline SECONDS from now under TOKEN (an integer);
* ``disarm TOKEN``: forget that deadline (the others stay).

When the earliest pending deadline passes, the watchdog writes its MESSAGE to stderr (the rank's
own stderr, which the launcher forwards) and ends the parent: SIGTERM, then SIGKILL two seconds
later if it is still there; then it ends the launcher (below). Deadlines are kept apart so that a
round's disarm cannot cancel the exit armed after an earlier timeout.

Where ``HVA_WATCHDOG_RECORD_DIR`` names a folder, the watchdog also leaves there, before it ends
the parent, ``watchdog-PID.json``: the parent's pid, the message and the time. A job script
reads it where the rank's stderr never reaches the launcher (a node behind a cut link). The
folder may be shared and writable by others, so the record is written to a new file of an
unguessable name opened with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a planted symlink cannot redirect
the write) and then renamed over ``watchdog-PID.json`` (a rename replaces a link planted there,
it does not follow it).

End of file on the pipe means the parent is gone. If a deadline was armed (the parent died
during a collective or after a timeout), the watchdog lets go of the rank's stderr (a launcher
forwarding it waits for end of file), waits for the deadline and then ends the launcher;
otherwise it just exits. Its stdout is /dev/null from the start.

``LAUNCHER_PID`` (0: none) is the rank's parent when that is OpenMPI's ``mpirun`` or ``orted``.
Measured on the emulated cluster with the link between nodes cut: every rank ended, but
``mpirun`` and the remote ``orted`` waited for each other until TCP gave up (about 15 minutes),
holding the allocation. Ending them once the rank's time is up is what ``MPI_Abort`` would do
if it could reach them.

Being a separate process is the point: a parent blocked inside Horovod's C++ code while holding
the GIL cannot run a Python thread, but this process still can.
"""

import json
import mmap
import os
import select
import signal
import struct
import sys
import time

RECORD_DIR_VARIABLE = "HVA_WATCHDOG_RECORD_DIR"

# The shared slots' layout (the parent's side: hvd_averaging.watchdog): every slot's header
# first, one after another (read in one call), then every slot's message.
SLOT_COUNT = 32
SLOT_HEADER = struct.Struct("<Qdi4x")  # sequence number, deadline (0: free), message length
SLOT_SEQUENCE = struct.Struct("<Q")  # the header's first field
SLOT_FIELDS = struct.Struct("<di")  # the header's other fields, after it
SLOT_MESSAGE_BYTES = 4096
ALL_HEADERS = struct.Struct("<" + SLOT_HEADER.format.lstrip("<") * SLOT_COUNT)
SLOTS_BYTES = ALL_HEADERS.size + SLOT_COUNT * SLOT_MESSAGE_BYTES
POLL_SECONDS = 0.1  # how late a deadline in a slot may be acted on


def message_offset(slot: int) -> int:
    return ALL_HEADERS.size + slot * SLOT_MESSAGE_BYTES


class SharedSlots:
    """This process's view of the parent's slots (read only)."""

    def __init__(self, fd: int):
        self._memory = mmap.mmap(fd, SLOTS_BYTES, prot=mmap.PROT_READ)

    def earliest(self, parent_gone: bool = False):
        """(deadline, message) of the earliest armed slot, or None. A slot the parent is
        writing (odd sequence number) is left for the next poll; once the parent is gone no
        write is under way, and one it left half done counts as it stands."""
        while True:
            headers = ALL_HEADERS.unpack_from(self._memory)
            armed = [(headers[i + 1], i // 3, headers[i], headers[i + 2])
                     for i in range(0, len(headers), 3)
                     if headers[i + 1] and (parent_gone or not headers[i] % 2)]
            if not armed:
                return None
            deadline, slot, sequence, length = min(armed)
            start = message_offset(slot)
            message = self._memory[start:start + length].decode("utf-8", "replace")
            if SLOT_SEQUENCE.unpack_from(self._memory, slot * SLOT_HEADER.size)[0] == sequence:
                return deadline, message
            # rewritten while its message was read: look again


def _leave_record(parent: int, message: str) -> None:
    """``watchdog-PARENT.json`` in the folder ``HVA_WATCHDOG_RECORD_DIR`` names, if any (written
    whole, then renamed, so a reader never sees half of it)."""
    folder = os.environ.get(RECORD_DIR_VARIABLE)
    if not folder:
        return
    path = os.path.join(folder, f"watchdog-{parent}.json")
    partial = f"{path}.{os.urandom(8).hex()}.partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as record:
            json.dump({"pid": parent, "message": message, "time": time.time()}, record)
        os.replace(partial, path)
    except OSError as error:
        sys.stderr.write(f"hvd_averaging watchdog: cannot write {path}: {error}\n")


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time), to tell a process from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _end(pid: int, started: str) -> bool:
    """SIGTERM, then SIGKILL after 2 s, unless the process is gone (or its pid reused)."""
    for signum, pause in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0)):
        if not started or _start_time(pid) != started:
            return False
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        limit = time.monotonic() + pause
        while time.monotonic() < limit and _start_time(pid) == started:
            time.sleep(0.05)
    return True


def main(parent: int, fd: int, launcher: int, slots_fd: int) -> int:
    parent_started = _start_time(parent)
    launcher_started = _start_time(launcher) if launcher else ""
    slots = SharedSlots(slots_fd) if slots_fd >= 0 else None
    pending = b""
    deadlines = {}  # token -> (monotonic deadline, message), from the pipe
    parent_gone = False
    while True:
        candidates = list(deadlines.values())
        in_slots = slots.earliest(parent_gone) if slots is not None else None
        if in_slots is not None:
            candidates.append(in_slots)
        earliest = min(candidates) if candidates else None
        now = time.monotonic()
        if earliest is not None and earliest[0] <= now:
            if not parent_gone:
                sys.stderr.write(earliest[1] + "\n")
                sys.stderr.flush()
                _leave_record(parent, earliest[1])
                _end(parent, parent_started)
            if launcher and _end(launcher, launcher_started) and not parent_gone:
                sys.stderr.write(f"hvd_averaging watchdog: ended the launcher (pid {launcher}) "
                                 "that was still waiting for the job's other nodes\n")
            return 0
        wait = None if earliest is None else earliest[0] - now
        if parent_gone:
            if earliest is None:
                return 0  # a normal exit
            time.sleep(wait)  # died during a collective or after a timeout: see it through
            continue
        if slots is not None:
            wait = POLL_SECONDS if wait is None else min(wait, POLL_SECONDS)
        if not select.select([fd], [], [], wait)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            parent_gone = True  # what it left armed is read again above
            # let go of the rank's stderr, or a launcher reading it until EOF would wait for us
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            continue
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            words = line.decode("utf-8", "replace").split(" ", 3)
            if words[0] == "arm" and len(words) == 4:
                deadlines[words[1]] = (time.monotonic() + float(words[2]), words[3])
            elif words[0] == "disarm" and len(words) == 2:
                deadlines.pop(words[1], None)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.exit(main(*(int(arg) for arg in sys.argv[1:5])))
