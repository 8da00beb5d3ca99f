"""The samples ledger: which samples each committed step trained on, so that exactly-once can be
checked across crashes, restarts and changes of world size (docs/checkpoints.md).

Each attempt of the job is a *generation*; each rank appends to ``gen{G}-rank{R}.jsonl`` a header
``{"begin": S, ...}`` (the step it resumed from), then one line per committed step. A record of
step ``s`` from generation ``g`` stands unless a later generation began at a step below ``s`` (it
redid that step). Lines a kill cut in half are ignored: their step was lost too.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

_FILE = re.compile(r"^gen(\d+)-rank(\d+)\.jsonl$")


class SampleLedger:
    """Appends this rank's committed steps to its ledger file (see the module's docstring)."""

    def __init__(self, folder: str, loader: Any, ctx: Any) -> None:
        self.folder = folder
        self.loader = loader
        self.ctx = ctx
        self.generation: int | None = None
        self._file: Any = None

    def begin(self, step: int) -> None:
        """Open this attempt's file, saying it resumed from ``step``. Collective: call on every rank."""
        gen = None
        if self.ctx.is_main:
            os.makedirs(self.folder, exist_ok=True)
            gen = max((int(m.group(1)) for name in _listdir(self.folder) if (m := _FILE.match(name))), default=0) + 1
        self.generation = gen = self.ctx.broadcast_object(gen)
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"gen{gen:05d}-rank{self.ctx.rank:05d}.jsonl")
        self._file = open(path, "a", buffering=1)  # one line, one write: a kill leaves at most half a line
        header = {"begin": int(step), "gen": gen, "rank": self.ctx.rank, "world_size": self.ctx.world_size,
                  "n": len(self.loader.dataset)}
        self._file.write(json.dumps(header) + "\n")

    def commit(self, step: int) -> None:
        """Record the samples of the batch the loader handed out last, as step ``step`` (done)."""
        if self._file is None:
            raise RuntimeError("SampleLedger.commit before begin")  # our own misuse
        epoch, indices, dropped = self.loader.last_batch
        rec: dict[str, Any] = {"s": int(step), "e": int(epoch), "i": indices, "t": round(time.time(), 3)}
        if dropped is not None:  # the epoch's last batch: what drop_last left out of it
            rec["d"] = dropped
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


# -- the check ---------------------------------------------------------------------------------

@dataclass
class EpochReport:
    epoch: int
    n: int
    seen: int = 0
    duplicated: int = 0
    """Extra trainings of samples seen more than once (a sample seen 3 times counts 2)."""
    missing: int = 0
    dropped: int = 0
    """Samples ``drop_last`` left out by design (fewer than one batch per rank at the epoch's end)."""
    complete: bool = False
    """The epoch's last batch was committed (an epoch still in progress may miss samples)."""
    examples: list[int] = field(default_factory=list)

    @property
    def exactly_once(self) -> bool:
        return self.duplicated == 0 and (self.missing == 0 or not self.complete)


@dataclass
class LedgerReport:
    epochs: list[EpochReport]
    generations: int
    steps_kept: int
    steps_discarded: int
    torn_lines: int

    @property
    def ok(self) -> bool:
        return all(e.exactly_once for e in self.epochs)


#: A header's sample count beyond this is no dataset dtrain trained (and is not allocated).
MAX_SAMPLES = 10**10


def check_ledger(folder: str) -> LedgerReport:
    """Read every ledger file in ``folder`` and count, per epoch, the samples of committed steps.

    Lines that are not a record as ``SampleLedger`` writes them (cut by a kill, binary, wrong
    types, indices outside the header's sample count) are left out and counted; a folder with
    ledger files and no valid record at all is a ConfigError, not an empty report."""
    files = sorted((int(m.group(1)), int(m.group(2)), name) for name in _listdir(folder) if (m := _FILE.match(name)))
    if not files:
        raise ConfigError(f"{folder} holds no ledger files (gen*-rank*.jsonl); give the folder passed to --ledger.")
    begins: dict[int, int] = {}
    records: list[tuple[int, dict[str, Any]]] = []
    n, torn = 0, 0
    for gen, _rank, name in files:
        lines, cut = _read_lines(os.path.join(folder, name))
        torn += cut
        for rec in lines:
            if "begin" in rec:
                begins[gen] = min(begins.get(gen, rec["begin"]), rec["begin"])
                n = max(n, rec.get("n", 0))
            else:
                records.append((gen, rec))
    out_of_range = [rec for _, rec in records if not _in_range(rec, n)]
    if out_of_range:
        torn += len(out_of_range)
        records = [(g, rec) for g, rec in records if _in_range(rec, n)]
    if not records and (torn or not begins):  # (headers alone, nothing else: a run stopped before its first step)
        raise ConfigError(f"{folder} holds {len(files)} ledger file(s) but no valid step record ({torn} unreadable or "
                          "malformed line(s)); give the folder a --ledger run wrote.")
    stands = [(gen, rec) for gen, rec in records if _stands(gen, rec["s"], begins)]
    lost = {(gen, rec["s"]) for gen, rec in records} - {(gen, rec["s"]) for gen, rec in stands}
    return LedgerReport(epochs=count_epochs([rec for _, rec in stands], n), generations=len({g for g, _, _ in files}),
                        steps_kept=len({rec["s"] for _, rec in stands}), steps_discarded=len(lost), torn_lines=torn)


def _in_range(rec: dict[str, Any], n: int) -> bool:
    """Every index of a step record is a sample of the dataset the headers describe."""
    return all(0 <= i < n for key in ("i", "d") for i in rec.get(key, ()))


def _stands(gen: int, step: int, begins: dict[int, int]) -> bool:
    """A step stands unless a later generation began before it (and so redid it, or dropped it)."""
    return all(begin >= step for g, begin in begins.items() if g > gen)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(_int(i) for i in value)


def _valid(rec: Any) -> bool:
    """A header (``begin``, ``n``) or a step record (``s``, ``e``, ``i``, maybe ``d``) of the
    types ``SampleLedger`` writes; a header's ``n`` at most ``MAX_SAMPLES``."""
    if not isinstance(rec, dict):
        return False
    if "begin" in rec:
        n = rec.get("n", 0)
        return _int(rec["begin"]) and rec["begin"] >= 0 and _int(n) and 0 <= n <= MAX_SAMPLES
    return ({"s", "e", "i"} <= rec.keys() and _int(rec["s"]) and _int(rec["e"]) and _ints(rec["i"])
            and ("d" not in rec or _ints(rec["d"])))


def read_records(path: str) -> tuple[list[Any], int]:
    """A ledger file's JSON lines, and how many were torn (cut by a kill in the middle of the write)."""
    out, torn = [], 0
    try:
        # Bytes that are not UTF-8 (a binary file) spoil their line only.
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    torn += 1
    except OSError as exc:
        raise ConfigError(f"cannot read ledger file {path}: {exc.strerror or exc}; check its permissions.") from None
    return out, torn


def _read_lines(path: str) -> tuple[list[dict[str, Any]], int]:
    records, torn = read_records(path)
    kept = [rec for rec in records if _valid(rec)]
    return kept, torn + len(records) - len(kept)


def count_epochs(kept: list[dict[str, Any]], n: int) -> list[EpochReport]:
    """Per epoch: which samples the kept step records trained, how often, and which were dropped."""
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for rec in kept:
        by_epoch.setdefault(rec["e"], []).append(rec)
    out = []
    for epoch in sorted(by_epoch):
        counts: Counter[int] = Counter()
        dropped: set[int] = set()
        complete = False
        for rec in by_epoch[epoch]:
            counts.update(rec["i"])
            if "d" in rec:
                complete = True
                dropped.update(rec["d"])
        dups = sorted(i for i, c in counts.items() if c > 1)
        accounted = set(counts) | dropped  # every index is in range(n) (checked), so n - this is what is missing
        rep = EpochReport(epoch=epoch, n=n, seen=len(counts), duplicated=sum(counts[i] - 1 for i in dups),
                          missing=n - len(accounted), dropped=len(dropped - set(counts)), complete=complete)
        # The first few missing, without building range(n) (a header may claim billions).
        rep.examples = dups[:5] or list(itertools.islice((i for i in range(n) if i not in accounted), 5))
        out.append(rep)
    return out


def render(report: LedgerReport) -> str:
    lines = [f"{'epoch':>5} {'samples':>8} {'seen':>8} {'duplicated':>10} {'missing':>8} {'dropped':>8}  status"]
    for e in report.epochs:
        if e.duplicated:
            status = f"FAIL: duplicated, e.g. {', '.join(map(str, e.examples))}"
        elif e.missing and e.complete:
            status = f"FAIL: missing, e.g. {', '.join(map(str, e.examples))}"
        elif e.missing:
            status = "in progress (no duplicate so far)"
        else:
            status = "exactly once"
        lines.append(f"{e.epoch:>5} {e.n:>8} {e.seen:>8} {e.duplicated:>10} {e.missing:>8} {e.dropped:>8}  {status}")
    lines.append(f"{report.generations} generation(s), {report.steps_kept} committed step(s) counted, "
                 f"{report.steps_discarded} step record(s) of lost work left out (redone after a resume)"
                 + (f", {report.torn_lines} torn or malformed line(s) ignored" if report.torn_lines else ""))
    lines.append("dropped: left out by drop_last at an epoch's end (by design, not an error)")
    return "\n".join(lines)
