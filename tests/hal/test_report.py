"""`kvhal.report`: tables and progress written to a file or pipe."""
from __future__ import annotations

import sys

from kvhal.report import print_table


def test_table_to_a_pipe_keeps_every_header_whole(capsys):
    columns = [f"column number {i}" for i in range(10)]  # ~170 columns wide, more than 80
    print_table("wide", columns, [list(range(10))])
    out = capsys.readouterr().out
    assert "…" not in out
    header = next(line for line in out.splitlines() if "column number 0" in line)
    assert all(c in header for c in columns)


def test_progress_off_a_terminal_prints_lines_a_log_can_show(capsys, monkeypatch):
    from kvhal import report

    bar = report.progress()  # pytest's stderr is not a terminal
    assert isinstance(bar, report.LineProgress)
    times = iter([0.0, 0.0, 1.0, 2.0, 12.5, 13.0])
    monkeypatch.setattr(report.time, "monotonic", lambda: next(times))
    bar = report.LineProgress(sys.stderr)
    with bar:
        task = bar.add_task("starting", total=None)
        bar.update(task, description="serving", total=3, completed=0)
        bar.advance(task)          # 2.0 s: within EVERY_S of the last line, not printed
        bar.advance(task)          # 12.5 s: printed
        bar.advance(task)          # 13.0 s: done, printed
    assert capsys.readouterr().err.splitlines() == [
        "[0 s] starting", "[1 s] serving: 0/3", "[12 s] serving: 2/3", "[13 s] serving: 3/3"]
