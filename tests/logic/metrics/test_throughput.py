"""Steady-state rates (issue 28, item 2): warm-up stays out of every rate and is reported apart."""

from __future__ import annotations

import pytest

from dtrain.metrics.throughput import SteadyRate, human, progress_fields

pytestmark = pytest.mark.smoke  # also run on the oldest torch claimed (.ci/run)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(rate: SteadyRate, clock: FakeClock, durations: list[float]) -> None:
    rate.start()
    for d in durations:
        clock.t += d
        rate.step_done()


def test_a_slow_first_step_stays_out_of_the_rate():
    clock = FakeClock()
    synced = []
    rate = SteadyRate(32, steps=20, warmup_steps=5, clock=clock, sync=lambda: synced.append(clock.t))
    rate.start()
    clock.t += 10.0  # step 1: compilation
    rate.step_done()
    assert rate.window() is None
    _run_more = [0.1] * 19
    for d in _run_more:
        clock.t += d
        rate.step_done()
    rate.finish()
    assert synced == [pytest.approx(10.4)]  # the device is waited for once, at the end of warm-up
    assert rate.samples_per_s == pytest.approx(32 / 0.1)  # 15 steady steps of 0.1 s
    assert rate.warmup_s == pytest.approx(10.4)
    assert rate.record() == {"warmup_s": 10.4, "warmup_steps": 5}


def test_windows_are_the_steps_since_the_last_record():
    clock = FakeClock()
    rate = SteadyRate(10, steps=100, warmup_steps=2, clock=clock)
    _run(rate, clock, [5.0, 1.0])  # warm-up
    _run_steps = [0.5] * 4
    for d in _run_steps:
        clock.t += d
        rate.step_done()
    assert rate.window() == pytest.approx(10 / 0.5)
    for _ in range(4):
        clock.t += 0.25
        rate.step_done()
    assert rate.window() == pytest.approx(10 / 0.25)
    assert rate.window() is None  # no step since


def test_short_runs_keep_a_figure():
    clock = FakeClock()
    two = SteadyRate(8, steps=2, warmup_steps=5, clock=clock)
    _run(two, clock, [4.0, 1.0])
    two.finish()
    assert two.warmup_steps == 1 and two.samples_per_s == pytest.approx(8.0) and two.warmup_s == pytest.approx(4.0)
    one = SteadyRate(8, steps=1, clock=clock)
    _run(one, clock, [2.0])
    one.finish()
    assert one.warmup_steps == 0 and one.samples_per_s == pytest.approx(4.0) and one.warmup_s == 0.0


def test_rates_read_as_people_read_them():
    assert human(20670.4, "samples/s") == "20,670 samples/s"
    assert human(52.34, "samples/s") == "52.3 samples/s"
    assert human(0.4123, "samples/s") == "0.412 samples/s"
    line = progress_fields({"loss": 2.34567, "samples_per_s": 20670.0, "tokens_per_s": 414000.0, "mfu": 0.261})
    assert line == "loss=2.346  20,670 samples/s  414,000 tokens/s  MFU 26.1%"
    assert progress_fields({"loss": 1.0, "samples_per_s": None, "tokens_per_s": None, "mfu": None}) == "loss=1  warming up"


def test_a_warmup_the_run_cannot_hold_is_named_in_one_warning():
    """--warmup-steps 100 on a 3-step run was shrunk to 1 without a word (issue 51, item 5); the
    default (5) still shrinks quietly, as docs/performance.md says."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dtrain")
    logger.addHandler(handler)
    try:
        rate = SteadyRate(8, steps=3, warmup_steps=100)
        assert rate.warmup_steps == 1
        assert said == ["--warmup-steps 100 is more than half of this run's 3 steps; the rates leave out the first 1 "
                        "step(s) instead (give --warmup-steps 1 or fewer, or a longer run)."]
        said.clear()
        quiet = [SteadyRate(8, steps=3), SteadyRate(8, steps=3, warmup_steps=1), SteadyRate(8, warmup_steps=100)]
        assert [r.warmup_steps for r in quiet] == [1, 1, 100] and said == []
    finally:
        logger.removeHandler(handler)
