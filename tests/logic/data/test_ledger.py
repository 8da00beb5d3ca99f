"""The samples ledger (`dtrain train --ledger`, `dtrain ckpt ledger`): the rule that counts a redone
step once, a normal run, a run killed with -9 and resumed (also on another world size), a forged
duplicate."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.data.ledger import check_ledger, render


def _write(folder: Path, gen: int, rank: int, begin: int, steps: dict[int, tuple[int, list[int]]], *, n: int = 8,
           last: set[int] = frozenset()) -> None:
    lines = [json.dumps({"begin": begin, "gen": gen, "rank": rank, "world_size": 2, "n": n})]
    for s, (e, idx) in steps.items():
        rec = {"s": s, "e": e, "i": idx}
        if s in last:
            rec["d"] = []
        lines.append(json.dumps(rec))
    (folder / f"gen{gen:05d}-rank{rank:05d}.jsonl").write_text("\n".join(lines) + "\n")


def test_steps_after_the_resumed_checkpoint_count_once(tmp_path):
    """Generation 1 did steps 1-3 (2 ranks), crashed; generation 2 (1 rank) resumed from the
    checkpoint of step 2 and redid step 3 with another split. Step 3 of generation 1 is left out."""
    _write(tmp_path, 1, 0, 0, {1: (0, [0]), 2: (0, [2]), 3: (0, [4])})
    _write(tmp_path, 1, 1, 0, {1: (0, [1]), 2: (0, [3]), 3: (0, [5])})
    _write(tmp_path, 2, 0, 2, {3: (0, [4, 5]), 4: (0, [6, 7])}, last={4})
    with open(tmp_path / "gen00002-rank00000.jsonl", "a") as f:
        f.write('{"s":5,"e":1,"i":[1')  # torn by a kill
    report = check_ledger(str(tmp_path))
    assert report.ok, render(report)
    [e0] = report.epochs
    assert (e0.seen, e0.duplicated, e0.missing, e0.complete) == (8, 0, 0, True)
    assert (report.steps_discarded, report.torn_lines, report.generations) == (1, 1, 2)


def test_a_duplicate_or_a_missing_sample_fails(tmp_path):
    _write(tmp_path, 1, 0, 0, {1: (0, [0, 1]), 2: (0, [2, 3])})
    _write(tmp_path, 1, 1, 0, {1: (0, [4, 5]), 2: (0, [6, 1])}, last={2})  # 1 twice, 7 never
    report = check_ledger(str(tmp_path))
    assert not report.ok
    assert (report.epochs[0].duplicated, report.epochs[0].missing) == (1, 1)
    assert "FAIL: duplicated, e.g. 1" in render(report)
