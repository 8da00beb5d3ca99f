"""dtrain bench: method selection, the figures, and the CLI end to end on a tiny task."""

from __future__ import annotations

import pytest

from dtrain import ConfigError
from dtrain.bench import DEFAULT_METHODS, parse_methods
from dtrain.bench.methods import METHODS
from dtrain.bench.report import build_report, markdown, percentile, summarise
from dtrain.bench.runner import BenchConfig, MethodRun, round_order


def test_parse_methods_adds_baseline_and_rejects_unknown():
    names = [m.name for m in parse_methods("ddp,hvd")]
    assert names == ["single", "ddp", "hvd"]
    with pytest.raises(ConfigError, match="unknown bench method.*fsdpp.*choose from"):
        parse_methods("ddp,fsdpp")
    with pytest.raises(ConfigError, match="twice"):
        parse_methods("ddp,ddp")


def test_default_methods_drop_gpu_only_without_cuda():
    import torch

    names = [m.name for m in parse_methods(None)]
    assert ("ddp-fp16" in names) == torch.cuda.is_available()
    assert set(DEFAULT_METHODS) - {"ddp-fp16"} <= set(names)


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([], 0.5) is None


def _record(rank: int, repeat_s: list[float], fb: float, compute: float, comm_wait: float = 0.0) -> dict:
    return {"rank": rank, "batch_size": 10, "steps_per_repeat": 4, "repeats": repeat_s,
            "steps": [[1.0, fb, comm_wait, 2.0]] * 4, "compute_only_ms": [compute] * 3, "peak_mem_mib": 100.0 + rank,
            "mem_kind": "rss", "comm_bytes_per_step": 4096.0, "final_loss": 0.5, "test_acc": 0.9, "threads": 1,
            "loss_curve": [[0.1, 1.0], [0.2, 0.5]]}


def test_summarise_uses_slowest_rank_and_exposed_comm():
    run = MethodRun(method=METHODS["hvd"], nproc=2, records=[[_record(0, [1.0, 2.0], 5.0, 4.0, 1.5), _record(1, [1.0, 4.0], 5.0, 4.0, 1.5)]])
    row = summarise(run, baseline_sps=40.0)
    # 2 ranks x 10 x 4 = 80 samples per repeat; slowest rank took 1.0 and 4.0 s.
    assert row["samples_per_s_runs"] == [80.0, 20.0]
    assert row["samples_per_s"] == 50.0
    assert row["scaling_efficiency"] == round(50.0 / (2 * 40.0), 3)
    assert row["breakdown_ms"] == {"data_wait": 1.0, "forward_backward": 4.0, "optimizer": 2.0, "exposed_comm": 2.5}
    assert row["step_time_ms_p50"] == 9.5
    assert row["peak_mem_mib_per_rank"] == [100.0, 101.0]


def test_epoch_time_is_the_training_set_over_the_rate():
    rec = [_record(0, [1.0], 5.0, 4.0) | {"train_samples": 1000}, _record(1, [1.0], 5.0, 4.0) | {"train_samples": 1000}]
    row = summarise(MethodRun(method=METHODS["ddp"], nproc=2, records=[rec]), baseline_sps=None)
    assert row["samples_per_s"] == 80.0 and row["epoch_s"] == 12.5  # 1000 samples at 80/s
    report = {"config": vars(BenchConfig()) | {"task": "digits"}, "environment": {"date": "d", "torch": "t", "backend": "gloo",
              "cpu": "c", "cpu_count": 2, "gpu": None}, "methods": [row]}
    assert "| epoch s |" in markdown(report) and "| 12.5 |" in markdown(report)
    old = summarise(MethodRun(method=METHODS["ddp"], nproc=2, records=[[_record(0, [1.0], 5.0, 4.0), _record(1, [1.0], 5.0, 4.0)]]), None)
    assert old["epoch_s"] is None  # records from before the field: no column, no error


def test_rounds_alternate_the_order_of_methods():
    runs = [MethodRun(method=METHODS[n], nproc=1) for n in ("single", "ddp", "hvd")]
    names = [[r.method.name for r in round_order(runs, i)] for i in range(3)]
    assert names == [["single", "ddp", "hvd"], ["hvd", "ddp", "single"], ["single", "ddp", "hvd"]]


def test_a_missing_metric_shows_as_a_dash():
    rec = [_record(0, [1.0], 5.0, 4.0) | {"test_acc": None}]
    row = summarise(MethodRun(method=METHODS["single"], nproc=1, records=[rec]), baseline_sps=None)
    report = {"config": vars(BenchConfig()) | {"task": "images"}, "environment": {"date": "d", "torch": "t", "backend": "gloo",
              "cpu": "c", "cpu_count": 2, "gpu": None}, "methods": [row]}
    assert markdown(report).splitlines()[6].endswith("| 0.5 | - |")  # synthetic images: no test set
    assert "None" not in markdown(report)


def test_cpu_flags_name_the_low_precision_features():
    from dtrain.bench.report import cpu_flags

    assert cpu_flags("model name\t: AMD EPYC\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n") == ["avx512_bf16"]
    assert cpu_flags("flags\t\t: fpu sse avx2\n") == [] and cpu_flags("") == []


def test_failed_method_is_reported_not_hidden():
    cfg = BenchConfig()
    runs = [MethodRun(method=METHODS["single"], nproc=1, records=[[_record(0, [1.0], 5.0, 5.0)]]),
            MethodRun(method=METHODS["ddp"], nproc=2, error="dtrain: error: boom")]
    report = build_report(cfg, runs)
    assert report["methods"][1]["error"] == "dtrain: error: boom"
    assert "failed: dtrain: error: boom" in markdown(report)


def test_comm_methods_are_ddp_with_each_comm_and_bad_ones_are_one_line():
    from dtrain.bench.fit import fit_methods
    from dtrain.bench.methods import comm_methods
    from dtrain.bench.runner import worker_args

    got = comm_methods(["powersgd:2", "localsgd"], warmup=5)
    assert [(m.name, m.strategy, m.comm) for m in got] == [("ddp+powersgd:2", "ddp", "powersgd:2"), ("ddp+localsgd:16", "ddp", "localsgd:16")]
    args = worker_args(BenchConfig(task="digits"), got[0], "/tmp/x")
    assert args[args.index("--comm") + 1] == "powersgd:2" and args[args.index("--strategy") + 1] == "ddp"
    assert "--comm" not in worker_args(BenchConfig(task="digits"), METHODS["ddp"], "/tmp/x")
    for bad, message in ((["none"], "is the ddp method itself"), (["auto"], "chooses at run time"),
                         (["bf16", "bf16"], "given twice"), (["zip"], "unknown --comm 'zip'")):
        with pytest.raises(ConfigError, match=message):
            comm_methods(bad, warmup=5)
    with pytest.raises(ConfigError, match="--warmup 1 is too short for --comm powersgd:2"):
        comm_methods(["powersgd:2"], warmup=1)
    fit = fit_methods(comm_methods(["bf16"], warmup=5), 1, "cpu", nproc_given=True, gpus=0)
    assert fit.methods == [] and "needs at least 2 processes" in fit.skipped[0]["why"]


def test_split_method_passes_batch_split_and_the_report_notes_its_shares():
    from dtrain.bench.report import split_note
    from dtrain.bench.runner import worker_args

    assert [m.name for m in parse_methods("ddp,ddp+split")] == ["single", "ddp", "ddp+split"]
    args = worker_args(BenchConfig(task="digits"), METHODS["ddp+split"], "/tmp/x")
    assert args[args.index("--batch-split") + 1] == "speed" and args[args.index("--strategy") + 1] == "ddp"
    assert "--batch-split" not in worker_args(BenchConfig(task="digits"), METHODS["ddp"], "/tmp/x")
    change = {"step": 5, "from_step": 7, "old": [16, 16], "new": [22, 10], "why": "measured after warm-up"}
    assert split_note([change]) == "shares 16/16 -> 22/10 from step 7 (measured after warm-up)"
    assert "kept the even shares" in split_note([])
