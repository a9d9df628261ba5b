"""`kvhal bench copy-kernel` refuses a backend without a copy kernel, in one line."""
from __future__ import annotations

import subprocess
import sys


def test_backend_without_kernel_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "-m", "kvhal.cli", "bench", "copy-kernel", "--backend",
                          "cpu", "--sizes", "4KiB"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == "kvhal bench copy-kernel: backend cpu has no copy kernel\n"
