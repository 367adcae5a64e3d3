"""The serving loops' phase clock: laps add up per phase, the summary is per counted phase."""

from __future__ import annotations

from dspark.server import phase_times
from dspark.server.phase_times import PhaseTimes


def test_laps_add_up_per_phase_and_the_summary_divides_by_the_counted_phase(monkeypatch):
    clock = iter([0.0, 1.0, 1.002, 1.0025, 3.0, 3.004, 3.0045, 9.0])
    monkeypatch.setattr(phase_times, "perf_counter", lambda: next(clock))
    times = PhaseTimes()  # 0.0
    times.lap("idle")  # 1.0
    times.lap("step")  # 2 ms
    times.lap("post")  # 0.5 ms
    times.lap("idle")  # 1.9975 s
    times.lap("step")  # 4 ms
    times.lap("post")  # 0.5 ms
    assert times.counts == {"idle": 2, "step": 2, "post": 2}
    assert (
        times.summary("step") == "2 steps; a step: step 3.000 ms, post 0.500 ms; idle 3.00 s in all"
    )
    assert PhaseTimes().summary("step") == "0 steps; a step: none"


def test_take_hands_over_the_times_so_far_and_starts_again(monkeypatch):
    clock = iter([0.0, 0.002, 0.003, 0.007])
    monkeypatch.setattr(phase_times, "perf_counter", lambda: next(clock))
    times = PhaseTimes()  # 0.0
    times.lap("step")  # 2 ms
    period = times.take()
    assert period.summary("step") == "1 steps; a step: step 2.000 ms"
    assert times.summary("step") == "0 steps; a step: none"
    times.lap("idle")  # 1 ms: laps continue from the last one
    times.lap("step")  # 4 ms
    assert times.summary("step") == "1 steps; a step: step 4.000 ms; idle 0.00 s in all"
    assert period.counts == {"step": 1}
