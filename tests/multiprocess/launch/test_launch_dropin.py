"""`dtrain run` as a drop-in for torch.distributed.launch: --local_rank, and a script that builds
its own world stopped with one line instead of a hang."""

from __future__ import annotations

import pytest

from tests.support import run_cli

OLD_STYLE = """import argparse, os
p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--x", default="a")
a = p.parse_args()
print(f"rank {os.environ['RANK']} local_rank {a.local_rank} x {a.x}")
"""

SPAWNS = """import torch.multiprocessing as mp
def work(i):
    pass
if __name__ == "__main__":
    mp.spawn(work, nprocs=2)
"""

OWN_SIZE = """import torch.distributed as dist
dist.init_process_group("gloo", world_size=4, rank=0)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_old_launcher_scripts_get_local_rank(tmp_path):
    (tmp_path / "old.py").write_text(OLD_STYLE)
    proc = run_cli(["run", "-n", "2", "old.py", "--x", "b"], cwd=str(tmp_path), timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 local_rank 0 x b" in proc.stdout and "rank 1 local_rank 1 x b" in proc.stdout
    assert "declares --local_rank" in proc.stderr
    off = run_cli(["run", "-n", "2", "--local-rank-arg", "none", "old.py"], cwd=str(tmp_path), timeout=90)
    assert "local_rank -1" in off.stdout, off.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("body, words", [(SPAWNS, "torch.multiprocessing.spawn"), (OWN_SIZE, "world_size=4")])
def test_a_script_building_its_own_world_is_stopped_in_one_line(tmp_path, body, words):
    (tmp_path / "s.py").write_text(body)
    proc = run_cli(["run", "-n", "2", "s.py"], cwd=str(tmp_path), timeout=90)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert errors and words in errors[0] and "Traceback" not in proc.stderr
