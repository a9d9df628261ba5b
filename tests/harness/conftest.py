"""Fixtures of the harness tests: hand-made traces and the shared Mooncake trace."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: CI clones the repository with ../shared beside it; KVHAL_SHARED_DIR overrides (worktrees).
SHARED = Path(os.environ.get("KVHAL_SHARED_DIR", ROOT.parent / "shared"))
CONVERSATION = SHARED / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.fixture
def conversation_trace() -> Path:
    """Mooncake's conversation trace; skips when ../shared is not beside the repository."""
    if not CONVERSATION.is_file():
        pytest.skip(f"Mooncake trace not found at {CONVERSATION} (set KVHAL_SHARED_DIR)")
    return CONVERSATION


@pytest.fixture
def write_trace(tmp_path):
    """write_trace(lines, name) -> Path: a JSONL file of `lines` (dicts or raw strings)."""

    def write(lines, name: str = "trace.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                                for x in lines))
        return path

    return write


def mooncake(ids: list[int], input_length: int | None = None, ts: float = 0) -> dict:
    """A Mooncake line whose blocks are `ids` (all full unless input_length says otherwise)."""
    n = len(ids) * 512 if input_length is None else input_length
    return {"timestamp": ts, "input_length": n, "output_length": 1, "hash_ids": ids}
