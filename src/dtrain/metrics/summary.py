"""A table of a model's top-level modules and their parameter counts."""

from __future__ import annotations

from torch import nn


def model_summary(model: nn.Module) -> list[tuple[str, str, int]]:
    """(name, type, parameters) for each direct child, then a total row."""
    rows = [(name, type(child).__name__, sum(p.numel() for p in child.parameters())) for name, child in model.named_children()]
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows.append(("total", f"{type(model).__name__} ({trainable:,} trainable)", total))
    return rows


def render_summary(model: nn.Module) -> str:
    """The summary as a text table (rich's when installed)."""
    rows = model_summary(model)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(r[0]) for r in rows)
        twidth = max(len(r[1]) for r in rows)
        lines = [f"{'name':<{width}}  {'type':<{twidth}}  {'params':>12}"]
        lines += [f"{n:<{width}}  {t:<{twidth}}  {p:>12,}" for n, t, p in rows]
        return "\n".join(lines)
    table = Table(title="model")
    table.add_column("name")
    table.add_column("type")
    table.add_column("params", justify="right")
    for name, kind, params in rows:
        table.add_row(name, kind, f"{params:,}")
    console = Console(width=100, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(table)
    return console.export_text().rstrip()
