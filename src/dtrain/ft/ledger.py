"""The samples ledger of a fault-tolerant job (``dtrain train --fault-tolerance --ledger DIR``).

Every replica group appends to a file of its own, ``ft-{replica}-{attempt}.jsonl``: a header (the
step it began at; ``source``: a fresh start or a disk checkpoint, or healed from a peer), then one
line per committed step with **every participant's** samples (the global order is known to all),
so a group killed between its commit and its write loses nothing the survivors did not write.

The check: a step's record stands unless a later ``start`` header began below it (a whole-job
restart redid that step), or it is a commit lost with its group: torchft's vote counts a group's
own processes, so a group can commit a step its peer's all-reduce failed; if it dies before anyone
heals from it, the survivors commit that step again with their own samples. So a file's last record
that another group's later record of the same step replaces, and that no later start of its replica
from disk went on from, is not the job's. Records of one step must otherwise agree; each counts once.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any

from ..data.ledger import LedgerReport, count_epochs, read_records
from ..errors import ConfigError
from .order import StepPlan

_FILE = re.compile(r"^ft-(.+)-([0-9a-f]{8})\.jsonl$")


class FtLedger:
    """Appends this replica group's committed steps (see the module's docstring)."""

    def __init__(self, folder: str, replica: str, n: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"ft-{replica}-{uuid.uuid4().hex[:8]}.jsonl")
        self._file = open(self.path, "a", buffering=1)  # one line, one write: a kill leaves at most half a line
        self.replica, self.n = replica, n

    def begin(self, step: int, *, healed: bool) -> None:
        self._write({"ft": 1, "begin": int(step), "source": "peer" if healed else "start", "replica": self.replica,
                     "n": self.n, "t": time.time()})

    def commit(self, step: int, plan: StepPlan) -> None:
        rec: dict[str, Any] = {"s": int(step), "e": plan.epoch, "i": plan.step_indices, "t": time.time()}
        if plan.dropped is not None:
            rec["de"], rec["d"] = plan.dropped
        self._write(rec)

    def end(self, step: int, plan: StepPlan) -> None:
        """The job's last epoch ended after ``step``: what it left out."""
        if plan.dropped is not None:
            self._write({"end": int(step), "de": plan.dropped[0], "d": plan.dropped[1], "t": time.time()})

    def _write(self, rec: dict[str, Any]) -> None:
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def is_ft_ledger(folder: str) -> bool:
    try:
        return any(_FILE.match(name) for name in os.listdir(folder))
    except OSError:
        return False


def check_ft_ledger(folder: str) -> tuple[LedgerReport, list[int]]:
    """Count every committed step's samples once; returns the report and the steps whose records disagree."""
    names = sorted(name for name in os.listdir(folder) if _FILE.match(name))
    if not names:
        raise ConfigError(f"{folder} holds no fault-tolerant ledger files (ft-*.jsonl); give the folder passed to --ledger.")
    starts, records, torn, n = [], [], 0, 0
    for name in names:
        lines, cut = read_records(os.path.join(folder, name))
        torn += cut
        for i, rec in enumerate(lines):
            if not isinstance(rec, dict):
                torn += 1
            elif "ft" in rec:
                n = max(n, int(rec["n"]))
                if rec["source"] == "start":
                    starts.append((name, float(rec["t"]), int(rec["begin"])))
            elif "s" in rec or "end" in rec:
                records.append({**rec, "file": name, "last": i == len(lines) - 1})
    # A file's own header comes before its records; another file's start header written after a
    # record, below its step, is a restart from disk that redid (or dropped) that step.
    stands = [r for r in records
              if not any(f != r["file"] and t > r["t"] and begin < r.get("s", r.get("end")) for f, t, begin in starts)]
    stands = [r for r in stands if not (r["last"] and "s" in r and _lost_with_its_group(r, stands, starts))]
    by_step: dict[int, dict[str, Any]] = {}
    disagree = set()
    for rec in (r for r in stands if "s" in r):
        seen = by_step.setdefault(rec["s"], rec)
        if (seen["e"], seen["i"]) != (rec["e"], rec["i"]):
            disagree.add(rec["s"])
    flat = [{"e": r["e"], "i": r["i"]} for r in by_step.values()]
    flat += [{"e": r["de"], "i": [], "d": r["d"]} for r in [*by_step.values(), *(r for r in stands if "end" in r)] if "d" in r]
    report = LedgerReport(epochs=count_epochs(flat, n), generations=len(names), steps_kept=len(by_step),
                          steps_discarded=len({r["s"] for r in records if "s" in r} - set(by_step)), torn_lines=torn)
    return report, sorted(disagree)


def _lost_with_its_group(rec: dict[str, Any], stands: list[dict[str, Any]], starts: list[tuple[str, float, int]]) -> bool:
    """``rec``, the last line of its file, is a commit lost with its group (the module's docstring):
    another group committed its step again later and went on from it (a later step's record, or the
    job's end), and no later start of its replica from disk went on from ``rec``."""
    replica, step = _replica(rec["file"]), rec["s"]
    went_on = {o["file"] for o in stands if o["file"] != rec["file"] and (o.get("s", -1) > step or o.get("end", -1) >= step)}
    redone = any(o["file"] in went_on and o.get("s") == step and o["t"] > rec["t"] for o in stands)
    resumed = any(_replica(f) == replica and t > rec["t"] and begin >= step for f, t, begin in starts)
    return redone and not resumed


def _replica(name: str) -> str:
    found = _FILE.match(name)
    return found.group(1) if found else name
