"""A fault script's account of one rank, for the runner to judge from data, not printed text.

``DIR/rank{R}.json`` is rewritten whole (written aside, then renamed) at every event:

- ``rank``, ``pid``, ``host``;
- ``step``: the last training step the rank reached, ``inside``: the call it was in then
  (None between calls);
- ``error_type``, ``error_message``: what it caught, if anything;
- ``checkpoint``, ``checkpoint_digest``: the file it saved after the error and a digest of the
  model values in it (:func:`hvd_averaging.agreement.tensor_digest` of the state's tensors);
- ``exit``: ``"completed"``, ``"raised"`` (re-raised after saving), ``"exits on purpose"`` (the
  fault itself), or None while it runs (a record that stays None: the process was ended from
  outside).

A rank ended by a signal leaves ``DIR/rank{R}.signal``: Python's traceback at the signal, written
by :mod:`faulthandler` from C (so also when the rank is blocked inside Horovod), before the
signal's default action ends it: SIGTERM and SIGHUP (a launcher or scheduler stopping the job),
and the fatal ones (an abort in Horovod's background thread, a crash), headed ``Fatal Python
error``. The watchdog leaves ``DIR/watchdog-{pid}.json`` when
``HVA_WATCHDOG_RECORD_DIR`` is ``DIR`` (the runner sets it).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

from hvd_averaging.agreement import tensor_digest

__all__ = ["RankRecord", "state_digest"]


def state_digest(state: dict) -> int:
    """Digest of a model ``state_dict``'s tensor values (the runner recomputes it on load)."""
    return tensor_digest([value for value in state.values() if isinstance(value, torch.Tensor)])


class RankRecord:
    """This rank's record in ``folder`` (see the module docstring)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = Path(folder) / f"rank{rank}.json"
        self.data: dict[str, Any] = {
            "rank": rank, "pid": os.getpid(), "host": os.uname().nodename, "step": None,
            "inside": None, "error_type": None, "error_message": None, "checkpoint": None,
            "checkpoint_digest": None, "exit": None}
        self._signal_file = open(Path(folder) / f"rank{rank}.signal", "w")  # noqa: SIM115
        for signum in (signal.SIGTERM, signal.SIGHUP):
            faulthandler.register(signum, file=self._signal_file, chain=True)
        faulthandler.enable(file=self._signal_file)
        self._write()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self._write()

    def caught(self, error: BaseException, step: int) -> None:
        self.update(step=step, error_type=type(error).__name__, error_message=str(error))

    def saved(self, path: Path, model_state: dict) -> None:
        self.update(checkpoint=str(path), checkpoint_digest=state_digest(model_state))

    def _write(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data))
        os.replace(partial, self.path)
