"""What each rank of a fault launch says of itself, read from the records it left
(``tests/faults/rank_record.py`` writes them; the watchdog adds its own), so that the stages
judge from data, not from the launcher's printed text.

Every rank is accounted for in exactly one way, :class:`RankAccount`'s ``how``:

- ``completed``, ``raised``, ``exits on purpose``: the rank's own last word (``exit``);
- ``watchdog``: the library's watchdog ended it and left ``watchdog-PID.json`` (its message);
- ``signal``: it was ended by a signal (SIGTERM or SIGHUP: the launcher or the scheduler
  stopping the job; or a fatal one, such as an abort in Horovod's background thread when a peer's
  connection closes) and its traceback at the signal says where it was;
- ``silent``: a record that ends without any of the above (SIGKILL, or the node died);
- ``no record``: the rank never started its record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from hvd_averaging.agreement import tensor_digest

__all__ = ["RankAccount", "read_accounts", "checkpoint_problems", "fault_problems", "ranks_on",
           "TIMEOUT_ERRORS"]

# What a rank may raise when a peer, a node or the link is gone: the library's timeout, or
# Horovod's own error when a connection closes under it.
TIMEOUT_ERRORS = ("AveragingTimeoutError", "HorovodInternalError")


@dataclass
class RankAccount:
    rank: int
    how: str
    record: dict[str, Any]
    detail: str = ""

    @property
    def step(self) -> Optional[int]:
        return self.record.get("step")

    def __str__(self) -> str:
        where = f"step {self.step}" + (f" inside {self.record['inside']}"
                                       if self.record.get("inside") else "")
        return f"rank {self.rank}: {self.how} at {where}" + (f" ({self.detail})" if self.detail else "")


def _innermost_frames(traceback: str, count: int = 2) -> str:
    """A fatal signal's header (``Fatal Python error: Aborted``) and the innermost frames."""
    lines = [line.strip() for line in traceback.splitlines()]
    frames = [line for line in lines if line.startswith("File")]
    header = [line for line in lines[:1] if line.startswith("Fatal Python error")]
    # faulthandler lists the innermost frame first
    return "; ".join([*header, " <- ".join(frames[:count])])


def read_accounts(folder: Path, ranks: int) -> dict[int, RankAccount]:
    """Every rank's account, from ``folder``'s records."""
    watchdog = {}
    for path in folder.glob("watchdog-*.json"):
        found = json.loads(path.read_text())
        watchdog[found["pid"]] = found
    accounts = {}
    for rank in range(ranks):
        path = folder / f"rank{rank}.json"
        if not path.exists():
            accounts[rank] = RankAccount(rank, "no record", {})
            continue
        record = json.loads(path.read_text())
        signal_path = folder / f"rank{rank}.signal"
        traceback = signal_path.read_text(errors="replace") if signal_path.exists() else ""
        if record.get("exit"):
            account = RankAccount(rank, record["exit"], record, record.get("error_type") or "")
        elif record["pid"] in watchdog:
            account = RankAccount(rank, "watchdog", record, watchdog[record["pid"]]["message"])
        elif traceback.strip():
            account = RankAccount(rank, "signal", record, _innermost_frames(traceback))
        else:
            account = RankAccount(rank, "silent", record)
        accounts[rank] = account
    return accounts


def checkpoint_problems(account: RankAccount) -> list[str]:
    """A raised rank's checkpoint must load with ``weights_only=True``, hold the model, the
    optimizer with the averager's step, and exactly the model values the rank recorded."""
    path = account.record.get("checkpoint")
    if not path:
        return [f"rank {account.rank} raised but recorded no checkpoint"]
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - reported as a failure
        return [f"{path}: {type(error).__name__}: {error}"]
    problems = []
    if not {"model", "optimizer", "step"} <= set(state) or \
            not isinstance(state["optimizer"].get("step"), int):
        problems.append(f"{path} lacks model/optimizer/the averager's step")
    elif tensor_digest([v for v in state["model"].values() if isinstance(v, torch.Tensor)]) \
            != account.record.get("checkpoint_digest"):
        problems.append(f"{path}: its model values differ from those rank {account.rank} recorded")
    if state.get("step") != account.step:
        problems.append(f"{path}: step {state.get('step')}, the rank recorded {account.step}")
    return problems


def fault_problems(accounts: dict[int, RankAccount], lost: set[int]) -> list[str]:
    """Every rank not on a lost node accounts for itself: it raised a timeout or Horovod's error
    and saved a checkpoint that holds what it recorded, or the watchdog ended it (its record),
    or a signal did (the traceback says where). At least one of them named the cause (raised,
    or the watchdog's message), unless every one was stopped from outside (the launcher or the
    scheduler noticed the loss first and ended the job: Open MPI's daemons, SLURM's NODE_FAIL).
    No rank completed training."""
    problems = []
    survivors = [a for rank, a in accounts.items() if rank not in lost]
    for account in accounts.values():
        if account.how == "completed":
            problems.append(f"{account}: training went on to the end")
    for account in survivors:
        if account.how == "raised":
            if account.record["error_type"] not in TIMEOUT_ERRORS:
                problems.append(f"{account}: {account.record['error_message'][:200]}")
            problems += checkpoint_problems(account)
        elif account.how not in ("watchdog", "signal"):
            problems.append(f"does not account for itself: {account}")
    named = any(a.how in ("raised", "watchdog") for a in survivors)
    if not named and not all(a.how == "signal" for a in survivors):
        problems.append("no surviving rank named the cause (a named error or the watchdog), and "
                        "not every one was stopped from outside")
    return problems


def ranks_on(accounts: dict[int, RankAccount], node: str) -> set[int]:
    """The ranks whose record names ``node`` as their host."""
    return {rank for rank, a in accounts.items() if a.record.get("host") == node}
