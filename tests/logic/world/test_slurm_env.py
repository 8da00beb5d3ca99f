"""SLURM as dtrain sees it from a task's environment, and preemption (no cluster needed)."""

from __future__ import annotations

import os
import signal

import pytest

import dtrain
from dtrain import ConfigError, World, preempt
from dtrain.launch.srun import spec_for_step
from dtrain.world import slurm as slurm_mod
from dtrain.world.slurm import SlurmStep, expand_tasks_per_node

BATCH_ENV = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
             "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def step_env(procid: int, *, ntasks: int = 4, spread: str = "2(x2)", node: int = 0, local: int = 0, **extra: str) -> dict:
    return {**BATCH_ENV, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": spread,
            "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local), "SLURMD_NODENAME": f"n{node + 1}", **extra}


@pytest.fixture(autouse=True)
def no_scontrol(monkeypatch):
    """These tests describe SLURM through the environment only; scontrol is faked where used."""
    monkeypatch.setattr(slurm_mod, "scontrol", lambda args, env=None: None)


def test_batch_script_is_one_process_not_rank_0_of_n():
    assert SlurmStep.from_env(BATCH_ENV) is None
    assert World.detect(BATCH_ENV, device="cpu").source == "single"


def test_one_task_per_process_uses_the_steps_counts():
    w = World.detect(step_env(3, spread="3,1", node=1, local=0), device="cpu")
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node_rank, w.source) == (3, 4, 0, 1, 1, "slurm")
    assert (w.slurm_job_id, w.requeue_count, w.master_port) == (7, 0, 15007)
    assert World.detect(step_env(1, spread="3,1"), device="cpu").local_size == 3


@pytest.mark.parametrize("spec, counts", [("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1]), ("3,1", [3, 1])])
def test_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


def test_master_address_comes_from_scontrol(monkeypatch):
    answers = {("show", "hostnames", "n[1-2]"): "n1\nn2\n",
               ("show", "node", "n1", "--oneliner"): "NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=vm\n"}
    monkeypatch.setattr(slurm_mod, "scontrol", lambda args, env=None: answers.get(tuple(args)))
    assert World.detect(step_env(0), device="cpu").master_addr == "10.0.0.7"
    assert World.detect(step_env(0, MASTER_ADDR="192.168.1.1"), device="cpu").master_addr == "192.168.1.1"


def test_master_address_without_scontrol_is_the_first_host():
    assert World.detect(step_env(0), device="cpu").master_addr == "n1"


def test_gpu_count_must_match_processes_on_the_node():
    with pytest.raises(ConfigError) as info:
        World.detect(step_env(0, SLURM_GPUS_ON_NODE="1"), device="cpu")
    assert "SLURM gave node n1 1 GPU(s) but 2 process(es) would run there" in str(info.value)
    World.detect(step_env(0, SLURM_GPUS_ON_NODE="2"), device="cpu")  # one per process: fine


def test_one_task_per_node_launch():
    env = step_env(1, ntasks=2, spread="1(x2)", node=1)
    spec = spec_for_step(SlurmStep.from_env(env), env, nproc=4)
    assert (spec.nnodes, spec.node_rank, spec.nproc, spec.world_size, spec.master_addr, spec.port) == (2, 1, 4, 8, "n1", 15007)
    with pytest.raises(ConfigError, match="1 GPU\\(s\\) but 4 process"):
        spec_for_step(SlurmStep.from_env({**env, "SLURM_GPUS_ON_NODE": "1"}), env, nproc=4)


def test_two_tasks_per_node_each_with_a_launcher_is_an_error():
    env = step_env(0)
    with pytest.raises(ConfigError, match="srun started 2 tasks on this node and each would start -n 4"):
        spec_for_step(SlurmStep.from_env(env), env, nproc=4)


def test_workers_of_a_slurm_agent_know_the_job():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2", **{"SLURM_PROCID": "0"}}
    w = World.detect(env, device="cpu")
    assert (w.source, w.slurm_job_id, w.requeue_count) == ("torchrun", 42, 2)


def test_signal_runs_hooks_and_stops_one_process():
    ctx = dtrain.init("single")
    ran = []
    try:
        assert preempt.install()
        preempt.register(lambda: ran.append("saved"))
        assert not preempt.check(ctx)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preempt.received() == signal.SIGUSR1
        assert preempt.check(ctx) and ran == ["saved"]
    finally:
        preempt.uninstall()
        ctx.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and preempt.received() == 0


def test_sigterm_from_a_cancel_is_not_requeued(monkeypatch):
    monkeypatch.setattr(preempt, "job_state", lambda job_id: "CANCELLED")
    monkeypatch.setattr(preempt, "requeue", lambda job_id: pytest.fail("requeued a cancelled job"))
    assert not preempt.requeue_job(5, signal.SIGTERM)
    monkeypatch.setattr(preempt, "requeue", lambda job_id: (True, ""))
    assert preempt.requeue_job(5, signal.SIGUSR1)
    assert not preempt.requeue_job(None, signal.SIGUSR1)
