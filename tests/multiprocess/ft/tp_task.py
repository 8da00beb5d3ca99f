"""A tiny ``lm`` (it has a tensor-parallel plan) whose every step is the whole training set (16
windows = 2 data shards x 8): the mean gradient of a step does not depend on how the windows are
split, so 2 replica groups x ``--parallel tp=2`` and plain ``--parallel dp_replicate=2,tp=2`` on 4
ranks train the same parameters. SGD, linear in the gradient: a rounding difference stays one."""

import dataclasses

import torch

from dtrain.tasks.gpt import gpt, gpt_blocks, gpt_tp_plan
from dtrain.tasks.lm import causal_lm_task

CONTEXT = 8


def make(epochs="6", layers="1", tie="true", data_dir=None):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (16 * CONTEXT + 1 + 4 * CONTEXT + 1,), generator=g, dtype=torch.uint8)
    train, val = tokens[:16 * CONTEXT + 1], tokens[16 * CONTEXT + 1:]
    task = causal_lm_task(name="lm-tiny", build_model=lambda: gpt(vocab=256, context=CONTEXT, layers=int(layers), heads=2, width=16,
                                                               tie=tie == "true"),
                          train=train, val=val, context=CONTEXT, blocks=gpt_blocks, tp_plan=gpt_tp_plan, batch_size=8)
    return dataclasses.replace(task, optimizer="sgd", lr=0.1, epochs=int(epochs))
