"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""


import pytest

from dtrain import ConfigError
from dtrain.launch import LaunchSpec


@pytest.mark.parametrize("kwargs, msg", [({"nproc": 0}, "-n/--nproc must be >= 1, got 0"),
                                          ({"nnodes": 2}, "needs --master-addr"),
                                          ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "outside 0..1"),
                                          ({"launcher": "mpirun"}, "unknown launcher"),
                                          ({"launcher": "spawn", "max_restarts": 1}, "needs --launcher torchrun")])
def test_launch_spec_validation(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        LaunchSpec(**kwargs)
