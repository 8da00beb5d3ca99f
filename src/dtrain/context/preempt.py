"""Preemption: a signal before the time limit ends in a checkpoint and a requeued job.

    from dtrain import preempt
    preempt.install()                                   # SIGUSR1/SIGTERM now only set a flag
    preempt.register(lambda: ckpt.save(step, model=model, optimizer=opt))   # the checkpoint hook
    for step ...:
        ...
        if preempt.check(ctx):                          # collective, at a step boundary
            break                                       # hooks ran on every rank; job requeued

A signal handler only sets a flag: a checkpoint is a collective, so it must be written at the
same step on every rank, which ``check`` agrees on with one small all-reduce (any rank signalled
-> every rank stops). ``dtrain train`` checks at each log interval.

Which signal means what (sbatch scripts from ``dtrain submit`` ask for ``--signal=USR1@90``):
SIGUSR1 (SLURM's warning before the time limit, or ``scancel --signal=USR1``) -> hooks, then
``scontrol requeue``. SIGTERM -> hooks, then a requeue only while the job is still RUNNING:
``scancel`` marks it CANCELLED first, and a user's cancel must not be undone.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._log import logger
from ..world.slurm import job_state, requeue

if TYPE_CHECKING:
    from .core import Context

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_received: int = 0
_previous: dict[int, object] = {}
_callbacks: list[Callable[[], None]] = []


def _handler(signum: int, frame: object) -> None:
    global _received
    _received = _received or signum  # the first signal decides; a handler only sets a flag


def install(signals: tuple[int, ...] = SIGNALS) -> bool:
    """Catch ``signals`` from now on (main thread only; returns False elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in signals:
        if sig not in _previous:
            _previous[sig] = signal.signal(sig, _handler)
    return True


def uninstall() -> None:
    """Restore the handlers ``install`` replaced; forget the hooks and any signal received."""
    global _received
    for sig, prev in _previous.items():
        signal.signal(sig, prev)  # type: ignore[arg-type]
    _previous.clear()
    _callbacks.clear()
    _received = 0


def register(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` on every rank when ``check`` stops the job (e.g. save a checkpoint). Returns ``fn``."""
    _callbacks.append(fn)
    return fn


def unregister(fn: Callable[[], None]) -> None:
    if fn in _callbacks:
        _callbacks.remove(fn)


def received() -> int:
    """The signal this process caught (0: none)."""
    return _received


def check(ctx: Context, *, announce: bool = True) -> bool:
    """True on every rank once any rank caught a signal; then the hooks have run on every rank
    and rank 0 has asked SLURM to requeue the job. ``announce=False``: the caller says why it
    stops (an elastic job's membership change), and outside SLURM nothing is logged here.
    Collective: call on every rank."""
    flag = torch.tensor([float(_received)], device=ctx.device)
    signum = int(ctx.all_reduce(flag, op="max").item())
    if signum == 0:
        return False
    name = signal.Signals(signum).name
    if ctx.is_main and announce:
        logger.warning(f"preemption: {name} received; running {len(_callbacks)} hook(s), then stopping")
    for fn in list(_callbacks):
        fn()
    ctx.barrier()
    if ctx.is_main and (announce or ctx.world.slurm_job_id is not None):
        requeue_job(ctx.world.slurm_job_id, signum)
    return True


#: Exit status of a worker of an elastic job that saved and stopped because other ranks were
#: signalled (their node leaves): not a failure, but torch's agent restarts only workers that
#: failed, and a restart is what puts this node into the next rendezvous round without them.
REJOIN_EXIT = 75


def requeue_job(job_id: int | None, signum: int) -> bool:
    """Requeue the SLURM job after ``signum`` (see the module's rules); True when it was."""
    if job_id is None:
        logger.warning("preemption: not a SLURM job; stopped without requeue")
        return False
    if signum == signal.SIGTERM:
        state = job_state(job_id)
        if state != "RUNNING":
            logger.warning(f"preemption: job {job_id} is {state or 'in an unknown state'}; SIGTERM from a cancel or the time limit is not requeued")
            return False
    # Said before the call: a requeue ends this attempt at once, often before the call returns
    # or before a line written after it reaches the job's log.
    logger.warning(f"preemption: requeueing job {job_id} (scontrol requeue); SLURM ends this attempt and starts it again")
    done, message = requeue(job_id)
    if done:
        logger.warning(f"preemption: job {job_id} requeued")
    else:
        logger.error(f"preemption: scontrol requeue {job_id} failed: {message}; submit the job again (sbatch --requeue lets it requeue)")
    return done
