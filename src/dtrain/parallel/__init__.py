"""Parallelisms that compose: one ``ParallelDims`` value says how ranks split and builds the one
``DeviceMesh``; ``apply.parallelize`` applies each parallelism in one fixed order, for every
strategy (each a ``ParallelDims`` preset) and every ``--parallel`` layout."""

from .dims import DIMS, ParallelDims, parse, resolve

__all__ = ["DIMS", "ParallelDims", "parse", "resolve"]
