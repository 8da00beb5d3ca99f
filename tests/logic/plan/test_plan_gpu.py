"""The plan's GPU side, on CPU: what a mixed-precision GPU run saves for backward (autocast's casts
and the fused attention emulated on the meta device), and ``--device cuda`` (this GPU, its step
timed) with torch.cuda's answers stood in. The timing itself runs on a GPU (benchmarks/plan_gpu.py)."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.parallel.dims import ParallelDims
from dtrain.plan import Settings, cluster, predict
from dtrain.plan.layouts import Layout
from dtrain.plan.profile import Block, ModelProfile, Timing, count


class Attention(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.heads = nn.Linear(width, 3 * width), heads
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in self.qkv(self.norm(x)).chunk(3, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)


def _saved(dtype, gpu, t=256, batch=4, width=32):
    x, y = torch.randn(batch, t, width), torch.randn(batch, t, width)
    return count(Attention, x, y, nn.functional.mse_loss, blocks=None, autocast_dtype=dtype, gpu=gpu)


def test_mixed_precision_saves_matmul_inputs_and_outputs_in_16_bits():
    def mlp():
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))

    x, y = torch.randn(32, 64), torch.randn(32, 64)
    fp32, bf16 = (count(mlp, x, y, nn.functional.mse_loss, blocks=None, autocast_dtype=d) for d in (None, torch.bfloat16))
    assert fp32["act"] > 0 and 0.45 < bf16["act"] / fp32["act"] < 0.75, (bf16["act"], fp32["act"])  # the norm stays fp32
    assert bf16["fwd"] == fp32["fwd"]


def test_a_gpus_fused_attention_saves_no_attention_matrix():
    cpu, gpu = _saved(torch.bfloat16, False), _saved(torch.bfloat16, True)
    b, t, w, h = 4, 256, 32, 4
    matrix = b * h * t * t  # elements of the T x T matrix the meta device's reference attention keeps
    assert cpu["act"] > 4 * matrix  # bytes: the reference keeps it in fp32
    # flash keeps q, k, v (one 16-bit base: the qkv output), its output, an fp32 log-sum-exp per row and head;
    # the rest: the norm's input and output (fp32), the output's 16-bit copy for the linear, the loss's inputs
    assert gpu["act"] < 40 * b * t * w < 4 * matrix
    assert gpu["fwd"] == pytest.approx(cpu["fwd"], rel=0.01), "the same forward FLOPs either way"


def test_fp32_gpu_attention_is_the_memory_efficient_kernel():
    fp32_gpu, fp32_cpu = _saved(None, True), _saved(None, False)
    assert fp32_gpu["act"] < fp32_cpu["act"] / 2


def _fake_cuda(monkeypatch, name="NVIDIA H200", gib=140.0, major=9):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=name, total_memory=int(gib * 2**30), major=major))


def test_device_cuda_is_this_gpu_with_its_presets_links(monkeypatch):
    _fake_cuda(monkeypatch)
    c = cluster.build({"device": "cuda", "nodes": 2, "procs_per_node": 8})
    assert c.device.profiled and c.is_gpu and "this GPU, profiled" in c.device.name
    assert c.device.peak_flops == cluster.DEVICES["h200"].peak_flops
    assert (c.intra_bw, c.inter_bw) == (cluster.LINKS["h200"]["intra_bw"], cluster.LINKS["h200"]["inter_bw"])
    assert "preset h200" in c.source["device"]
    _fake_cuda(monkeypatch, name="Some New GPU", gib=24)
    d = cluster.build({"device": "cuda"}).device
    assert d.profiled and d.memory_bytes == 24 * 2**30 and d.flops("bf16-mixed") == 0.0  # its peak: what the profile achieves
    assert d.bf16  # compute capability 9: --precision auto plans bf16 on it
    _fake_cuda(monkeypatch, name="Some Old GPU", gib=16, major=7)
    assert not cluster.build({"device": "cuda"}).device.bf16


def test_device_cuda_without_a_gpu_or_with_mfu_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible here"):
        cluster.build({"device": "cuda"})
    with pytest.raises(ConfigError, match="--mfu 0.3 with --device cuda"):
        cluster.build({"device": "cuda", "achieved_fraction": 0.3})


def test_a_profiled_gpu_steps_at_its_measured_times_a_named_one_at_flops_times_mfu():
    prof = ModelProfile(name="m", params=10**6, fwd_flops=1e12, act_bytes=1e6, precision="bf16-mixed",
                        timing=Timing(batch=8, fwd_s=0.08, bwd_s=0.16, opt_s=0.004, threads=1, device="cuda"))
    s = Settings(batch=8, precision="bf16-mixed", optimizer="adamw")
    h200 = cluster.build({"device": "h200"})
    profiled = cluster.Cluster(device=cluster.replace(h200.device, profiled=True), intra_bw=h200.intra_bw, inter_bw=h200.inter_bw)
    measured = predict(prof, profiled, Layout("single", ParallelDims()), s)
    assert measured.step_s == pytest.approx(0.08 + 0.16 + 0.004, rel=1e-6)
    named = predict(prof, h200, Layout("single", ParallelDims()), s)
    fwd = 8 * 1e12 / (989e12 * 0.4)
    assert named.phases_s["forward"] == pytest.approx(fwd, rel=1e-6)


def test_activation_checkpointing_timed_with_the_blocks_checkpointed_adds_no_second_recomputation(monkeypatch):
    """The GPU run's forward under checkpointing held the wrappers' own cost (H200: 13.1 ms against
    9.9 ms): where the step is timed on the planned device it is timed checkpointed, and the plan
    adds no modelled recomputation on top; a step timed without it gets one more forward of the blocks."""
    import dtrain.parallel.transforms as transforms
    from dtrain.plan.machinery import measure, sample_batch
    from dtrain.tasks import load_task

    task = load_task("lm", options={"layers": "2", "heads": "2", "width": "32", "context": "16", "max_bytes": "20000"})
    x, y = sample_batch(task, 4)
    calls = []
    real = transforms.checkpoint

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(transforms, "checkpoint", counted)
    t = measure(task, x, y, optimizer="adamw", lr=1e-3, autocast_dtype=None, threads=1, repeats=5, checkpointed=True)
    plain = measure(task, x, y, optimizer="adamw", lr=1e-3, autocast_dtype=None, threads=1, repeats=5)
    assert t.checkpointed and not plain.checkpointed
    assert len(calls) == 2 * 7  # both blocks, every timed and warm-up step of the checkpointed model only

    blocks = tuple(Block(params=1000, fwd_flops=4e11, act_bytes=1e5, out_bytes=1e3) for _ in range(2))
    base = ModelProfile(name="m", params=10**6, fwd_flops=1e12, act_bytes=1e6, blocks=blocks, precision="bf16-mixed",
                        timing=Timing(batch=8, fwd_s=0.08, bwd_s=0.16, opt_s=0.004, threads=1, device="cuda"))
    h200 = cluster.build({"device": "h200"})
    gpu = cluster.Cluster(device=cluster.replace(h200.device, profiled=True), intra_bw=h200.intra_bw, inter_bw=h200.inter_bw)
    s = Settings(batch=8, precision="bf16-mixed", optimizer="adamw", activation_checkpointing=True)
    single = Layout("single", ParallelDims())
    modelled = predict(base, gpu, single, s)
    assert modelled.phases_s["backward"] == pytest.approx(0.16 + 0.08 * 0.8, rel=1e-6)  # one more forward of the blocks (80%)
    timed = predict(replace(base, timing=replace(base.timing, checkpointed=True)), gpu, single, s)
    assert timed.phases_s["backward"] == pytest.approx(0.16, rel=1e-6)
    assert timed.single_step_s == pytest.approx(0.08 + 0.16 + 0.004, rel=1e-6)
    named = predict(replace(base, timing=replace(base.timing, checkpointed=True)), h200, single, s)  # FLOPs: modelled
    assert named.phases_s["backward"] > named.phases_s["forward"] * 2


def test_a_gpu_step_is_timed_on_the_gpus_clock_with_one_wait_at_its_end(monkeypatch):
    """``timed_step(gpu=True)`` reads each phase off CUDA events and waits once per step, so the host
    queues a phase while the GPU runs the one before, as training does (an H100 timed a step that
    waited before every clock reading +12%, its checkpointed step +29%, over the training run)."""
    from dtrain.plan import machinery as timing

    gpu_ms, waits = [0.0], []

    def busy(ms):  # the GPU's clock runs on by the work just queued
        gpu_ms[0] += ms

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = gpu_ms[0]

        def synchronize(self):
            waits.append(self.at)

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("waited for the GPU inside the step"))
    net = nn.Linear(4, 1)
    net.register_forward_hook(lambda *a: busy(10.0))
    net.weight.register_hook(lambda g: busy(20.0) or g)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *a: busy(1.0))
    task = types.SimpleNamespace(loss_fn=lambda out, y: ((out - y) ** 2).mean())
    run = timing.timed_step(net, opt, task, torch.randn(8, 4), torch.randn(8, 1), timing.NoCast, gpu=True)
    assert run() == pytest.approx((0.010, 0.020, 0.001))
    assert run() == pytest.approx((0.010, 0.020, 0.001)) and waits == [31.0, 62.0]
