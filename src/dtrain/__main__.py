import gc
import os
import sys

# torch's C++ warnings (a store client's every retry, with a C++ stack; "the hostname of the client
# socket cannot be retrieved") buried dtrain's one-line reasons; set before torch loads, inherited
# by the workers. -v/--verbose or the user's own TORCH_CPP_LOG_LEVEL keeps them.
if not {"-v", "--verbose"} & set(sys.argv[1:]):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from .cli import main  # noqa: E402 -- after the environment above


def _leave(code: int) -> None:
    """Exit after a process that trained in a process group (srun or torchrun tasks): Python's exit
    hooks run (the checkpoint folder's lock is released), then the process leaves without the
    interpreter's finalization, where destroying the groups dtrain keeps (world/group.py) can
    abort a finished task ("terminate called without an active exception")."""
    import atexit

    run_hooks = getattr(atexit, "_run_exitfuncs", None)
    if run_hooks is None:
        sys.exit(code)
    run_hooks()
    from .launch.lifecycle import exit_now  # flush, then os._exit

    exit_now(code)


if __name__ == "__main__":
    code = main()
    # The command is done: spare the exit a full collection of the heap (seconds of CPU after
    # a launch that loaded a data set), as the workers do (launch/lifecycle.py).
    gc.disable()
    gc.freeze()
    group = sys.modules.get("dtrain.world.group")
    if group is not None and getattr(group, "_left_groups", None):
        _leave(code)
    sys.exit(code)
