"""`dtrain plan --precision float8` and `--fsdp-reduce`: the converted linears counted as train
converts them, their matmuls at the data sheet's float8 peak and their casts as memory traffic,
float8 all-gathers under FSDP, bf16 reduce-scatters; devices without float8 refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dtrain.cli import main as cli_main
from dtrain.parallel.dims import ParallelDims
from dtrain.plan import Settings, cluster, predict
from dtrain.plan.float8 import Float8Counts, compute_rates, count
from dtrain.plan.layouts import Layout
from dtrain.plan.profile import Block, ModelProfile
from dtrain.plan.steps import fsdp_units
from dtrain.tasks import load_task
from tests.logic.cli.test_bad_inputs import _one_line

LM = ["--task", "lm", "--task-arg", "layers=2", "--task-arg", "width=2048", "--task-arg", "heads=16",
      "--task-arg", "context=64", "--task-arg", "max_bytes=100000", "--batch-size", "2"]


def lm(width: int):
    return load_task("lm", options={"layers": "2", "width": str(width), "heads": "16", "context": "64", "max_bytes": "100000"})


def test_count_finds_the_linears_train_converts_and_their_matmul_flops():
    per_block = 4 * 2048 * 2048 + 2 * 2048 * 8192  # q, k, v, proj; the MLP's two: all large enough at width 2048
    got = count(lm(2048), batch=2)
    assert got.params == 2 * per_block and got.block_params == (per_block, per_block)
    assert got.fwd_flops == pytest.approx(2 * 64 * 2 * per_block)  # 2 FLOPs a multiply-add, 64 tokens a sample
    # width 1024: torchao's rule skips a linear with in <= 4096 and out <= 1024, so only the MLP's first converts
    small = count(lm(1024), batch=2)
    assert small.params == 2 * 1024 * 4096
    assert small.fwd_cast_bytes == pytest.approx(2 * 64 * 5 * 1024)  # its input: amax read, cast read + write


def toy(f8: Float8Counts | None) -> ModelProfile:
    blocks = tuple(Block(params=1000, fwd_flops=4e9, act_bytes=0.0, out_bytes=0.0) for _ in range(2))
    return ModelProfile(name="toy", params=2500, fwd_flops=10e9, act_bytes=0.0, blocks=blocks, float8=f8)


def test_converted_matmuls_run_at_the_float8_peak_and_casts_at_the_memory_bandwidth():
    c = cluster.build({"device": "h100", "achieved_fraction": 0.5})
    f8 = Float8Counts(fwd_flops=6e9, fwd_cast_bytes=1e6, bwd_cast_bytes=3e6, params=1600, block_params=(800, 800))
    s = Settings(batch=4, precision="float8")
    fwd, bwd = compute_rates(toy(f8), c, s)
    r16, r8, bw = 989e12 * 0.5, 1979e12 * 0.5, c.device.mem_bw
    weights = 5 * 1600 / 4
    assert fwd == pytest.approx(4e9 / r16 + 6e9 / r8 + (1e6 + weights) / bw)
    assert bwd == pytest.approx((20e9 - 12e9) / r16 + 12e9 / r8 + (3e6 + weights) / bw)
    lay = Layout("fsdp", ParallelDims(dp_shard=8))
    bf16 = predict(toy(None), replace(c, nodes=1, procs_per_node=8), lay, Settings(batch=4, precision="bf16-mixed", param_comm_bytes=2))
    fp8 = predict(toy(f8), replace(c, nodes=1, procs_per_node=8), lay, Settings(batch=4, precision="float8", param_comm_bytes=2))
    assert fp8.step_s < bf16.step_s
    a100 = cluster.build({"device": "a100"})
    with pytest.raises(Exception, match="has no float8 rate"):
        compute_rates(toy(f8), a100, s)


def test_fsdp_gathers_float8_weights_in_one_byte_the_rest_in_the_policys_two():
    f8 = Float8Counts(fwd_flops=6e9, fwd_cast_bytes=0.0, bwd_cast_bytes=0.0, params=1600, block_params=(800, 800))
    root = 500  # embeddings and head: never converted

    def gather_bytes(prof, s):
        return [g for g, _, _ in fsdp_units(prof, s)]

    assert gather_bytes(toy(f8), Settings(batch=1, precision="float8", param_comm_bytes=2)) == [2 * root, 2 * 1000 - 800,
                                                                                                 2 * 1000 - 800]
    assert gather_bytes(toy(f8), Settings(batch=1, precision="bf16-mixed", param_comm_bytes=2)) == [1000, 2000, 2000]


def _best(argv, capsys, notes=None):
    assert cli_main(["plan", *LM, "--device", "h100", "-n", "8", "--layouts", "fsdp", "--json", *argv]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if notes is not None:
        notes.extend(out["assumptions"])
    return out["best"]


@pytest.mark.timeout(120)
def test_plan_float8_and_fsdp_reduce_on_the_command_line(capsys):
    bf16 = _best(["--precision", "bf16-mixed"], capsys)
    notes = []
    fp8 = _best(["--precision", "float8"], capsys, notes)
    assert any(n.startswith("float8 (tensorwise): 12 linear(s) converted") for n in notes)  # 6 a block, 2 blocks
    assert fp8["step_ms"] < bf16["step_ms"]
    assert fp8["memory_mib"]["gathered"] < bf16["memory_mib"]["gathered"]
    reduced = _best(["--precision", "bf16-mixed", "--fsdp-reduce", "bf16"], capsys)
    assert reduced["comm_ms"] < bf16["comm_ms"]  # half the reduce-scatter bytes


BAD = [
    (["--device", "a100", "--precision", "float8"], "the plan's device 'A100 SXM 80GB' has no float8 rate"),
    (["--device", "cpu", "--precision", "float8"], "--precision float8: the plan's device is this CPU"),
    (["--fsdp-reduce", "bf32"], "--fsdp-reduce 'bf32' is not a reduce dtype"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_float8_plan_is_one_line_exit_2(argv, says, capsys):
    assert cli_main(["plan", *LM, "-n", "2", "--no-layout-profile", *argv]) == 2
    assert says in _one_line(capsys.readouterr().err)
