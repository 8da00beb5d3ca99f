"""The links probe repeats latency-bound sizes more than the large ones (it costs next to nothing,
and a median of 3 small collectives moved 5x between two measurements of one bed link)."""

from __future__ import annotations

import torch

from dtrain.diag import probe


def test_small_sizes_are_timed_at_least_small_reps_times(monkeypatch):
    asked = []
    monkeypatch.setattr(probe, "_ops", lambda kind, size, n, rank, device: (kind, size))
    monkeypatch.setattr(probe, "_median_time", lambda op, device, reps: asked.append((op, reps)) or 1e-3)
    monkeypatch.setattr(probe.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(probe.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(probe.dist, "all_reduce", lambda t, op=None: None)
    out = probe.time_collectives(torch.device("cpu"), sizes=(64, 64 << 10, 1 << 20), reps=3)
    reps = {size: r for (kind, size), r in asked}
    assert reps == {64: probe.SMALL_REPS[1], 64 << 10: probe.SMALL_REPS[1], 1 << 20: 3}
    assert out["send_recv"][64] == 0.5e-3 and out["all_reduce"][1 << 20] == 1e-3  # half a round trip
