"""``HVA_*`` settings that are not timeouts (those are :mod:`.deadlines`'), read from the
environment and checked at ``hva.init()`` (through :func:`.deadlines.check_environment`)."""

from __future__ import annotations

import os

__all__ = ["ROUTE_POLICIES", "route_policy"]

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
