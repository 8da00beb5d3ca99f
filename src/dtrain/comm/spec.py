"""What ``--comm`` asks for, parsed once from its string into a frozen value."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

KINDS = ("none", "fp16", "bf16", "powersgd", "localsgd", "auto")
CHOICES = "none, fp16, bf16, powersgd[:RANK], localsgd[:H], auto"
DEFAULT_WARMUP = 10
AUTO_WARMUP = 8


@dataclass(frozen=True, kw_only=True)
class CommSpec:
    kind: str = "none"
    """none: all-reduce every step; fp16/bf16: all-reduce compressed to 16 bits; powersgd:
    low-rank compression with error feedback; localsgd: local steps, parameters averaged every
    ``period`` steps; auto: measure the link, then pick one of these."""
    rank: int = 2
    """PowerSGD's matrix approximation rank (``powersgd:RANK``)."""
    period: int = 16
    """Local SGD: steps between parameter averages (``localsgd:H``)."""
    warmup: int | None = None
    """Plain all-reduce steps before compression or local steps start; None: 10. For auto, the
    steps it measures during (default 8)."""

    def __post_init__(self) -> None:
        if self.warmup is None:
            object.__setattr__(self, "warmup", AUTO_WARMUP if self.kind == "auto" else DEFAULT_WARMUP)
        if self.kind not in KINDS:
            raise ConfigError(f"unknown --comm {self.kind!r}; choose one of: {CHOICES}.")
        if self.rank < 1:
            raise ConfigError(f"--comm powersgd:{self.rank}: the rank must be an integer >= 1 (e.g. powersgd:2).")
        if self.period < 1:
            raise ConfigError(f"--comm localsgd:{self.period}: the period H must be an integer >= 1 (e.g. localsgd:16).")
        if self.warmup < 0:
            raise ConfigError(f"--comm-warmup must be >= 0 steps, got {self.warmup}.")
        # DDP rebuilds its buckets after the first step, and PowerSGD keys its error feedback by
        # bucket: torch's PowerSGDState insists on at least 2 plain steps.
        if self.kind == "powersgd" and self.warmup < 2:
            raise ConfigError(f"--comm-warmup {self.warmup} is too short for powersgd (DDP settles its buckets in the first steps); use >= 2.")
        if self.kind == "auto" and self.warmup < 4:
            raise ConfigError(f"--comm-warmup {self.warmup} is too short for auto (it measures during the warm-up); use >= 4.")

    @classmethod
    def parse(cls, text: str | CommSpec | None, *, warmup: int | None = None) -> CommSpec:
        """``none``, ``fp16``, ``bf16``, ``powersgd[:RANK]``, ``localsgd[:H]`` or ``auto``."""
        if isinstance(text, CommSpec):
            return text if warmup is None else cls(kind=text.kind, rank=text.rank, period=text.period, warmup=warmup)
        extra = {} if warmup is None else {"warmup": warmup}
        kind, sep, arg = (text or "none").strip().lower().partition(":")
        if kind not in KINDS:
            raise ConfigError(f"unknown --comm {text!r}; choose one of: {CHOICES}.")
        if not sep:
            return cls(kind=kind, **extra)
        if kind == "powersgd":
            return cls(kind=kind, rank=_positive(arg, text, "the rank", "powersgd:2"), **extra)
        if kind == "localsgd":
            return cls(kind=kind, period=_positive(arg, text, "the period H", "localsgd:16"), **extra)
        raise ConfigError(f"--comm {kind} takes no argument, got {text!r}; write --comm {kind}.")

    def __str__(self) -> str:
        if self.kind == "powersgd":
            return f"powersgd:{self.rank}"
        if self.kind == "localsgd":
            return f"localsgd:{self.period}"
        return self.kind


def _positive(arg: str, text: str, what: str, example: str) -> int:
    try:
        value = int(arg)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"--comm {text}: {what} must be an integer >= 1 (e.g. {example}).")
    return value
