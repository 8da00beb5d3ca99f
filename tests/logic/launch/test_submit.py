"""One job description -> an sbatch script or a Kubeflow PyTorchJob manifest (no cluster needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain import ConfigError
from dtrain.launch import jobspec, k8s, sbatch
from tests.paths import TESTS

SCHEMA = json.loads((TESTS / "schemas" / "pytorchjob.schema.json").read_text())

JOB_TOML = """\
name = "mnist-2n"
command = ["dtrain", "train", "--task", "mnist", "--data-dir", "/data/mnist"]
nodes = 2
procs_per_node = 2
gpus_per_node = 2
cpus_per_proc = 8
mem_per_proc = "4G"
time = "01:30:00"
[env]
NCCL_DEBUG = "WARN"
[slurm]
partition = "gpu"
setup = ["source .venv/bin/activate"]
[k8s]
image = "registry.example.com/me/train:1"
"""


@pytest.fixture
def job_file(tmp_path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB_TOML)
    return path


def test_process_layout_and_script_command():
    job = jobspec.JobSpec(command=("train.py", "--lr", "0.1"), nodes=2, procs_per_node=4, layout="process",
                          dtrain=("python3", "-m", "dtrain"))
    assert sbatch.srun_argv(job) == ["srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=1",
                                     "--kill-on-bad-exit=1", "python3", "-m", "dtrain", "run", "train.py", "--lr", "0.1"]
    node = jobspec.with_overrides(job, layout="node", command=("dtrain", "run", "--launcher", "spawn", "train.py"))
    assert sbatch.srun_argv(node)[-6:] == ["run", "-n", "4", "--launcher", "spawn", "train.py"]


@pytest.mark.parametrize("values, expect", [
    ({"gpus_per_node": 2, "procs_per_node": 4}, "gpus_per_node 2 does not match procs_per_node 4"),
    ({"command": ("python", "train.py")}, "command must start with `dtrain train`, `dtrain run` or a script.py"),
    ({"command": ("dtrain", "train", "-n", "4")}, "command sets -n; the job description owns them"),
    ({"command": ("dtrain", "bench")}, "a job runs `dtrain train` or `dtrain run SCRIPT`"),
    ({"command": ("dtrain", "run", "--launcher", "spawn")}, "names no script"),
    ({"time": "2h"}, "is not a time limit"),
    ({"mem_per_proc": "lots"}, "is not a size"),
    ({"layout": "rack"}, "unknown layout 'rack'; choose one of: node, process"),
    ({"name": "my job"}, "job name 'my job' may hold only"),
    ({"nodes": 0}, "nodes must be >= 1"),
    ({"nodes": 3, "max_nodes": 1}, 'nodes = "3:1" has MAX below MIN'),
    ({"nodes": 1, "max_nodes": 3, "layout": "process"}, "needs layout 'node'"),
    ({"command": ("dtrain", "train", "--rdzv-id", "x")}, "command sets --rdzv-id; the job description owns them"),
])
def test_bad_job_descriptions(values, expect):
    with pytest.raises(ConfigError, match=None) as info:
        jobspec.JobSpec(**{"command": ("train.py",), **values})
    assert expect in str(info.value)


def test_unknown_toml_key_names_the_known_ones(tmp_path):
    path = tmp_path / "j.toml"
    path.write_text('command = ["train.py"]\nnode = 2\n')
    with pytest.raises(ConfigError, match="unknown key\\(s\\) node; known keys: command, cpus_per_proc"):
        jobspec.load(path)


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("10:30", 630), ("01:30:00", 5400), ("2-00", 172800),
                                           ("1-02:03:04", 93784)])
def test_time_forms(text, seconds):
    assert jobspec.time_seconds(text) == seconds


def test_memory_forms():
    assert [jobspec.mem_mib(x) for x in ("4G", "512M", "512", "1.5G", "2GiB")] == [4096, 512, 512, 1536, 2048]


def test_schema_is_not_vacuous(job_file):
    jsonschema = pytest.importorskip("jsonschema")
    manifest = k8s.render(jobspec.load(job_file))
    container = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    container["imagee"] = container.pop("image")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, SCHEMA)


def test_yaml_reads_back_as_the_same_manifest(job_file):
    yaml = pytest.importorskip("yaml")
    manifest = k8s.render(jobspec.load(job_file))
    assert yaml.safe_load(k8s.to_yaml(manifest)) == manifest


@pytest.mark.parametrize("values, expect", [
    ({"k8s_image": ""}, "a Kubernetes job needs an image"),
    ({"name": "Mnist_2"}, "is not a Kubernetes name"),
    ({"layout": "process"}, "layout 'process' is SLURM's"),
])
def test_bad_kubernetes_jobs(job_file, values, expect):
    job = jobspec.with_overrides(jobspec.load(job_file), **values)
    with pytest.raises(ConfigError) as info:
        k8s.render(job)
    assert expect in str(info.value)
