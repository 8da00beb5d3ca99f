"""Minimal reproduction: torchft 0.2.0's DistributedDataParallel fails an assertion in the
survivor when its peer replica group dies during the gradient all-reduce (gloo, CPU, torch 2.14.1),
instead of reporting the error to the Manager so that the step is not committed.

    python benchmarks/ft_ddp_peer_loss.py            # torchft DDP: the survivor dies (AssertionError in _comm_hook)
    python benchmarks/ft_ddp_peer_loss.py --flat     # what dtrain.ft does: Manager.allreduce on one flat buffer

Two replica groups of one process each and a Lighthouse (min 1). At step 40 replica 1 waits 1 s and
exits before its all-reduce, while replica 0 waits in the step's all-reduce, which then fails
(gloo: connection closed by peer).
With torchft's DDP, ``_ManagedWork.wait`` catches the gloo error before it sets the future chain
up, and ``DistributedDataParallel._comm_hook`` then asserts ``fut._fut`` (torchft/ddp.py): the
survivor's backward raises AssertionError. With ``Manager.allreduce(...).wait()`` the same error
is reported to the Manager, ``should_commit`` returns False and the survivor goes on alone.
Prints one line per replica; exit status 0 when the survivor finished its steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

STEPS, DIE_AT = 60, 40  # steps of 0.1 s: replica 1 is in the quorum long before step 40


def replica(rid: int, lighthouse: str, flat: bool) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1, use_async_quorum=False,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict, rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse, replica_id=str(rid),
                      hostname="127.0.0.1", timeout=timedelta(seconds=10))
    net = model if flat else DistributedDataParallel(manager, model)
    while manager.current_step() < STEPS:
        opt.zero_grad()
        manager.start_quorum()
        if rid == 1 and manager.current_step() == DIE_AT:
            time.sleep(1.0)  # replica 0 is waiting in the step's all-reduce by now
            os._exit(0)  # this replica group is lost
        net(torch.randn(8, 4)).pow(2).mean().backward()
        if flat:
            grads = [p.grad for p in model.parameters()]
            buf = torch.cat([g.flatten() for g in grads])
            manager.allreduce(buf).wait()
        if manager.should_commit():
            opt.step()
        time.sleep(0.1)
    print(f"replica {rid}: finished {manager.current_step()} steps, {manager.num_participants()} participant(s) at the end", flush=True)
    manager.shutdown(wait=False)


def main() -> int:
    flat = "--flat" in sys.argv
    if len(sys.argv) > 2 and sys.argv[1] == "replica":
        replica(int(sys.argv[2]), sys.argv[3], flat)
        return 0
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    addr = "http://127.0.0.1:" + lighthouse.address().rpartition(":")[2]
    procs = [subprocess.Popen([sys.executable, __file__, "replica", str(i), addr, *(["--flat"] if flat else [])],
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    codes = []
    for i, p in enumerate(procs):
        _, err = p.communicate(timeout=120)
        codes.append(p.returncode)
        last = [line for line in err.splitlines() if "Error" in line or "exception" in line][-1:] or ["(no error)"]
        print(f"replica {i}: exit status {p.returncode}; last error line: {last[0][:200]}")
    lighthouse.shutdown()
    return 0 if codes[0] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
