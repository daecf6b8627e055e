"""What our caches key on and where they live: a model file's identity and the cache folder.

The identity of a model is its first shard's name, size and a SHA-256 of its header (metadata and
tensor table, the bytes before the tensor data): a re-quantized or re-exported model has another
one; the same file copied elsewhere keeps it. Calibration profiles (profile.py) and expert digests
(digests.py) are saved in the cache folder under names made from it.
"""

import hashlib
import os
from pathlib import Path


def file_identity(index):
    """{name, size, header_sha256} of the model's first shard."""
    shard = index.shards[0]
    digest = hashlib.sha256()
    with open(shard.path, "rb") as f:
        left = shard.data_offset
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return {"name": Path(shard.path).name, "size": int(shard.file_size), "header_sha256": digest.hexdigest()}


def cache_dir():
    """EMPANEL_PROFILE_DIR, else ~/.cache/empanel-gguf/profiles (or under $XDG_CACHE_HOME)."""
    if os.environ.get("EMPANEL_PROFILE_DIR"):
        return Path(os.environ["EMPANEL_PROFILE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "empanel-gguf" / "profiles"


def cached_path(identity, suffix):
    """The cache file of a model identity: <stem>-<16 hex digits of its header digest><suffix>."""
    return cache_dir() / f"{Path(identity['name']).stem}-{identity['header_sha256'][:16]}{suffix}"
