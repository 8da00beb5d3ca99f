"""Pure meters, a model summary, and where figures go (progress display, JSON lines)."""

from .meters import DataWait
from .sinks import JsonlSink, ProgressSink
from .summary import model_summary, render_summary

__all__ = ["DataWait", "JsonlSink", "ProgressSink", "model_summary", "render_summary"]
