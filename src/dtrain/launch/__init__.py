"""``dtrain run``: start N workers per node with torch's elastic launcher or with
``torch.multiprocessing.spawn``, one node or several."""

from .runner import launch_function, launch_script
from .spec import LaunchSpec

__all__ = ["LaunchSpec", "launch_function", "launch_script"]
