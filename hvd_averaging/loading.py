"""Reading a checkpoint file on every rank, so that one rank's bad or missing file is known on
every rank at once.

A rank whose ``torch.load`` raises would otherwise leave the others in the next collective
(``load_state_dict``'s agreement) until the timeout, blaming it as a dead rank. Here every rank
joins one small agreement after its read, whether the read worked or not.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import horovod.torch as hvd
import torch

from .agreement import check_same_on_all_ranks

__all__ = ["load_checkpoint"]


def load_checkpoint(path: Union[str, os.PathLike], *, map_location: Any = None,
                    process_set: Optional[hvd.ProcessSet] = None) -> Any:
    """``torch.load(path, map_location=map_location, weights_only=True)`` on every rank of
    ``process_set`` (default: all), then one agreement that every rank read its file (collective;
    each rank may read its own path). Nothing is applied: pass the result to the wrappers'
    ``load_state_dict``, which checks and agrees on the contents.

    Raises:
        OSError, pickle.UnpicklingError, RuntimeError (...): this rank's read failed, as
            ``torch.load`` raised it (``weights_only=True`` refuses anything but data);
        RuntimeError: another rank's read failed, naming that rank, its path's error and cause;
        AveragingTimeoutError: a rank did not join within ``hva.timeout()`` (it died, or its read
            did not finish).
    """
    loaded, error = None, None
    try:
        loaded = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as bad:  # noqa: BLE001  (whatever the read raised, the others must hear of it)
        error = bad
    check_same_on_all_ranks(f"hva.load_checkpoint({os.fspath(path)!r}) (every rank read its file)",
                            True, local_error=error, process_set=process_set,
                            name="hva.agree.load_checkpoint")
    return loaded
