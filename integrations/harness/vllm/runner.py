"""Real vLLM engines in fresh processes, driven step by step (the demo, the benchmark, tests).

vLLM keeps process-global state, so every engine runs in its own process
(`python -m kvhal.integrations.harness.vllm.runner SPEC.json`, `EngineProcess`): it starts the engine,
then runs steps sent as JSON lines on stdin and answers each on stdout. Two engines can be
alive at once, so the demo alternates their requests and both see the same machine load.

Scenario (`run_scenario`): {"tp": int, "model": "tiny" | "demo" | "tiny-swa" | "tiny-mla" |
           "tiny-hybrid", "model_dir"?: checkpoint folder (instead of "model"),
           "served_model_name"?: str, "max_lora_rank"?: int (enables LoRA),
           "num_blocks": int | null, "kv_cache_dtype"?: str (vLLM's, "auto"),
           "mamba_ssm_cache_dtype"?: str (vLLM's, "auto"), "max_num_batched_tokens"?: int,
           "max_num_seqs"?: int (vLLM's, its defaults),
           "max_model_len": int, "engines": [{"kvhal": null | {kvhal config},
           "connector_module_path"?: str, "steps": [...]}]}
Steps ("op"):
    "generate": {"prompts": {name: [token ids]}, "max_tokens": int, "cache_salt"?: str,
                 "kv_transfer_params"?: {...}, "lora"?: {"name", "id", "path"},
                 "prompt_logprobs"?: int}
        → {name: `engine.Completion` fields, "wall_s": seconds of the whole call}
    "reset": {"connector"?: bool}: vLLM's `reset_prefix_cache()`; kvhal keeps its tiers, and
        its host tier too unless "connector" (then only the secondary tiers keep theirs) → null
    "drop_page_cache": {"root": folder}: evict every file under it from the OS page cache
        (`kvhal.integrations.harness.bench.tier.drop_page_cache`, so fs-tier reads hit the disk) → null
Extra ops (e.g. the tests' fault injection) register in `OPS` before `run` is called.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvhal.integrations.harness.bench.tier import drop_page_cache

from .engine import engine_env, generate, make_llm, shutdown
from .model import DEMO, TINY, TINY_HYBRID, TINY_MLA, TINY_SWA, build_model

MODELS = {"tiny": TINY, "demo": DEMO, "tiny-swa": TINY_SWA, "tiny-mla": TINY_MLA,
          "tiny-hybrid": TINY_HYBRID}


class ScenarioError(RuntimeError):
    """The engine process failed; the message carries the tail of its stderr."""


def _generate(llm: Any, step: dict) -> dict:
    names = list(step["prompts"])
    start = time.perf_counter()
    done = generate(llm, [step["prompts"][n] for n in names], step["max_tokens"],
                    step.get("cache_salt"), step.get("kv_transfer_params"), step.get("lora"),
                    step.get("prompt_logprobs"))
    wall = time.perf_counter() - start
    return {**{n: dataclasses.asdict(c) for n, c in zip(names, done)}, "wall_s": wall}


def _reset(llm: Any, step: dict) -> None:
    if not llm.reset_prefix_cache(reset_connector=step.get("connector", False)):
        raise ScenarioError("vLLM refused reset_prefix_cache()")


def _drop_page_cache(llm: Any, step: dict) -> None:
    drop_page_cache(step["root"])


OPS: dict[str, Callable[[Any, dict], Any]] = {
    "generate": _generate,
    "reset": _reset,
    "drop_page_cache": _drop_page_cache,
}


#: Prefix of the one stdout line that carries a step's result (vLLM logs to stdout too).
RESULT = "KVHAL-RESULT "


def serve(spec: dict) -> None:
    """Start one engine from `spec` ({"tp", "model" or "model_dir", "num_blocks",
    "max_model_len", "kvhal", "connector_module_path"?, "kv_cache_dtype"?,
    "mamba_ssm_cache_dtype"?, "served_model_name"?, "max_lora_rank"?, "max_num_batched_tokens"?,
    "max_num_seqs"?}), then run steps
    read as JSON lines from stdin, answering each with one `RESULT` line on stdout, until stdin
    closes."""
    model = spec.get("model_dir") or build_model(MODELS[spec.get("model", "tiny")])
    llm = make_llm(model, tp=spec["tp"], kvhal_config=spec["kvhal"],
                   connector_module_path=spec.get("connector_module_path"),
                   num_blocks=spec.get("num_blocks"), max_model_len=spec.get("max_model_len", 4096),
                   kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                   mamba_ssm_cache_dtype=spec.get("mamba_ssm_cache_dtype", "auto"),
                   served_model_name=spec.get("served_model_name"),
                   max_lora_rank=spec.get("max_lora_rank"),
                   max_num_batched_tokens=spec.get("max_num_batched_tokens"),
                   max_num_seqs=spec.get("max_num_seqs"))
    print(RESULT + json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            step = json.loads(line)
            print(RESULT + json.dumps(OPS[step["op"]](llm, step)), flush=True)
    finally:
        shutdown(llm)


class EngineProcess:
    """One engine in a fresh process (`serve`), driven step by step.

    Several can run side by side so that their requests alternate and share the machine's
    conditions. Use as a context manager; `close` shuts the engine down.

    Args:
        spec: As `serve` takes it.
        workdir: Folder for the spec file.
        name: Names the spec file and the process in errors.
        command: The runner command line before its argument (callers that register extra
            `OPS` run their own script that calls `main`).

    Raises:
        ScenarioError: the process died (the tail of its stderr is in the message).
    """

    def __init__(self, spec: dict, *, workdir: Path, name: str,
                 command: Sequence[str] = (sys.executable, "-m", __name__)):
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(spec))
        self.name = name
        self._stderr = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([*command, str(path)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    @property
    def pid(self) -> int:
        """Process id of the engine process (TP=1: the process that runs kvhal's tiers)."""
        return self._proc.pid

    def wait_ready(self) -> None:
        """Block until the engine has started."""
        self._read()

    def send(self, step: dict) -> None:
        """Start one step without waiting for it; `result` returns what it answers."""
        self._proc.stdin.write(json.dumps(step) + "\n")
        self._proc.stdin.flush()

    def result(self) -> Any:
        """The answer of the step `send` started (blocks until it is there)."""
        return self._read()

    def step(self, step: dict) -> Any:
        """Run one step (see the module docstring) and return its result."""
        self.send(step)
        return self.result()

    def _read(self) -> Any:
        for line in self._proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        self._proc.wait()
        self._stderr.seek(0)
        raise ScenarioError(f"engine process {self.name!r} exited with "
                            f"{self._proc.returncode}: {self._stderr.read()[-3000:]}")

    def close(self) -> None:
        """Close stdin so the engine shuts down (kvhal drains its tiers); wait for the exit.

        Raises:
            ScenarioError: the process exited with an error.
        """
        if self._stderr.closed:  # killed
            return
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        code = self._proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-3000:]
        self._stderr.close()
        if code != 0:
            raise ScenarioError(f"engine process {self.name!r} exited with {code}: {tail}")

    def kill(self) -> None:
        """SIGKILL the engine process (a crashed instance) and reap it. Idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for f in (self._proc.stdin, self._proc.stdout, self._stderr):
            if not f.closed:
                f.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_scenario(scenario: dict, *, workdir: Path, name: str,
                 on_step: Callable[[], None] | None = None,
                 command: Sequence[str] = (sys.executable, "-m", __name__)) -> list[list]:
    """Run every engine of `scenario` in turn, each in a fresh process; return per-engine
    step results.

    Args:
        workdir: Folder for the spec files.
        on_step: Called after each finished step (drives a progress bar).
        command: As `EngineProcess` takes it.

    Raises:
        ScenarioError: an engine process failed.
    """
    results = []
    common = {k: v for k, v in scenario.items() if k != "engines"}
    for i, engine in enumerate(scenario["engines"]):
        spec = {**common, **{k: v for k, v in engine.items() if k != "steps"}}
        with EngineProcess(spec, workdir=workdir,
                           name=f"{name}-{i}", command=command) as proc:
            proc.wait_ready()
            steps = []
            for step in engine["steps"]:
                steps.append(proc.step(step))
                if on_step is not None:
                    on_step()
        results.append(steps)
    return results


def main(argv: list[str]) -> None:
    """`python -m kvhal.integrations.harness.vllm.runner SPEC.json`: serve one engine (see `serve`).

    Once `serve` returned (the engine shut down, kvhal's tiers drained and its region freed),
    the process ends without the interpreter's teardown: with vLLM and torch loaded that is
    seconds of C-level finalisation (measured under load: 2-3 s per TP=1 engine, ~6 s at
    TP=2, no Python frame running) that `EngineProcess.close` would wait for. An exception
    from `serve` still ends the process the usual way (traceback, exit status 1)."""
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.update(engine_env(spec["tp"]))
    serve(spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
