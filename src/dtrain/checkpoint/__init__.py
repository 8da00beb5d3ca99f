"""Checkpoint storage: atomic writes, safe loads."""

from .io import atomic_save, safe_load

__all__ = ["atomic_save", "safe_load"]
