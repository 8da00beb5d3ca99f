"""Where a fault-tolerant job's replica groups start from: a group that joins late at start-up
heals everything a step depends on from its peer (the two end with equal models: their result
lines carry equal digests), and ``--init-from`` starts every group from the folder's weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dtrain.checkpoint import read_checkpoint
from dtrain.checkpoint.validate import newest_valid
from dtrain.ft.ledger import check_ft_ledger
from tests.multiprocess.ft.test_fault_tolerance import _lighthouse, _mkdir, _records, _result
from tests.support import run_cli
from tests.support.procs import LaunchedJob

pytest.importorskip("torchft")


@pytest.mark.timeout(300)
def test_a_group_that_joins_late_at_start_up_ends_with_its_peers_model(tmp_path):
    (tmp_path / "pace").write_text("0.05")  # 0.8 s a step: b joins while a trains alone (a alone would take 160 s)

    def args(replica, *extra):
        return ["train", "--fault-tolerance", "min=1,heartbeat=1,timeout=30", "--task", "tests.user_task:make_paced",
                "--task-arg", f"pace_file={tmp_path / 'pace'}", "--epochs", "100", "--max-steps", "200", "--replica-id", replica,
                "--ledger", str(tmp_path / "ledger"), "--metrics-file", str(tmp_path / "m.jsonl"), "--log-every", "1", *extra]

    with LaunchedJob(args("a"), out_dir=_mkdir(tmp_path / "a")) as a:
        a.wait_for(lambda: sum(r["replica"] == "a" for r in _records(str(tmp_path / "m.jsonl"))) >= 5, timeout=120)
        with LaunchedJob(args("b", "--lighthouse", _lighthouse(a)), out_dir=_mkdir(tmp_path / "b")) as b:
            b.wait_for(lambda: any(r["replica"] == "b" for r in _records(str(tmp_path / "m.jsonl"))), timeout=120)
            (tmp_path / "pace").write_text("0")
            assert b.wait(timeout=120)[0] == 0, b.stderr()
        assert a.wait(timeout=120)[0] == 0, a.stderr()
        ra, rb = _result(a), _result(b)
    # b healed from a at its first quorum (a was ahead), and both trained the same steps after
    assert rb["fault_tolerance"]["healed_at_steps"][0] >= 5 and ra["steps"] == rb["steps"] == 200
    # Adam's moments, the step count, the data position and the model all came with the heal: the
    # models are equal bit for bit (a heal without the optimizer's state ends with other weights)
    assert ra["fault_tolerance"]["model_digest"] == rb["fault_tolerance"]["model_digest"]
    report, disagree = check_ft_ledger(str(tmp_path / "ledger"))
    assert report.ok and disagree == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_init_from_starts_every_replica_group_from_the_folders_weights(tmp_path):
    from safetensors.torch import load_file

    from tests.logic.tasks.test_hf import folder, llama_config

    path = folder(tmp_path / "llama", llama_config())
    weights = folder(tmp_path / "weights", llama_config(), weights=True)  # random weights of their own (seed 1)
    ckpt = str(tmp_path / "ckpt")
    # lr 1e-9: after one AdamW step each group's weights are the ones it started from (within ~1e-8)
    r = run_cli(["train", "--task", f"hf:{path}", "--task-arg", "context=32", "--task-arg", "max_bytes=40000",
                 "--fault-tolerance", "min=2", "--nproc", "2", "--max-steps", "1", "--batch-size", "4", "--lr", "1e-9",
                 "--init-from", weights, "--checkpoint-dir", ckpt], timeout=360)
    assert r.returncode == 0, r.stderr[-2000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 and all(x["steps"] == 1 for x in results)
    expected = load_file(os.path.join(weights, "model.safetensors"))
    for group in ("replica-0-0", "replica-0-1"):
        saved = read_checkpoint(newest_valid(os.path.join(ckpt, group))[0], map_location="cpu")["objects"]["model"]
        compared = [k for k in expected if "hf." + k in saved]
        assert len(compared) == len(expected), sorted(set(expected) - {k.removeprefix("hf.") for k in saved})[:4]
        for key in compared:
            torch.testing.assert_close(saved["hf." + key], expected[key], rtol=0, atol=1e-6)
