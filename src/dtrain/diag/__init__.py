"""Diagnostics: the stall watchdog, the collective checker and the all-reduce probe of
``dtrain doctor`` (whose checks live with its command, ``dtrain.cli.doctor_checks`` and ``doctor_probe``). They turn
a silent hang or a misconfigured cluster into a clear report."""

from .tracker import Tracker
from .watchdog import STALL_EXIT, Watchdog

__all__ = ["STALL_EXIT", "Tracker", "Watchdog"]
