"""The links probe repeats latency-bound sizes more than the large ones (it costs next to nothing,
and a median of 3 small collectives moved 5x between two measurements of one bed link), and times
two sends crossing in opposite directions, the second fired a share of one send's time later, and
sends on a connection of their own (a pipeline's hand-offs: a sender's TCP may pace it)."""

from __future__ import annotations

import pytest
import torch

from dtrain.diag import probe


def test_small_sizes_are_timed_at_least_small_reps_times(monkeypatch):
    asked = []
    monkeypatch.setattr(probe, "_ops", lambda kind, size, n, rank, device: (kind, size, None))
    monkeypatch.setattr(probe, "_crossed", lambda size, rank, lag, device: (probe.CROSSED, size, lag))
    # a round trip of 1 ms plus 1 s per 100 MB
    monkeypatch.setattr(probe, "_call_time", lambda op, device, reps, expected=False:
                        asked.append((op, reps, expected)) or 1e-3 + op[1] / 1e8)
    monkeypatch.setattr(probe.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(probe.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(probe.dist, "all_reduce", lambda t, op=None: None)
    monkeypatch.setattr(probe, "time_after_idle", lambda device, one_way, reps: {probe.IDLE_SIZE: one_way[64]})
    monkeypatch.setattr(probe, "time_stream", lambda device, one_way, reps: {probe.IDLE_SIZE: 2 * one_way[64]})
    out = probe.time_collectives(torch.device("cpu"), sizes=(64, 64 << 10, 1 << 20), reps=3)
    assert out[probe.IDLE] == {probe.IDLE_SIZE: out["send_recv"][64]}
    assert out[probe.STREAM] == {probe.IDLE_SIZE: 2 * out["send_recv"][64]}
    reps = {size: (r, e) for (kind, size, _), r, e in asked if kind != probe.CROSSED}
    assert reps == {64: (probe.SMALL_REPS[1], True), 64 << 10: (probe.SMALL_REPS[1], True), 1 << 20: (3, False)}
    assert out["send_recv"][64] == pytest.approx((1e-3 + 64 / 1e8) / 2)  # half a round trip
    assert out["all_reduce"][1 << 20] == pytest.approx(1e-3 + (1 << 20) / 1e8)
    crossed = {size: (lag, r) for (kind, size, lag), r, _ in asked if kind == probe.CROSSED}
    assert set(crossed) == set(probe.CROSSED_SIZES) == set(out[probe.CROSSED])
    for size, (lag, r) in crossed.items():
        assert lag == pytest.approx(probe.CROSSED_LAG * probe.one_way_at(out["send_recv"], size)) and lag > 0
        assert r == (probe.SMALL_REPS[1] if size <= probe.SMALL_REPS[0] else 3)


def test_one_send_is_read_off_the_measured_sizes():
    one = {64: 1e-4, 1 << 20: 0.4, 4 << 20: 1.6}
    assert probe.one_way_at(one, 64) == pytest.approx(1e-4) and probe.one_way_at(one, 32) == pytest.approx(1e-4)
    assert probe.one_way_at(one, 64 << 10) == pytest.approx(1e-4 + (0.4 - 1e-4) * ((64 << 10) - 64) / ((1 << 20) - 64))
    assert probe.one_way_at(one, 2 << 20) == pytest.approx(0.8) and probe.one_way_at(one, 8 << 20) == pytest.approx(3.2)


def test_a_small_collectives_time_is_what_a_call_costs_on_average():
    """Calls of two modes (the bed's and loopback's small gloo all-reduce: ~0.5 or ~3.5 ms): the
    median lands on either, the expected time on the calls' mean; a stray stall is left out."""
    fast, slow = [0.5e-3] * 8, [3.5e-3] * 7
    assert probe.expected_time(fast + slow) == pytest.approx((8 * 0.5e-3 + 7 * 3.5e-3) / 15)
    assert probe.expected_time(fast[:6] + slow) == pytest.approx((6 * 0.5e-3 + 7 * 3.5e-3) / 13)  # the median: 3.5 ms
    forty = [0.5e-3] * 21 + [3.5e-3] * 18 + [0.2]  # one 200 ms stall in 40 calls: 2 cut from each end
    assert probe.expected_time(forty) == pytest.approx((19 * 0.5e-3 + 17 * 3.5e-3) / 36)


def test_a_send_after_idle_waits_one_sends_time_before_each_round_trip(monkeypatch):
    """The send after idle (what a step's first transfer after its compute costs): each round trip
    after a barrier and a pause as long as one send of that size takes; half the median kept."""
    events, clock = [], [0.0]
    monkeypatch.setattr(probe.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(probe.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(probe.dist, "all_reduce", lambda t, op=None: None)
    monkeypatch.setattr(probe.dist, "barrier", lambda: events.append("barrier"))
    trips = iter([0.02] + [0.01, 0.03, 0.012, 0.011, 0.5, 0.013, 0.01, 0.014, 0.012])  # warm-up, then 9 (one stall)

    def op():
        events.append("send")
        clock[0] += next(trips)
    monkeypatch.setattr(probe, "_ops", lambda kind, size, n, rank, device: op if (kind, size) == ("send_recv", probe.IDLE_SIZE) else None)
    monkeypatch.setattr(probe.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    one_way = {64: 1e-4, 1 << 20: 0.4}
    out = probe.time_after_idle(torch.device("cpu"), one_way, reps=3)
    assert out == {probe.IDLE_SIZE: pytest.approx(0.012 / 2)}
    pause = probe.one_way_at(one_way, probe.IDLE_SIZE)
    assert events == ["send"] + ["barrier", ("sleep", pause), "send"] * probe.IDLE_REPS


def test_sends_on_a_connection_of_their_own_keep_the_settled_second_half(monkeypatch):
    """The stream of hand-offs: a new group of ranks 0 and 1, each round trip after a barrier and
    one send's pause; the median of the second half (BBR's start-up left out), halved; the group
    is destroyed afterwards."""
    events, clock, made = [], [0.0], []
    monkeypatch.setattr(probe.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(probe.dist, "all_reduce", lambda t, op=None: None)
    monkeypatch.setattr(probe.dist, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(probe.dist, "new_group", lambda ranks: made.append(ranks) or "pair")
    monkeypatch.setattr(probe.dist, "destroy_process_group", lambda g: events.append(("destroy", g)))
    # half round trips of the start-up (slow, then settling), then the settled ones: 21 ms, one 30 ms
    halves = iter([0.06, 0.03, 0.025, 0.023, 0.022, 0.021] + [0.021, 0.021, 0.03, 0.021, 0.021, 0.021])

    def leg(name):
        def call(t, peer, group=None):
            assert (peer, group) == (1, "pair")
            events.append(name)
            if name == "recv":
                clock[0] += 2 * next(halves)
        return call
    monkeypatch.setattr(probe.dist, "send", leg("send"))
    monkeypatch.setattr(probe.dist, "recv", leg("recv"))
    monkeypatch.setattr(probe.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    one_way = {64: 1e-4, 1 << 20: 0.4}
    out = probe.time_stream(torch.device("cpu"), one_way, reps=3)
    assert made == [[0, 1]]
    assert out == {probe.IDLE_SIZE: pytest.approx(0.021)}
    pause = probe.one_way_at(one_way, probe.IDLE_SIZE)
    assert events == ["barrier", ("sleep", pause), "send", "recv"] * probe.STREAM_REPS + [("destroy", "pair")]


def test_the_all_gathers_large_sizes_keep_the_slowest_of_three_groups_of_calls(monkeypatch):
    """An all-gather of a megabyte takes one of two modes that come in runs of calls (the bed's: the
    bytes at the rate, or ~1.5x; training's FSDP took the slow one): its large sizes are timed in
    three groups, before, amid and after the other kinds, and the slowest group's median kept; its
    small sizes and the other kinds once."""
    calls = []
    # the all-gather of 1 MiB: 45 ms in the first and last group, 64 ms in the middle one
    ag = iter([0.045, 0.064, 0.045])

    def sized(op, device, size, reps):
        calls.append((op[0], size))
        if op[0] == "all_gather" and size > probe.SMALL_REPS[0]:
            return next(ag)
        return 1e-3 + size / 1e8
    monkeypatch.setattr(probe, "_ops", lambda kind, size, n, rank, device: (kind, size))
    monkeypatch.setattr(probe, "_sized_time", sized)
    monkeypatch.setattr(probe.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(probe.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(probe.dist, "all_reduce", lambda t, op=None: None)
    for name in ("time_crossed", "time_after_idle", "time_stream"):
        monkeypatch.setattr(probe, name, lambda device, one_way, reps: {})
    out = probe.time_collectives(torch.device("cpu"), sizes=(64, 1 << 20), reps=3)
    assert out["all_gather"] == {64: pytest.approx(1e-3 + 64 / 1e8), 1 << 20: 0.064}
    assert calls[0] == ("all_gather", 1 << 20) and calls[-1] == ("all_gather", 1 << 20)
    assert calls.count(("all_gather", 1 << 20)) == 3 and calls.count(("all_gather", 64)) == 1
    assert all(calls.count((kind, size)) == 1 for kind in probe.KINDS if kind != "all_gather" for size in (64, 1 << 20))
    assert out["all_reduce"][1 << 20] == pytest.approx(1e-3 + (1 << 20) / 1e8)
