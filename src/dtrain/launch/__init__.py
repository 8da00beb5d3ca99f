"""``dtrain run``: start N workers per node with torch's elastic launcher or with
``torch.multiprocessing.spawn``, one node or several."""

from .spec import LaunchSpec
from .runner import launch_function, launch_script

__all__ = ["LaunchSpec", "launch_function", "launch_script"]
