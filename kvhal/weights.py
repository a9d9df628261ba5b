"""Content fingerprints of model checkpoints and adapters: the weights' part of a namespace.

kvhal's secondary tiers outlive the process and are shared between instances, so a chunk's
namespace must change whenever the bytes that compute the KV change, and must not change with
the name or path they are served under (DESIGN §4): a fine-tune served under the old name, a
checkpoint replaced in place, or a LoRA adapter rewritten in place computes other KV; the same
weights copied to another folder compute the same KV.

`fingerprint(folder)` digests the content of every file of a checkpoint (or adapter) folder
that computes the KV (`model_files`): the weight files vLLM's loader reads, configs (`.json`)
and custom model code (`.py`, vLLM's `trust_remote_code`), minus the files that only shape
text (`NOT_KV_FILES`: tokenizers and generation defaults; the token ids themselves are in the
block hashes); a GGUF checkpoint is its one file. Each file enters with its name (a single
file without it: renaming a GGUF changes nothing), its size and an XXH3-128 tree digest of its
bytes (64 MiB pieces, digested in parallel threads from a read-only mmap; xxhash releases the
GIL), so two folders holding the same files give the same fingerprint wherever they are.

A header-and-size digest would be cheaper but misses exactly the rollout it is for: two
fine-tunes of one architecture have the same safetensors headers and sizes. Reading the
content costs one read of the weights, from the page cache when the engine has just loaded
them (figures in the README's "Namespaces" section). An operator who cannot afford it, or whose
weights are not in a local folder, pins the identity instead (`model_identity` in the
connector config).
"""
from __future__ import annotations

import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

#: File suffixes of weight files vLLM loads (safetensors, PyTorch, GGUF).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: The safetensors index whose weight map names the shards vLLM loads.
INDEX_FILE = "model.safetensors.index.json"
#: Weight-suffixed files a trainer writes that vLLM does not load
#: (`filter_files_not_needed_for_inference`).
NOT_WEIGHT_FILES = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt",
                              "scheduler.pt", "scaler.pt"})
#: Other file suffixes whose content computes the KV: configs (model, quantization,
#: preprocessor, adapter) and custom model code.
CONFIG_SUFFIXES = (".json", ".py")
#: Files with those suffixes that do not change the KV of given token ids.
NOT_KV_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "vocab.json", "added_tokens.json", "generation_config.json",
                          "chat_template.json"})
#: Bytes per independently digested piece of a file.
PIECE_BYTES = 64 << 20
#: Threads digesting pieces at once.
MAX_THREADS = 8


class WeightsError(ValueError):
    """A folder cannot be fingerprinted (missing, unreadable, or holding no model files);
    the message names the folder and the file."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The fingerprint of one folder.

    Attributes:
        digest: "xxh3-128:<32 hex digits>" over every file's relative path, size and content.
        names: The files digested, relative to the folder, in digest order.
        nbytes: Bytes read.
        seconds: Wall time spent.
    """

    digest: str
    names: tuple[str, ...]
    nbytes: int
    seconds: float


def model_files(folder: str) -> list[str]:
    """Names, sorted, of the files in `folder` (not below it) that compute the KV, chosen as
    vLLM's default loader chooses weights (`DefaultModelLoader._prepare_weights`): the
    `*.safetensors` files if there are any (only those the `model.safetensors.index.json`
    weight map names, when there is one), else the `*.bin` files less the trainer's
    (`NOT_WEIGHT_FILES`), else `*.pt`, `*.pth`, `*.gguf`; plus every `.json` and `.py` except
    `NOT_KV_FILES`. Subfolders (a trainer's `checkpoint-*/`, a repo's `original/` copy) are
    never read: vLLM loads none of them.

    Raises:
        WeightsError: `folder` is not a readable directory, or its safetensors index is not
            valid JSON (names it).
    """
    if not os.path.isdir(folder):
        raise WeightsError(f"{folder}: not a directory")
    try:
        names = sorted(e.name for e in os.scandir(folder) if e.is_file())
    except OSError as exc:
        raise WeightsError(f"{folder}: cannot list ({exc.strerror})") from None
    lower = {n: n.lower() for n in names}
    weights: list[str] = []
    for suffixes in ((".safetensors",), (".bin",), (".pt", ".pth", ".gguf")):
        weights = [n for n in names if lower[n].endswith(suffixes)
                   and lower[n] not in NOT_WEIGHT_FILES]
        if weights:
            break
    if weights and INDEX_FILE in names and weights[0].endswith(".safetensors"):
        weights = [n for n in weights if n in _indexed(os.path.join(folder, INDEX_FILE))]
    configs = [n for n in names if lower[n].endswith(CONFIG_SUFFIXES)
               and lower[n] not in NOT_KV_FILES]
    return sorted(weights + configs)


def _indexed(path: str) -> set[str]:
    """The shard file names a safetensors index's `weight_map` names."""
    try:
        with open(path) as f:
            return set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightsError(f"{path}: not a safetensors index ({type(exc).__name__})") from None


def fingerprint(path: str) -> Fingerprint:
    """The content fingerprint of a checkpoint or adapter folder, or of a single weight file
    (a GGUF checkpoint), by the rule of the module docstring.

    Thread-safe; reads every model file once, up to `MAX_THREADS` pieces at a time.

    Raises:
        WeightsError: the path is missing or holds no weight file, or a file cannot be read
            (names it).
    """
    start = time.perf_counter()
    single = os.path.isfile(path)
    if single:
        folder, files = os.path.dirname(path), [os.path.basename(path)]
    else:
        folder, files = path, model_files(path)
    if not any(f.lower().endswith(WEIGHT_SUFFIXES) for f in files):
        raise WeightsError(f"{path}: no weight file (none of {', '.join(WEIGHT_SUFFIXES)})")
    sizes = []
    for rel in files:
        try:
            sizes.append(os.stat(os.path.join(folder, rel)).st_size)
        except OSError as exc:
            raise WeightsError(f"{os.path.join(folder, rel)}: cannot stat ({exc.strerror})") \
                from None
    pieces = [(i, offset) for i, size in enumerate(sizes)
              for offset in range(0, max(size, 1), PIECE_BYTES)]
    threads = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(pieces)))
    with ThreadPoolExecutor(threads, thread_name_prefix="kvhal-fingerprint") as pool:
        digests = list(pool.map(lambda p: _piece(os.path.join(folder, files[p[0]]),
                                                 sizes[p[0]], p[1]), pieces))
    total = xxhash.xxh3_128()
    at = 0
    for rel, size in zip(files, sizes):
        n = max(1, -(-size // PIECE_BYTES))
        total.update(f"{'' if single else rel}\0{size}\0".encode())
        total.update(xxhash.xxh3_128(b"".join(digests[at:at + n])).digest())
        at += n
    return Fingerprint(f"xxh3-128:{total.hexdigest()}", tuple(files), sum(sizes),
                       time.perf_counter() - start)


def _piece(path: str, size: int, offset: int) -> bytes:
    """XXH3-128 of bytes [offset, offset + PIECE_BYTES) of the file at `path` (`size` bytes
    when it was listed).

    Raises:
        WeightsError: the file cannot be read or changed size while being read.
    """
    if size == 0:
        return xxhash.xxh3_128(b"").digest()
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if len(mm) != size:
                raise WeightsError(f"{path}: changed size while being fingerprinted")
            view = memoryview(mm)
            try:
                return xxhash.xxh3_128(view[offset:offset + PIECE_BYTES]).digest()
            finally:
                view.release()
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read ({exc.strerror or exc})") from None
