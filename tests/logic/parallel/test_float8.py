"""float8 training as values and one process (``--precision float8``, ``dtrain.parallel.float8``):
which linears are converted, the one-line refusals, the flags, --precision auto's pick. Training on
1 and 2 ranks, checkpoints: tests/multiprocess/parallel/test_float8.py; real float8 kernels:
tests/gpu/test_float8_gpu.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from dtrain.cli import main as cli_main
from dtrain.errors import ConfigError
from dtrain.parallel.float8 import apply_float8, converts, gains
from dtrain.precision import Float8Config, Precision, auto_precision
from dtrain.tasks.gpt import gpt, gpt_blocks
from dtrain.train.config import RuntimeConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
REFUSAL = ("float8 needs a GPU with compute capability >= 8.9 (Hopper/Ada); this is cpu; use bf16-mixed, "
           "or --float8-emulate for a test.")


def _gpt(width: int = 32) -> tuple[nn.Module, list[nn.Module]]:
    model = gpt(vocab=256, context=16, width=width, layers=2, heads=4)
    return model, gpt_blocks(model)


def test_emulated_float8_converts_every_block_linear_and_not_the_head():
    model, blocks = _gpt()
    block_linears = sorted(n for n, m in model.named_modules() if type(m) is nn.Linear and any(m is x for b in blocks for x in b.modules()))
    names = converts(model, Float8Config(emulate=True), blocks)
    assert sorted(names) == block_linears and len(names) == 12  # 6 per block: q, k, v, proj, the MLP's two
    assert all(n.startswith("block") for n in names) and "head.out" not in names  # not the output head
    assert apply_float8(model, Float8Config(emulate=True), blocks) == 12
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {kinds[n] for n in names} == {"Float8Linear"} and set(kinds.values()) == {"Float8Linear", "Linear"}
    assert model.head.out.weight is model.embed.tok.weight  # the tie holds


def test_real_float8_converts_only_linears_large_enough_and_multiples_of_16():
    model = nn.Sequential(nn.Linear(4096, 8192), nn.Linear(8192, 1000), nn.Linear(1024, 1024), nn.Linear(1000, 4096),
                          nn.Linear(4096, 256))
    # tensorwise (torchao's rule): K <= 4096 and N <= 1024 loses; 1000 is no multiple of 16; the last is the head
    assert converts(model, Float8Config()) == ["0"]
    assert gains(nn.Linear(1024, 4096), "tensorwise") and not gains(nn.Linear(4096, 1024), "tensorwise")
    assert gains(nn.Linear(4096, 8192), "rowwise") and not gains(nn.Linear(2048, 4096), "rowwise")
    assert converts(model, Float8Config(emulate=True)) == ["0", "2"]  # emulated: size does not matter, 16 does


def test_float8_on_cpu_is_refused_in_one_line_unless_emulated():
    with pytest.raises(ConfigError) as err:
        Precision.resolve("float8", CPU)
    assert str(err.value) == REFUSAL
    p = Precision.resolve(Precision.with_float8(recipe="rowwise", emulate=True), CPU)
    assert (p.effective, p.autocast_dtype, p.float8.recipe, p.device_type) == ("float8", torch.bfloat16, "rowwise", "cpu")
    with pytest.raises(ConfigError, match="--float8-recipe 'colwise' is not a recipe; choose one of: tensorwise, rowwise"):
        Float8Config(recipe="colwise")


def test_train_refuses_float8_on_cpu_before_any_worker(capsys):
    env, log = dict(os.environ), logging.getLogger("dtrain")
    saved = (list(log.handlers), log.propagate, log.level)
    try:
        assert cli_main(["train", "--task", "lm", "-n", "2", "--precision", "float8"]) == 2
    finally:  # the CLI hands flags to workers through the environment and points dtrain's logger at stderr
        os.environ.clear()
        os.environ.update(env)
        log.handlers[:], log.propagate, log.level = saved
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [f"dtrain: error: {REFUSAL}"]


def test_float8_flags_need_float8():
    with pytest.raises(ConfigError, match=r"--float8-recipe applies to --precision float8, not 'bf16-mixed'; add --precision float8 or drop it"):
        RuntimeConfig(precision="bf16-mixed", float8_recipe="rowwise")
    spec = RuntimeConfig(precision="float8", float8_recipe="rowwise", float8_emulate=True).precision_spec()
    assert spec.float8 == Float8Config(recipe="rowwise", emulate=True)
    assert RuntimeConfig(precision="bf16-mixed").precision_spec() == "bf16-mixed"


def test_fast_picks_float8_where_the_gpu_has_it():
    assert auto_precision(CUDA, bf16_supported=True, float8_supported=True) == "float8"
    assert auto_precision(CUDA, bf16_supported=True, float8_supported=False) == "bf16-mixed"
    assert auto_precision(CPU) == "fp32"
