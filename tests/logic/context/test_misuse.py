"""Misuses of ``dtrain.init`` and the Context, each one line (issue 51, item 5): an unknown
option named with the options that exist, strings where a bool goes, a closed Context, a save
onto a folder."""

from __future__ import annotations

import pytest
import torch

import dtrain
from dtrain import CheckpointError, ConfigError, DtrainError


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_an_unknown_option_is_named_with_the_options_that_exist():
    with pytest.raises(ConfigError) as info:
        dtrain.init(bogus_option=1)  # one process: strategy auto is single, which has no options
    text = _one_line(info.value)
    assert "strategy 'single' has no option bogus_option (it takes none)" in text and "ddp" in text
    assert "takes no arguments" not in text
    with pytest.raises(ConfigError) as info:
        dtrain.init("ddp", bucket_cap=5)
    text = _one_line(info.value)
    assert "strategy 'ddp' has no option bucket_cap; its options are: " in text and "bucket_cap_mb" in text


@pytest.mark.parametrize("option", ["compile", "activation_checkpointing"])
@pytest.mark.parametrize("value", ["no", "off", 1, None])
def test_bool_options_of_init_take_only_bools(option, value):
    with pytest.raises(ConfigError) as info:
        dtrain.init(**{option: value})
    assert f"dtrain.init({option}=...) got" in _one_line(info.value) and "give True or False" in str(info.value)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_async_save_takes_only_a_bool(tmp_path, value):
    ctx = dtrain.init()
    try:
        with pytest.raises(ConfigError, match=r"ctx.checkpoints\(async_save=...\) got .*give True or False"):
            ctx.checkpoints(str(tmp_path / "ck"), async_save=value)
        from dtrain.checkpoint import CheckpointManager

        with pytest.raises(ConfigError, match=r"CheckpointManager\(async_save=...\) got"):
            CheckpointManager(ctx._run_state(), str(tmp_path / "ck2"), async_save=value)
    finally:
        ctx.close()


def test_every_method_of_a_closed_context_says_so(tmp_path):
    ctx = dtrain.init()
    model = ctx.setup(torch.nn.Linear(2, 2))
    ctx.close()
    ctx.close()  # twice: still fine
    calls = {
        "all_reduce": lambda: ctx.all_reduce(torch.ones(1)),
        "barrier": ctx.barrier,
        "broadcast_object": lambda: ctx.broadcast_object(1),
        "setup": lambda: ctx.setup(torch.nn.Linear(2, 2)),
        "backward": lambda: ctx.backward(model(torch.ones(1, 2)).sum()),
        "save": lambda: ctx.save(str(tmp_path / "x.pt"), {"model": model}),
        "checkpoints": lambda: ctx.checkpoints(str(tmp_path / "ck")),
        "print": lambda: ctx.print("x"),
    }
    for name, call in calls.items():
        with pytest.raises(DtrainError) as info:
            call()
        assert _one_line(info.value).startswith(f"the Context was closed; ctx.{name}() needs an open one"), name
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "ck").exists()
    assert ctx.rank == 0 and model(torch.ones(1, 2)).shape == (1, 2)  # properties and the model still work


def test_with_block_closes_and_then_refuses():
    with dtrain.init() as ctx:
        ctx.barrier()
    with pytest.raises(ConfigError, match=r"the Context was closed; ctx.barrier\(\)"):
        ctx.barrier()


def test_save_onto_a_folder_is_one_line_and_leaves_the_folder_alone(tmp_path):
    folder = tmp_path / "model.pt"
    folder.mkdir()
    (folder / "kept").write_text("x")
    ctx = dtrain.init()
    try:
        with pytest.raises(CheckpointError) as info:
            ctx.save(str(folder), {"model": ctx.setup(torch.nn.Linear(2, 2))})
        assert f"cannot write checkpoint {folder}: it is a folder; give a file path" in _one_line(info.value)
    finally:
        ctx.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporary file left beside it
    assert [p.name for p in folder.iterdir()] == ["kept"]
