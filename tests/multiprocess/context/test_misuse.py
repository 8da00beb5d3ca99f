"""Misuses of the Context on 2 ranks (issue 51, item 5): after ``close`` every rank says so in
one line (torch's own error was a traceback per rank), and a save onto a folder stops every rank
with rank 0's line instead of leaving the others waiting at a barrier."""

from __future__ import annotations

import os

import torch

import dtrain
from tests.support import run_distributed


def calls_after_close() -> list[str]:
    ctx = dtrain.init("ddp", stall_timeout=0)
    ctx.setup(torch.nn.Linear(2, 2))
    ctx.close()
    said = []
    for call in (lambda: ctx.all_reduce(torch.ones(1)), ctx.barrier, lambda: ctx.save("x.pt", {})):
        try:
            call()
            said.append("no error")
        except dtrain.DtrainError as exc:
            said.append(str(exc))
    return said


def test_a_closed_context_refuses_on_every_rank():
    for said in run_distributed(calls_after_close, world_size=2, timeout=120):
        assert [s.split(";")[0] for s in said] == ["the Context was closed"] * 3, said
        assert "ctx.all_reduce() needs an open one" in said[0] and all("\n" not in s for s in said)


def save_onto(folder: str) -> str:
    ctx = dtrain.init("ddp", stall_timeout=0)
    model = ctx.setup(torch.nn.Linear(2, 2))
    try:
        ctx.save(folder, {"model": model})
        return "saved"
    except dtrain.CheckpointError as exc:
        # The group still works (no rank was left inside a collective): a save to a file goes on.
        ctx.save(os.path.join(os.path.dirname(folder), "ok.pt"), {"model": model})
        return str(exc)
    finally:
        ctx.close()


def test_save_onto_a_folder_stops_every_rank_with_one_line(tmp_path):
    folder = tmp_path / "model.pt"
    folder.mkdir()
    said = run_distributed(save_onto, str(folder), world_size=2, timeout=120)
    assert said[0] == said[1] and said[0].startswith(f"cannot write checkpoint {folder}: it is a folder"), said
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "ok.pt"] and os.listdir(folder) == []
