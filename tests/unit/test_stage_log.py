"""The runner's stage table: a row per stage that ran, and one per skipped stage with its reason."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from stage_log import StageLog  # noqa: E402


def test_failed_and_skipped_stages_have_rows_and_only_failures_fail(capsys):
    log = StageLog()
    assert log.run("passes", lambda: True)
    assert not log.run("fails", lambda: print("the cause") or False)
    log.skip("SLURM", "HVA_SKIP_SLURM=1 and no slurmctld")
    table = log.table().splitlines()
    assert "| passes | ok |" in table[2] and "| fails | FAILED |" in table[3]
    assert "| SLURM | skipped: HVA_SKIP_SLURM=1 and no slurmctld | |" in table
    assert log.failed() == ["fails"]
    assert "the cause" in log.failure_report() and "SLURM" not in log.failure_report()
    assert "=== skipped: SLURM" in capsys.readouterr().out
