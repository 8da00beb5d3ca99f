"""What a model costs per sample: FLOPs and saved activations (whole and per block) counted on the
meta device, and the step timed on the device at hand; or written as data (``transformer``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .machinery import WARMUP_GPU, Machinery, NoCast, Timing, data_time, measure, sample_batch


@dataclass(frozen=True, kw_only=True)
class Block:
    """One repeated unit (transformer block, ResNet stage), per sample."""

    params: int
    fwd_flops: float
    act_bytes: float  # tensors its forward saves for backward
    out_bytes: float  # its output: what a pipeline stage sends and checkpointing keeps


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    name: str
    params: int
    fwd_flops: float  # forward FLOPs per sample; backward is ``bwd_ratio`` times it
    act_bytes: float  # saved-for-backward bytes per sample, under the profile's precision
    blocks: tuple[Block, ...] = ()
    before_blocks: Block | None = None
    """The layers before the first block (embeddings): a pipeline's first stage holds them, its last the rest."""
    matrices: tuple[tuple[int, int], ...] = ()  # parameters as PowerSGD views them (rows x columns)
    out_bytes: float = 0.0  # the model's output per sample (logits): TP gathers it whole for the loss
    tokens_per_sample: int | None = None
    tensors: int = 0
    bwd_ratio: float = 2.0
    timing: Timing | None = None
    precision: str = "fp32"
    notes: tuple[str, ...] = field(default=())
    machinery: Machinery | None = None
    float8: Any = None  # under ``--precision float8``: the linears it converts (``float8.Float8Counts``)

    @property
    def boundary_bytes(self) -> float:
        return max((b.out_bytes for b in self.blocks), default=0.0)

    @property
    def achieved_flops(self) -> float | None:
        t = self.timing
        return None if t is None or t.fwd_s + t.bwd_s <= 0 else self.fwd_flops * (1 + self.bwd_ratio) * t.batch / (t.fwd_s + t.bwd_s)

    def as_dict(self) -> dict[str, Any]:
        t = self.timing
        return {"name": self.name, "params": self.params, "fwd_gflops_per_sample": self.fwd_flops / 1e9,
                "act_mib_per_sample": self.act_bytes / 2**20, "blocks": len(self.blocks), "precision": self.precision,
                "measured": None if t is None else {"batch": t.batch, "fwd_ms": t.fwd_s * 1e3, "bwd_ms": t.bwd_s * 1e3,
                                                    "opt_ms": t.opt_s * 1e3, "data_ms": t.data_s * 1e3, "threads": t.threads, "device": t.device,
                                                    "achieved_gflops": (self.achieved_flops or 0) / 1e9},
                "machinery": None if self.machinery is None else self.machinery.describe()}


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, (list, tuple)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return value if torch.is_tensor(value) else None


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _Saved:
    """Bytes of distinct tensors saved for backward, parameters (and their cast copies) left out."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.seen, self.total, self.kept = params, {}, 0, []

    def exclude(self, t: torch.Tensor) -> None:
        self.params.add(id(t))
        self.kept.append(t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in self.params and id(base) not in self.seen:
            self.seen[id(base)] = base  # a reference keeps the id unique while counting
            self.total += _nbytes(base)
        return t


class MetaAutocast(torch.overrides.TorchFunctionMode):
    """Autocast's casts on the meta device (where ``torch.autocast`` does nothing); with
    ``fused_attention`` (a GPU), unmasked attention is the fused kernel, which saves no matrix."""

    F = torch.nn.functional
    LOW = (F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
           torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.Tensor.matmul,
           torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm, torch.einsum, F.scaled_dot_product_attention)
    FP32 = (F.layer_norm, F.group_norm, F.rms_norm, F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss, F.mse_loss,
            F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits, F.kl_div, F.softplus, F.normalize,
            torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, torch.logsumexp)

    def __init__(self, dtype: torch.dtype, *, fused_attention: bool, weights: Any = None) -> None:
        super().__init__()
        self.dtype, self.fused_attention, self.weights = dtype, fused_attention, weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.LOW:
            args, kwargs = self._cast((args, kwargs), self.dtype)
            if func is self.F.scaled_dot_product_attention and self.fused_attention:
                return _fused_attention(*args, **kwargs)
        elif func in self.FP32:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        return func(*args, **kwargs)

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        """Floating tensors in ``value`` (nested) as ``dtype``; a parameter's copy is no activation."""
        if torch.is_tensor(value):
            if not value.is_floating_point() or value.dtype == dtype:
                return value
            out = value.to(dtype)
            if isinstance(value, nn.Parameter) and self.weights is not None:
                self.weights.exclude(out)
            return out
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        return {k: self._cast(v, dtype) for k, v in value.items()} if isinstance(value, dict) else value


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The GPU's fused attention on meta tensors where it applies, else the reference one."""
    if attn_mask is not None or enable_gqa or q.shape[1] != k.shape[1]:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal, scale=scale)[0]


def count(build: Callable[[], nn.Module], x: Any, y: Any, loss_fn: Callable, *, blocks: Callable | None,
          autocast_dtype: torch.dtype | None, gpu: bool = False) -> dict[str, Any]:
    """FLOPs and saved bytes of one forward+backward on the meta device, whole and per block."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..metrics.flops import _to_meta

    with torch.device("meta"):
        model = build()
    units = list(blocks(model)) if blocks else []
    saved = _Saved({id(p) for p in model.parameters()})
    counter = FlopCounterMode(display=False)
    per_block: list[dict[str, float]] = []

    def pre(_m, _args):
        per_block.append({"flops0": counter.get_total_flops(), "saved0": saved.total})

    def post(m, _args, out):
        rec = per_block[-1]
        rec.update(params=sum(p.numel() for p in m.parameters()), flops=counter.get_total_flops() - rec["flops0"],
                   saved=saved.total - rec["saved0"], out=_nbytes(_first_tensor(out)))

    children = list(model.children())
    first = next((i for i, c in enumerate(children) if units and c is units[0]), None)  # a cut Sequential's first block
    handles = [u.register_forward_pre_hook(pre) for u in units] + [u.register_forward_hook(post) for u in units]
    xm, ym = _to_meta(x), _to_meta(y)
    cast = MetaAutocast(autocast_dtype or torch.float32, fused_attention=gpu, weights=saved) if autocast_dtype is not None or gpu else NoCast()
    with counter, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        with cast:
            out = model(xm)
            loss = loss_fn(out, ym)
        fwd, act = counter.get_total_flops(), saved.total
        loss.backward()
    for h in handles:
        h.remove()
    params = list(model.parameters())
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "fwd": fwd, "bwd": counter.get_total_flops() - fwd, "act": act,
            "out": _nbytes(_first_tensor(out)), "blocks": per_block,
            "before": None if first is None else {"params": sum(p.numel() for c in children[:first] for p in c.parameters()),
                                                   "flops": per_block[0]["flops0"], "saved": per_block[0]["saved0"]},
            "matrices": tuple((p.shape[0], p.numel() // p.shape[0]) for p in params if p.dim() >= 2)}


def profile_task(task: Any, *, batch: int, precision: str = "fp32", gpu: bool = False) -> ModelProfile:
    """Count one batch of ``task`` on the meta device (as a GPU runs it with ``gpu``); ``add_timing`` times it."""
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    x, y = sample_batch(task, batch)
    try:
        c = count(task.build_model, x, y, task.loss_fn, blocks=task.blocks, autocast_dtype=dtype, gpu=gpu)
    except Exception as exc:  # a model that cannot run on meta: say so, no guess
        raise ConfigError(f"task {task.name!r}: its model could not be profiled on the meta device "
                          f"({type(exc).__name__}: {exc}); dtrain plan needs FLOPs and activation sizes.") from None
    blocks = tuple(Block(params=int(b.get("params", 0)), fwd_flops=b.get("flops", 0) / batch,
                         act_bytes=b.get("saved", 0) / batch, out_bytes=b.get("out", 0) / batch) for b in c["blocks"])
    pre = c["before"]
    before = None if pre is None else Block(params=pre["params"], fwd_flops=pre["flops"] / batch, act_bytes=pre["saved"] / batch, out_bytes=0.0)
    return ModelProfile(name=task.name, params=c["params"], fwd_flops=c["fwd"] / batch, act_bytes=c["act"] / batch,
                        blocks=blocks, before_blocks=before, matrices=c["matrices"], out_bytes=c["out"] / batch, tensors=c["tensors"],
                        tokens_per_sample=task.tokens_per_sample, bwd_ratio=c["bwd"] / c["fwd"] if c["fwd"] else 2.0,
                        precision=precision, notes=("FLOPs and activations counted on the meta device (FlopCounterMode, saved-tensor hooks)",))


def add_timing(prof: ModelProfile, task: Any, *, batch: int, optimizer: str | None = None, threads: int = 1,
           machinery: Machinery | None = None, device: str = "cpu", checkpointed: bool = False) -> ModelProfile:
    """``prof`` with one batch timed on this CPU (or ``device="cuda"``), or ``machinery``'s plain step."""
    if machinery is not None and device != "cuda":
        plain = machinery.steps["plain"]
        t = Timing(batch=batch, fwd_s=plain.forward, bwd_s=plain.backward, opt_s=plain.optimizer, threads=machinery.threads,
                   device="cpu", data_s=data_time(task, batch))
        note = (f"step timed on this CPU, batch {batch}, {machinery.threads} thread(s): plain and each layout's own, "
                f"medians of {machinery.rounds} rounds")
        return replace(prof, timing=t, machinery=machinery, notes=(*prof.notes, note))
    gpu = device == "cuda"
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16 if gpu else torch.bfloat16}.get(prof.precision)
    x, y = sample_batch(task, batch)
    t = measure(task, x, y, optimizer=optimizer or task.optimizer, lr=task.lr, autocast_dtype=dtype, threads=threads,
                device=device, checkpointed=checkpointed)
    what = (f"this GPU ({torch.cuda.get_device_name(0)}), batch {batch}: medians after {WARMUP_GPU} warm-up steps, CUDA events"
            if gpu else f"this CPU, batch {batch}, {threads} thread(s)")
    return replace(prof, timing=t, notes=(*prof.notes, f"step timed on {what}" + (", blocks checkpointed" if t.checkpointed else "")))


def transformer(name: str, *, layers: int, width: int, ffn: int, heads: int, kv_heads: int, vocab: int, seq: int,
                act_bytes_per_layer_token: float | None = None, tied: bool = False, gated: bool = True) -> ModelProfile:
    """A decoder-only transformer as data (Llama-style). FLOPs per token: 2 x every weight + 4 x seq x
    width a layer (as torchtitan counts); activations 34 x width bytes a token and layer (Korthikanti)."""
    head = width // heads
    attn = width * (heads * head) + 2 * width * (kv_heads * head) + (heads * head) * width
    mlp = (3 if gated else 2) * width * ffn
    per_layer = attn + mlp + 2 * width
    emb = vocab * width
    params = layers * per_layer + emb * (1 if tied else 2) + width
    per_layer_flops = (2 * (attn + mlp) + 4 * seq * width) * seq
    per_layer_act = (act_bytes_per_layer_token or 34 * width) * seq
    blocks = tuple(Block(params=per_layer, fwd_flops=per_layer_flops, act_bytes=per_layer_act, out_bytes=2 * width * seq)
                   for _ in range(layers))
    fwd = layers * per_layer_flops + 2 * emb * seq  # the output head; the embedding is a lookup
    per_layer_mats = [(width, heads * head), (width, kv_heads * head), (width, kv_heads * head), (heads * head, width)]
    per_layer_mats += [(width, ffn)] * (3 if gated else 2)
    mats = tuple(per_layer_mats * layers) + ((vocab, width),) * (1 if tied else 2)
    return ModelProfile(name=name, params=params, fwd_flops=fwd, act_bytes=layers * per_layer_act + 4 * vocab * seq,
                        blocks=blocks, before_blocks=Block(params=emb, fwd_flops=0.0, act_bytes=0.0, out_bytes=0.0), matrices=mats, out_bytes=4 * vocab * seq, tokens_per_sample=seq,
                        tensors=layers * (len(per_layer_mats) + 2) + (2 if tied else 3),
                        precision="bf16-mixed", notes=("written as data: " + name,))

