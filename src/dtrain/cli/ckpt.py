"""`dtrain ckpt ls|verify|diff|consolidate|ledger|export`: look into checkpoints, check them, compare two of them,
check a samples ledger, export an hf:PATH run's model for transformers."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from .._log import configure_cli_logging, logger
from ..checkpoint import list_checkpoints, lock, resolve, verify
from ..checkpoint.validate import read_latest_name, read_whole
from ..errors import CheckpointError, ConfigError
from ..metrics.memory import human_bytes


def _logged(func):
    """The warnings of a command (a checkpoint skipped, ``latest`` pointing nowhere) as ``dtrain: ...`` lines."""
    def run(args: argparse.Namespace) -> int:
        saved = logger.handlers[:], logger.propagate, logger.level
        configure_cli_logging(0)
        try:
            return func(args)
        finally:  # called in-process (tests, scripts): leave the logger as it was
            logger.handlers[:], logger.propagate, logger.level = saved[0], saved[1], saved[2]
    return run


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="list, verify and compare checkpoints", description=__doc__)
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ls|verify|diff|consolidate|ledger|export", parser_class=type(p))
    cmds.required = True
    ls = cmds.add_parser("ls", help="steps, sizes and validity of the checkpoints in DIR")
    ls.add_argument("dir")
    ls.set_defaults(func=_logged(cmd_ls))
    ver = cmds.add_parser("verify", help="check every checkpoint in DIR (or one) against its checksums; exit 1 if any fails")
    ver.add_argument("path")
    ver.set_defaults(func=_logged(cmd_verify))
    diff = cmds.add_parser("diff", help="compare two checkpoints tensor by tensor; exit 0 only when identical")
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument("--only", default=None, help="compare only this entry (e.g. model)")
    diff.set_defaults(func=_logged(cmd_diff))
    con = cmds.add_parser("consolidate", help="write one entry of a checkpoint (sharded or not) as a single-file plain state dict")
    con.add_argument("path", help="a checkpoint, or a checkpoint directory (its latest)")
    con.add_argument("out", help="the .pt file to write (torch.load(out) gives the state dict)")
    con.add_argument("--entry", default="model", help="what to write: model (default), optimizer, ..., or all (every entry, by name)")
    con.set_defaults(func=_logged(cmd_consolidate))
    led = cmds.add_parser("ledger", help="per epoch, the samples a --ledger run trained on: seen, duplicated, missing; exit 1 unless exactly once")
    led.add_argument("dir", help="the folder given to --ledger")
    led.set_defaults(func=_logged(cmd_ledger))
    exp = cmds.add_parser("export", help="write an hf:PATH run's checkpoint as a Hugging Face folder (config.json + safetensors)",
                          description="`dtrain ckpt export CHECKPOINT --hf DIR --config PATH`: a checkpoint of `dtrain train "
                          "--task hf:PATH`\n(any layout, sharded included) as a folder transformers loads "
                          "(`AutoModelForCausalLM.from_pretrained(DIR)`).")
    exp.add_argument("path", help="a checkpoint, or a checkpoint directory (its latest)")
    exp.add_argument("--hf", required=True, metavar="DIR", help="the folder to write (must not exist)")
    exp.add_argument("--config", required=True, metavar="PATH",
                     help="the model's folder the run trained (the PATH of --task hf:PATH): its config.json and tokenizer files are copied")
    exp.set_defaults(func=_logged(cmd_export))


def cmd_ls(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        raise ConfigError(f"{args.dir} is not a folder; give the --checkpoint-dir of a run.")
    latest, why = read_latest_name(args.dir)
    if why:
        print(f"warning: {why}")
    holder = lock.holder_of(args.dir)
    if holder is not None:
        print(f"in use by {holder.describe()}")
    ckpts = list_checkpoints(args.dir)
    if not ckpts:
        print(f"{args.dir}: no checkpoints")
        return 0
    print(f"{'step':>10}  {'size':>10}  {'status':<8}  name")
    for step, path in ckpts:
        v = verify(path)
        mark = " <- latest" if latest and os.path.abspath(latest) == os.path.abspath(path) else ""
        status = "valid" if v.ok else "INVALID"
        print(f"{step:>10}  {human_bytes(v.bytes, 1):>10}  {status:<8}  {os.path.basename(path)}{mark}" + ("" if v.ok else f"  ({v.problem})"))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0: all valid; 1: a checkpoint fails; 2: the path is no checkpoint at all."""
    path = args.path
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist; give a checkpoint folder, a --checkpoint-dir or a .pt file.")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "manifest.json")) and list_checkpoints(path):
        targets = [p for _, p in list_checkpoints(path)]
        _, why = read_latest_name(path)
        if why:
            print(f"warning: {why}; a resume uses the newest valid checkpoint")
    else:
        targets = [resolve(path)]  # raises for a folder that holds no checkpoint
        if os.path.isfile(path):
            v = verify(path, load=False)  # no torch.save archive at all: a wrong path, not a failed check
            if not v.ok:
                raise CheckpointError(f"{v.problem}; give a checkpoint folder, a --checkpoint-dir or a .pt file.")
    bad = 0
    for p in targets:
        v = verify(p)
        print(f"{'ok  ' if v.ok else 'FAIL'} {p}" + ("" if v.ok else f": {v.problem}"))
        bad += not v.ok
    return 1 if bad else 0


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)) and any(torch.is_tensor(v) or isinstance(v, (dict, list, tuple)) for v in obj):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = (read_whole(resolve(p)) for p in (args.a, args.b))
    if args.only:
        a, b = (_pick(x, args.only, p) for x, p in ((a, args.a), (b, args.b)))
    else:  # the training state's objects (model, optimizer, ...), not times or RNG
        a, b = (x.get("objects", x) if isinstance(x, dict) else x for x in (a, b))
    fa, fb = _flatten(a), _flatten(b)
    differ = 0
    for key in sorted(set(fa) | set(fb)):
        if key not in fa or key not in fb:
            print(f"{key}: only in {'A' if key in fa else 'B'}")
            differ += 1
            continue
        x, y = fa[key], fb[key]
        if torch.is_tensor(x) and torch.is_tensor(y):
            if x.shape != y.shape or x.dtype != y.dtype:
                print(f"{key}: shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
                differ += 1
            elif not torch.equal(x, y):
                d = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
                print(f"{key}: max |diff| {d:.3g}")
                differ += 1
        elif x != y:
            print(f"{key}: {x!r} vs {y!r}")
            differ += 1
    print(f"{len(set(fa) | set(fb))} entries compared: " + ("identical" if not differ else f"{differ} differ"))
    return 0 if not differ else 1


def _pick(state: Any, name: str, path: str) -> Any:
    objects = state.get("objects", state) if isinstance(state, dict) else {}
    if not isinstance(objects, dict) or name not in objects:
        raise CheckpointError(f"checkpoint {path} has no {name!r} (it holds: {', '.join(sorted(objects))}).")
    return objects[name]


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Sharded checkpoints (fsdp, hsdp, pipeline) are read whole, in this one process."""
    from .. import _check as check
    from ..checkpoint import atomic_save

    check.output_file("ckpt consolidate OUT", args.out)  # before reading a large checkpoint
    path = resolve(args.path)
    state = read_whole(path)
    objects = state.get("objects") if isinstance(state, dict) else None
    objects = dict(objects) if isinstance(objects, dict) else {}
    if not objects:
        raise CheckpointError(f"checkpoint {path} holds no entries to consolidate.")
    if args.entry != "all" and args.entry not in objects:
        raise CheckpointError(f"checkpoint {path} has no {args.entry!r} (it holds: {', '.join(sorted(objects))}); pick one with --entry.")
    out = objects if args.entry == "all" else objects[args.entry]
    atomic_save(out, args.out)
    tensors = [v for v in _flatten(out).values() if torch.is_tensor(v)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    print(f"wrote {args.out}: {args.entry} of {path}, {len(tensors)} tensors, {human_bytes(size, 1)}")
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    from ..data.ledger import check_ledger, render

    if not os.path.isdir(args.dir):
        raise ConfigError(f"{args.dir} is not a folder; give the folder passed to --ledger.")
    from ..ft.ledger import check_ft_ledger, is_ft_ledger

    if is_ft_ledger(args.dir):  # a --fault-tolerance job's: every committed step once, whichever group wrote it
        report, disagree = check_ft_ledger(args.dir)
        print(render(report) + "".join(f"\nFAIL: step {s}'s records disagree" for s in disagree[:5]))
        return 0 if report.ok and not disagree else 1
    report = check_ledger(args.dir)
    print(render(report))
    return 0 if report.ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    from ..checkpoint.hf_export import export

    done = export(args.path, args.config, args.hf)
    tok = f", tokenizer {', '.join(done.tokenizer_files)}" if done.tokenizer_files else ", no tokenizer files"
    print(f"wrote {done.path}: {done.tensors} tensors of {done.checkpoint}, config of {args.config}{tok}")
    return 0
