"""The step breakdown, stragglers named with their cause, and the run's observability outputs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import dtrain
from dtrain.errors import ConfigError
from dtrain.metrics.breakdown import PHASES, StepBreakdown, p90, pack, stats, unpack
from dtrain.metrics.stragglers import StragglerConfig, StragglerDetector


def _window(steps=10, **ms):
    med = {p: float(ms.get(p, 1.0)) for p in PHASES}
    med["step"] = sum(med[p] for p in PHASES)
    med["own"] = med["step"] - med["comm"]
    return {"steps": steps, "median_ms": med, "p90_ms": dict(med)}


def test_breakdown_books_each_lap_to_its_phase_and_folds_checkpoints_into_rest():
    bd = StepBreakdown("cpu")
    clock = iter([0.0, 0.002, 0.005, 0.009, 0.010, 0.013, 0.014, 0.020])
    import dtrain.metrics.breakdown as mod

    real = mod.time.perf_counter
    mod.time.perf_counter = lambda: next(clock)
    try:
        bd._laps = [("start", mod.time.perf_counter(), None)]
        for phase in ("data_wait", "forward", "backward", "comm", "optimizer", "checkpoint"):
            bd.lap(phase)
        bd.finish()
    finally:
        mod.time.perf_counter = real
    w = bd.window()
    assert w["steps"] == 1
    assert w["median_ms"] == pytest.approx({"data_wait": 2, "forward": 3, "backward": 4, "comm": 1, "optimizer": 3,
                                            "rest": 1 + 6, "step": 20, "own": 19})
    assert bd.window() is None  # a new window after each read


def test_breakdown_marks_backward_compute_end_before_backward_returns():
    ctx = dtrain.init("single")
    try:
        net = torch.nn.Linear(4, 2)
        model, opt = ctx.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        bd = ctx.breakdown
        for _ in range(3):
            bd.step_starts()
            x = torch.randn(8, 4)
            bd.got_batch()
            ctx.backward(model(x).sum())
            opt.step()
        bd.finish()
        laps = bd.summary()
    finally:
        ctx.close()
    med = laps["median_ms"]
    # Every phase is there and they add up to the step (over 2 steps a median is the mean, so sums hold).
    assert laps["steps"] == 2 and set(PHASES) <= set(med)
    assert sum(med[p] for p in PHASES) == pytest.approx(med["step"], abs=0.004)  # each figure rounded to 1 us
    assert laps["median_ms"]["backward"] > 0 and laps["median_ms"]["optimizer"] > 0


def test_breakdown_off_records_no_phases_but_keeps_data_wait():
    bd = StepBreakdown("cpu", enabled=False)
    for _ in range(3):
        bd.step_starts()
        bd.got_batch()
        bd.lap("forward")
    bd.finish()
    assert bd.window() is None and bd.data.steps == 2


def test_stats_pack_and_p90():
    assert p90([float(v) for v in range(1, 11)]) == 9.0 and p90([5.0]) == 5.0
    w = stats([(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6)])
    assert w["median_ms"]["step"] == 21 and w["median_ms"]["own"] == 17
    assert unpack(pack(w)) == w and unpack(pack(None)) is None


@pytest.mark.parametrize("slow, cause", [({"data_wait": 30.0}, "input"), ({"forward": 20.0, "backward": 15.0}, "compute")])
def test_detector_names_the_slow_rank_and_its_cause(slow, cause):
    det = StragglerDetector(StragglerConfig(window=20, threshold=1.3), ["a", "b", "c"])
    healthy, waiting = _window(), _window(comm=30.0)  # the others wait for the straggler in their all-reduce
    assert det.add(10, [waiting, _window(**slow), waiting]) == []  # the window is not complete yet
    found = det.add(20, [waiting, _window(**slow), waiting])
    assert [(s["step"], s["rank"], s["host"], s["cause"], s["window_steps"]) for s in found] == [(20, 1, "b", cause, 20)]
    assert found[0]["line"].startswith("straggler: rank 1 (host b) took ") and "the median step for the last 20 steps" in found[0]["line"]
    assert det.add(30, [healthy] * 3) == [] and det.add(40, [healthy] * 3) == []


def test_detector_is_quiet_on_a_healthy_run_with_jitter():
    det = StragglerDetector(StragglerConfig(window=10, threshold=1.3), ["h", "h"])
    for i in range(20):
        assert det.add(10 * i, [_window(forward=1.0 + 0.1 * (i % 3)), _window(forward=1.2)]) == []


def test_straggler_config_validates_itself():
    with pytest.raises(ConfigError, match="--straggler-threshold must be > 1"):
        StragglerConfig(threshold=0.9)
    with pytest.raises(ConfigError, match="--straggler-window must be >= 1"):
        StragglerConfig(window=0)


def _matrix(n, slow=None, fast=1.0, slow_ms=40.0, both_ways=True, ranks_per_host=1):
    """One-way ms[src][dst] on a star: a transfer through host ``slow``'s link takes ``slow_ms``."""
    host = [r // ranks_per_host for r in range(n)]
    ms = [[float("nan") if a == b else fast + 0.01 * (a + b) for b in range(n)] for a in range(n)]
    for a in range(n):
        for b in range(n):
            if a != b and host[a] != host[b] and (host[a] == slow or both_ways and host[b] == slow):
                ms[a][b] = slow_ms
    return ms


def test_slow_hosts_names_the_host_whose_link_is_slow_from_three_hosts_on():
    from dtrain.metrics.links import slow_hosts

    hosts4 = ["n0", "n1", "n2", "n3"]
    found = slow_hosts(_matrix(4, slow=2), hosts4, 1.3, 1.0)
    assert {(f["host"], f["direction"]) for f in found} == {("n2", "upload"), ("n2", "download")}
    assert found[0]["ms"] == 40.0 and found[0]["others_ms"] < 1.1
    # Only what it sends is slow: its upload alone; ranks of one host talk over loopback, not the link.
    up = slow_hosts(_matrix(6, slow=1, both_ways=False, ranks_per_host=2), ["a", "a", "b", "b", "c", "c"], 1.3, 1.0)
    assert [(f["host"], f["direction"]) for f in up] == [("b", "upload")]
    assert slow_hosts(_matrix(3), ["n0", "n1", "n2"], 1.3, 1.0) == []  # healthy
    assert slow_hosts(_matrix(2, slow=1), ["n0", "n1"], 1.3, 1.0) == []  # two hosts: one path, either end
    assert slow_hosts(_matrix(3, slow=0, slow_ms=1.5), ["n0", "n1", "n2"], 1.3, 1.0) == []  # below min_excess_ms


def test_detector_probes_the_links_only_when_communication_dominates_every_rank():
    hosts = ["n0", "n1", "n2"]
    det = StragglerDetector(StragglerConfig(window=20), hosts)
    bound = _window(comm=40.0)  # every rank waits in communication: 40 of 45 ms
    det.add(10, [bound] * 3)
    assert det.probe_due is None  # the window is not complete yet
    assert det.add(20, [bound] * 3) == [] and det.probe_due == (20, 20, pytest.approx(40 / 45))
    found = det.name_links(_matrix(3, slow=1), 65536)
    assert [(s["rank"], s["host"], s["cause"]) for s in found] == [(1, "n1", "network")] and det.probe_due is None
    assert found[0]["line"].startswith("straggler: rank 1 (host n1): every rank spent >= 89% of its step waiting in communication "
                                       "for the last 20 steps; this host's link ") and "64 KiB in 40.0 ms" in found[0]["line"]
    assert det.add(30, [bound] * 3) == [] and det.add(40, [bound] * 3) == [] and det.name_links(_matrix(3), 65536) == []
    # Not when compute dominates, nor when one rank is the straggler (the others wait for it), nor with two hosts.
    det.add(50, [_window()] * 3), det.add(60, [_window()] * 3)
    assert det.probe_due is None
    det.add(70, [bound, _window(forward=45.0), bound]), det.add(80, [bound, _window(forward=45.0), bound])
    assert det.probe_due is None
    # A link-bound step (600 ms, 560 of them waiting) where one rank's own time is 1.5x the others'
    # (6 ms more forward: 1% of the step) names no one from own time; the links are probed instead.
    link_bound = StragglerDetector(StragglerConfig(window=10), hosts)
    assert link_bound.add(10, [_window(comm=560.0, forward=12.0), _window(comm=560.0, forward=12.0), _window(comm=560.0, forward=18.0)]) == []
    assert link_bound.probe_due is not None and link_bound.name_links(_matrix(3), 65536) == []
    # A rank that does stand out on a link-bound step (48 ms more forward: 8%) waits for the probe:
    # the slow link is named if there is one, else that rank.
    uneven = [_window(comm=560.0, forward=12.0), _window(comm=560.0, forward=12.0), _window(comm=560.0, forward=60.0)]
    assert link_bound.add(20, uneven) == [] and link_bound.probe_due is not None
    assert [(s["rank"], s["cause"]) for s in link_bound.name_links(_matrix(3, slow=1), 65536)] == [(1, "network")]
    assert link_bound.add(30, uneven) == []
    assert [(s["rank"], s["cause"]) for s in link_bound.name_links(_matrix(3), 65536)] == [(2, "compute")]
    two = StragglerDetector(StragglerConfig(window=10), ["a", "b", "b"])
    two.add(10, [bound] * 3)
    assert two.probe_due is None


def test_host_names_stay_one_per_node_when_nodes_share_a_hostname():
    from dtrain.train.observe import host_names

    assert host_names([("a", 0), ("a", 0), ("b", 1)]) == ["a", "a", "b"]
    assert host_names([("vm", 0), ("vm", 1), ("vm", 2)]) == ["vm/node0", "vm/node1", "vm/node2"]


def test_tensorboard_without_the_package_is_one_line(tmp_path, monkeypatch):

    from dtrain.metrics.tensorboard import check_tensorboard

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the tensorboard package"):
        check_tensorboard(str(tmp_path / "tb"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_tensorboard(str(tmp_path / "f"))


def test_flops_are_counted_on_meta_and_mfu_needs_a_peak():
    from dtrain.metrics.flops import count_step_flops, peak_flops, utilisation

    batch, n_in, n_out = 16, 8, 4
    x, y = torch.randn(batch, n_in), torch.randint(0, n_out, (batch,))
    flops = count_step_flops(lambda: torch.nn.Linear(n_in, n_out), x, y, torch.nn.functional.cross_entropy)
    assert flops == 2 * (2 * batch * n_in * n_out)  # forward matmul + weight gradient (the input needs none)
    assert x.device.type == "cpu" and count_step_flops(lambda: 1 / 0, x, y, torch.nn.functional.cross_entropy) is None
    assert peak_flops(torch.device("cpu"), "fp32") == (None, None)
    assert utilisation(1e9, 100.0, None, 2) == {"achieved_tflops": 0.1, "mfu": None}
    assert utilisation(1e9, 100.0, 1e12, 2)["mfu"] == 0.05 and utilisation(None, 100.0, 1e12, 2)["mfu"] is None


@pytest.mark.parametrize("spec", ["5", "6:3", "0:2", "a:b"])
def test_trace_steps_are_checked(spec):
    from dtrain.metrics.trace import parse_steps

    with pytest.raises(ConfigError, match="--trace"):
        parse_steps(spec)
    assert parse_steps("20:25") == (20, 25)


def test_report_renders_plots_and_a_summary_from_a_run_folder(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the 'report' extra)")
    from dtrain.metrics.report import render

    slow, waiting = _window(data_wait=30.0), _window(comm=30.0)
    line = "straggler: rank 1 (host b) took 2.0x the median step for the last 20 steps: data wait 30 ms vs 1 ms median (input-bound)"
    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for step in (10, 20):
            rec = {"step": step, "train_loss": 1.0 / step, "samples_per_s": 100.0 + step, "breakdown": [waiting, slow], "peak_mib": [10.0, 11.0]}
            if step == 20:
                rec["stragglers"] = [{"step": 20, "rank": 1, "cause": "input", "line": line}]
            fh.write(json.dumps(rec) + "\n")
    paths = render(str(tmp_path))
    assert {"curves", "breakdown", "memory", "markdown"} == set(paths)
    for key in ("curves", "breakdown", "memory"):
        with open(paths[key], "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(paths["markdown"]).read()
    assert "- steps: 20" in md and line in md and "| 1 | 30.00 |" in md and "![breakdown](breakdown.png)" in md


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA events)")
def test_breakdown_on_a_gpu_times_phases_with_cuda_events():
    bd = StepBreakdown("cuda")
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    for _ in range(4):
        bd.step_starts()
        bd.got_batch()
        loss = (w @ w).square().sum()
        bd.backward_starts(loss)
        loss.backward()
        bd.backward_done()
        bd.lap("optimizer")
    bd.finish()
    assert bd._pending and all(laps[-1][2] is not None for laps in bd._pending)  # events, not yet read
    w = bd.window()
    assert w["steps"] == 4 and w["median_ms"]["backward"] > 0 and w["median_ms"]["forward"] > 0


# In-process through dtrain.cli.main (as subprocesses in tests/multiprocess/train/test_observe.py they
# cost an interpreter start each): refused before any process starts.
def _cli(argv: list[str], capsys) -> tuple[int, str]:
    from tests.support import run_cli_here

    code = run_cli_here(argv)
    return code, capsys.readouterr().err


def test_report_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    code, err = _cli(["report", str(tmp_path)], capsys)
    assert code == 2 and err.strip() == (
        f"dtrain: error: dtrain report: no metrics records (*.jsonl) in {tmp_path}; train with --metrics-file {tmp_path}/metrics.jsonl.")


@pytest.mark.parametrize("argv, expected", [
    (["--straggler-threshold", "1"], "dtrain: error: --straggler-threshold must be > 1 (a ratio to the median step), got 1.0; e.g. 1.3."),
    (["--straggler-window", "0"], "dtrain: error: --straggler-window must be >= 1 step, got 0."),
    (["--trace", "9:3"], "dtrain: error: --trace 9:3 needs 1 <= START < END; e.g. --trace 20:25 for steps 20 to 24."),
    (["--trace", "2:4", "--no-breakdown"], "dtrain: error: --trace draws the breakdown's spans; drop --no-breakdown."),
])
def test_bad_observe_flags_are_one_line(argv, expected, capsys):
    code, err = _cli(["train", "--max-steps", "2", *argv], capsys)
    assert code == 2 and err.strip() == expected, err
