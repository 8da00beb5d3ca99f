"""The sbatch scripts of hostile job values, run by bash with a stand-in for srun: nothing but
srun runs, and srun gets the job's words as written (issue 51, item 3)."""

from __future__ import annotations

import json
import subprocess

import pytest

from dtrain.launch import jobspec, sbatch
from tests.logic.launch.test_job_values import BASE, FREE_TEXT, HOSTILE


@pytest.mark.parametrize("value", [v for v in HOSTILE if "\n" not in v and "\r" not in v])
@pytest.mark.parametrize("where", sorted(FREE_TEXT))
def test_the_script_runs_srun_alone_with_the_words_as_written(tmp_path, where, value):
    job = jobspec.with_overrides(BASE, **FREE_TEXT[where](value), slurm_setup=('cd "$RUN_DIR"',))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/sh\nprintf "%s\\n" "A=${A-}"; for a in "$@"; do printf "[%s]\\n" "$a"; done\n')
    srun.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RUN_DIR": str(run_dir), "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}
    r = subprocess.run(["bash", "-c", sbatch.render(job)], capture_output=True, text=True, env=env, cwd=run_dir, timeout=30)
    assert r.returncode == 0, r.stderr
    assert list(run_dir.iterdir()) == [] and not (tmp_path / "INJECTED").exists()
    printed = r.stdout.splitlines()
    assert printed[0] == f"A={job.env.get('A', '')}"
    assert "\n".join(printed[1:]) == "\n".join(f"[{a}]" for a in sbatch.srun_argv(job)[1:])


CWD_PROBE = "import os, sys\nopen(sys.argv[1], 'w').write(os.getcwd())\n"


@pytest.mark.timeout(400)
def test_a_workdir_with_spaces_and_shell_syntax_reaches_a_real_sbatch(slurm_cluster, tmp_path):
    """sbatch reads the quoted #SBATCH options as written: the job runs in the folder named by
    workdir (spaces, '$(...)', quotes, '#') and logs to the file named by output; nothing runs."""
    import sys
    import time

    from tests.support import run_cli

    workdir = tmp_path / "my runs $(touch INJECTED) 'q' #1"
    workdir.mkdir()
    probe = workdir / "cwd probe.py"
    probe.write_text(CWD_PROBE)
    job = tmp_path / "job.toml"
    q = json.dumps  # a TOML basic string
    job.write_text(f'name = "cwd"\ncommand = ["dtrain", "run", {q(str(probe))}, "seen.txt"]\nworkdir = {q(str(workdir))}\n'
                   f'dtrain = {q(sys.executable + " -m dtrain")}\n[slurm]\noutput = "log $(touch INJECTED) #%j.out"\n')
    r = run_cli(["submit", "--slurm", str(job), "--out", str(tmp_path / "cwd.sbatch")], env=slurm_cluster.env,
                cwd=str(tmp_path), timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    job_id = int(r.stdout.split()[0])
    log = workdir / f"log $(touch INJECTED) #{job_id}.out"
    deadline = time.monotonic() + 300
    while not (workdir / "seen.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (workdir / "seen.txt").read_text() == str(workdir), log.read_text() if log.exists() else "no log"
    assert log.exists() and "dtrain: job" in log.read_text()
    assert not list(tmp_path.rglob("INJECTED"))
