"""dtrain's version, in a module of its own so the ground (``world``) can read it without
importing the package root."""

__version__ = "0.1.0"
