"""`scripts/gpu_check.sh` as the device machine will run it, checked where no GPU is: it
parses, and its steps' timeouts fit the 9 minutes a lent GPU machine gives one command."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
#: 9 minutes, less a minute for the machine's start and the transfers of the tree and $OUT.
BUDGET_S = 480 + 30


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert (out.returncode, out.stderr) == (0, "")


def test_every_step_is_timed_and_the_timeouts_fit_the_budget():
    text = SCRIPT.read_text()
    commands = [line.strip() for line in text.splitlines()
                if re.search(r'"\$PY"|\$\{PYTEST\[@\]\}|nvidia-smi|bash -c', line)
                and not line.lstrip().startswith(("#", "site=", "own=", "PYTEST="))]
    assert len(commands) >= 10
    assert [c for c in commands if "timeout " not in c] == []
    assert sum(int(n) for n in re.findall(r"\btimeout (\d+)\b", text)) <= BUDGET_S
