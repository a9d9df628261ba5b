"""Printing results: a rich table for people, JSON for machines (`--json`)."""
from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print `rows` under `columns` as a table on stdout.

    On a terminal the table fits its width; written to a file or pipe (a log, `| tee`) it is
    printed at its natural width, so no header or cell is cut to "…" (rich would assume 80
    columns there).
    """
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col[:1].isalpha() is False else "left")
    for row in rows:
        table.add_row(*(escape(f"{v:.3g}" if isinstance(v, float) else str(v)) for v in row))
    console = Console()
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update(width=1 << 16), table).maximum
        console = Console(width=max(console.width, natural))
    console.print(table)


def print_json(payload: Any) -> None:
    """Print `payload` as indented JSON on stdout."""
    json.dump(payload, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def progress(disable: bool = False):
    """A rich progress bar (transient, on stderr); disabled for `--json` runs if asked."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True, disable=disable)
