"""`dtrain bench`: the seed project's comparison as a tool. Runs one task under each method
(each in its own processes), measures the same things the same way for all, and writes
``report.md``, ``report.json`` and ``chart.png``.

``methods.METHODS`` lists what can be compared; ``runner.run_bench`` runs them;
``report`` turns the per-rank records into the report.
"""

from .methods import DEFAULT_METHODS, METHODS, Method, parse_methods

__all__ = ["DEFAULT_METHODS", "METHODS", "Method", "parse_methods"]
