"""Parallelisms that compose: one ``ParallelDims`` value says how ranks split, builds the one
``DeviceMesh``, and ``compose`` applies each parallelism in a fixed order (see ``apply``)."""

from .dims import DIMS, ParallelDims, parse, resolve

__all__ = ["DIMS", "ParallelDims", "parse", "resolve"]
