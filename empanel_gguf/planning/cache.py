"""What our caches key on and where they live: a model file's identity and the cache folder.

The identity of a model is its first shard's name, size and a SHA-256 of its header (metadata and
tensor table, the bytes before the tensor data): a re-quantized or re-exported model has another
one; the same file copied elsewhere keeps it. Calibration profiles (profile.py) and expert digests
(digests.py) are saved in the cache folder under names made from it.
"""

import hashlib
import os
from pathlib import Path


_IDENTITIES = {}  # (path, inode, size, mtime, ctime, data offset) -> file_identity: a load asks several caches


def file_identity(index):
    """{name, size, header_sha256} of the model's first shard, hashed once per version of the
    file in this process (the profile, the layout and the digests of one load all ask)."""
    shard = index.shards[0]
    st = os.stat(shard.path)
    key = (os.path.realpath(shard.path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, shard.data_offset)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = _hash_identity(shard)
    return dict(_IDENTITIES[key])


def _hash_identity(shard):
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
