"""The race's baseline step is bounded: ``hvd.DistributedOptimizer.synchronize()`` waits with no
handle the demo may poll, so a rank that never joins the step must not leave the others waiting
(a real two-rank horovodrun launch; the watchdog ends the waiting rank, naming the wait)."""
import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
TIMEOUT_S = 2  # HVA_TIMEOUT_SECONDS: the watchdog acts 2 s (its grace) after it
OTHER_RANK_WAITS_S = 40

BASELINE_ALONE = f"""
import argparse, time
import horovod.torch as hvd
import hvd_averaging as hva
from hvd_averaging.examples.methods import BaselineTrainer
from hvd_averaging.examples.tasks import DigitsTask

hva.init()
task = DigitsTask()
trainer = BaselineTrainer(task.model(0), task, argparse.Namespace(baseline_fp16=False, lr=0.01))
x, y = next(task.batches(hvd.rank(), hvd.size(), 0))
trainer.step(x, y)
print(f"rank {{hvd.rank()}} stepped together", flush=True)
if hvd.rank() == 0:
    trainer.step(x, y)  # rank 1 never joins this step
    print("rank 0 completed a step alone", flush=True)
else:
    time.sleep({OTHER_RANK_WAITS_S})
"""


def test_a_baseline_step_the_other_rank_never_joins_is_ended_by_the_watchdog(tmp_path):
    """At the commit before this test rank 0 waited in synchronize() until the other rank was
    gone (no watchdog record; the launch outlived the other rank's wait)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               HVA_TIMEOUT_SECONDS=str(TIMEOUT_S), HVA_WATCHDOG_RECORD_DIR=str(tmp_path))
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2",
                           str(BIN / "python"), "-c", BASELINE_ALONE], capture_output=True,
                          text=True, timeout=240, env=env, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert "rank 0 stepped together" in out and "rank 1 stepped together" in out, out
    assert "completed a step alone" not in out and proc.returncode != 0, out
    records = [json.loads(path.read_text()) for path in tmp_path.glob("watchdog-*.json")]
    assert len(records) == 1, out
    assert "the baseline's synchronize() (its gradient allreduces)" in records[0]["message"]
    assert f"HVA_TIMEOUT_SECONDS={TIMEOUT_S}" in records[0]["message"]
