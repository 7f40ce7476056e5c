"""Reading a multi-rank launch: the environment it needs and each rank's pytest verdict."""

from __future__ import annotations

import os
import re

__all__ = ["launch_env", "test_launch_env", "rank_summaries", "suite_passed",
           "EVERY_TEST_RUNS_FROM_RANKS"]

# horovodrun and mpirun --tag-output prefix each rank's lines with [rank] (Gloo) or [1,rank] (MPI)
_SUMMARY = re.compile(
    r"\[(?:\d+,)?(\d+)\]<stdout>:((?:\d+ (?:passed|failed|errors?|skipped|warnings?),? ?)+in [\d.]+s)")


def launch_env(**extra: str) -> dict[str, str]:
    """This environment for a launch: root allowed, more ranks than cores allowed."""
    env = dict(os.environ, **extra)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return env


def test_launch_env(**extra: str) -> dict[str, str]:
    """:func:`launch_env` for the test suite's launches, with one compute thread per rank: 4-8
    ranks share the machine's cores, and torch's default (a thread per core in every rank)
    starved Horovod's background threads (the Gloo 4-rank suite took 131 s with it, 54 s
    without). The demo and the benchmarks keep torch's default."""
    return launch_env(**{"OMP_NUM_THREADS": "1", **extra})


def rank_summaries(output: str) -> list[tuple[int, str]]:
    """(rank, pytest summary line) for every rank that printed one, by rank."""
    return sorted(((int(rank), line) for rank, line in _SUMMARY.findall(output)))


# The suite's only skips are node-aware tests that need 2 nodes of 2 ranks; from this many
# ranks on every test must run, so that a skip cannot stand in for a pass.
EVERY_TEST_RUNS_FROM_RANKS = 4


def suite_passed(output: str, returncode, expected_ranks: int) -> bool:
    """Every rank printed a pytest summary without failures or errors (nor skips, with
    :data:`EVERY_TEST_RUNS_FROM_RANKS` ranks or more), and the launch exited 0."""
    summaries = rank_summaries(output)
    banned = ("failed", "error") + (("skipped",) if expected_ranks >= EVERY_TEST_RUNS_FROM_RANKS
                                    else ())
    return (returncode == 0 and {r for r, _ in summaries} == set(range(expected_ranks))
            and all(word not in line for _, line in summaries for word in banned))
