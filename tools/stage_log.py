"""The test runner's record of its stages: pass, fail or skipped (and why), how long each took,
and for a failed stage the end of what it printed (repeated after the summary, where a CI log's
tail shows it)."""

from __future__ import annotations

import io
import sys
import time
from typing import Callable

__all__ = ["StageLog"]

FAILURE_TAIL_CHARS = 2500


class _Tee(io.TextIOBase):
    """Writes through to the real stream and keeps a copy."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class StageLog:
    """Runs stages one after another and remembers (label, passed, seconds) for each, and
    the stages it was told to skip, with the reason."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, bool, float]] = []
        self.failure_tails: dict[str, str] = {}
        self.skipped: list[tuple[str, str]] = []

    def skip(self, label: str, why: str) -> None:
        """Record a stage that does not run (neither passed nor failed), and why."""
        print(f"\n=== skipped: {label}: {why}", flush=True)
        self.skipped.append((label, why))

    def run(self, label: str, stage: Callable[[], bool]) -> bool:
        start = time.monotonic()
        tee = _Tee(sys.stdout)
        sys.stdout = tee
        try:
            ok = bool(stage())
        finally:
            sys.stdout = tee.stream
        self.stages.append((label, ok, time.monotonic() - start))
        if not ok:
            self.failure_tails[label] = tee.copy.getvalue()[-FAILURE_TAIL_CHARS:]
        return ok

    def failed(self) -> list[str]:
        return [label for label, ok, _ in self.stages if not ok]

    def failure_report(self) -> str:
        """The end of each failed stage's output, labelled (empty when all passed)."""
        return "\n".join(f"--- the end of what the failed stage {label!r} printed:\n{tail}"
                         for label, tail in self.failure_tails.items())

    def table(self) -> str:
        """A Markdown table of every stage, then the total."""
        rows = [f"| {label} | {'ok' if ok else 'FAILED'} | {seconds:.0f} |"
                for label, ok, seconds in self.stages]
        rows += [f"| {label} | skipped: {why} | |" for label, why in self.skipped]
        total = sum(seconds for _, _, seconds in self.stages)
        return "\n".join(["| stage | result | seconds |", "|---|---|---|", *rows,
                          f"| all stages | | {total:.0f} |"])
