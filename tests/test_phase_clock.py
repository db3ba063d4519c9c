"""PhaseClock (mpipar/mpi/bench/phase_clock.py): each phase's time exclusive of the phases
inside it, one record per outermost call, on a clock the test drives."""

import time

from mpipar.mpi.bench import phase_clock as lean


def test_exclusive_phases_one_record_per_step(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "process_time", lambda: now[0])
    clock = lean.PhaseClock()
    assert clock.overhead == 0.0  # the calibration's clock did not move

    def work(seconds):
        now[0] += seconds

    leaf = clock.wrap(lambda: work(2.0), "data")

    def mid():
        work(1.0)
        leaf()
        work(1.0)

    timed_mid = clock.wrap(mid, "forward")

    def step():
        work(0.5)
        timed_mid()
        leaf()

    timed_step = clock.wrap(step, "whatever")  # the outermost call is the step itself
    timed_step()
    timed_step()
    assert clock.steps == [{"data": 4.0, "forward": 2.0, "step": 0.5}] * 2
    assert clock.medians() == {"data": 4.0, "forward": 2.0, "step": 0.5, "total": 6.5}


def test_a_timed_calls_overhead_comes_off_its_caller(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "process_time", lambda: now[0])
    clock = lean.PhaseClock()
    clock.overhead = 0.25
    inner = clock.wrap(lambda: None, "p2p")

    def outer():
        now[0] += 1.0
        inner()
        inner()
    clock.wrap(outer, "step")()
    assert clock.steps == [{"p2p": 0.0, "step": 0.5}]


def test_patch_wraps_a_method_in_place(monkeypatch):
    class Thing:
        def run(self, x):
            return x + 1

    clock = lean.PhaseClock()
    monkeypatch.setattr(Thing, "run", Thing.run)  # restored after the test
    clock.patch(Thing, "run", "forward")
    assert Thing().run(1) == 2 and len(clock.steps) == 1 and "step" in clock.steps[0]
