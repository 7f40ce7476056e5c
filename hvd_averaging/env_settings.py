"""``HVA_*`` settings that are not timeouts (those are :mod:`.deadlines`'), read from the
environment and checked at ``hva.init()`` (through :func:`.deadlines.check_environment`); the
list of every ``HVA_*`` variable the library reads, and the message when ranks disagree on one
(``hva.init()`` compares them across ranks)."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["ROUTE_POLICIES", "SETTINGS", "route_policy", "settings_disagreement"]

# How a set that can average node-aware chooses between that and one flat allreduce (rounds of
# at least NODE_AWARE_MIN_BYTES; below it every round is flat):
ROUTE_POLICIES = {
    "measure": "time both at the set's first round of each size and take the faster (default)",
    "node-aware": "always node-aware",
    "flat": "always one flat allreduce",
}


def route_policy() -> str:
    """``HVA_ROUTE`` (default ``measure``).

    Raises:
        ValueError: any other value, naming it and the choices.
    """
    value = os.environ.get("HVA_ROUTE", "measure")
    if value not in ROUTE_POLICIES:
        raise ValueError(f"HVA_ROUTE={value!r} must be one of "
                         + "; ".join(f"{k!r} ({v})" for k, v in ROUTE_POLICIES.items()))
    return value


# Every HVA_* variable the library reads, and its rule. hva.init() parses each on every rank
# and then compares the values in effect across ranks.
SETTINGS = {
    "HVA_TIMEOUT_SECONDS": "seconds a collective of the library may wait (a positive finite "
                           "number; default 45; hva.set_timeout() overrides it)",
    "HVA_EXIT_AFTER_TIMEOUT_SECONDS": "seconds a process may go on after an "
                                      "AveragingTimeoutError (a positive finite number, or "
                                      "'never'; default half the timeout; "
                                      "hva.set_timeout(..., exit_after=...) overrides it)",
    "HVA_ROUTE": "how sets spanning nodes average rounds of at least 1 MiB: "
                 + ", ".join(repr(k) for k in ROUTE_POLICIES) + " (default 'measure')",
    "HVA_WATCHDOG_RECORD_DIR": "an existing folder where the watchdog leaves a record of each "
                               "process it ends (default: none)",
}


def settings_disagreement(values_by_rank: dict[str, list[str]]) -> Optional[str]:
    """The message naming each setting whose value in effect differs across ranks, with which
    ranks hold which value, or None when every rank agrees.

    ``values_by_rank``: per variable, every rank's value as text, in rank order.
    """
    parts = []
    for variable, values in values_by_rank.items():
        if len(set(values)) < 2:
            continue
        holders: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            holders.setdefault(value, []).append(rank)
        said = "; ".join(f"{value} on rank(s) {ranks}" for value, ranks in holders.items())
        parts.append(f"{variable} differs across ranks: {said}")
    if not parts:
        return None
    return (". ".join(parts) + ". Every rank must run with the same HVA_* settings (ranks that "
            "differ would take different collectives or give up at different times, and a "
            "timeout would then blame a rank that is fine); set them alike in the launch "
            "environment (horovodrun -x, mpirun -x, the job script) and hva.set_timeout() alike "
            "on every rank")
