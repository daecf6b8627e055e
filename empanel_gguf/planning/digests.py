"""Expert digests for verified reads (moe_verify): XXH3-64 of every expert of every routed-expert
tensor, as its bytes lie in the GGUF file.

`empanel-gguf verify MODEL.gguf` reads every expert once and saves the digests next to the
calibration profiles (cache.cache_dir()), tied to the file's identity (size and header
SHA-256, cache.file_identity). A load with moe_verify=True hands them to the sidecar, whose
reader threads hash each expert as it lands (before any repack or copy to a device) and fail the
decode on a mismatch. Without saved digests, each expert's first read gives its digest and every
later read of it must match.

The file (JSON): {"format", "version", "hash": "xxh3-64", "model": identity, "tensors":
{name: [16 hex digits per expert]}}. The hash is the sidecar's own (empanel_hash64, xxHash as
llama.cpp vendors it), so the pass and the reads agree by construction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .cache import cached_path, file_identity

FORMAT = "empanel-gguf-digests"
VERSION = 1
HASH = "xxh3-64"


class DigestError(ValueError):
    """Saved digests that cannot be used for this file."""


def default_path(index, identity=None) -> Path:
    return cached_path(identity or file_identity(index), ".digests.json")


def compute(index, hash64, progress=None) -> dict:
    """{tensor name: np.uint64 [n_expert]} over every routed-expert tensor of `index`, reading
    each expert once; hash64(bytes) -> int is the sidecar's hash (engine.native.hash64);
    progress(done_bytes, total_bytes) after each tensor."""
    total = sum(t.nbytes for t in index.expert_tensors())
    done = 0
    digests = {}
    files = {}
    try:
        for t in index.expert_tensors():
            f = files.get(t.path) or files.setdefault(t.path, open(t.path, "rb", buffering=0))
            out = np.zeros(t.n_expert, dtype=np.uint64)
            buf = bytearray(t.stride)
            view = memoryview(buf)
            for e in range(t.n_expert):
                f.seek(t.offset + e * t.stride)
                got = f.readinto(view)
                if got != t.stride:
                    raise DigestError(f"{t.path}: {t.name} expert {e} is cut short ({got} of {t.stride} bytes): "
                                      "the file is truncated")
                out[e] = hash64(buf)
            digests[t.name] = out
            done += t.nbytes
            if progress is not None:
                progress(done, total)
    finally:
        for f in files.values():
            f.close()
    return digests


def save(index, digests, path=None, identity=None) -> Path:
    identity = identity or file_identity(index)
    path = Path(path) if path is not None else default_path(index, identity)
    data = {"format": FORMAT, "version": VERSION, "hash": HASH, "model": identity,
            "tensors": {name: [f"{int(d):016x}" for d in values] for name, values in digests.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def load(index, path=None, identity=None):
    """The saved digests of this file ({name: np.uint64 [n_expert]}), None if none are saved;
    DigestError for digests of another file or a broken digest file."""
    identity = identity or file_identity(index)
    path = Path(path) if path is not None else default_path(index, identity)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DigestError(f"{path}: not a readable digest file ({e}); run empanel-gguf verify --force "
                          f"{index.path} to hash the file anew") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION \
            or data.get("hash") != HASH:
        raise DigestError(f"{path}: not an {FORMAT} file of version {VERSION} ({HASH}); run empanel-gguf verify "
                          f"--force {index.path} to hash the file anew")
    if data.get("model") != identity:
        raise DigestError(f"{path}: the digests of another file ({(data.get('model') or {}).get('name', '?')}); "
                          f"run empanel-gguf verify {index.path}")
    tensors = data.get("tensors") or {}
    out = {}
    for t in index.expert_tensors():
        values = tensors.get(t.name)
        if not isinstance(values, list) or len(values) != t.n_expert:
            raise DigestError(f"{path}: no digests for {t.name}; run empanel-gguf verify {index.path}")
        out[t.name] = np.array([int(v, 16) for v in values], dtype=np.uint64)
    return out


def check(index, saved, hash64, progress=None):
    """Hash the file again and compare with `saved`: [(tensor name, expert)] that differ."""
    now = compute(index, hash64, progress)
    return [(name, int(e)) for name, values in now.items() for e in np.nonzero(values != saved[name])[0]]

