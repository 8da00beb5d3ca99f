"""``python -m tests.support.netbed``: a bed of N hosts from the shell, a command run on every
host with ``{node_rank}``, ``{master_addr}``, ``{host_addr}`` and ``{hosts}`` filled in (see
``netbed``'s docstring)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from .netbed import Link, NetBed, NetBedUnavailable
from .netbed import __doc__ as _BED_DOC


def _link_arg(text: str) -> tuple[int, Link]:
    """``HOST:RATE_MBIT[:DELAY_MS]`` (``--link 2:20``, ``--link 1:100:5``)."""
    parts = text.split(":")
    try:
        host = int(parts[0])
        rate = float(parts[1]) if len(parts) > 1 and parts[1] else None
        delay = float(parts[2]) if len(parts) > 2 and parts[2] else None
        if len(parts) > 3 or host < 0:
            raise ValueError
        return host, Link(rate_mbit=rate, delay_ms=delay)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"--link {text!r} is not HOST:RATE_MBIT[:DELAY_MS] with a rate > 0, e.g. 2:20") from None


def main(argv: Sequence[str] | None = None) -> int:
    from dtrain._check import Parser  # one-line usage errors, exit 2, as the dtrain command

    parser = Parser(prog="python -m tests.support.netbed", description=_BED_DOC.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (namespaces) on the bridge (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="every host's link rate in Mbit/s (tbf; default: unshaped)")
    parser.add_argument("--delay-ms", type=float, default=None, help="delay on what each host sends (netem, or where the kernel has none the bed's user-space delay line)")
    parser.add_argument("--link", type=_link_arg, action="append", default=[], metavar="HOST:RATE[:DELAY]",
                        help="one host's own link (repeatable), e.g. --link 2:20 for host 2 at 20 Mbit/s")
    parser.add_argument("--shared-name", default=None, metavar="NAME",
                        help="every host has this host name, resolving to 127.0.0.1 on each (as on many Debian/Ubuntu "
                             "images and containers); default: each host its own name n<i>")
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill every node after this many seconds")
    parser.add_argument("--check", action="store_true", help="only say whether a bed can be built here, and whether netem exists")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- COMMAND with {node_rank}, {master_addr}, {host_addr} and {hosts}")
    args = parser.parse_args(argv)
    for flag, value in (("--rate-mbit", args.rate_mbit), ("--delay-ms", args.delay_ms), ("--timeout", args.timeout)):
        if value is not None and not (math.isfinite(value) and (value > 0 or flag == "--delay-ms" and value == 0)):
            parser.error(f"{flag} must be a finite number > 0, got {value:g}")
    if not 1 <= args.hosts <= 250:
        parser.error(f"--hosts must be 1..250, got {args.hosts}")
    bad = [h for h, _ in args.link if h >= args.hosts]
    if bad:
        parser.error(f"--link names host {bad[0]}, but --hosts {args.hosts} has hosts 0..{args.hosts - 1}")
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        with NetBed(hosts=args.hosts, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms, links=dict(args.link),
                    shared_name=args.shared_name) as bed:
            shaped = ", ".join(f"{n} {a} {f'{lk.rate_mbit:g} Mbit/s' if lk.rate_mbit else 'unshaped'}"
                               + (f" +{lk.delay_ms:g} ms" if lk.delay_ms else "") for n, a, lk in zip(bed.names, bed.addresses, bed.links))
            print(f"netbed: {bed.hosts} hosts on a bridge: {shaped}; netem "
                  f"{'available' if bed.netem else 'not in this kernel'}"
                  + ("; delays by the user-space delay line" if bed.delay_line else ""), flush=True)
            if args.check or not cmd:
                return 0
            outs = bed.run_nodes(lambda r, m: [a.format(node_rank=r, master_addr=m, host_addr=bed.addresses[r], hosts=bed.hosts)
                                               for a in cmd], timeout=args.timeout)
    except NetBedUnavailable as exc:
        print(f"dtrain: error: netbed: {exc}.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("netbed: interrupted; the bed was removed.", file=sys.stderr)
        return 130
    for o in outs:
        status = "timed out" if o.returncode is None else f"exit {o.returncode}"
        print(f"--- node {o.node_rank} ({status}) ---\n{o.output.rstrip()}", flush=True)
    return max((1 if o.returncode is None else abs(o.returncode)) for o in outs)
