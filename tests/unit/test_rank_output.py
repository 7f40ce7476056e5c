"""tools/rank_output.py's verdict on a launch, from output shaped as horovodrun prints it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from rank_output import EVERY_TEST_RUNS_FROM_RANKS, rank_summaries, suite_passed  # noqa: E402


def output(*lines_by_rank: str, mpi: bool = True) -> str:
    prefix = "[1,{}]<stdout>:" if mpi else "[{}]<stdout>:"
    return "\n".join(prefix.format(rank) + line for rank, line in enumerate(lines_by_rank))


@pytest.mark.parametrize("mpi", [True, False])
def test_every_rank_passing_passes(mpi):
    text = output(*["113 passed, 5 warnings in 30.73s"] * 2, mpi=mpi)
    assert rank_summaries(text) == [(0, "113 passed, 5 warnings in 30.73s"),
                                    (1, "113 passed, 5 warnings in 30.73s")]
    assert suite_passed(text, 0, 2)


@pytest.mark.parametrize("line", ["112 passed, 1 failed in 3.0s", "112 passed, 1 error in 3.0s",
                                  "110 passed, 2 errors in 3.0s"])
def test_a_failure_or_error_on_one_rank_fails(line):
    assert not suite_passed(output("113 passed in 3.0s", line), 0, 2)


def test_a_missing_rank_a_nonzero_exit_or_a_hang_fails():
    text = output("113 passed in 3.0s", "113 passed in 3.0s")
    assert not suite_passed(text, 0, 3)
    assert not suite_passed(text, 1, 2)
    assert not suite_passed(text, None, 2)


def test_skips_pass_below_the_full_suite_rank_count_only():
    below = EVERY_TEST_RUNS_FROM_RANKS - 2
    assert suite_passed(output(*["113 passed, 5 skipped in 3.0s"] * below), 0, below)
    full = EVERY_TEST_RUNS_FROM_RANKS
    assert not suite_passed(output(*["117 passed, 1 skipped in 3.0s"] * full), 0, full)
    assert suite_passed(output(*["118 passed in 3.0s"] * full), 0, full)
