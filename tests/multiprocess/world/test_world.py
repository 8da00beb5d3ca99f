"""World.detect on SLURM's variables: the host list is expanded by ``scontrol`` where it is installed (a child process)."""

from dtrain import World


def test_slurm_environment_master_is_first_host():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "4",
           "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_ID": "0"}
    w = World.detect(env, device="cpu")
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node_rank, w.source) == (5, 8, 1, 2, 2, "slurm")
    assert w.master_addr == "gpu07"
    assert w.master_port == 15000 + 4242


def test_each_source_answers_only_its_own_environment():
    from dtrain.world import sources

    torchrun = {"RANK": "1", "WORLD_SIZE": "2"}
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n1"}
    assert [s.__name__ for s in sources.SOURCES] == ["TorchrunEnv", "SlurmTasks", "OneProcess"]
    assert sources.TorchrunEnv.detect(torchrun)["rank"] == 1 and sources.TorchrunEnv.detect(slurm) is None
    assert sources.SlurmTasks.detect(slurm)["rank"] == 1 and sources.SlurmTasks.detect(torchrun) is None
    assert sources.SlurmTasks.detect({**slurm, "SLURM_NTASKS": "1"}) is None  # one task: a launcher, not a rank
    assert sources.OneProcess.detect({}) == {"source": "single"}
    assert sources.detect({**torchrun, "SLURM_JOB_ID": "9"})["slurm_job_id"] == 9  # the job, whoever started the process
