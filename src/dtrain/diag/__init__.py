"""Diagnostics: the stall watchdog, the collective checker and the preflight checks of
``dtrain doctor``. They turn a silent hang or a misconfigured cluster into a clear report."""

from .tracker import Tracker
from .watchdog import STALL_EXIT, Watchdog

__all__ = ["STALL_EXIT", "Tracker", "Watchdog"]
