"""Printing results: a rich table for people, JSON for machines (`--json`)."""
from __future__ import annotations

import json
import sys
import time
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
    """Progress of a long command on stderr, disabled for `--json` runs if asked: a rich
    progress bar (transient) on a terminal; elsewhere (a log, a pipe, CI), where rich draws
    nothing until the end, one line per change of task and at most one per
    `LineProgress.EVERY_S` seconds while a task advances."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not disable and not console.is_terminal:
        return LineProgress(sys.stderr)
    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=disable)


class LineProgress:
    """The subset of `rich.progress.Progress` the commands use (context manager, `add_task`,
    `update`, `advance`, `remove_task`), printing plain lines `"[12 s] description: 3/40"`
    to `stream`."""

    #: Least seconds between two lines of one task that only advanced.
    EVERY_S = 10.0

    def __init__(self, stream) -> None:
        self._stream = stream
        self._tasks: list[dict[str, Any]] = []
        self._start = time.monotonic()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        """Start a task; returns its id."""
        self._tasks.append({"description": description, "total": total, "completed": 0,
                            "printed": 0.0})
        self._print(len(self._tasks) - 1)
        return len(self._tasks) - 1

    def update(self, task: int, *, description: str | None = None, total: float | None = None,
               completed: float | None = None, advance: float = 0, **_) -> None:
        """Change a task's description, total or completed count (as rich's `update`)."""
        state = self._tasks[task]
        changed = description is not None and description != state["description"]
        for key, value in (("description", description), ("total", total),
                           ("completed", completed)):
            if value is not None:
                state[key] = value
        state["completed"] += advance
        self._print(task, force=changed)

    def advance(self, task: int, advance: float = 1) -> None:
        """Advance a task by `advance` steps."""
        self.update(task, advance=advance)

    def remove_task(self, task: int) -> None:
        """End a task (rich removes its bar; a line was printed when it finished)."""

    def _print(self, task: int, force: bool = True) -> None:
        state, now = self._tasks[task], time.monotonic()
        done = state["total"] is not None and state["completed"] >= state["total"]
        if not (force or done or now - state["printed"] >= self.EVERY_S):
            return
        state["printed"] = now
        count = (f": {state['completed']:g}/{state['total']:g}" if state["total"] is not None
                 else "")
        self._stream.write(f"[{now - self._start:.0f} s] {state['description']}{count}\n")
        self._stream.flush()
