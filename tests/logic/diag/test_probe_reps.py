"""The links probe repeats latency-bound sizes more than the large ones (it costs next to nothing,
and a median of 3 small collectives moved 5x between two measurements of one bed link)."""

from __future__ import annotations

import pytest
import torch

from dtrain.diag import probe


def test_small_sizes_are_timed_at_least_small_reps_times(monkeypatch):
    asked = []
    monkeypatch.setattr(probe, "_ops", lambda kind, size, n, rank, device: (kind, size, None))
    # a round trip of 1 ms plus 1 s per 100 MB
    monkeypatch.setattr(probe, "_call_time", lambda op, device, reps, expected=False:
                        asked.append((op, reps, expected)) or 1e-3 + op[1] / 1e8)
    monkeypatch.setattr(probe.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(probe.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(probe.dist, "all_reduce", lambda t, op=None: None)
    out = probe.time_collectives(torch.device("cpu"), sizes=(64, 64 << 10, 1 << 20), reps=3)
    reps = {size: (r, e) for (kind, size, _), r, e in asked}
    assert reps == {64: (probe.SMALL_REPS[1], True), 64 << 10: (probe.SMALL_REPS[1], True), 1 << 20: (3, False)}
    assert out["send_recv"][64] == pytest.approx((1e-3 + 64 / 1e8) / 2)  # half a round trip
    assert out["all_reduce"][1 << 20] == pytest.approx(1e-3 + (1 << 20) / 1e8)
    assert set(out) == set(probe.KINDS)


def test_a_small_collectives_time_is_what_a_call_costs_on_average():
    """Calls of two modes (the bed's and loopback's small gloo all-reduce: ~0.5 or ~3.5 ms): the
    median lands on either, the expected time on the calls' mean; a stray stall is left out."""
    fast, slow = [0.5e-3] * 8, [3.5e-3] * 7
    assert probe.expected_time(fast + slow) == pytest.approx((8 * 0.5e-3 + 7 * 3.5e-3) / 15)
    assert probe.expected_time(fast[:6] + slow) == pytest.approx((6 * 0.5e-3 + 7 * 3.5e-3) / 13)  # the median: 3.5 ms
    forty = [0.5e-3] * 21 + [3.5e-3] * 18 + [0.2]  # one 200 ms stall in 40 calls: 2 cut from each end
    assert probe.expected_time(forty) == pytest.approx((19 * 0.5e-3 + 17 * 3.5e-3) / 36)


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
    out = probe.time_collectives(torch.device("cpu"), sizes=(64, 1 << 20), reps=3)
    assert out["all_gather"] == {64: pytest.approx(1e-3 + 64 / 1e8), 1 << 20: 0.064}
    assert calls[0] == ("all_gather", 1 << 20) and calls[-1] == ("all_gather", 1 << 20)
    assert calls.count(("all_gather", 1 << 20)) == 3 and calls.count(("all_gather", 64)) == 1
    assert all(calls.count((kind, size)) == 1 for kind in probe.KINDS if kind != "all_gather" for size in (64, 1 << 20))
    assert out["all_reduce"][1 << 20] == pytest.approx(1e-3 + (1 << 20) / 1e8)
