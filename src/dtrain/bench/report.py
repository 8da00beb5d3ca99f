"""Turn per-rank records into the report: figures per method, report.md, report.json, chart.png."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from typing import Any

import torch

from .._version import __version__
from .measure import PHASES
from .runner import BenchConfig, MethodRun


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarise(run: MethodRun, baseline_sps: float | None) -> dict[str, Any]:
    """One method's figures. samples/s of a repeat = samples of all ranks / the slowest rank's
    wall time; the median is over every repeat of every round."""
    m = run.method
    row: dict[str, Any] = {"method": m.name, "description": m.description, "processes": run.nproc,
                           "strategy": m.strategy if m.kind == "dtrain" else "torch DDP", "precision": m.precision,
                           "launcher": m.launcher if m.kind == "dtrain" else "torchrun"}
    if run.error or not run.records:
        row["error"] = run.error or "no records"
        return row
    rates, step_ms, phases, compute, peak = [], [], {p: [] for p in PHASES}, [], []
    for records in run.records:
        first = records[0]
        samples = first["batch_size"] * first["steps_per_repeat"] * (first.get("replicas") or len(records))
        for i in range(len(first["repeats"])):
            rates.append(samples / max(r["repeats"][i] for r in records))
        for r in records:
            for s in r["steps"]:
                step_ms.append(sum(s))
                for p, v in zip(PHASES, s):
                    phases[p].append(v)
            compute.extend(r["compute_only_ms"])
            peak.append(r["peak_mem_mib"])
    last = run.records[-1]
    sps = statistics.median(rates)
    fb, comm_wait = statistics.median(phases["forward_backward"]), statistics.median(phases["comm_wait"])
    compute_ms = statistics.median(compute) if compute else fb
    warm = [max(r.get("warmup_s") or 0.0 for r in records) for records in run.records]
    row.update(
        samples_per_s=round(sps, 2),
        warmup_s=round(statistics.median(warm), 3),
        samples_per_s_runs=[round(x, 2) for x in rates],
        scaling_efficiency=round(sps / (run.nproc * baseline_sps), 3) if baseline_sps else None,
        step_time_ms_p50=round(percentile(step_ms, 0.5), 3),
        step_time_ms_p90=round(percentile(step_ms, 0.9), 3),
        breakdown_ms={
            "data_wait": round(statistics.median(phases["data_wait"]), 3),
            "forward_backward": round(min(fb, compute_ms), 3),
            "optimizer": round(statistics.median(phases["optimizer"]), 3),
            # Communication the step waited for: backward's extra time over a step with no
            # gradient sync (DDP), plus an explicit wait for gradients (hvd).
            "exposed_comm": round(max(0.0, fb - compute_ms) + comm_wait, 3),
        },
        peak_mem_mib_per_rank=[round(x, 1) for x in peak[-run.nproc:]],
        # dtrain's own per-step breakdown, each rank (forward, backward compute, exposed comm apart); None for torch DDP
        step_breakdown_ms_per_rank=[(r.get("breakdown") or {}).get("median_ms") for r in last],
        state_mib_per_rank=[round(sum(r["state_bytes"].values()) / 2**20, 2) if r.get("state_bytes") else None for r in last],
        mem_kind=last[0]["mem_kind"],
        comm_bytes_per_step=last[0]["comm_bytes_per_step"],
        final_loss=round(last[0]["final_loss"], 5) if last[0]["final_loss"] is not None else None,
        metric_name=last[0].get("metric_name", "test_acc"),
        **{last[0].get("metric_name", "test_acc"): round(last[0]["test_acc"], 4) if last[0]["test_acc"] is not None else None},
        tokens_per_s=round(sps * last[0]["tokens_per_sample"], 1) if last[0].get("tokens_per_sample") else None,
        # The seed project's figure: one pass over the training set at this rate (drop_last aside)
        epoch_s=round(last[0]["train_samples"] / sps, 2) if last[0].get("train_samples") and sps > 0 else None,
        threads_per_process=last[0]["threads"],
        loss_curve=last[0]["loss_curve"],
    )
    if last[0].get("batch_split") is not None:  # ddp+split: how the shares moved (the last round's)
        row["batch_split"] = last[0]["batch_split"]
    return row


def split_note(changes: list[dict[str, Any]]) -> str:
    """How ``--batch-split speed`` moved the shares in one run, for the report's notes."""
    if not changes:
        return "the measured split kept the even shares (no other split shortened the step)"
    return "; ".join(f"shares {'/'.join(map(str, c['old']))} -> {'/'.join(map(str, c['new']))} from step {c['from_step']} "
                     f"({c['why']})" for c in changes)


def environment(cfg: BenchConfig) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtrain": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "backend": "nccl" if cuda and cfg.device != "cpu" else "gloo",
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "gpu_count": torch.cuda.device_count() if cuda else 0,
        "world_size": cfg.nproc,
    }


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return fh.read()
    except OSError:
        return ""


def _cpu_model() -> str:
    line = next((ln for ln in _cpuinfo().splitlines() if ln.startswith("model name")), "")
    return line.split(":", 1)[-1].strip() or platform.processor() or "unknown"


LOW_PRECISION_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
"""CPU features that decide whether bf16/fp16 autocast is fast on a CPU: without them torch
emulates bf16, several times slower than fp32."""


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The ``LOW_PRECISION_FLAGS`` this CPU has (from /proc/cpuinfo; [] where unknown)."""
    line = next((ln for ln in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in LOW_PRECISION_FLAGS if f in have]


def build_report(cfg: BenchConfig, runs: list[MethodRun], *, skipped: list[dict[str, str]] | None = None,
                 notes: list[str] | None = None) -> dict[str, Any]:
    """``skipped``: methods that cannot run on this machine, each with why; ``notes``: what was
    changed to fit it (``dtrain.bench.fit``)."""
    base = next((r for r in runs if r.method.name == "single"), None)
    base_sps = summarise(base, None).get("samples_per_s") if base else None
    return {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
            "environment": environment(cfg),
            "methods": [summarise(r, base_sps) for r in runs],
            "skipped": list(skipped or []), "notes": list(notes or [])}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _or_dash(x: Any) -> Any:
    return "-" if x is None else x


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def markdown(report: dict[str, Any]) -> str:
    env, cfg = report["environment"], report["config"]
    head = (f"# dtrain bench: task `{cfg['task']}`, {cfg['nproc']} processes\n\n"
            f"{env['date']} · torch {env['torch']} · {env['backend']} · {env['cpu']} ({env['cpu_count']} cores"
            f"{''.join(', ' + f for f in env.get('cpu_flags') or [])})"
            f"{' · ' + env['gpu'] if env['gpu'] else ''} · {cfg['threads']} thread(s)/process · "
            f"{cfg['warmup']} warm-up + {cfg['repeats']}x{cfg['steps']} measured steps x {cfg['rounds']} round(s)\n\n")
    ok = [m for m in report["methods"] if "error" not in m]
    metric = ok[0]["metric_name"] if ok else "test_acc"
    tokens = any(m.get("tokens_per_s") for m in ok)  # sequence tasks (lm): tokens/s beside samples/s
    epoch = any(m.get("epoch_s") for m in ok)
    cols = ["method", "procs", "samples/s", *(["tokens/s"] if tokens else []), *(["epoch s"] if epoch else []), "scaling eff.", "warm-up s", "step p50 ms", "step p90 ms",
            "data ms", "fwd+bwd ms", "optim ms", "exposed comm ms", "peak mem MiB/rank", "state MiB/rank", "comm MiB/step",
            "final loss", metric.replace("_", " ")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in report["methods"]:
        if "error" in m:
            lines.append(f"| {m['method']} | {m['processes']} | failed: {m['error']} |" + " |" * (len(cols) - 3))
            continue
        b = m["breakdown_ms"]
        eff = "-" if m["scaling_efficiency"] is None else f"{m['scaling_efficiency']:.2f}"
        lines.append("| " + " | ".join(str(x) for x in (
            m["method"], m["processes"], f"{m['samples_per_s']:.1f}", *([f"{m['tokens_per_s']:.0f}"] if tokens else []),
            *([_num(m.get("epoch_s"))] if epoch else []), eff, _num(m.get("warmup_s")), f"{m['step_time_ms_p50']:.2f}",
            f"{m['step_time_ms_p90']:.2f}", f"{b['data_wait']:.2f}", f"{b['forward_backward']:.2f}", f"{b['optimizer']:.2f}",
            f"{b['exposed_comm']:.2f}", "/".join(f"{x:.0f}" for x in m["peak_mem_mib_per_rank"]),
            "/".join("-" if x is None else f"{x:.2f}" for x in m.get("state_mib_per_rank", [])),
            _mib(m["comm_bytes_per_step"]), _or_dash(m["final_loss"]), _or_dash(m.get(metric)))) + " |")
    notes = ("\nsamples/s: median over repeats of (samples of all ranks / slowest rank's time), after the warm-up "
             "steps (compilation, autotuning, first batches; their wall time is `warm-up s`). Epoch s: the training "
             "set's samples / samples/s (the seed project's time per epoch). Scaling efficiency: "
             "samples/s / (processes x samples/s of `single`). Exposed comm: backward's extra time over the same step "
             "without gradient sync, plus time waiting for gradients in the optimizer. Peak memory: "
             f"{'max CUDA memory allocated' if env['gpu'] else 'peak RSS'} per rank. State MiB/rank: parameters + gradients + optimizer state held by each rank after "
             "a step (shards only under zero1/fsdp, one stage under pipeline). Comm MiB/step: bytes each rank hands "
             "to collectives per step (gradients to all-reduce; zero1 adds the parameter broadcast, fsdp is two "
             "parameter all-gathers and one gradient reduce-scatter; ddp+METHOD what its --comm method sends, "
             "local SGD its parameters once every H steps; '-' when unknown).\n")
    fitted = "".join(f"\n- {n}" for n in report.get("notes", []))
    fitted += "".join(f"\n- `{m['method']}`: {split_note(m['batch_split'])}" for m in ok if "batch_split" in m)
    fitted += "".join(f"\n- skipped `{s['method']}`: {s['why']}" for s in report.get("skipped", []))
    return head + "\n".join(lines) + "\n" + (fitted + "\n" if fitted else "") + notes


def write_chart(report: dict[str, Any], path: str) -> str | None:
    """Bars of samples/s per method and loss against wall time; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [m for m in report["methods"] if "error" not in m]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars.bar([m["method"] for m in ok], [m["samples_per_s"] for m in ok], color="tab:blue")
    bars.set_ylabel("samples/s (median)")
    bars.set_title(f"{report['config']['task']}: throughput per method")
    bars.tick_params(axis="x", rotation=30)
    for m in ok:
        t, loss = zip(*m["loss_curve"]) if m["loss_curve"] else ((), ())
        curves.plot(t, loss, label=m["method"])
    curves.set_xlabel("wall time since training started (s)")
    curves.set_ylabel("training loss (rank 0)")
    curves.set_title("loss against wall time")
    curves.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out: str) -> dict[str, str | None]:
    os.makedirs(out, exist_ok=True)
    md = os.path.join(out, "report.md")
    with open(md, "w") as fh:
        fh.write(markdown(report))
    js = os.path.join(out, "report.json")
    with open(js, "w") as fh:
        json.dump(report, fh, indent=1)
    return {"report.md": md, "report.json": js, "chart.png": write_chart(report, os.path.join(out, "chart.png"))}
