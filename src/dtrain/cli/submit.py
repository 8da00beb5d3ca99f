"""`dtrain submit (--slurm | --k8s) [JOB.toml] [flags] [-- COMMAND ...]`: one job description,
written as an sbatch script (and submitted) or as a Kubeflow PyTorchJob manifest."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import _check as check
from ..errors import ConfigError
from ..launch import jobspec, k8s, sbatch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a job to SLURM, or write it as a Kubernetes PyTorchJob", description=__doc__)
    _add_options(p)
    p.add_argument("job", nargs="?", default=None, help="job description (TOML)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --: dtrain train ... | script.py ...")
    p.set_defaults(func=main, _parser=p)


def _add_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--slurm", action="store_true", help="write an sbatch script and submit it with sbatch")
    where.add_argument("--k8s", action="store_true", help="write a Kubeflow PyTorchJob manifest (YAML; .json: JSON)")
    p.add_argument("--dry-run", action="store_true", help="only write the script/manifest (to stdout without --out)")
    p.add_argument("--out", default=None, help="file to write (default: NAME.sbatch / NAME.pytorchjob.yaml)")
    p.add_argument("--wait", action="store_true", help="SLURM: wait for the job to end (sbatch --wait, which may notice the end ~30 s late); exit with its status")
    g = p.add_argument_group("the job (override the JOB file)")
    g.add_argument("--name", default=None)
    g.add_argument("--nodes", default=None, metavar="N|MIN:MAX", help="nodes of the job; MIN:MAX: elastic (dtrain train --nnodes MIN:MAX)")
    g.add_argument("--procs-per-node", type=int, default=None)
    g.add_argument("--gpus-per-node", type=int, default=None)
    g.add_argument("--cpus-per-proc", type=int, default=None)
    g.add_argument("--mem-per-proc", default=None, help="e.g. 4G")
    g.add_argument("--time", default=None, help="time limit, e.g. 02:00:00")
    g.add_argument("--layout", default=None, help="node (one task per node, default) or process (one task per process)")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of the job (repeatable)")
    g.add_argument("--partition", default=None, help="SLURM partition")
    g.add_argument("--image", default=None, help="Kubernetes container image")
    g.add_argument("--dtrain-cmd", default=None, help='how to start dtrain on the cluster (default "dtrain")')


_NOT_TOML = (".yaml", ".yml", ".json", ".ini", ".cfg", ".sbatch")


def _split_command(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse hands everything after JOB to the command; the options there (up to ``--``)
    are submit's own: ``dtrain submit --slurm job.toml --dry-run -- dtrain train ...``."""
    rest = list(args.command)
    if args.job is not None and args.job.lower().endswith(_NOT_TOML):
        raise ConfigError(f"job file {args.job}: a job description is TOML (a .toml file); convert it, "
                          "or give the command after -- (e.g. dtrain submit --k8s -- dtrain train ...).")
    if args.job is not None and not args.job.endswith(".toml"):
        return None, [args.job, *rest]  # no JOB file: the command starts here, options and all
    if "--" in rest:
        own, command = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
    else:
        own, command = rest, []
    if own:
        args._parser.parse_args([*own, *([args.job] if args.job else [])], namespace=args)
    return args.job, command


def build_job(args: argparse.Namespace) -> tuple[jobspec.JobSpec, str]:
    job_file, command = _split_command(args)
    if command[:1] == ["--"]:
        command = command[1:]
    base = jobspec.load(job_file) if job_file else None
    env = {}
    for pair in args.env:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env {pair!r} is not KEY=VALUE; write e.g. --env OMP_NUM_THREADS=4.")
        env[key] = value
    overrides = dict(
        name=args.name, nodes=args.nodes, procs_per_node=args.procs_per_node, gpus_per_node=args.gpus_per_node,
        cpus_per_proc=args.cpus_per_proc, mem_per_proc=args.mem_per_proc, time=args.time, layout=args.layout,
        command=tuple(command) or None, dtrain=jobspec.split_words("--dtrain-cmd", args.dtrain_cmd) if args.dtrain_cmd else None,
        env={**(base.env if base else {}), **env} if env else None,
        slurm_partition=args.partition, k8s_image=args.image,
    )
    job = jobspec.with_overrides(base, **overrides)
    return job, job_file or ""


def main(args: argparse.Namespace) -> int:
    if args.out is not None:
        check.output_file("--out", args.out)
    job, source = build_job(args)
    if args.slurm == args.k8s:
        raise ConfigError("say where the job goes: --slurm (sbatch script) or --k8s (PyTorchJob manifest).")
    if args.slurm:
        text = sbatch.render(job, source=source)
        default_out = f"{job.name}.sbatch"
        if job.elastic:
            print(f"dtrain: note: {sbatch.ELASTIC_NOTE}.", file=sys.stderr)
    else:
        manifest = k8s.render(job)
        as_json = bool(args.out and args.out.endswith(".json"))
        text = json.dumps(manifest, indent=2) + "\n" if as_json else k8s.to_yaml(manifest)
        default_out = f"{job.name}.pytorchjob.yaml"
    if args.dry_run and not args.out:
        sys.stdout.write(text)
        return 0
    out = Path(args.out or default_out)
    check.output_file("--out", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if args.k8s or args.dry_run:
        hint = f"; apply it with: kubectl apply -f {out}" if args.k8s else ""
        print(f"dtrain: wrote {out}{hint}", file=sys.stderr)
        return 0
    job_id, status = sbatch.submit(out, wait=args.wait)
    print(job_id, flush=True)
    print(f"dtrain: submitted job {job_id} ({job.nodes_text()} node(s) x {job.procs_per_node} process(es)); script {out}", file=sys.stderr)
    return status if args.wait else 0
