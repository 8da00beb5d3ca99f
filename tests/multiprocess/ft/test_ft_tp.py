"""`dtrain train --fault-tolerance --parallel tp=2 --nproc 2` (and pp=2): a replica group of 2
processes with each layer split over them (tensor parallel) or the layers in 2 stages (pipeline),
replicated across groups by torchft (each rank averages its gradient slices with the other group's
same rank). 2 groups x 2 processes on this host train the same parameters as plain
``--parallel dp_replicate=2,tp=2`` (``pp=2``) on 4 ranks, which are one process's on the whole set."""

from __future__ import annotations

import pytest
import torch

from dtrain.ft.ledger import check_ft_ledger
from tests.support.procs import LaunchedJob

from .test_ft_fsdp import _lighthouse, _mkdir, _model, _result, one_process

pytest.importorskip("torchft")

TASK = "tests.multiprocess.ft.tp_task:make"


# pp: 2 blocks for 2 stages, the head untied from the embedding (tied weights cannot span stages)
LAYOUTS = {"tp=2": (), "pp=2": ("--task-arg", "layers=2", "--task-arg", "tie=false")}


def _group(tmp_path, layout, replica, *extra):
    return ["train", "--fault-tolerance", "min=2,heartbeat=1,timeout=60", "--parallel", layout, "--nproc", "2", "--task", TASK,
            *LAYOUTS[layout], "--replica-id", replica, "--checkpoint-dir", str(tmp_path / "ckpt"), "--ledger", str(tmp_path / "ledger"), *extra]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_in_two_replica_groups_trains_as_plain_dp_by_it_on_four_ranks(tmp_path, layout):
    """Every step is the whole training set (16 windows: 2 groups x 8, min=2 so both groups are in
    every step): the parameters after 6 steps equal one process's on the whole set (plain
    dp_replicate=2 x the layout's too: 2e-8 apart) within float32 rounding, and the 2 groups' bit
    for bit; without the groups' average each would train on its half."""
    with LaunchedJob(_group(tmp_path, layout, "a"), out_dir=_mkdir(tmp_path / "a")) as a:
        a.wait_for(lambda: _lighthouse(a) is not None, timeout=120)
        with LaunchedJob(_group(tmp_path, layout, "b", "--lighthouse", _lighthouse(a)), out_dir=_mkdir(tmp_path / "b")) as b:
            assert b.wait(timeout=300)[0] == 0, b.stderr()
            assert a.wait(timeout=120)[0] == 0, a.stderr()
            ra, rb = _result(a), _result(b)
    assert ra["steps"] == rb["steps"] == 6
    ft = ra["fault_tolerance"]
    assert ft["processes_per_replica"] == 2 and ft["batch_per_replica"] == 8  # TP's ranks, or stages, read the same batch
    assert ft["participants_min"] == 2 and ft["steps_not_committed"] == 0
    (sa, ma), (sb, mb), (sp, mp) = (_model(str(tmp_path / "ckpt" / "replica-a")), _model(str(tmp_path / "ckpt" / "replica-b")),
                                    one_process(tmp_path, TASK, 16, *LAYOUTS[layout]))
    assert sa == sb == sp == "step-00000006"
    assert ma.keys() == mb.keys() == mp.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    for k in ma:
        torch.testing.assert_close(ma[k], mp[k], rtol=1e-5, atol=1e-6)
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == [] and report.steps_kept == 6
