"""The ``lm`` task (a GPT-style byte-level decoder) and the model switches it exercises
(``--compile``, ``--activation-checkpointing``, fsdp wrapping and pipeline splitting per block).

Tier 1: corpus reading, bad input, stage bounds. Tier 2: 2 ranks on gloo against one process.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

import dtrain
from dtrain.errors import ConfigError, DataError
from dtrain.parallel.pipeline import PipelineConfig, block_bounds, split_stage
from dtrain.tasks import load_task
from dtrain.tasks.lm import corpus_files, read_corpus

# A tiny model on the first 60 kB of the standard library's sources: a few seconds per run.
TINY = {"layers": "2", "heads": "2", "width": "32", "context": "32", "max_bytes": "60000"}
STEPS = 4
# Tolerance of the parity tests (fp32). Two ranks compute each gradient as the mean of two
# half-batch means (all-reduce / reduce-scatter) instead of one mean over the batch; LayerNorm,
# softmax and the 256-way cross entropy reorder sums further. Each reordering moves a value by a
# few ulps; AdamW keeps per-step updates at lr scale (1e-3), so after 4 steps weights (~0.02)
# and losses (~5.5) agree to about 1e-6. A real bug (a missing 1/N, a block not synced) moves
# the loss by more than 1e-3 within these steps.
TOL = 2e-5


def _task(**extra: str):
    return load_task("lm", options={**TINY, **extra})


# -- tier 1 ---------------------------------------------------------------------------------------
def test_corpus_reads_a_folder_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"22")
    (tmp_path / "one.txt").write_bytes(b"1")
    (tmp_path / ".hidden").write_bytes(b"x")
    root, files = corpus_files(str(tmp_path))
    assert [f[len(root) + 1:] for f in files] == ["b/two.txt", "one.txt"]
    assert read_corpus(files, 0) == (b"221", 2)
    assert read_corpus(files, 1) == (b"2", 1)  # cut at max_bytes


def test_default_corpus_is_the_stdlib_and_windows_are_shifted_targets():
    task = _task()
    x, y = task.train_set[5]
    assert x.shape == y.shape == (32,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # the target of position t is the token at t + 1
    assert len(task.train_set) == (57000 - 1) // 32 and len(task.test_set) == (3000 - 1) // 32  # last 5% validates
    assert task.metric_name == "val_loss" and task.tokens_per_sample == 32


def test_corpus_smaller_than_a_window_is_one_line(tmp_path):
    (tmp_path / "tiny.txt").write_bytes(b"hello world")
    with pytest.raises(DataError, match=r"has 11 bytes, too few .* context=32"):
        load_task("lm", data_dir=str(tmp_path / "tiny.txt"), options=TINY)
    (tmp_path / "big.txt").write_bytes(b"x" * 1000)  # enough text, but capped below two windows: say which cap
    with pytest.raises(DataError, match=r"has 50 bytes \(capped at max_bytes=50\).* raise --task-arg max_bytes="):
        load_task("lm", data_dir=str(tmp_path / "big.txt"), options={**TINY, "max_bytes": "50"})


@pytest.mark.parametrize("args, message", [
    ({"width": "30", "heads": "4"}, "width=30 is not divisible by heads=4"),
    ({"layers": "0"}, "layers=0 must be >= 1"),
    ({"dropout": "1.5"}, "dropout=1.5"),
])
def test_nonsense_sizes_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        _task(**args)


def test_pipeline_splits_between_blocks_and_refuses_tied_weights():
    task = _task(layers="4")
    model = task.build_model()  # embed, block0..block3, head
    assert block_bounds(model, 2, task.blocks(model)) == [(0, 3), (3, 6)]
    assert block_bounds(model, 4, task.blocks(model)) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    with pytest.raises(ConfigError, match="4 block"):
        block_bounds(model, 5, task.blocks(model))
    with pytest.raises(ConfigError, match="tie=false"):  # embedding and head share a weight
        split_stage(model, 1, 2, PipelineConfig(), task.blocks(model))
    untied = _task(layers="4", tie="false").build_model()
    assert list(dict(split_stage(untied, 1, 2, PipelineConfig(), [m for m in untied if type(m).__name__ == "Block"]).named_children())) == ["block2", "block3", "head"]


def test_activation_checkpointing_needs_blocks():
    ctx = dtrain.init("single", activation_checkpointing=True)
    with pytest.raises(ConfigError, match="needs the model's blocks"):
        ctx.setup(torch.nn.Linear(2, 2))
    ctx.close()


# -- training -------------------------------------------------------------------------------------
def train(strategy: str, batch: int, options: dict | None = None, task_args: dict | None = None, switches: dict | None = None) -> dict:
    """``STEPS`` AdamW steps of ``batch`` windows per data-parallel rank: losses and final weights."""
    task = _task(**(task_args or {}))
    ctx = dtrain.init(strategy, seed=0, **(switches or {}), **(options or {}))
    model = task.build_model()
    blocks = task.blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt, blocks=blocks)
    it = iter(ctx.setup_dataloader(DataLoader(task.train_set, batch_size=batch, shuffle=True)))
    losses = []
    for _ in range(STEPS):
        x, y = next(it)
        loss = ctx.forward_backward(model, x, y, task.loss_fn)
        opt.step()
        opt.zero_grad()
        losses.append(ctx.all_reduce(loss.clone(), op="mean").item())
    state = {}
    for k, v in ctx.unwrap(model).state_dict().items():
        state[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    if strategy == "pipeline":
        merged: dict = {}
        for part in ctx.gather_object(state):
            merged.update(part)
        state = merged
    out = {"losses": losses, "state": state}
    ctx.close()
    return out


def _assert_close(got: dict, ref: dict, tol: float = TOL) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= tol, f"loss curves differ: {got['losses']} vs {ref['losses']}"
    assert got["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        diff = (got["state"][k] - ref["state"][k]).abs().max().item()
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > {tol}"


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single", 16)


def test_loss_starts_near_uniform_and_falls(reference):
    losses = reference["losses"]
    assert abs(losses[0] - math.log(256)) < 0.1  # GPT-2 init: near-uniform over 256 bytes
    assert losses[-1] < losses[0] - 0.05


def test_activation_checkpointing_gives_the_same_loss(reference):
    # Recomputation runs the same operations on the same inputs: on CPU the results agree bit
    # for bit (tolerance 1e-6 leaves room for a kernel choosing another order on recompute).
    _assert_close(train("single", 16, switches={"activation_checkpointing": True}), reference, tol=1e-6)
