"""The test runner's record of its stages: pass or fail and how long each took."""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["StageLog"]


class StageLog:
    """Runs stages one after another and remembers (label, passed, seconds) for each."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, bool, float]] = []

    def run(self, label: str, stage: Callable[[], bool]) -> bool:
        start = time.monotonic()
        ok = bool(stage())
        self.stages.append((label, ok, time.monotonic() - start))
        return ok

    def failed(self) -> list[str]:
        return [label for label, ok, _ in self.stages if not ok]

    def table(self) -> str:
        """A Markdown table of every stage, then the total."""
        rows = [f"| {label} | {'ok' if ok else 'FAILED'} | {seconds:.0f} |"
                for label, ok, seconds in self.stages]
        total = sum(seconds for _, _, seconds in self.stages)
        return "\n".join(["| stage | result | seconds |", "|---|---|---|", *rows,
                          f"| all stages | | {total:.0f} |"])
