"""One job description -> an sbatch script or a Kubeflow PyTorchJob manifest (no cluster needed)."""

from __future__ import annotations

import json
import subprocess

import pytest

from dtrain import ConfigError
from dtrain.launch import jobspec, k8s, sbatch
from tests.logic.launch import test_submit as logic_half
from tests.logic.launch.test_submit import JOB_TOML, SCHEMA
from tests.support import run_cli

# The logic half's fixtures, shared: pytest finds a fixture by its name in the module.
job_file = logic_half.job_file


def test_toml_job_as_sbatch_script(job_file):
    text = sbatch.render(jobspec.load(job_file))
    for line in ["#SBATCH --job-name=mnist-2n", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --mem=8192M", "#SBATCH --gres=gpu:2", "#SBATCH --time=01:30:00",
                 "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --signal=USR1@90", "#SBATCH --partition=gpu",
                 "export OMP_NUM_THREADS=8", "export NCCL_DEBUG=WARN", "source .venv/bin/activate"]:
        assert line in text.splitlines(), line
    assert text.splitlines()[-1] == ("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=16 --kill-on-bad-exit=1 "
                                     "dtrain train -n 2 --task mnist --data-dir /data/mnist")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("nodes", [1, 3])
def test_manifest_validates_against_pytorchjob_schema(job_file, nodes):
    jsonschema = pytest.importorskip("jsonschema")
    job = jobspec.with_overrides(jobspec.load(job_file), nodes=nodes)
    manifest = k8s.render(job)
    jsonschema.validate(manifest, SCHEMA)
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas", 0) == nodes - 1
    master = specs["Master"]["template"]["spec"]["containers"][0]
    assert master["name"] == "pytorch" and master["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert f'-n 2 --nnodes {nodes} --node-rank 0 --master-addr "$DTRAIN_POD_IP" --master-port 29500' in master["command"][2]
    assert manifest["spec"]["runPolicy"]["activeDeadlineSeconds"] == 5400
    if nodes > 1:
        worker = specs["Worker"]["template"]["spec"]["containers"][0]
        assert '--node-rank "$((DTRAIN_REPLICA_INDEX + 1))" --master-addr mnist-2n-master-0' in worker["command"][2]
        fields = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in worker["env"]}
        assert fields["DTRAIN_REPLICA_INDEX"] == "metadata.labels['training.kubeflow.org/replica-index']"
        # the rendered shell line parses
        assert subprocess.run(["sh", "-n", "-c", worker["command"][2]]).returncode == 0


def test_cli_dry_run_and_json_manifest(job_file, tmp_path):
    r = run_cli(["submit", "--slurm", str(job_file), "--dry-run", "--nodes", "3"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=3" in r.stdout and r.stdout.startswith("#!/bin/bash")
    out = tmp_path / "job.json"
    r = run_cli(["submit", "--k8s", str(job_file), "--out", str(out), "--env", "A=1"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"kubectl apply -f {out}" in r.stderr
    manifest = json.loads(out.read_text())
    env = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "A", "value": "1"} in env and {"name": "NCCL_DEBUG", "value": "WARN"} in env


def test_cli_flags_only_job():
    r = run_cli(["submit", "--slurm", "--dry-run", "--nodes", "2", "--procs-per-node", "2", "--", "train.py", "--lr", "1"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].endswith("dtrain run -n 2 train.py --lr 1")


@pytest.mark.parametrize("args, expect", [
    (["--slurm", "--dry-run", "--procs-per-node", "4", "--gpus-per-node", "2", "--", "train.py"],
     "gpus_per_node 2 does not match procs_per_node 4"),
    (["--dry-run", "--", "train.py"], "say where the job goes: --slurm"),
    (["--slurm", "--dry-run"], "the job has no command"),
    (["--k8s", "--dry-run", "--", "train.py"], "a Kubernetes job needs an image"),
])
def test_cli_bad_jobs_are_one_line(args, expect):
    r = run_cli(["submit", *args], timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith("dtrain: error: ") and expect in err, err


ELASTIC_TOML = JOB_TOML.replace("nodes = 2", 'nodes = "1:3"')


def test_elastic_job_as_sbatch_script_runs_the_nodes_slurm_gave(tmp_path):
    """nodes = "MIN:MAX" on SLURM: --nodes=MIN-MAX and --no-kill; the script, run with stand-ins
    for srun and scontrol, starts dtrain with --nnodes MIN:MAX on the allocation's first node."""
    path = tmp_path / "job.toml"
    path.write_text(ELASTIC_TOML)
    job = jobspec.load(path)
    assert job.elastic and (job.nodes, job.max_nodes) == (1, 3)
    text = sbatch.render(job)
    lines = text.splitlines()
    assert "#SBATCH --nodes=1-3" in lines and "#SBATCH --no-kill" in lines
    assert sbatch.ELASTIC_NOTE in text  # what SLURM cannot do, said in the script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho node07; echo node08\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    script = text.replace("source .venv/bin/activate", "true")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[07-08]"}
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    argv = r.stdout.splitlines()
    assert argv[:6] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=16", "--no-kill", "--kill-on-bad-exit=0"]
    assert argv[6:] == ["dtrain", "train", "-n", "2", "--nnodes", "1:3", "--master-addr", "node07", "--master-port", "15123",
                        "--rdzv-id", "slurm-123", "--task", "mnist", "--data-dir", "/data/mnist"]


def test_elastic_manifest_is_the_operators_elastic_form(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    path = tmp_path / "job.toml"
    path.write_text(ELASTIC_TOML.replace('"1:3"', '"2:4"'))
    manifest = k8s.render(jobspec.load(path))
    jsonschema.validate(manifest, SCHEMA)
    assert manifest["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4, "rdzvBackend": "c10d", "rdzvPort": 29500,
                                                 "rdzvHost": "mnist-2n-worker-0", "rdzvId": "mnist-2n"}
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Worker"] and specs["Worker"]["replicas"] == 4 and specs["Worker"]["restartPolicy"] == "OnFailure"
    line = specs["Worker"]["template"]["spec"]["containers"][0]["command"][2]
    assert "-n 2 --nnodes 2:4 --master-addr mnist-2n-worker-0 --master-port 29500 --rdzv-id mnist-2n" in line
    assert "--node-rank" not in line and subprocess.run(["sh", "-n", "-c", line]).returncode == 0


def test_elastic_job_file_mistakes_are_one_line(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('command = ["train.py"]\nnnodes = "1:4"\n')
    with pytest.raises(ConfigError, match='a job file says nodes, not nnodes; write nodes = "1:4"'):
        jobspec.load(path)
    path.write_text('command = ["train.py"]\nnodes = "1-4"\n')
    with pytest.raises(ConfigError, match="is not a number of nodes or \"MIN:MAX\""):
        jobspec.load(path)
    r = run_cli(["submit", "--slurm", "--dry-run", "--nodes", "2:4", "--", "train.py"], timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == f"dtrain: note: {sbatch.ELASTIC_NOTE}.", r.stderr
