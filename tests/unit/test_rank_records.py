"""The fault stages' verdicts from per-rank records (tools/rank_records.py), on records written
by the fault scripts' own writer (tests/faults/rank_record.py) and by hand."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests" / "faults"))

from cluster_tests import advice_problems  # noqa: E402
from rank_record import state_digest  # noqa: E402
from rank_records import checkpoint_problems, fault_problems, ranks_on, read_accounts  # noqa: E402
from run_tests import elastic_shrink_problems  # noqa: E402


def write(folder, rank, **fields):
    record = {"rank": rank, "pid": 1000 + rank, "host": "n0" if rank < 2 else "n1", "step": 12,
              "inside": "optimizer.step", "error_type": None, "error_message": None,
              "checkpoint": None, "checkpoint_digest": None, "exit": None, **fields}
    (folder / f"rank{rank}.json").write_text(json.dumps(record))


def raised_with_checkpoint(folder, rank, error_type="AveragingTimeoutError"):
    model = {"weight": torch.full((2, 3), float(rank))}
    path = folder / f"rank{rank}.pt"
    torch.save({"model": model, "optimizer": {"step": 12}, "step": 12}, path)
    write(folder, rank, error_type=error_type, error_message="not finished after 10 s",
          exit="raised", checkpoint=str(path), checkpoint_digest=state_digest(model))


def test_each_rank_is_accounted_for_in_exactly_one_way(tmp_path):
    raised_with_checkpoint(tmp_path, 0)
    write(tmp_path, 1)  # ended by the watchdog
    (tmp_path / "watchdog-1001.json").write_text(json.dumps(
        {"pid": 1001, "message": "hvd_averaging watchdog: rank 1 ... still blocked", "time": 1}))
    write(tmp_path, 2)
    (tmp_path / "rank2.signal").write_text(
        'Current thread 0x1 (most recent call first):\n  File "x.py", line 41 in _poll_until\n'
        '  File "x.py", line 52 in drive\n')
    write(tmp_path, 3)  # killed without a word
    accounts = read_accounts(tmp_path, 5)
    assert [a.how for a in accounts.values()] == ["raised", "watchdog", "signal", "silent",
                                                  "no record"]
    assert "_poll_until" in accounts[2].detail and "still blocked" in accounts[1].detail
    assert checkpoint_problems(accounts[0]) == []
    assert ranks_on(accounts, "n1") == {2, 3}
    problems = fault_problems({r: accounts[r] for r in range(4)}, lost={2, 3})
    assert problems == []  # the silent rank was on the lost node
    problems = fault_problems({r: accounts[r] for r in range(4)}, lost=set())
    assert problems == ["does not account for itself: rank 3: silent at step 12 inside optimizer.step"]


def test_a_checkpoint_that_differs_from_the_record_is_caught(tmp_path):
    raised_with_checkpoint(tmp_path, 0)
    state = torch.load(tmp_path / "rank0.pt", weights_only=True)
    state["model"]["weight"][0, 0] += 1
    torch.save(state, tmp_path / "rank0.pt")
    (account,) = read_accounts(tmp_path, 1).values()
    assert checkpoint_problems(account) == [
        f"{tmp_path / 'rank0.pt'}: its model values differ from those rank 0 recorded"]


def test_the_cause_must_be_named_and_nobody_may_complete(tmp_path):
    for rank in range(2):
        write(tmp_path, rank)
        (tmp_path / f"rank{rank}.signal").write_text('  File "x.py", line 1 in f\n')
    accounts = read_accounts(tmp_path, 2)
    assert fault_problems(accounts, set()) == []  # both stopped from outside: the launcher named it
    (tmp_path / "rank1.signal").unlink()  # rank 1 silent, on the lost node
    assert fault_problems(read_accounts(tmp_path, 2), {1}) == []
    (tmp_path / "rank1.signal").write_text(
        'Fatal Python error: Aborted\n\nThread 0x2 (most recent call first):\n'
        '  File "h.py", line 9 in synchronize\n')
    aborted = read_accounts(tmp_path, 2)[1]
    assert aborted.how == "signal" and aborted.detail.startswith("Fatal Python error: Aborted; File")
    (tmp_path / "rank1.signal").unlink()
    write(tmp_path, 1, exit=None, pid=77)
    (tmp_path / "watchdog-77.json").write_text(json.dumps({"pid": 77, "message": "m", "time": 1}))
    assert fault_problems(read_accounts(tmp_path, 2), set()) == []  # the watchdog named it
    (tmp_path / "watchdog-77.json").unlink()
    assert fault_problems(read_accounts(tmp_path, 2), set()) == [
        "does not account for itself: rank 1: silent at step 12 inside optimizer.step",
        "no surviving rank named the cause (a named error or the watchdog), and not every one "
        "was stopped from outside"]
    write(tmp_path, 1, exit="completed")
    assert any("went on to the end" in p for p in fault_problems(read_accounts(tmp_path, 2), set()))
    raised_with_checkpoint(tmp_path, 0, error_type="ValueError")
    assert any("not finished" in p for p in fault_problems(read_accounts(tmp_path, 1), set()))


def test_the_writer_records_every_event_and_a_signal_traceback(tmp_path):
    import subprocess
    code = ("import sys, time; sys.path.insert(0, %r); from pathlib import Path; "
            "from rank_record import RankRecord; r = RankRecord(Path(%r), 3); "
            "r.update(step=7, inside='sleeping'); print('ready', flush=True); time.sleep(30)"
            % (str(ROOT / "tests" / "faults"), str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.terminate()
    assert proc.wait(30) == -15
    account = read_accounts(tmp_path, 4)[3]
    assert account.how == "signal" and account.step == 7 and account.record["inside"] == "sleeping"
    assert "<string>" in account.detail  # where it was: the script's sleep


@pytest.mark.parametrize("message,problem", [
    ("x: not finished after 2 s ... needs a link of at least ~33.6 Mbit/s between nodes; set "
     "HVA_TIMEOUT_SECONDS or hva.set_timeout()", None),
    ("x: not finished after 2 s ... set HVA_TIMEOUT_SECONDS or hva.set_timeout()", "no link rate"),
    ("x: not finished after 2 s ... needs ~5.0 Mbit/s; HVA_TIMEOUT_SECONDS, set_timeout", "no link rate"),
    ("x: not finished ... needs ~33.6 Mbit/s; HVA_TIMEOUT_SECONDS, set_timeout", "the timeout"),
    ("x: not finished after 2 s ... needs ~33.6 Mbit/s", "how to set"),
])
def test_the_slow_link_advice_is_judged_by_meaning(message, problem):
    found = advice_problems(message, 2, 10)
    assert (found == []) if problem is None else any(problem in p for p in found), found


def test_the_elastic_records_are_compared_across_ranks(tmp_path):
    def final(rank, **changes):
        record = {"rank": rank, "size": 3, "resets": 1, "averager_step": 41, "diloco_step": 41,
                  "levels": {"2": 1, "4": 3}, "parameters_digest": 5,
                  "outer_parameters_digest": 6, "global_copy_digest": 7,
                  "wrapper_steps": [41, 41], "wrapper_parameters_digest": 9, **changes}
        (tmp_path / f"final-rank{rank}.json").write_text(json.dumps(record))
    for rank in range(3):
        final(rank)
    assert elastic_shrink_problems(tmp_path) == []
    final(2, global_copy_digest=8)
    assert elastic_shrink_problems(tmp_path) == ["global_copy_digest differs across ranks"]
    final(2, averager_step=40)
    assert "rank 2: size 3, steps 40/41" in elastic_shrink_problems(tmp_path)[0]
    final(2, wrapper_steps=[41, 42])
    assert elastic_shrink_problems(tmp_path) == [
        "rank 2: PostLocalSGDOptimizer/PostLocalSGD steps [41, 42] (expected 41 each)"]
    (tmp_path / "final-rank2.json").unlink()
    assert elastic_shrink_problems(tmp_path) == ["records from final ranks [0, 1], expected [0, 1, 2]"]
