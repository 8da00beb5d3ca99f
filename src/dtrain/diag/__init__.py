"""Diagnostics: the stall watchdog, the collective checker and the collectives probe of ``dtrain
doctor``; they turn a silent hang or a misconfigured cluster into a clear report."""

from .tracker import Tracker
from .watchdog import STALL_EXIT, Watchdog

__all__ = ["STALL_EXIT", "Tracker", "Watchdog"]
