"""`kvhal.report.print_table` written to a file or pipe."""
from __future__ import annotations

from kvhal.report import print_table


def test_table_to_a_pipe_keeps_every_header_whole(capsys):
    columns = [f"column number {i}" for i in range(10)]  # ~170 columns wide, more than 80
    print_table("wide", columns, [list(range(10))])
    out = capsys.readouterr().out
    assert "…" not in out
    header = next(line for line in out.splitlines() if "column number 0" in line)
    assert all(c in header for c in columns)
