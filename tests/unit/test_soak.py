"""The fault soak's pure logic (tools/soak.py): drawing faults, judging a fault from the workers'
records, the summary."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from soak import (FAULT_KINDS, FaultBag, feasible_kinds, final_problems,  # noqa: E402
                  judge_fault, passed, read_events, summarize, summary_line, world_problems,
                  worlds)

TIMEOUT = 10.0


# -- drawing ------------------------------------------------------------------------------------

def test_feasible_kinds_keep_min_np_and_need_an_absent_node_to_add_back():
    assert feasible_kinds(4, 2, 3, 0) == [k for k in FAULT_KINDS if k != "worker_added_back"]
    assert feasible_kinds(2, 2, 1, 2) == ["link_slowed", "rank_stalled", "worker_added_back"]
    # a node fault needs a node other than the launcher's in the world
    assert feasible_kinds(3, 2, 0, 1) == ["rank_killed", "link_slowed", "rank_stalled",
                                          "worker_added_back"]


def draw_many(seed, count, kinds=FAULT_KINDS):
    """Draws as the soak makes them, applying each removal and addition to the cluster's state."""
    bag, members, absent, draws = FaultBag(seed, kinds), [0, 1, 2, 3], [], []
    for _ in range(count):
        draw = bag.draw(members=members, present=sorted(set(range(4)) - set(absent)),
                        absent=absent, min_np=2, timeout_s=TIMEOUT)
        draws.append(draw)
        assert len(members) - (draw.kind in ("rank_killed", "node_lost", "link_cut")) >= 2
        if draw.kind in ("node_lost", "link_cut"):
            assert draw.node != 0 and draw.node in members
            members.remove(draw.node)
            absent.append(draw.node)
        elif draw.kind == "worker_added_back":
            assert draw.node in absent
            absent.remove(draw.node)
            members.append(draw.node)
        elif draw.kind in ("rank_killed", "rank_stalled"):
            assert draw.node in members
    return draws


def test_a_seed_gives_the_same_draws_and_another_seed_others():
    assert draw_many(7, 20) == draw_many(7, 20)
    assert draw_many(7, 20) != draw_many(8, 20)


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_comes_up_in_twenty_draws_and_lengths_follow_the_timeout(seed):
    draws = draw_many(seed, 20)
    assert {d.kind for d in draws} == set(FAULT_KINDS)
    for d in draws:
        if d.kind == "link_cut":
            assert d.seconds == 1.5 * TIMEOUT  # longer than the timeout
        elif d.kind == "rank_stalled":
            assert d.seconds in (0.5 * TIMEOUT, 1.5 * TIMEOUT)
        elif d.kind == "link_slowed":
            assert 10 <= d.seconds <= 20
        else:
            assert d.seconds == 0


def test_five_draws_are_five_kinds():
    for seed in range(20):
        assert len({d.kind for d in draw_many(seed, 5)}) == 5


def test_six_draws_give_every_kind_so_the_short_soak_cuts_a_link():
    # make test's short soak (6 faults) relies on it to cut a link for 3x the timeout
    for seed in range(300):
        assert {d.kind for d in draw_many(seed, 6)} == set(FAULT_KINDS)


def test_an_unknown_or_empty_kind_selection_is_refused():
    with pytest.raises(ValueError, match="link_cutt"):
        feasible_kinds(4, 2, 3, 0, ["link_cutt"])
    with pytest.raises(ValueError, match="non-empty"):
        FaultBag(0, []).draw(members=[0, 1, 2], present=[0, 1, 2], absent=[], min_np=2,
                             timeout_s=TIMEOUT)


def test_a_world_without_workers_is_refused():
    with pytest.raises(ValueError, match="no workers"):
        FaultBag(0).draw(members=[], present=[0], absent=[], min_np=2, timeout_s=TIMEOUT)


# -- records ------------------------------------------------------------------------------------

def start(t, world, rank, size, batch, digest="d0", pid=None, host=None):
    return {"event": "start", "time": t, "world": world, "rank": rank, "size": size,
            "batch": batch, "digest": digest, "pid": pid or 100 + rank, "host": host or f"n{rank}"}


def commit(t, world, rank, batch, digest=None, pid=None):
    return {"event": "commit", "time": t, "world": world, "batch": batch, "digest": digest,
            "pid": pid or 100 + rank, "host": f"n{rank}"}


def two_worlds(resume_batch=6, start_digests=("s", "s"), commit_digests=("a", "a")):
    """World A (3 ranks) commits batches 1-6 (digests at even batches); a fault at t=10; world B
    (2 ranks) starts at t=12 from ``resume_batch`` and commits the next batches."""
    events = [start(0, "A", r, 3, 0) for r in range(3)]
    for batch in range(1, 7):
        for r in range(3):
            events.append(commit(batch, "A", r, batch, "x" if batch % 2 == 0 else None))
    events += [start(12, "B", r, 2, resume_batch, start_digests[r], pid=200 + r) for r in range(2)]
    for r in range(2):
        events.append(commit(13, "B", r, resume_batch + 1, None, pid=200 + r))
        events.append(commit(14, "B", r, resume_batch + 2, commit_digests[r], pid=200 + r))
    return events


FAULT = {"kind": "rank_killed", "injected_at": 10.0, "disrupted_until": 10.0}


def test_a_clean_recovery_survives_with_its_recovery_time():
    record = judge_fault(FAULT, two_worlds(), window_end=30, bound_s=2 * TIMEOUT)
    assert record["survived"], record["problems"]
    assert record["steps_lost"] == 0 and record["recovery_s"] == 3.0
    assert record["since_injection_s"] == 3.0
    assert record["worlds"] == [{"token": "B", "size": 2, "start_batch": 6, "ranks_started": 2,
                                 "started_s": 2.0}]


def test_a_world_resuming_before_the_last_commit_loses_steps():
    record = judge_fault(FAULT, two_worlds(resume_batch=4), 30, 2 * TIMEOUT)
    assert not record["survived"] and record["steps_lost"] == 2
    assert "resumed from batch 4" in record["problems"][0]


def test_a_world_resuming_one_past_the_last_recorded_commit_is_whole_but_two_is_not():
    # one past: the fault cut off the record line of a commit Horovod had saved
    assert judge_fault(FAULT, two_worlds(resume_batch=7), 30, 2 * TIMEOUT)["survived"]
    record = judge_fault(FAULT, two_worlds(resume_batch=8), 30, 2 * TIMEOUT)
    assert not record["survived"] and record["steps_lost"] == 0
    assert "past world A's last commit (6)" in record["problems"][0]


def test_parameters_that_differ_after_the_sync_or_an_average_fail_the_fault():
    record = judge_fault(FAULT, two_worlds(start_digests=("s", "t")), 30, 2 * TIMEOUT)
    assert not record["survived"]
    assert any("differ across ranks at the start" in p for p in record["problems"])
    record = judge_fault(FAULT, two_worlds(commit_digests=("a", "b")), 30, 2 * TIMEOUT)
    assert any("after the all-rank average of batch 8" in p for p in record["problems"])


def test_a_recovery_past_twice_the_timeout_or_none_at_all_fails():
    late = {**FAULT, "injected_at": 10.0, "disrupted_until": 10.0}
    events = two_worlds()
    for e in events:
        if e["world"] == "B":
            e["time"] += 20  # first commit 23 s after the fault
    record = judge_fault(late, events, 60, 2 * TIMEOUT)
    assert not record["survived"] and record["recovery_s"] == 23.0
    assert "over 20 s" in record["problems"][0]
    only_a = [e for e in two_worlds() if e["world"] == "A"]
    record = judge_fault(late, only_a, 60, 2 * TIMEOUT)
    assert not record["survived"] and record["recovery_s"] is None


def test_a_fault_without_a_reset_recovers_at_the_next_commit_of_the_same_world():
    events = [e for e in two_worlds() if e["world"] == "A"]
    events += [commit(16, "A", r, 7) for r in range(3)]
    slowed = {"kind": "link_slowed", "injected_at": 4.5, "disrupted_until": 15.0}
    record = judge_fault(slowed, events, 30, 2 * TIMEOUT)
    assert record["survived"] and record["recovery_s"] == 1.0 and record["worlds"] == []
    assert record["since_injection_s"] == 11.5


def test_world_problems_name_a_rank_started_twice_and_a_double_commit():
    events = [start(0, "W", 0, 2, 0), start(0, "W", 0, 2, 0, pid=300),
              commit(1, "W", 1, 1), commit(1.5, "W", 1, 1)]
    problems = world_problems(worlds(events)["W"])
    assert any("rank started twice" in p for p in problems)
    assert any("committed twice" in p for p in problems)


def test_read_events_skips_a_line_cut_short_and_sorts_by_time(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(commit(2, "W", 0, 1)) + "\n"
                                      + '{"event": "comm')
    (tmp_path / "b.jsonl").write_text(json.dumps(start(1, "W", 1, 2, 0)) + "\n")
    assert [e["time"] for e in read_events(tmp_path)] == [1, 2]


def test_summary_counts_and_line():
    records = [judge_fault(FAULT, two_worlds(), 30, 20),
               judge_fault(FAULT, two_worlds(resume_batch=4), 30, 20)]
    summary = summarize(records)
    assert summary == {"faults_injected": 2, "faults_survived": 1, "steps_lost": 2,
                       "longest_recovery_s": 3.0, "kinds": {"rank_killed": 2}}
    assert summary_line(summary) == ("soak: faults injected 2 / survived 1 / steps lost 2 / "
                                     "longest recovery 3.0 s")
    assert not passed({**summary, "problems": []}, 2)
    assert passed({**summarize(records[:1]), "problems": []}, 1)
    assert not passed({**summarize(records[:1]), "problems": ["exit code 1"]}, 1)
    assert not passed({**summarize(records[:1]), "problems": []}, 2)  # fewer injected than asked


def test_the_end_needs_every_listed_worker_at_one_batch_with_equal_parameters():
    ends = [{"event": "end", "world": "W", "host": f"n{r}", "batch": 90, "digest": "d"}
            for r in range(3)]
    assert final_problems(ends, 3) == []
    assert "2 workers ended training (3 listed)" in final_problems(ends[:2], 3)[0]
    ends[2] = {**ends[2], "digest": "e"}
    assert "ended differently" in final_problems(ends, 3)[0]
