import gc
import os
import sys

# torch's C++ warnings (a store client's every retry, with a C++ stack; "the hostname of the client
# socket cannot be retrieved") buried dtrain's one-line reasons; set before torch loads, inherited
# by the workers. -v/--verbose or the user's own TORCH_CPP_LOG_LEVEL keeps them.
if not {"-v", "--verbose"} & set(sys.argv[1:]):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from .cli import main  # noqa: E402 -- after the environment above

if __name__ == "__main__":
    code = main()
    # The command is done: spare the exit a full collection of the heap (seconds of CPU after
    # a launch that loaded a data set), as the workers do (launch/lifecycle.py).
    gc.disable()
    gc.freeze()
    sys.exit(code)
