"""``dtrain report RUN_DIR``: a run's metrics (``*.jsonl``, ``result.json``, a merged trace) as
PNG plots and a short markdown summary (docs/observability.md)."""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from collections import Counter
from typing import Any

from .. import _check as check
from .._log import logger
from ..errors import ConfigError
from .breakdown import PHASES

COLOURS = {"data_wait": "#e15759", "forward": "#4e79a7", "backward": "#76b7b2", "comm": "#f28e2b", "optimizer": "#59a14f", "rest": "#bab0ac"}


def load_run(run_dir: str) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(metrics records in step order, the result record or None). Lines that are not records
    as ``dtrain train`` writes them (binary, wrong types) are left out, and said so."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"dtrain report: {run_dir} is not a folder; give the folder holding the run's metrics.jsonl.")
    records: list[dict[str, Any]] = []
    bad, fields = 0, Counter()
    for path in sorted(p for p in glob.glob(os.path.join(run_dir, "*.jsonl")) if os.path.isfile(p)):
        parsed = [_parse(line) for line in _lines(path)]
        kept = [r for r in (_record(v, fields) for v in parsed) if r is not None]
        bad += len(parsed) - len(kept)
        records += kept
    if not records:
        raise ConfigError(f"dtrain report: no metrics records (*.jsonl) in {run_dir}"
                          + (f" ({bad} line(s) that are not one)" if bad else "")
                          + f"; train with --metrics-file {run_dir}/metrics.jsonl.")
    result = None
    path = os.path.join(run_dir, "result.json")
    if os.path.isfile(path):
        lines = [ln for ln in _lines(path) if ln.strip()]
        last = _parse(lines[-1]) if lines else None
        result = None if last is None else _clean(last, fields)
        if lines and last is None:
            logger.warning(f"{path}'s last line is not a result record (a JSON object); left out.")
    if bad or fields:
        what = [f"{bad} line(s) that are not metrics records"] if bad else []
        what += [f"{sum(fields.values())} field(s) of the wrong type ({', '.join(sorted(fields))})"] if fields else []
        logger.warning(f"left out {' and '.join(what)} in {run_dir}.")
    return sorted(records, key=lambda r: r["step"]), result


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:  # a binary file spoils its lines only
            return fh.readlines()
    except OSError as exc:
        raise ConfigError(f"dtrain report: cannot read {path}: {exc.strerror or exc}.") from None


def _parse(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _windows(value: Any) -> bool:
    """A breakdown as the loop writes it: per rank, None or {"median_ms": {phase: ms or None}}."""
    return isinstance(value, list) and all(
        w is None or (isinstance(w, dict) and isinstance(w.get("median_ms"), dict)
                      and all(v is None or _num(v) for v in w["median_ms"].values())) for w in value)


_CHECKS = {"train_loss": _num, "samples_per_s": _num, "achieved_tflops": _num, "mfu": _num, "breakdown": _windows,
           "peak_mib": lambda v: isinstance(v, list) and all(m is None or _num(m) for m in v),
           "stragglers": lambda v: isinstance(v, list) and all(isinstance(x, dict) and isinstance(x.get("line"), str)
                                                               and _num(x.get("step")) for x in v)}


def _clean(rec: dict[str, Any], dropped: Counter) -> dict[str, Any]:
    """The record without the fields whose type is not the one written (they are not drawn;
    ``dropped`` counts them by name)."""
    bad = [k for k, v in rec.items() if k in _CHECKS and v is not None and not _CHECKS[k](v)]
    dropped.update(bad)
    return {k: v for k, v in rec.items() if k not in bad}


def _record(rec: dict[str, Any] | None, dropped: Counter) -> dict[str, Any] | None:
    if rec is None or not (isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool)):
        return None
    return _clean(rec, dropped)


def rank_breakdown(records: list[dict[str, Any]], result: dict[str, Any] | None) -> list[dict[str, float]]:
    """Each rank's median ms per phase: the result's whole-run figures, else the median of the
    intervals'. A phase with no figure (None: not measured, e.g. under pipeline) is left out."""
    if result and result.get("breakdown"):
        return [{p: v for p, v in w["median_ms"].items() if v is not None} if w else {} for w in result["breakdown"]]
    windows = [r["breakdown"] for r in records if r.get("breakdown")]
    if not windows:
        return []
    out = []
    for k in range(max(len(w) for w in windows)):
        mine = [w[k]["median_ms"] for w in windows if k < len(w) and w[k]]
        out.append({p: statistics.median(vals) for p in PHASES if (vals := [m[p] for m in mine if _num(m.get(p))])})
    return out


def render(run_dir: str, out: str | None = None) -> dict[str, str]:
    """Writes the PNGs and ``report.md`` into ``out`` (default RUN_DIR/report); returns their paths."""
    records, result = load_run(run_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("dtrain report needs matplotlib; pip install 'dtrain[report]' (or matplotlib).") from None
    out = out or os.path.join(run_dir, "report")
    check.output_dir("--out", out)
    os.makedirs(out, exist_ok=True)
    paths: dict[str, str] = {}
    steps = [r["step"] for r in records]

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(steps, [r.get("train_loss") for r in records], marker=".")
    a.set(xlabel="step", ylabel="training loss", title="loss")
    b.plot(steps, [r.get("samples_per_s") for r in records], marker=".", color="#59a14f")
    b.set(xlabel="step", ylabel="samples/s", title="throughput")
    paths["curves"] = _save(fig, plt, out, "curves.png")

    ranks = rank_breakdown(records, result)
    if ranks:
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(ranks) + 2), 3.5))
        bottom = [0.0] * len(ranks)
        for p in PHASES:
            vals = [r.get(p, 0.0) for r in ranks]
            ax.bar([f"rank {k}" for k in range(len(ranks))], vals, bottom=bottom, label=p, color=COLOURS[p])
            bottom = [x + v for x, v in zip(bottom, vals)]
        ax.set(ylabel="ms per step (median)", title="where each rank's step goes")
        ax.legend(fontsize="small", bbox_to_anchor=(1.02, 1), loc="upper left")
        paths["breakdown"] = _save(fig, plt, out, "breakdown.png")

    mem = [(r["step"], r["peak_mib"]) for r in records if r.get("peak_mib")]
    if mem:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for k in range(max(len(m) for _, m in mem)):
            ax.plot([s for s, m in mem if k < len(m)], [m[k] for _, m in mem if k < len(m)], marker=".", label=f"rank {k}")
        ax.set(xlabel="step", ylabel="peak MiB", title="memory")
        ax.legend(fontsize="small")
        paths["memory"] = _save(fig, plt, out, "memory.png")

    for trace in sorted(p for p in glob.glob(os.path.join(run_dir, "*trace*.json")) if os.path.isfile(p))[:1]:
        timeline = trace_timeline(trace, plt)
        if timeline is not None:
            paths["timeline"] = _save(timeline, plt, out, "timeline.png")
        else:
            logger.warning(f"{trace} is not a dtrain trace (no spans of the types --trace writes); no timeline drawn.")

    paths["markdown"] = os.path.join(out, "report.md")
    with open(paths["markdown"], "w", encoding="utf-8") as fh:
        fh.write(markdown(records, result, ranks, paths))
    return paths


def trace_timeline(path: str, plt: Any) -> Any:
    """A figure of a merged trace (``dtrain train --trace``): a row per rank and track, a bar per
    span, coloured by phase (collectives in one colour); None if the file is not such a trace."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            doc = json.load(fh)
        events = [e for e in doc["traceEvents"] if isinstance(e, dict)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # Only spans of the types the tracer writes are drawn (a hand-edited file may hold anything).
    spans = [e for e in events if e.get("ph") == "X" and _num(e.get("ts")) and _num(e.get("dur")) and isinstance(e.get("name"), str)
             and isinstance(e.get("pid"), int) and isinstance(e.get("tid", 0), int)]
    if not spans:
        return None
    rows = sorted({(e["pid"], e.get("tid", 0)) for e in spans})
    names = {e.get("pid"): str(e["args"].get("name")) for e in events
             if e.get("name") == "process_name" and isinstance(e.get("args"), dict) and isinstance(e.get("pid"), int)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    for y, (pid, tid) in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e.get("tid", 0)) == (pid, tid)):
            colour = COLOURS.get(e["name"], "#edc948" if tid else "#bab0ac")
            ax.broken_barh([(e["ts"] / 1e3, max(e["dur"], 1.0) / 1e3)], (y - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"{names.get(pid, f'rank {pid}')} {'collectives' if tid else 'phases'}" for pid, tid in rows])
    ax.invert_yaxis()
    other = doc.get("otherData") if isinstance(doc, dict) else None
    steps = other.get("steps", "") if isinstance(other, dict) else ""
    ax.set(xlabel="ms (rank 0's clock)", title=f"trace of steps {steps}: phases and each gradient bucket's all-reduce")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()] + [plt.Rectangle((0, 0), 1, 1, color="#edc948")]
    ax.legend(handles, [*COLOURS, "collective"], fontsize="small", bbox_to_anchor=(1.01, 1), loc="upper left")
    return fig


def _save(fig: Any, plt: Any, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(records: list[dict[str, Any]], result: dict[str, Any] | None, ranks: list[dict[str, float]], paths: dict[str, str]) -> str:
    last = records[-1]
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")]
    loss = last.get("train_loss")
    lines = ["# Run report", "", f"- steps: {last['step']}, last training loss " + (f"{loss:.4g}" if _num(loss) else "unknown")]
    if rates:
        lines.append(f"- samples/s: median {statistics.median(rates):.1f} over {len(rates)} log intervals")
    if result:
        if result.get("achieved_tflops") is not None:
            mfu = f", MFU {result['mfu']:.1%}" if result.get("mfu") is not None else " (MFU: no peak known for the device)"
            lines.append(f"- achieved {result['achieved_tflops'] * 1e3:.4g} GFLOP/s over all ranks{mfu}")
        metric = [k for k in ("test_acc", "val_loss") if result.get(k) is not None]
        lines += [f"- {k}: {result[k]}" for k in metric]
    stragglers = [s for r in records for s in r.get("stragglers") or []]
    lines.append(f"- stragglers: {len(stragglers)} named" if stragglers else "- stragglers: none named")
    lines += [f"  - step {s['step']}: {s['line']}" for s in stragglers]
    if ranks:
        lines += ["", "## Breakdown (median ms per step)", "", "| rank | " + " | ".join(PHASES) + " |",
                  "|---" * (len(PHASES) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(f"{r.get(p, 0.0):.2f}" for p in PHASES) + " |" for k, r in enumerate(ranks)]
    lines += ["", *[f"![{name}]({os.path.basename(p)})" for name, p in paths.items() if p.endswith(".png")], ""]
    return "\n".join(lines)
