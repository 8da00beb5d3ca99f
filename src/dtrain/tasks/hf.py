"""``--task hf:PATH``: a Hugging Face ``transformers`` causal language model from a local folder
(nothing is ever downloaded), trained on the ``lm`` task's windows, tokenised by the folder's
tokenizer, else byte-level.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .._log import logger
from ..checkpoint import hf as folder
from ..errors import ConfigError, DataError, first_line
from . import Task
from .lm import causal_lm_task, corpus_files, read_corpus

BYTES = 256


class CausalLM(nn.Module):
    """A transformers causal LM whose forward maps token ids (B, T) to logits (B, T, V), as every
    dtrain task's model maps inputs to outputs. Its parameters are the model's, under ``hf.``."""

    def __init__(self, model: nn.Module, init_from: str = "") -> None:
        super().__init__()
        self.hf = model
        self.init_from = init_from  # a folder whose weights load_init reads once the layout split the model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # No key/value cache: training sees each window once.
        return self.hf(input_ids=idx, use_cache=False).logits


def make_task(path: str, data_dir: str | None = None, context: int = 0, max_bytes: int = 2_000_000,
              val_fraction: float = 0.05, init_from: str = "") -> Task:
    """``context``: tokens per window (0: 128, or the model's maximum if smaller)."""
    what = f"task 'hf:{path}'"
    folder.check_folder(what, path)
    if init_from:
        folder.check_folder(f"--init-from {init_from}", init_from)
        if not folder.has_weights(init_from):
            raise ConfigError(f"--init-from {init_from} has no model.safetensors; give a folder with weights "
                              "(e.g. one `dtrain ckpt export --hf` wrote).")
    config = folder.load_config(what, path)
    context = _context(what, config, context)
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"{what}: val_fraction={val_fraction} must be in (0, 1), e.g. 0.05.")
    tokens, source = _tokens(what, path, config, data_dir, max_bytes)
    n_val = max(context + 1, int(len(tokens) * val_fraction))
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if len(train) < context + 1:
        raise DataError(f"{what}: the corpus has {len(tokens)} tokens ({source}), too few for a training and a "
                        f"validation window of context={context}; give more text (--data-dir, --task-arg max_bytes=0) "
                        "or a smaller --task-arg context=.")
    logger.info(f"hf: {config.model_type} from {path}{' with the weights of ' + init_from if init_from else ''}; "
                f"{len(train):,} training and {len(val):,} validation tokens ({source})")

    def build() -> nn.Module:
        # --init-from's weights are not read here: every rank would read them whole; load_init
        # reads each rank's shards after the layout split the model
        return CausalLM(folder.build_causal_lm(what, path, config, weights=not init_from), init_from=init_from)

    return causal_lm_task(name=f"hf:{path}", build_model=build, train=train, val=val, context=context, blocks=hf_blocks,
                          tp_plan=hf_tp_plan, batch_size=8, load_weights=load_init if init_from else None)


def load_init(model: nn.Module) -> None:
    """``--init-from DIR``'s weights into the set-up model, each rank reading its own shards only.
    Not collective."""
    from ..checkpoint import hf_shards

    root = hf_shards.model_module(model)
    causal = next((m for m in root.modules() if isinstance(m, CausalLM)), None)
    if causal is None or not causal.init_from:
        return
    what = f"--init-from {causal.init_from}"
    read = hf_shards.read_into(what, causal, causal.init_from, prefix="hf.")
    logger.info(f"{what}: {read.tensors} tensors, this rank read {read.bytes_read / 2**20:,.1f} of their "
                f"{read.bytes_total / 2**20:,.1f} MiB (its shards)")
    causal.init_from = ""


def _context(what: str, config: Any, context: int) -> int:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context < 0:
        raise ConfigError(f"{what}: context={context} must be >= 1 (or 0: the default).")
    if context == 0:
        return min(128, limit) if limit else 128
    if limit and context > limit:
        raise ConfigError(f"{what}: context={context} is longer than the model's {limit} positions; use --task-arg context={limit} or less.")
    return context


def _tokens(what: str, path: str, config: Any, data_dir: str | None, max_bytes: int) -> tuple[torch.Tensor, str]:
    """The corpus as token ids (int64), and a few words on where they came from."""
    if max_bytes < 0:
        raise ConfigError(f"{what}: max_bytes={max_bytes} must be >= 0 (0: the whole corpus).")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    root, files = corpus_files(data_dir)
    data, used = read_corpus(files, max_bytes)
    where = f"{len(data):,} bytes from {used} file(s) under {root}"
    if not any(os.path.isfile(os.path.join(path, n)) for n in folder.TOKENIZER_FILES):
        if vocab < BYTES:
            raise ConfigError(f"{what}: vocab_size={vocab} is smaller than the {BYTES} byte values a byte-level corpus "
                              f"needs, and {path} has no tokenizer; add the model's tokenizer files to the folder "
                              f"(tokenizer.json, ...) or use vocab_size >= {BYTES}.")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)
        return tokens, f"{where}, byte-level"
    tf = folder.transformers()
    with folder.offline():
        try:
            tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (ValueError, OSError, KeyError, TypeError) as exc:
            raise ConfigError(f"{what}: the tokenizer files in {path} do not load ({first_line(exc, 200)}); fix or remove them "
                              "(without them the corpus is read byte-level).") from None
        ids = tok(data.decode("utf-8", errors="replace"), add_special_tokens=False, verbose=False)["input_ids"]
    tokens = torch.tensor(ids, dtype=torch.long)
    top = int(tokens.max()) if len(tokens) else -1
    if top >= vocab:
        raise ConfigError(f"{what}: the tokenizer gives token id {top}, beyond the model's vocab_size={vocab}; "
                          "give the tokenizer the model was made for.")
    return tokens, f"{where}, {type(tok).__name__}"


def _inner(model: nn.Module) -> nn.Module:
    return model.hf if isinstance(model, CausalLM) else model


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (FSDP's and checkpointing's units): the outermost modules of the classes
    in ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``), else the longest ``nn.ModuleList``'s items."""
    inner = _inner(model)
    names = set(getattr(inner, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    for m in inner.modules():
        if type(m).__name__ in names and not any(m in set(b.modules()) for b in found):
            found.append(m)
    if found:
        return found
    lists = [m for m in inner.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


LLAMA_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


def hf_tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """Megatron-LM's split of Llama-style layers: q, k, v, gate and up column-wise (whole heads per
    rank), o and down row-wise (partial sums all-reduced); embeddings, norms and head stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    inner = _inner(model)
    config = inner.config
    what = f"hf model {config.model_type} ({type(inner).__name__})"
    names = {id(m): n for n, m in model.named_modules()}
    blocks = hf_blocks(model)
    if not blocks or not all(_llama_style(b) for b in blocks):
        raise ConfigError(f"--parallel tp={tp}: dtrain has no tensor-parallel plan for {what}; it splits Llama-style layers "
                          "(self_attn.q/k/v/o_proj and mlp.gate/up/down_proj, all nn.Linear); drop tp (fsdp shards any model).")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise ConfigError(f"--parallel tp={tp}: {what} has {name}={value}, which {tp} ranks cannot split evenly; "
                              f"use a tp that divides {value}.")
    plan: dict[str, Any] = {}
    for block in blocks:
        prefix = names[id(block)]
        for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{sub}"] = ColwiseParallel()
        for sub in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{sub}"] = RowwiseParallel()
    return plan


def _llama_style(block: nn.Module) -> bool:
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    return (attn is not None and mlp is not None and all(isinstance(getattr(attn, n, None), nn.Linear) for n in LLAMA_ATTN)
            and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in LLAMA_MLP))
