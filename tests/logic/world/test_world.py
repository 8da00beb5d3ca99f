import pytest
import torch

from dtrain import ConfigError, World
from dtrain.world import expand_hostlist


def test_single_process_by_default():
    w = World.detect({})
    assert (w.rank, w.size, w.local_rank, w.source) == (0, 1, 0, "single")
    assert not w.distributed and w.is_main


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
    w = World.detect(env, device="cpu")
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node_rank) == (3, 4, 1, 2, 1)
    assert (w.master_addr, w.master_port, w.source, w.backend) == ("10.1.2.3", 29400, "torchrun", "gloo")
    assert w.num_nodes == 2




def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    assert World.detect(env, device="cpu").source == "torchrun"


def test_bad_environment_is_a_config_error():
    with pytest.raises(ConfigError, match="RANK"):
        World.detect({"RANK": "x", "WORLD_SIZE": "2"}, device="cpu")
    with pytest.raises(ConfigError, match="outside"):
        World.detect({"RANK": "2", "WORLD_SIZE": "2"}, device="cpu")


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("n[1,3-4],login", ["n1", "n3", "n4", "login"]),
        ("rack[8-10]-gpu", ["rack8-gpu", "rack9-gpu", "rack10-gpu"]),
    ],
)
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        World.detect({}, device="cuda")




def test_launcher_facts_are_read_by_their_source():
    from dtrain.world.sources import SlurmTasks, TorchrunEnv

    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r",
           "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1", "SLURM_JOB_ID": "77"}
    assert (TorchrunEnv.rank_label(env), TorchrunEnv.local_rank(env), TorchrunEnv.size(env)) == ("3", "1", 4)
    assert (TorchrunEnv.run_id(env), TorchrunEnv.restarts_left(env), SlurmTasks.job_id(env)) == ("r", 2, "77")
    assert (TorchrunEnv.rank_label({}), TorchrunEnv.local_rank({}), TorchrunEnv.size({})) == ("?", None, 1)
    assert (TorchrunEnv.run_id({}), TorchrunEnv.restarts_left({}), SlurmTasks.job_id({})) == (None, 0, None)
