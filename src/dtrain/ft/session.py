"""One replica group's link to the job: torchft's Manager, asked for a quorum before each step,
the gradients averaged over it, its commit vote after (``dtrain.train.ft_replica`` and
``dtrain.context.replicas`` use it). The caller owns the state a peer heals from; the quorum is
synchronous (the step's samples depend on who is in it), so healing happens inside ``quorum()``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._log import logger
from ..errors import ConfigError, DtrainError
from .spec import FaultTolerance, FaultToleranceStopped, require_torchft

CONNECT_TIMEOUT = timedelta(seconds=10)
"""How long a replica group tries to reach the Lighthouse when it starts."""


def quiet_torchft() -> None:
    """What torchft prints on its own, kept to what a user needs (call before torchft loads)."""
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft loads: else its servers log every quorum
    # torchft logs a failed all-reduce with its traceback; the loop says it in one line instead.
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # torch's loader of a peer's state (torchft's HTTP transport) warns that its buffer is read-only.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


class Session:
    """A replica group's torchft Manager (see the module's docstring)."""

    def __init__(self, ft: FaultTolerance, *, replica_id: str, lighthouse: str, host: str,
                 state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None],
                 group: tuple[int, int, int] | None = None) -> None:
        """``group``: (this process's rank in its replica group, the group's size, the port of the
        group's store at ``host``; ``dtrain.ft.group``); None: a group of this one process."""
        require_torchft()
        from torch.distributed import TCPStore

        from .process_group import QuorumGroup, QuorumManager

        self.ft, self.replica_id, self.lighthouse = ft, replica_id, lighthouse
        self.healed: list[int] = []
        """The steps this group healed to from a peer (step 0: the initial sync of a fresh job)."""
        self._load = load_state_dict
        step_timeout = timedelta(seconds=ft.step_timeout_s)
        rank, size, port = group or (0, 1, 0)
        if group is None:
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this group's own store
            port = self._store.port
        try:
            self.manager: Any = QuorumManager(
                pg=QuorumGroup(connect=timedelta(seconds=ft.connect_s), step=step_timeout), load_state_dict=self._healed, state_dict=state_dict,
                min_replica_size=ft.min_replicas,
                # the quorum (and any healing) before the step: the step's samples depend on it
                use_async_quorum=False, rank=rank, world_size=size, store_addr=host, store_port=port,
                lighthouse_addr=lighthouse, replica_id=replica_id, hostname=host, timeout=step_timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=CONNECT_TIMEOUT,
                checkpoint_transport=_transport(host, step_timeout))
        except RuntimeError as exc:  # torchft's server could not reach the Lighthouse
            reason = str(exc).rsplit(": ", 1)[-1].strip()[:80]
            raise ConfigError(f"cannot reach the Lighthouse at {lighthouse} within {CONNECT_TIMEOUT.seconds} s ({reason}); "
                              "check --lighthouse (or --master-addr), and that node 0's job is up.") from None

    def _healed(self, state: dict[str, Any]) -> None:
        self._load(state)
        self.healed.append(self.manager.current_step())  # torchft set the step before it hands us the state

    @property
    def step(self) -> int:
        """Committed steps so far (the same on every replica group of the quorum)."""
        return self.manager.current_step()

    def quorum(self, before_stop: Callable[[int], str] = lambda step: "") -> tuple[int, int]:
        """The quorum of the next step (and healing, if this group is behind): (our rank, participants).
        No quorum: ``before_stop(step)`` (a checkpoint; it returns what to add to the line), then
        FaultToleranceStopped."""
        try:
            self.manager.start_quorum()
            rank, participants = self.manager.participating_rank(), self.manager.num_participants()
        except DtrainError:  # our own load_state_dict's line (a peer's state that does not fit)
            raise
        except Exception as exc:  # torchft raises what its RPC raised: a timeout, a refused connection
            step = self.manager.current_step()
            saved = before_stop(step)
            raise FaultToleranceStopped(
                f"no quorum within {self.ft.quorum_timeout_s:g} s at step {step} (the Lighthouse is gone, or fewer than "
                f"min={self.ft.min_replicas} replica group(s) are up: {str(exc).splitlines()[0][:160]}){saved}; "
                "restart the job (with --resume to continue from the checkpoints).") from None
        if rank is None:
            raise FaultToleranceStopped("this replica group is not a participant of its quorum (a spare); "
                                        "spares are not supported yet.")
        return rank, participants

    def average_gradients(self, params: Iterable[torch.nn.Parameter], buffers: Iterable[torch.Tensor] = ()) -> None:
        average_gradients(self.manager, params, buffers)

    def should_commit(self, participants: int) -> bool:
        """torchft's vote: True when every participant finished the step; else one warning line."""
        if self.manager.should_commit():
            return True
        error = self.manager.errored()
        why = (str(error.original_exception).strip().splitlines() or ["?"])[0][:160] if error is not None else (
            f"{participants} replica group(s), fewer than min={self.ft.min_replicas}")
        logger.warning(f"replica group {self.replica_id}: step {self.manager.current_step() + 1} not committed ({why}); "
                       "the next quorum takes its samples again")
        return False

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def first_quorum(session: Any, ft: FaultTolerance, restarted: bool,
                 before_stop: Callable[[int], str] = lambda step: "") -> tuple[tuple[int, int], bool]:
    """``session``'s first quorum, and whether this group is alone there with no peer: restarted by
    its launcher, alone and healed by nobody, the others finished or died while it started. It asks
    again for up to ``timeout`` first (a peer in a long step or save misses a quorum)."""
    tries = max(1, int(ft.quorum_timeout_s / (ft.join_s / 2)))  # a count: a group's processes agree
    for _ in range(tries):
        joined = session.quorum(before_stop)
        if not restarted or joined[1] > 1 or session.healed:
            return joined, False
        time.sleep(ft.join_s / 2)  # within the Lighthouse's join wait: a peer's next quorum takes us in
    return joined, True


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state as a peer heals from it: copies, since torchft's transport serves it while
    this group's next forward already changes buffers in place (BatchNorm's statistics); parameters
    and the optimizer's state only change after the vote, which waits for the healing peer."""
    return {k: _local(v).detach().clone() for k, v in module.state_dict().items()}


def load_snapshot(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A peer's ``snapshot`` into ``module``. A sharded module (FSDP) takes it shard by shard: the
    peer is the other group's process of the same rank, which holds the same slices."""
    own = module.state_dict()
    if not any(_local(v) is not v for v in own.values()):
        module.load_state_dict(state)
        return
    if own.keys() != state.keys():
        raise ConfigError(f"a peer's model state has other entries than this model ({sorted(set(own) ^ set(state))[:4]}); "
                          "start every replica group with the same task and model.")
    with torch.no_grad():
        for key, value in own.items():
            _local(value).copy_(state[key])


def model_digest(model: torch.nn.Module) -> str:
    """A digest of the model's parameters and buffers (under FSDP: this process's shards): equal
    on every group of a job whose heals carried the whole state."""
    import hashlib

    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        local = _local(value)
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each sharded tensor (a DTensor under FSDP) as this process's shard."""
    state = optimizer.state_dict()
    return {**state, "state": {i: {k: _local(v) for k, v in s.items()} for i, s in state["state"].items()}}


def load_optimizer_snapshot(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A peer's ``optimizer_snapshot``: loaded, then each shard made a DTensor again like its parameter
    (the optimizer's step on a sharded parameter takes sharded state)."""
    optimizer.load_state_dict(state)
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # dtrain's forwarding wrappers
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _local(p) is p:
                continue
            from torch.distributed.tensor import DTensor

            per_param = optimizer.state.get(p, {})
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and _local(value) is value and value.dim() and value.shape == _local(p).shape:
                    per_param[key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                        shape=p.shape, stride=p.stride())


def _local(t: Any) -> Any:
    """This process's shard of a DTensor (the same memory); anything else as it is."""
    return getattr(t, "_local_tensor", t)


def average_gradients(manager: Any, params: Iterable[torch.nn.Parameter], buffers: Iterable[torch.Tensor] = ()) -> None:
    """The gradients averaged over the quorum by torchft's fault-tolerant all-reduce, as one flat
    buffer; a failed one (a peer lost mid-step) is reported to the manager, so the step is not
    committed (torchft 0.2.0's DDP fails an assertion there instead: benchmarks/ft_ddp_peer_loss.py).
    The floating-point ``buffers`` (BatchNorm's statistics) are averaged in the same buffer, or the
    groups' models would drift apart in them."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:  # unused this step: every group must still send the same buffer
            p.grad = torch.zeros_like(p)
    # A sharded gradient (FSDP inside the group): this process's shard, already averaged over its
    # group; it is averaged with the other groups' same shard (their process of the same rank).
    grads = [_local(p.grad) for p in params] + [_local(b) for b in buffers if b.is_floating_point()]
    flat = _flatten_dense_tensors(grads)
    manager.allreduce(flat).wait()
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (a healing peer fetches this group's state from it),
    advertised at ``host``: torchft's own advertises ``socket.gethostname()``, which on hosts that
    share one name (or whose name resolves to loopback) sends the peer to itself."""
    from torchft.checkpointing import HTTPTransport

    class _AtHost(HTTPTransport):
        def address(self) -> str:
            return f"http://{_url_host(host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return _AtHost(timeout=timeout, num_chunks=0)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
