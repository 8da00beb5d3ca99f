"""`dtrain ckpt export CHECKPOINT --hf DIR --config PATH`: a checkpoint of `dtrain train --task hf:PATH`
(any layout, sharded included) as a folder transformers loads (`AutoModelForCausalLM.from_pretrained(DIR)`)."""

from __future__ import annotations

import argparse


def add_parser(cmds: argparse._SubParsersAction, logged) -> None:
    exp = cmds.add_parser("export", help="write an hf:PATH run's checkpoint as a Hugging Face folder (config.json + safetensors)",
                          description=__doc__)
    exp.add_argument("path", help="a checkpoint, or a checkpoint directory (its latest)")
    exp.add_argument("--hf", required=True, metavar="DIR", help="the folder to write (must not exist)")
    exp.add_argument("--config", required=True, metavar="PATH",
                     help="the model's folder the run trained (the PATH of --task hf:PATH): its config.json and tokenizer files are copied")
    exp.set_defaults(func=logged(cmd_export))


def cmd_export(args: argparse.Namespace) -> int:
    from ..checkpoint.hf_export import export

    done = export(args.path, args.config, args.hf)
    tok = f", tokenizer {', '.join(done.tokenizer_files)}" if done.tokenizer_files else ", no tokenizer files"
    print(f"wrote {done.path}: {done.tensors} tensors of {done.checkpoint}, config of {args.config}{tok}")
    return 0
