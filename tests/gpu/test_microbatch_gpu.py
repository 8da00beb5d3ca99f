"""--micro-batch auto against a real CUDA out-of-memory: the GPU made 4 GiB small for the process
(``torch.cuda.set_per_process_memory_fraction``), the lm task at a batch of 64 that does not fit
whole; the plan proposes, the trials confirm, and the micro-batch found is the largest that runs:
the next larger one ran out of memory for real. Skips without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support import run_distributed

pytestmark = pytest.mark.gpu

CAPACITY_GIB = 4.0
LM = {"layers": "4", "heads": "8", "width": "512", "context": "512"}
"""13.0 M parameters (0.2 GiB with AdamW's state and the gradients); the plan counts 67 MiB saved for
backward per 512-token sequence in fp32, so 64 of them (4.2 GiB) do not fit in 4 GiB."""
BATCH = 64


def task(**options: str):
    """The lm task without its test set: the final evaluation (batch 256, not what is searched) stays out of the figure."""
    import dataclasses

    from dtrain.tasks import load_task

    return dataclasses.replace(load_task("lm", options=options), test_set=None)


def _fit_in_a_smaller_gpu() -> dict:
    from dtrain.cli.microbatch import with_proposal
    from dtrain.train import TrainConfig, run
    from dtrain.train.config import BatchConfig, ObserveConfig, RuntimeConfig, ScheduleConfig, TaskConfig
    from dtrain.train.microbatch import AutoMicro
    from dtrain.world import World, destroy_process_group, init_process_group

    torch.cuda.set_device(0)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAPACITY_GIB * 2**30 / total, 0)  # a 4 GiB GPU, as the allocator sees it
    world = World.detect(device="cuda")
    init_process_group(world)
    try:
        cfg = TrainConfig(task=TaskConfig(name="tests.gpu.test_microbatch_gpu:task", args=LM), batch=BatchConfig(size=BATCH, micro=AutoMicro()),
                          schedule=ScheduleConfig(max_steps=3), runtime=RuntimeConfig(device="cuda"), observe=ObserveConfig(log_every=100))
        cfg = with_proposal(cfg, 1, "cuda")  # the plan reads the fraction: its capacity is 4 GiB
        out = run(cfg, world=world)
        return {**out, "proposal": cfg.batch.micro.proposal, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    finally:
        destroy_process_group()


@pytest.mark.timeout(600)
def test_the_micro_batch_found_is_the_largest_that_runs_on_a_4_gib_gpu():
    got = run_distributed(_fit_in_a_smaller_gpu, world_size=1, timeout=580)[0]
    m, trials = got["micro_batch"], [tuple(t) for t in got["micro_batch_trials"]]
    print({"proposal": got["proposal"], "micro_batch": m, "trials": trials, "search_s": got["micro_batch_search_s"],
           "peak_gib": round(got["peak_gib"], 2)})
    assert 1 <= m < BATCH and got["grad_accum"] * m == BATCH and got["steps"] == 3
    bigger = [d for d in range(m + 1, BATCH + 1) if BATCH % d == 0][0]
    assert (bigger, False) in trials, f"the next micro-batch up, {bigger}, was not seen to run out of memory: {trials}"
    assert len(trials) <= 4, trials
    assert got["peak_gib"] <= CAPACITY_GIB
