import gc
import sys

from .cli import main

if __name__ == "__main__":
    code = main()
    # The command is done: spare the exit a full collection of the heap (seconds of CPU after
    # a launch that loaded a data set), as the workers do (launch/lifecycle.py).
    gc.disable()
    gc.freeze()
    sys.exit(code)
