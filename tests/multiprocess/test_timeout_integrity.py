"""A round whose wait ends early (a timeout, Ctrl-C, a SIGTERM handler that raises to save)
while its collective stays queued in Horovod: what the ranks save is whole, nothing of theirs
receives the late rank's write afterwards, and the next round averages every rank's inputs.

The late rank is always the last; it arrives only once every other rank said, by a marker
file, that its wait ended (a file, not a sleep, orders the two)."""
import os
import signal
import threading
import time

import pytest
import torch

import horovod.torch as hvd
import hvd_averaging as hva
from helpers import OutOfBand, param
from hvd_averaging.rounds import average_tensors

SHAPES = [(512, 500), (7,)]  # under 1 MiB in all: the flat route, in place, on any placement
ELEMENTS = sum(torch.Size(s).numel() for s in SHAPES)


class Preempted(Exception):
    """What a job's SIGTERM handler raises so that its except block saves a checkpoint."""


def _preempted(signum, frame):
    raise Preempted(f"signal {signum}")


def interrupt_soon(kind: str):
    """Deliver ``kind``'s signal to this process in 1 s, while it waits in the round: SIGINT
    (Python raises KeyboardInterrupt) or SIGTERM (a handler raises Preempted). Returns the
    exception the wait then raises and a function that restores the handler."""
    number = signal.SIGINT if kind == "sigint" else signal.SIGTERM
    previous = signal.signal(number, signal.default_int_handler if kind == "sigint" else _preempted)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), number))
    timer.start()

    def restore():
        timer.cancel()
        signal.signal(number, previous)
    return (KeyboardInterrupt if kind == "sigint" else Preempted), restore


def own_values(rank):
    """Each rank's inputs: every element differs, and all of them are small integers (every
    sum and the division by a power-of-two world are exact in float32)."""
    return [torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) * (rank + 1) + index
            for index, s in enumerate(SHAPES)]


def true_average(world):
    return [torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) * (world + 1) / 2
            + index for index, s in enumerate(SHAPES)]


def set_values(tensors, values):
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(v)


@pytest.mark.parametrize("kind", ["sigint", "sigterm"])
def test_interrupted_wait_leaves_what_is_saved_and_the_parameters_whole(world, rank, tmp_path,
                                                                        kind):
    """KeyboardInterrupt, or a SIGTERM handler's exception, while the others wait for the late
    rank: their except block saves; then the late rank completes the round. The saved copy and
    the parameters afterwards hold every element from before the round (at the commit before
    this test the saved copy was whole but the late average overwrote the parameters
    afterwards: the test fails there on the interrupted rank);
    the memory the abandoned round holds is stated, then let go by the next round, which
    averages every rank's values element for element."""
    late = world - 1
    on_time = [r for r in range(world) if r != late]
    signals = OutOfBand(f"interrupt-{kind}")
    params = [param(0.0, shape=s) for s in SHAPES]
    hva.average_parameters(params)  # the layout agreed, the parameters bound to the slab
    set_values(params, own_values(rank))
    before = [p.detach().clone() for p in params]
    hva.set_timeout(120, exit_after=None)  # the interrupt, not the timeout, ends the wait
    try:
        if rank == late:
            signals.wait_for("saved", on_time)
            hva.average_parameters(params)  # completes: the others' allreduce was queued
            signals.tell("done")
        else:
            expected, restore = interrupt_soon(kind)
            try:
                with pytest.raises(expected):
                    hva.average_parameters(params)
            finally:
                restore()
            torch.save([p.detach() for p in params], tmp_path / "except.pt")
            signals.tell("saved")
            signals.wait_for("done", [late])
            time.sleep(0.5)  # a late write that reached the parameters has landed by now
    finally:
        hva.set_timeout(None)
    if rank == late:
        for p, want in zip(params, true_average(world)):
            assert torch.equal(p.detach(), want), "the late rank averaged"
    else:
        saved = torch.load(tmp_path / "except.pt", weights_only=True)
        for index, (p, s, b) in enumerate(zip(params, saved, before)):
            changed = int((s != b).sum())
            assert changed == 0, f"saved tensor #{index}: {changed} elements changed"
            overwritten = int((p.detach() != b).sum())
            assert overwritten == 0, f"parameter #{index}: {overwritten} elements overwritten"
        from hvd_averaging.abandoned_rounds import bytes_held_by_timed_out_rounds
        assert bytes_held_by_timed_out_rounds() == 4 * ELEMENTS  # the old flat storage
    signals.close()
    # the next round first lets the abandoned one go, then averages what every rank holds now
    set_values(params, own_values(rank))
    hva.average_parameters(params)
    for index, (p, want) in enumerate(zip(params, true_average(world))):
        wrong = int((p.detach() != want).sum())
        assert wrong == 0, f"parameter #{index}: {wrong} elements differ from the true average"
    from hvd_averaging.abandoned_rounds import bytes_held_by_timed_out_rounds
    assert bytes_held_by_timed_out_rounds() == 0


class Rounds:
    """One kind of round, run the same way on every rank: ``first()`` is the round the late
    rank misses, ``second()`` the one after it, ``values()`` what they average."""

    def __init__(self, what: str):
        self.what = what
        if what == "gradients":  # copied through buffers reused from round to round
            self.tensors = [torch.zeros(s) for s in SHAPES]
            average_tensors(self.tensors, name="grads", bind=False)  # the layout agreed
        else:
            self.tensors = [param(0.0, shape=s) for s in SHAPES]
            if what == "delayed":
                self.averager = hva.PeriodicModelAverager(period=2, delay=1)
            self._run()  # the layout agreed, the parameters bound to the slab
            if what == "delayed":
                self._run()  # steps 0 and 1: a round started and applied

    def _run(self):
        if self.what == "gradients":
            average_tensors(self.tensors, name="grads", bind=False)
        elif self.what == "parameters":
            hva.average_parameters(self.tensors)
        else:
            self.averager.average_parameters(self.tensors)

    def first(self):
        """The round the late rank misses: it raises on the others (at its apply step for a
        delayed round, whose start returns at once)."""
        if self.what == "delayed":
            self.averager.average_parameters(self.tensors)  # step 2: the round starts
        self._run()

    def after_timeout(self):
        """On the ranks that timed out: a delayed averager's step 3 again (it raised there)."""
        if self.what == "delayed":
            self.averager.average_parameters(self.tensors)

    def second(self):
        self._run()
        if self.what == "delayed":
            self._run()  # step 5 applies what step 4 started


@pytest.mark.parametrize("what", ["parameters", "gradients", "delayed"])
def test_the_round_after_a_timeout_averages_every_ranks_inputs(world, rank, what):
    """The others time out (3 s) and go straight on to the next round with new inputs, while
    the late rank is still away; it arrives 1 s later, completes the first round, then joins
    the second. The second round's result, on every rank, equals the true average of all ranks'
    inputs element for element. Parameters live in the flat storage (bound); gradients are
    copied through buffers reused from round to round (bind=False); a delayed round sends a
    copy from wire buffers its averager keeps: the first round's late write must reach none of
    them. At the commit before this test the others' second round raised ValueError at once
    (Horovod refuses a collective whose name is still queued)."""
    late = world - 1
    on_time = [r for r in range(world) if r != late]
    signals = OutOfBand(f"after-timeout-{what}")
    rounds = Rounds(what)
    set_values(rounds.tensors, [v * 3 for v in own_values(rank)])  # the first round's inputs
    hva.set_timeout(3, exit_after=None)  # this test recovers from the stall
    try:
        if rank == late:
            signals.wait_for("raised", on_time)
            time.sleep(1.0)  # the others are inside their second round by now
            rounds.first()  # completes the first round
        else:
            with pytest.raises(hva.AveragingTimeoutError):
                rounds.first()
            signals.tell("raised")
            rounds.after_timeout()
        hva.set_timeout(60, exit_after=None)  # the second round waits for the late rank
        set_values(rounds.tensors, own_values(rank))  # the second round's inputs
        rounds.second()
    finally:
        hva.set_timeout(None)
    for index, (t, want) in enumerate(zip(rounds.tensors, true_average(world))):
        wrong = int((t.detach() != want).sum())
        assert wrong == 0, f"{what} #{index}: {wrong} elements differ from the true average"
    everyone = hvd.allgather(rounds.tensors[1].detach().reshape(1, -1), name=f"test.after.{what}")
    assert all(torch.equal(row, true_average(world)[1].reshape(-1)) for row in everyone)
    signals.close()


def test_no_room_to_move_still_raises_averaging_timeout_error(world, rank, monkeypatch):
    """Moving the parameters needs a second copy; when no memory holds one (the allocator's
    failure injected on the ranks that time out), the error is still AveragingTimeoutError (at
    the commit before this test: OutOfMemoryError, which also disarmed the watchdog's exit
    after a timeout), chained to the failure and saying that the late write can reach the
    parameters; nothing was changed, so the late rank's arrival writes the first round's
    average into them, as said. The next round, once that has happened, averages every rank's
    inputs."""
    from hvd_averaging.abandoned_rounds import settle
    late = world - 1
    on_time = [r for r in range(world) if r != late]
    signals = OutOfBand("no-room")
    params = [param(0.0, shape=s) for s in SHAPES]
    hva.average_parameters(params)
    set_values(params, own_values(rank))
    hva.set_timeout(3, exit_after=None)
    try:
        if rank == late:
            signals.wait_for("raised", on_time)
            hva.average_parameters(params)
            signals.tell("done")
        else:
            real = torch.empty_like

            def no_room(*args, **kwargs):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB")
            monkeypatch.setattr(torch, "empty_like", no_room)
            try:
                with pytest.raises(hva.AveragingTimeoutError) as info:
                    hva.average_parameters(params)
            finally:
                monkeypatch.setattr(torch, "empty_like", real)
            signals.tell("raised")
            message = str(info.value)
            assert "not finished after 3 s" in message
            assert "could not be moved out of the round's reach" in message
            assert isinstance(info.value.__cause__, MemoryError)
            assert isinstance(info.value.__cause__.__cause__, torch.OutOfMemoryError)
            signals.wait_for("done", [late])
            settle(hvd.global_process_set, "test")  # until the late write has landed
            for index, (p, want) in enumerate(zip(params, true_average(world))):
                assert torch.equal(p.detach(), want), f"parameter #{index}: the late write"
        hva.set_timeout(60, exit_after=None)
        set_values(params, own_values(rank))
        hva.average_parameters(params)
    finally:
        hva.set_timeout(None)
    for index, (p, want) in enumerate(zip(params, true_average(world))):
        assert torch.equal(p.detach(), want), f"parameter #{index}"
    signals.close()
