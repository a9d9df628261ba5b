"""How an engine process of `kvhal.integrations.harness.vllm.runner` ends (its `serve` replaced, so no
vLLM engine starts): once `serve` returned (the engine shut down, kvhal's tiers drained), the
process exits 0 with its output flushed and without the interpreter's teardown (seconds of
vLLM's and torch's finalisation that `EngineProcess.close` would wait for); an engine that
failed still ends the usual way.
"""
from __future__ import annotations

import json
import subprocess
import sys

#: A runner process whose `serve` prints (unflushed) instead of starting an engine, with an
#: atexit handler standing for the interpreter's teardown.
SCRIPT = """
import atexit, sys
from kvhal.integrations.harness.vllm import runner
atexit.register(lambda: print("teardown ran", flush=True))
def serve(spec):
    print("served " + spec["model"], end="")
    if spec.get("fail"):
        raise RuntimeError("engine failed")
runner.serve = serve
runner.main(sys.argv[1:])
"""


def _run(tmp_path, spec: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True,
                          text=True, timeout=120)


def test_a_served_engine_exits_0_flushed_without_the_interpreter_teardown(tmp_path):
    """Fails with `main` returning after `serve` (as it did): "teardown ran" is printed."""
    out = _run(tmp_path, {"tp": 1, "model": "tiny"})
    assert (out.returncode, out.stdout) == (0, "served tiny")


def test_a_failed_engine_exits_1_the_usual_way(tmp_path):
    out = _run(tmp_path, {"tp": 1, "model": "tiny", "fail": True})
    assert (out.returncode, out.stdout) == (1, "served tinyteardown ran\n")
    assert out.stderr.rstrip().endswith("RuntimeError: engine failed")
