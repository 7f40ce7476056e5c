"""Horovod's function mode (``horovod.run(fn)``) on the patched build, under one launcher:

    python tests/security/function_mode_job.py mpi|gloo

Runs a function on 2 local ranks that initializes Horovod, allreduces its rank and waits a
moment. Meanwhile a thread of this (the launching) process reads the job secret from a worker's
environment (``HOROVOD_WORKER_SECRET``, which the patch hands it by name under mpirun and on
stdin under Gloo) and looks for it, in hex, on the command line of every process on the host.
Prints one JSON line: the results the launcher got back (read from its key-value store, whose
values the workers sign with that secret), whether the secret was found in a worker's
environment, and the command lines that held it (none may).
"""
import json
import os
import sys
import threading
import time
from pathlib import Path

import horovod


def job() -> tuple[int, int, float]:
    import horovod.torch as hvd
    import torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="function_mode")
    time.sleep(3)  # the scan below runs meanwhile
    return hvd.rank(), hvd.size(), float(total.item())


def _processes() -> list[Path]:
    return [p for p in Path("/proc").iterdir() if p.name.isdigit()]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended, or is not ours to read
        return b""


def scan(found: dict, stop: threading.Event) -> None:
    """Find the workers' secret in an environment, then every command line that holds it."""
    me = os.getpid()
    while not stop.is_set():
        for proc in _processes() if "secret" not in found else []:
            if int(proc.name) == me:
                continue
            for entry in _read(proc / "environ").split(b"\0"):
                if entry.startswith(b"HOROVOD_WORKER_SECRET="):
                    found["secret"] = entry.split(b"=", 1)[1].decode()
        secret = found.get("secret")
        if secret:
            for proc in _processes():
                cmdline = _read(proc / "cmdline").replace(b"\0", b" ").decode(errors="replace")
                if secret in cmdline or "HOROVOD_WORKER_SECRET=" in cmdline:
                    found["command_lines"].add(cmdline[:200])
        time.sleep(0.2)


def main() -> int:
    mode = sys.argv[1]
    found: dict = {"command_lines": set()}
    stop = threading.Event()
    scanner = threading.Thread(target=scan, args=(found, stop), daemon=True)
    scanner.start()
    try:
        results = horovod.run(job, np=2, hosts="localhost:2", use_mpi=mode == "mpi",
                              use_gloo=mode == "gloo")
    finally:
        stop.set()
        scanner.join()
    print(json.dumps({"mode": mode, "results": [list(r) for r in results],
                      "secret_seen_in_a_worker": bool(found.get("secret")),
                      "command_lines_with_secret": sorted(found["command_lines"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
