"""`dtrain bench`: one task under each method (each in its own processes), measured the same way
for all, written as ``report.md``, ``report.json`` and ``chart.png``."""

from .methods import DEFAULT_METHODS, METHODS, Method, parse_methods

__all__ = ["DEFAULT_METHODS", "METHODS", "Method", "parse_methods"]
