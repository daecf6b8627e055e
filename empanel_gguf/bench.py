"""Benchmark empanel-gguf against stock llama.cpp (same build) on a MoE GGUF, llama-bench style.

    empanel-gguf bench --write-model /data/qwen3-30b-a3b-shape.gguf      # write (or reuse), then bench
    empanel-gguf bench -m MODEL.gguf -r 3 -p 64 -n 32 --json out.json    # bench an existing model
    empanel-gguf bench --write-model tiny.gguf --layers 2 --experts 16 --top-k 4 --embd 256 \
        --expert-ff 256 --heads 4 --heads-kv 2 --head-dim 64 --write-only      # a tiny model only

(`python scripts/bench.py ...` runs the same on the working tree's package.)

What it does, in one run and one build:
- Optionally writes a synthetic MoE GGUF of a real model's shape (default Qwen3-30B-A3B: qwen3moe,
  48 layers x 128 experts, top-8, n_embd 2048, expert ff 768, 32 q / 4 kv heads of 128), every
  matrix Q4_K written as raw random blocks (no quantizer), streamed tensor by tensor; a file whose
  metadata carries the same shape fingerprint is reused.
- Measures each configuration in its own child process (own peak RSS, own page cache state; the
  page cache is dropped before each run): stock llama.cpp (moe_slots=None), stock with weights
  served from the mapping (use_extra_bufts=False) at the machine's readahead and at 128 KiB, and
  empanel at 100 %, 50 %, 25 % and the minimum slots (= top-k); each uncapped and under a cgroup v1
  memory cap (default 40 % of the model). Children over the cap are OOM-killed; that is a result.
  Uncapped runs get a guard group (available memory less 1 GiB) so an OOM kill hits the child.
- Measures the drive's own O_DIRECT bandwidth (random expert-sized ranges of the model, the reader's
  chunk size and queue depth) before and after every run and at the start and end, and reports
  each empanel row against the drive-bound ceiling: drive GB/s / bytes missed per token, capped by
  the resident decode rate. The disk's own counters (/sys/block/<dev>/stat) give its rate while
  busy during each phase; /proc/stat gives the CPU time other processes took during each run
  (this machine is shared; --wait-idle waits for quiet CPUs before each run).
- Every run feeds the same tokens: a fixed prompt (pp) and a fixed forced continuation (tg, one
  token per eval, no sampling), so all arms see the same routing.

Output: a markdown table (stdout), a details table, the targets of issue 4, and --json with every
sample (rewritten after each run, so a long run can be watched). Progress goes to stderr.
Root-only steps (dropping caches, cgroups, readahead) have switches to turn them off.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import mmap
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
ALIGN = 4096  # O_DIRECT alignment used by the drive probe (as the sidecar's reader)

# ---------------------------------------------------------------------------------------------
# Synthetic model: a real model's shape, random Q4_K blocks

WRITER_VERSION = 1
FINGERPRINT_KEY = "empanel.bench.fingerprint"
Q4_K_BLOCK = 256  # values per block
Q4_K_BYTES = 144  # bytes per block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
# std of (scale * q - 7.5 * min) for uniform 6-bit scale/min and 4-bit q: sqrt(47532 + 19195);
# d = 1 / (258 * sqrt(fan_in)) gives weights of std ~1/sqrt(fan_in), mean ~0 (dmin = 7.5 d)
Q4_K_SPREAD = 258.0


@dataclass(frozen=True)
class ModelShape:
    """What determines a synthetic model file (defaults: Qwen3-30B-A3B)."""

    arch: str = "qwen3moe"
    n_layer: int = 48
    n_expert: int = 128
    n_expert_used: int = 8
    n_embd: int = 2048
    n_ff_exp: int = 768
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    context_length: int = 4096
    seed: int = 0

    def check(self):
        for what, n in (("--embd", self.n_embd), ("--expert-ff", self.n_ff_exp),
                        ("--heads x --head-dim", self.n_head * self.head_dim)):
            if n <= 0 or n % Q4_K_BLOCK:
                raise SystemExit(f"bench: {what} is {n}; Q4_K rows must be a positive multiple of 256")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise SystemExit(f"bench: --top-k {self.n_expert_used} must lie in 1..{self.n_expert}")
        if self.n_head % self.n_head_kv:
            raise SystemExit(f"bench: --heads {self.n_head} must be a multiple of --heads-kv {self.n_head_kv}")
        if self.arch != "qwen3moe":
            raise SystemExit(f"bench: only qwen3moe shapes are written, not {self.arch}")


def shape_fingerprint(shape: ModelShape) -> str:
    return hashlib.sha256(f"{WRITER_VERSION}:{shape!r}".encode()).hexdigest()[:16]


def q4_k_blocks(rng, n_rows: int, ne0: int, fan_in: int, scale: float = 1.0):
    """Random Q4_K rows as raw bytes, numpy shape (n_rows, ne0 / 256 * 144), uint8.

    block_q4_K = {f16 d, f16 dmin, u8 scales[12], u8 qs[128]}: the 12 scale bytes pack 8 6-bit
    scales and 8 6-bit mins, so random bytes are random scales/mins; qs are random nibbles.
    """
    import numpy as np

    assert ne0 % Q4_K_BLOCK == 0, ne0
    n_blocks = n_rows * (ne0 // Q4_K_BLOCK)
    blocks = rng.integers(0, 256, size=(n_blocks, Q4_K_BYTES), dtype=np.uint8)
    d = np.float16(scale / (Q4_K_SPREAD * math.sqrt(fan_in)))
    head = np.array([d, np.float16(7.5 * float(d))], dtype="<f2").view(np.uint8)
    blocks[:, :4] = head
    return blocks.reshape(n_rows, ne0 // Q4_K_BLOCK * Q4_K_BYTES)


def _tensor_plan(shape: ModelShape, n_vocab: int):
    """[(name, ne in ggml order, kind, scale)], kind: q4k | norm | router (F32 like real files)."""
    s = shape
    n_q, n_kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    plan = [("token_embd.weight", (s.n_embd, n_vocab), "q4k", math.sqrt(s.n_embd))]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        plan += [
            (p + "attn_norm.weight", (s.n_embd,), "norm", 1.0),
            (p + "attn_q.weight", (s.n_embd, n_q), "q4k", 1.0),
            (p + "attn_k.weight", (s.n_embd, n_kv), "q4k", 1.0),
            (p + "attn_v.weight", (s.n_embd, n_kv), "q4k", 1.0),
            (p + "attn_output.weight", (n_q, s.n_embd), "q4k", 1.0),
            (p + "attn_q_norm.weight", (s.head_dim,), "norm", 1.0),
            (p + "attn_k_norm.weight", (s.head_dim,), "norm", 1.0),
            (p + "ffn_norm.weight", (s.n_embd,), "norm", 1.0),
            (p + "ffn_gate_inp.weight", (s.n_embd, s.n_expert), "router", 1.0),
            (p + "ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "q4k", 1.0),
            (p + "ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "q4k", 1.0),
            (p + "ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), "q4k", 1.0),
        ]
    plan += [("output_norm.weight", (s.n_embd,), "norm", 1.0),
             ("output.weight", (s.n_embd, n_vocab), "q4k", 1.0)]
    return plan


def _tensor_bytes(ne, kind) -> int:
    n = math.prod(ne)
    return n // Q4_K_BLOCK * Q4_K_BYTES if kind == "q4k" else 4 * n


def _tensor_data(rng, ne, kind, scale):
    import numpy as np

    if kind == "norm":
        return np.ones(tuple(reversed(ne)), dtype=np.float32)
    if kind == "router":  # logits with std ~1: routing changes from token to token
        w = rng.standard_normal(tuple(reversed(ne)), dtype=np.float32)
        return w * np.float32(1.0 / math.sqrt(ne[0]))
    n_rows = math.prod(ne[1:])
    blocks = q4_k_blocks(rng, n_rows, ne[0], fan_in=ne[0], scale=scale)
    return blocks.reshape(tuple(reversed(ne[1:])) + (blocks.shape[-1],))


def model_is_current(shape: ModelShape, path: Path) -> bool:
    """The file at `path` was written complete from `shape` (same fingerprint, all data there)."""
    import gguf

    if not path.is_file():
        return False
    try:
        reader = gguf.GGUFReader(path)
        f = reader.get_field(FINGERPRINT_KEY)
        if f is None or f.contents() != shape_fingerprint(shape):
            return False
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
        return end <= path.stat().st_size
    except (ValueError, IndexError, KeyError, OSError):
        return False


def write_model(shape: ModelShape, path, log=print) -> Path:
    """Write the synthetic model to `path` unless an identical one is there. Tensors are made and
    written one at a time (the largest, one expert tensor, is ~113 MB for Qwen3-30B-A3B), into a
    temporary name that is renamed at the end."""
    import gguf
    import numpy as np

    from empanel_gguf import fixtures

    shape.check()
    path = Path(path)
    if model_is_current(shape, path):
        log(f"bench: reusing {path} ({path.stat().st_size / GiB:.2f} GiB, fingerprint {shape_fingerprint(shape)})")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, _, _ = fixtures.vocabulary()
    plan = _tensor_plan(shape, len(tokens))
    total = sum(_tensor_bytes(ne, kind) for _, ne, kind, _ in plan)
    free = os.statvfs(path.parent)
    if free.f_bavail * free.f_frsize < total + GiB:
        raise SystemExit(f"bench: {path.parent} has {free.f_bavail * free.f_frsize / GiB:.1f} GiB free; "
                         f"the model needs {total / GiB:.1f} GiB")
    log(f"bench: writing {path} ({total / GiB:.2f} GiB of tensors, {len(plan)} tensors)")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    t0 = time.perf_counter()
    try:
        w = gguf.GGUFWriter(tmp, shape.arch)
        s = shape
        w.add_name(f"synthetic {s.arch} {s.n_layer}x{s.n_expert} top-{s.n_expert_used} Q4_K")
        w.add_string(FINGERPRINT_KEY, shape_fingerprint(shape))
        w.add_string("empanel.bench.shape", json.dumps(asdict(shape)))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
        w.add_context_length(s.context_length)
        w.add_embedding_length(s.n_embd)
        w.add_block_count(s.n_layer)
        w.add_feed_forward_length(s.n_ff_exp * s.n_expert_used)  # unused by qwen3moe layers
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_head_count(s.n_head)
        w.add_head_count_kv(s.n_head_kv)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_layer_norm_rms_eps(fixtures.RMS_EPS)
        w.add_rope_freq_base(1e6)
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        fixtures.add_tokenizer(w)  # the fixtures' byte-level BPE vocabulary (one definition)

        for name, ne, kind, _ in plan:
            nbytes = _tensor_bytes(ne, kind)
            if kind == "q4k":  # byte shape; the writer turns it into the element shape
                byte_shape = tuple(reversed(ne[1:])) + (ne[0] // Q4_K_BLOCK * Q4_K_BYTES,)
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                                  raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            else:
                w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        written, last_report = 0, time.perf_counter()
        for i, (name, ne, kind, scale) in enumerate(plan):
            data = _tensor_data(np.random.default_rng([shape.seed, i]), ne, kind, scale)
            w.write_tensor_data(data)
            written += data.nbytes
            if time.perf_counter() - last_report > 10:
                last_report = time.perf_counter()
                log(f"bench:   {written / GiB:.1f} / {total / GiB:.1f} GiB "
                    f"({written / (last_report - t0) / 1e9:.2f} GB/s)")
        w.close()
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    dt = time.perf_counter() - t0
    log(f"bench: wrote {path} in {dt:.1f} s ({total / dt / 1e9:.2f} GB/s)")
    return path


# ---------------------------------------------------------------------------------------------
# The machine: memory cgroups, page cache, readahead, the drive


def _read(path, default=None):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def meminfo() -> dict:
    out = {}
    for line in (_read("/proc/meminfo", "") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def drop_caches() -> bool:
    """sync; echo 3 > /proc/sys/vm/drop_caches (root). False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class MemCgroup:
    """A cgroup v1 memory group for the measured children, nested in this process's own group
    (so whatever limits that has still apply). The children move themselves in."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, name: str):
        parent = self.ROOT
        for line in (_read("/proc/self/cgroup", "") or "").splitlines():
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                candidate = self.ROOT / rel.lstrip("/")
                if candidate.is_dir():
                    parent = candidate
        self.path = parent / name
        self.path.mkdir(exist_ok=True)  # OSError where not root or not cgroup v1
        self.procs = self.path / "cgroup.procs"

    def _write(self, leaf, value):
        (self.path / leaf).write_text(f"{value}\n")

    def prepare(self, limit_bytes: int):
        """Empty the group's leftover charges, set the limit, reset the peak and fail counters."""
        for leaf, value in (("memory.force_empty", 0), ("memory.limit_in_bytes", int(limit_bytes)),
                            ("memory.max_usage_in_bytes", 0), ("memory.failcnt", 0)):
            try:
                self._write(leaf, value)
            except OSError:
                if leaf == "memory.limit_in_bytes":
                    raise

    def oom_kills(self) -> int:
        for line in (_read(self.path / "memory.oom_control", "") or "").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def max_usage(self) -> int:
        return int(_read(self.path / "memory.max_usage_in_bytes", "0") or 0)

    def failcnt(self) -> int:
        return int(_read(self.path / "memory.failcnt", "0") or 0)

    def remove(self):
        for _ in range(50):
            try:
                self._write("memory.force_empty", 0)
            except OSError:
                pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def block_queue_dir(path) -> Path | None:
    """/sys/block/<dev>/queue of the whole disk holding `path`'s file system, or None."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not dev.exists():  # e.g. overlayfs: take the mount's source device
        best, source = "", None
        target = str(Path(path).resolve())
        for line in (_read("/proc/self/mountinfo", "") or "").splitlines():
            left, _, right = line.partition(" - ")
            mount_point, src = left.split()[4], (right.split() + ["", ""])[1]
            if (target == mount_point or target.startswith(mount_point.rstrip("/") + "/")) \
                    and len(mount_point) > len(best) and src.startswith("/dev/"):
                best, source = mount_point, src
        if source is None:
            return None
        dev = Path("/sys/class/block") / Path(os.path.realpath(source)).name
        if not dev.exists():
            return None
    dev = dev.resolve()
    if (dev / "partition").exists():
        dev = dev.parent
    queue = dev / "queue"
    return queue if (queue / "read_ahead_kb").exists() else None


class Readahead:
    """Set read_ahead_kb of a block queue for a `with` block, restoring the original always."""

    def __init__(self, queue_dir: Path, kb: int):
        self.file = queue_dir / "read_ahead_kb"
        self.kb = kb
        self.original = None

    def __enter__(self):
        self.original = self.file.read_text().strip()
        self.file.write_text(f"{self.kb}\n")
        return self

    def __exit__(self, *exc):
        self.file.write_text(f"{self.original}\n")
        return False


def cpu_jiffies() -> tuple[int, int, int, int]:
    """(user, busy, total, steal) jiffies of all CPUs from /proc/stat; user includes nice."""
    fields = [int(x) for x in (_read("/proc/stat", "cpu 0") or "cpu 0").splitlines()[0].split()[1:]]
    fields += [0] * (8 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    busy = user + nice + system + irq + softirq + steal
    return user + nice, busy, busy + idle + iowait, steal


def wait_for_idle(max_wait_s: float, busy_pct: float) -> float:
    """Wait (at most max_wait_s) until user processes keep the CPUs less than busy_pct busy over
    one second: other processes share this machine and ggml's threads suffer from them. Returns
    the seconds waited."""
    t0 = time.perf_counter()
    while True:
        u0, _, t_0, _ = cpu_jiffies()
        time.sleep(1.0)
        u1, _, t_1, _ = cpu_jiffies()
        if t_1 <= t_0 or 100 * (u1 - u0) / (t_1 - t_0) < busy_pct or time.perf_counter() - t0 >= max_wait_s:
            return time.perf_counter() - t0


def expert_ranges(index):
    """[(shard path, [(offset, size) per tensor])] for every (layer, expert): one miss each."""
    out = []
    for layer in index.layers:
        for e in range(index.n_expert):
            out.append([(t.path, t.offset + e * t.stride, t.stride) for t in layer.tensors.values()])
    return out


def probe_drive(index, seconds: float, chunk_bytes: int, depth: int, seed: int = 0,
                direct: bool = True) -> dict | None:
    """Read random experts of the model (all their tensors, cut into aligned chunks) with `depth`
    threads for `seconds`: the drive's bandwidth at the reader's chunk size and queue depth.
    None where O_DIRECT is refused (tmpfs) and direct is asked."""
    if seconds <= 0:
        return None
    chunk_bytes = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fds = {}
    try:
        for shard in index.shards:
            fds[shard.path] = os.open(shard.path, flags)
    except OSError as e:
        for fd in fds.values():
            os.close(fd)
        return {"error": f"open: {e}"}
    sizes = {p: os.fstat(fd).st_size for p, fd in fds.items()}
    experts = expert_ranges(index)
    rng = random.Random(seed)
    lock = threading.Lock()
    pending = []  # chunks of the expert being handed out
    counters = [0, 0]  # bytes, reads
    errors = []
    deadline = time.perf_counter() + seconds

    def next_chunk():
        with lock:
            if not pending:
                for path, offset, size in experts[rng.randrange(len(experts))]:
                    start = offset // ALIGN * ALIGN
                    end = min((offset + size + ALIGN - 1) // ALIGN * ALIGN,
                              (sizes[path] + ALIGN - 1) // ALIGN * ALIGN)
                    for at in range(start, end, chunk_bytes):
                        pending.append((fds[path], at, min(chunk_bytes, end - at)))
                pending.reverse()
            return pending.pop()

    def worker():
        buf = mmap.mmap(-1, chunk_bytes)  # page aligned, as O_DIRECT wants
        view = memoryview(buf)
        n_bytes = n_reads = 0
        try:
            while time.perf_counter() < deadline:
                fd, at, n = next_chunk()
                n_bytes += os.preadv(fd, [view[:n]], at)
                n_reads += 1
        except OSError as e:
            errors.append(str(e))
        finally:
            view.release()
            buf.close()
            with lock:
                counters[0] += n_bytes
                counters[1] += n_reads

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, depth))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    if errors and not counters[0]:
        return {"error": errors[0]}
    return {"gbps": counters[0] / dt / 1e9, "bytes": counters[0], "reads": counters[1], "seconds": dt,
            "chunk_bytes": chunk_bytes, "depth": depth, "direct": direct,
            **({"errors": errors[:3]} if errors else {})}


# ---------------------------------------------------------------------------------------------
# Configurations

STOCK, MMAP, EMPANEL = "stock", "stock-mmap", "empanel"
CAP_NONE, CAP = "none", "cap"
DEFAULT_CONFIGS = (
    [f"{n}@{CAP_NONE}" for n in ("stock", "empanel-100%", "empanel-50%", "empanel-25%", "empanel-min")]
    + [f"{n}@{CAP}" for n in ("stock", "stock-mmap", "stock-mmap-ra128", "empanel-100%", "empanel-50%",
                              "empanel-25%", "empanel-min", "empanel-auto")])


@dataclass
class Config:
    name: str  # stock | stock-mmap | stock-mmap-ra<KB> | empanel-<moe_slots>
    cap: str  # none | cap
    kind: str  # stock | stock-mmap | empanel
    moe_slots: object = None  # for empanel: what Llama(moe_slots=) gets
    readahead_kb: int | None = None  # stock-mmap-ra<KB>: read_ahead_kb during the run
    moe_policy: str | None = None  # empanel-<slots>/<policy>: this run's moe_policy

    @property
    def key(self):
        return f"{self.name}@{self.cap}"


def parse_config(text: str, top_k: int) -> list[Config]:
    """'name' (uncapped and capped), 'name@none' or 'name@cap' -> Configs."""
    name, _, cap = text.strip().partition("@")
    caps = [cap] if cap else [CAP_NONE, CAP]
    for c in caps:
        if c not in (CAP_NONE, CAP):
            raise SystemExit(f"bench: config '{text}': the part after @ must be 'none' or 'cap'")
    if name == STOCK:
        kind, slots, ra = STOCK, None, None
    elif name == MMAP:
        kind, slots, ra = MMAP, None, None
    elif name.startswith(MMAP + "-ra") and name[len(MMAP) + 3:].isdigit():
        kind, slots, ra = MMAP, None, int(name[len(MMAP) + 3:])
    elif name.startswith(EMPANEL + "-") and len(name) > len(EMPANEL) + 1:
        value, _, policy = name[len(EMPANEL) + 1:].partition("/")
        kind, ra = EMPANEL, None
        slots = top_k if value == "min" else int(value) if value.isdigit() else value
        if policy:
            from .sizing import POLICIES

            if policy not in POLICIES:
                raise SystemExit(f"bench: config '{text}': policy '{policy}' is not one of {', '.join(POLICIES)}")
            return [Config(name, c, kind, slots, ra, policy) for c in caps]
    else:
        raise SystemExit(f"bench: unknown config '{text}'; use stock, stock-mmap, stock-mmap-ra<KB>, "
                         "empanel-<N|P%|size|min|auto>[/<policy>], each optionally @none or @cap")
    return [Config(name, c, kind, slots, ra) for c in caps]


def parse_opt(text: str):
    """'key=value' -> (key, int | float | bool | None | str)."""
    key, eq, raw = text.partition("=")
    if not eq or not key:
        raise SystemExit(f"bench: option '{text}' is not key=value")
    low = raw.lower()
    if low in ("true", "yes", "on"):
        return key, True
    if low in ("false", "no", "off"):
        return key, False
    if low == "none":
        return key, None
    for conv in (int, float):
        try:
            return key, conv(raw)
        except ValueError:
            pass
    return key, raw


# ---------------------------------------------------------------------------------------------
# The child: one measured run

PROMPT_TEXT = (
    "The history of the river towns is written in their bridges. Each generation built a "
    "crossing that suited its trade: fords for the drovers, timber spans for the carts, stone "
    "arches when the wool money came, and iron when the railway needed to cross without "
    "stopping. Walk along the water today and you can read four hundred years of ambition in "
    "the piers, the patched parapets and the toll houses now sold as holiday cottages. "
)


WARMUP_TEXT = (
    "Salt was the first fortune of the coast. Long before the harbour walls, families boiled "
    "seawater in lead pans on the marsh edge and carried the crystals inland on mules; the "
    "tracks they wore became the lanes that the later turnpikes straightened, and the pans left "
    "the low mounds that walkers still take for the barrows of forgotten kings. "
)


def token_trace(llm, n_prompt: int, n_gen: int, text: str = PROMPT_TEXT):
    """(prompt tokens, forced continuation): the same text for every arm, repeated as needed."""
    text = text.encode()
    tokens = llm.tokenize(text, add_bos=True)
    while len(tokens) < n_prompt + n_gen:
        tokens += llm.tokenize(text, add_bos=False)
    return tokens[:n_prompt], tokens[n_prompt:n_prompt + n_gen]


def last_logits(llm):
    """The logits of the last evaluated token, copied. (Llama.scores holds them only with
    logits_all=True; with it off, llama-cpp-python leaves `scores` unset.)"""
    import numpy as np

    ptr = llm._ctx.get_logits_ith(-1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def _proc_status() -> dict:
    out = {}
    for line in (_read("/proc/self/status", "") or "").splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _proc_io() -> dict:
    out = {}
    for line in (_read("/proc/self/io", "") or "").splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def _disk(stat_path) -> tuple[int, float] | None:
    """(bytes read, seconds busy) of the whole disk so far, from /sys/block/<dev>/stat (sectors
    read is field 3, io_ticks field 10). Counts every process's I/O on that disk."""
    if not stat_path:
        return None
    fields = (_read(stat_path, "") or "").split()
    if len(fields) < 10:
        return None
    return int(fields[2]) * 512, int(fields[9]) / 1000.0


def _disk_delta(after, before) -> dict:
    if after is None or before is None:
        return {}
    return {"dev_read_bytes": after[0] - before[0], "dev_busy_s": after[1] - before[1]}


def _delta(after: dict | None, before: dict | None) -> dict | None:
    """after - before for the counters of moe_stats()['total']; gauges (slots) kept, rates
    (hit_rate, *_gbps) recomputed."""
    if after is None:
        return None
    before = before or {}
    out = {}
    for key, value in after.items():
        if key.endswith("_gbps") or key == "hit_rate":
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and key not in ("n_slots", "n_resident"):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    lookups = out.get("hits", 0) + out.get("misses", 0)
    out["hit_rate"] = out.get("hits", 0) / lookups if lookups else None
    return out


class _MappedWeights:
    """Within the block, models load with llama_model_params.use_extra_bufts = False: no CPU
    repack buffers, the weights are served from the file mapping. llama_cpp.Llama has no argument
    for it and builds the params inside __init__, so the one function that receives them,
    llama_model_load_from_file (as _internals.LlamaModel calls it), is wrapped."""

    def __init__(self, llama_cpp_module):
        self.module = llama_cpp_module.llama_cpp

    def __enter__(self):
        self.original = original = self.module.llama_model_load_from_file

        def load(path_model, params):
            params.use_extra_bufts = False
            return original(path_model, params)

        self.module.llama_model_load_from_file = load
        return self

    def __exit__(self, *exc):
        self.module.llama_model_load_from_file = self.original
        return False


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result_path = Path(spec["result"])
    phase_path = Path(spec["result"] + ".phase")

    def phase(name):
        phase_path.write_text(name)

    phase("cgroup")
    try:  # if memory runs out machine-wide, the measured child goes first, not a bystander
        Path("/proc/self/oom_score_adj").write_text("1000\n")
    except OSError:
        pass
    if spec.get("cgroup_procs"):
        Path(spec["cgroup_procs"]).write_text(f"{os.getpid()}\n")  # before anything big is loaded
    phase("import")
    import numpy as np

    import empanel_gguf
    from empanel_gguf import Llama

    baseline_rss = _proc_status().get("VmRSS")
    kwargs = dict(n_ctx=spec["n_ctx"], n_batch=spec["n_batch"], n_ubatch=spec["n_ubatch"],
                  n_threads=spec["threads"], n_threads_batch=spec["threads"], logits_all=False,
                  seed=0, verbose=True)
    kwargs.update(spec.get("llama_opts") or {})
    if spec["kind"] == EMPANEL:
        kwargs.update(spec.get("moe_opts") or {})
        kwargs["moe_slots"] = spec["moe_slots"]

    phase("load")
    t0 = time.perf_counter()
    if spec["kind"] == MMAP:
        with _MappedWeights(empanel_gguf.llama_cpp):
            llm = Llama(spec["model"], **kwargs)
    else:
        llm = Llama(spec["model"], **kwargs)
    load_s = time.perf_counter() - t0
    after_load = _proc_status()
    prompt, trace = token_trace(llm, spec["n_prompt"], spec["n_gen"])

    warmup = None
    if spec.get("warmup"):
        # like llama-bench, a warm-up run first (other text), so that the measured run sees the
        # steady state (warm pools / page cache), not the first reads after load: a prompt of up
        # to warmup_tokens in pieces of n_prompt, then n_gen decoded tokens, within warmup_s seconds
        phase("warmup")
        w_prompt, w_trace = token_trace(llm, spec["warmup_tokens"], spec["n_gen"], WARMUP_TEXT)
        moe_w0 = _total(llm)
        t0 = time.perf_counter()
        n_pp = 0
        while n_pp < len(w_prompt):
            piece = w_prompt[n_pp:n_pp + max(1, spec["n_prompt"])]
            llm.eval(piece)
            n_pp += len(piece)
            if time.perf_counter() - t0 > spec["warmup_s"]:
                break
        w_pp_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        n_tg = 0
        for tok in w_trace:
            if n_tg >= spec["min_tg"] and time.perf_counter() - t0 > spec["warmup_s"]:
                break
            llm.eval([tok])
            n_tg += 1
        w_tg_s = time.perf_counter() - t1
        llm.reset()  # the next eval drops the warm-up's KV cells
        warmup = {"pp": {"n": n_pp, "s": w_pp_s}, "tg": {"n": n_tg, "s": w_tg_s},
                  "moe": _delta(_total(llm), moe_w0)}

    disk = spec.get("disk_stat")
    io0, moe0, dk0 = _proc_io(), _total(llm), _disk(disk)
    phase("pp")
    t0 = time.perf_counter()
    llm.eval(prompt)
    pp_s = time.perf_counter() - t0
    logits = last_logits(llm)
    pp_finite = bool(np.isfinite(logits).all())
    pp_spread = float(logits.std())
    io1, moe1, dk1 = _proc_io(), _total(llm), _disk(disk)

    phase("tg")
    times, argmax, finite = [], [], True
    t_start = time.perf_counter()
    for tok in trace:
        t0 = time.perf_counter()
        llm.eval([tok])
        t1 = time.perf_counter()
        times.append(t1 - t0)
        logits = last_logits(llm)
        argmax.append(int(np.argmax(logits)))
        finite = finite and bool(np.isfinite(logits).all())
        if t1 - t_start > spec["max_tg_s"] and len(times) >= spec["min_tg"]:
            break
    tg_finite = finite
    io2, moe2, dk2 = _proc_io(), _total(llm), _disk(disk)
    status = _proc_status()

    lib = empanel_gguf._native.lib_dir() / "libempanel.so"
    result = {
        "status": "ok",
        "pid": os.getpid(),
        "empanel_gguf": str(Path(empanel_gguf.__file__).parent),
        "libempanel_mtime": os.stat(lib).st_mtime if lib.exists() else None,
        "load_s": load_s,
        "n_ubatch": int(llm.context_params.n_ubatch),
        "n_batch": int(llm.n_batch),
        "n_threads": spec["threads"],
        "rss_baseline": baseline_rss,
        "rss_after_load": after_load.get("VmRSS"),
        "peak_rss": status.get("VmHWM"),
        "rss_end": status.get("VmRSS"),
        "rss_anon_end": status.get("RssAnon"),
        "rss_file_end": status.get("RssFile"),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "moe_slots_total": (moe2 or {}).get("n_slots"),
        "moe_slots_resolved": getattr(llm, "moe_slots", None),
        "warmup": warmup,
        "pp": {"n": len(prompt), "s": pp_s, "finite": pp_finite, "logit_std": pp_spread,
               "io_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
               "moe": _delta(moe1, moe0), **_disk_delta(dk1, dk0)},
        "tg": {"n": len(times), "s": sum(times), "token_s": times, "finite": tg_finite,
               "argmax": argmax,
               "io_read_bytes": io2.get("read_bytes", 0) - io1.get("read_bytes", 0),
               "moe": _delta(moe2, moe1), **_disk_delta(dk2, dk1)},
        "moe_total": moe2,
    }
    result_path.write_text(json.dumps(result))
    phase("close")
    llm.close()
    phase("done")
    return 0


def _total(llm):
    stats = llm.moe_stats() if hasattr(llm, "moe_stats") else None
    return dict(stats["total"]) if stats else None


# ---------------------------------------------------------------------------------------------
# The parent: runs, samples, rows


@dataclass
class Bench:
    args: argparse.Namespace
    index: object
    model_path: Path
    model_bytes: int
    cap_bytes: int | None
    guard_bytes: int | None
    cgroup: MemCgroup | None
    queue_dir: Path | None
    log_dir: Path
    probe_chunk: int
    probe_depth: int
    probe_direct: bool
    notices: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    drive: list = field(default_factory=list)
    started: str = ""


def log(text):
    print(text, file=sys.stderr, flush=True)


def run_child(bench: Bench, cfg: Config, rep: int, n: int) -> dict:
    """One measured run of `cfg` in a child process; returns the sample."""
    a = bench.args
    stem = f"{n:03d}-{cfg.name.replace('%', 'pct').replace('/', '-')}-{cfg.cap}-r{rep}"
    spec_path = bench.log_dir / f"{stem}.spec.json"
    result_path = bench.log_dir / f"{stem}.result.json"
    log_path = bench.log_dir / f"{stem}.log"
    limit = bench.cap_bytes if cfg.cap == CAP else bench.guard_bytes
    sample = {"config": cfg.name, "cap": cfg.cap, "rep": rep, "kind": cfg.kind,
              "moe_slots": cfg.moe_slots, "limit_bytes": limit, "log": str(log_path)}
    spec = {
        "model": str(bench.model_path), "kind": cfg.kind, "moe_slots": cfg.moe_slots,
        "n_prompt": a.n_prompt, "n_gen": a.n_gen, "n_ctx": a.n_ctx, "n_batch": a.n_batch,
        "n_ubatch": a.n_ubatch, "threads": a.threads, "max_tg_s": a.max_tg_s, "min_tg": a.min_tg,
        "warmup": not a.no_warmup, "warmup_tokens": a.warmup_tokens, "warmup_s": a.warmup_s,
        "moe_opts": dict(a.moe_opt, **({"moe_policy": cfg.moe_policy} if cfg.moe_policy else {})),
        "llama_opts": dict(a.llama_opt), "result": str(result_path),
        "cgroup_procs": None,
        "disk_stat": str(bench.queue_dir.parent / "stat") if bench.queue_dir else None,
    }
    if bench.cgroup is not None and limit is not None:
        bench.cgroup.prepare(limit)
        spec["cgroup_procs"] = str(bench.cgroup.procs)
    elif cfg.cap == CAP:
        return {**sample, "status": "skipped", "error": "no memory cgroup (needs root and cgroup v1)"}
    spec_path.write_text(json.dumps(spec, indent=1))

    ra = None
    if cfg.readahead_kb is not None:
        if bench.queue_dir is None:
            return {**sample, "status": "skipped", "error": "no block device queue found for readahead"}
        ra = Readahead(bench.queue_dir, cfg.readahead_kb)
    oom_before = bench.cgroup.oom_kills() if bench.cgroup is not None else 0
    proc = None
    try:
        if ra is not None:
            try:
                ra.__enter__()
            except OSError as e:
                return {**sample, "status": "skipped", "error": f"cannot set read_ahead_kb: {e}"}
        sample["read_ahead_kb"] = int(_read(bench.queue_dir / "read_ahead_kb", "0")) if bench.queue_dir else None
        if a.wait_idle > 0:
            sample["waited_idle_s"] = wait_for_idle(a.wait_idle, a.idle_pct)
        if not a.no_drop_caches:
            sample["caches_dropped"] = drop_caches()
        if a.probe_s > 0:
            probe = probe_drive(bench.index, a.probe_s, bench.probe_chunk, bench.probe_depth,
                                seed=n, direct=bench.probe_direct)
            sample["drive"] = probe
        env = dict(os.environ)  # the child measures the very package this process uses
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t0 = time.perf_counter()
        jiffies0, self0 = cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "empanel_gguf.bench", "--child", str(spec_path)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            rusage, wait_status, timed_out = None, None, False
            while True:
                pid, wait_status, rusage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() - t0 > a.timeout:
                    timed_out = True
                    os.kill(proc.pid, signal.SIGKILL)
                    _, wait_status, rusage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.05)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
        sample["wall_s"] = time.perf_counter() - t0
        jiffies1, self1 = cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
        sample.update(_contention(jiffies0, jiffies1, self0, self1, rusage, sample["wall_s"]))
        if a.probe_s > 0:
            sample["drive_after"] = probe_drive(bench.index, a.probe_s, bench.probe_chunk, bench.probe_depth,
                                                seed=10_000 + n, direct=bench.probe_direct)
    finally:
        if proc is not None and proc.returncode is None:  # interrupted while it ran
            try:
                os.kill(proc.pid, signal.SIGKILL)
                os.waitpid(proc.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        if ra is not None and ra.original is not None:
            ra.__exit__(None, None, None)

    sample["returncode"] = proc.returncode
    sample["child_maxrss"] = rusage.ru_maxrss * 1024 if rusage is not None else None
    phase = _read(str(result_path) + ".phase", "?")
    sample["phase"] = phase
    if bench.cgroup is not None and limit is not None:
        sample["cgroup_peak"] = bench.cgroup.max_usage()
        sample["cgroup_failcnt"] = bench.cgroup.failcnt()
        oom = bench.cgroup.oom_kills() - oom_before
        sample["oom_kills"] = oom
    else:
        oom = 0
    if result_path.exists():
        sample.update(json.loads(result_path.read_text()))
        if proc.returncode != 0:  # measured, then died closing
            sample["status"] = "ok"
            sample["close_error"] = f"exit {proc.returncode} in phase {phase}"
    elif timed_out:
        sample["status"] = "timeout"
        sample["error"] = f"no result after {a.timeout:.0f} s (phase {phase})"
    elif oom or proc.returncode == -signal.SIGKILL:
        sample["status"] = "oom"
        sample["error"] = f"OOM-killed during {phase}" if oom else f"SIGKILL during {phase}"
    else:
        sample["status"] = "error"
        sample["error"] = f"exit {proc.returncode} during {phase}: " + _tail(log_path)
    if sample.get("peak_rss") is None:
        sample["peak_rss"] = sample["child_maxrss"]
    return sample


def _contention(j0, j1, self0, self1, child, wall_s) -> dict:
    """User CPU time other processes used while the child ran, as a share of all CPUs (this
    process and the child excluded). User time only: the kernel time around our own I/O (softirq,
    kworkers, kswapd) is not attributable to the child but is not competition either."""
    hz = os.sysconf("SC_CLK_TCK")
    user_s = (j1[0] - j0[0]) / hz
    total_s = (j1[2] - j0[2]) / hz
    mine = self1.ru_utime - self0.ru_utime
    child_user = child.ru_utime if child is not None else 0.0
    others = max(0.0, user_s - mine - child_user)
    return {"child_cpu_s": (child.ru_utime + child.ru_stime) if child is not None else None,
            "others_cpu_s": others,
            "others_cpu_pct": 100 * others / total_s if total_s > 0 else None,
            "machine_busy_pct": 100 * (j1[1] - j0[1]) / hz / total_s if total_s > 0 else None,
            "steal_pct": 100 * (j1[3] - j0[3]) / hz / total_s if total_s > 0 else None}


def _tail(path, n=600):
    try:
        data = Path(path).read_bytes()[-n:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip().replace("\n", " | ")


def sample_metrics(s: dict) -> dict:
    """Per-sample numbers for the tables (absent where not applicable)."""
    if s.get("status") != "ok":
        return {}
    m = {}
    for ph in ("pp", "tg"):
        d = s[ph]
        n, sec = d["n"], d["s"]
        moe = d.get("moe")
        m[f"{ph}_tps"] = n / sec if sec > 0 else None
        m[f"{ph}_io_per_tok"] = d["io_read_bytes"] / n if n else None
        if moe and n:
            m[f"{ph}_read_per_tok"] = moe.get("bytes_read", 0) / n
            m[f"{ph}_hit"] = moe.get("hit_rate")
            read_s = moe.get("read_s", 0)
            # what the drive delivered (aligned windows) while the reader read
            drive_bytes = moe.get("io_bytes") or moe.get("bytes_read", 0)
            m[f"{ph}_reader_gbps"] = drive_bytes / read_s / 1e9 if read_s else None
            m[f"{ph}_wait_ms"] = 1000 * moe.get("remap_s", 0) / n
            m[f"{ph}_read_ms"] = 1000 * read_s / n
            if "write_s" in moe:
                m[f"{ph}_write_ms"] = 1000 * moe["write_s"] / n
            m[f"{ph}_compute_ms"] = 1000 * (sec - moe.get("remap_s", 0)) / n
            remaps = moe.get("n_remaps", 0)
            m[f"{ph}_waves"] = moe.get("n_waves", 0) / remaps if remaps else None  # per layer, micro-batch
            m[f"{ph}_read_bytes"] = moe.get("bytes_read", 0)
            m[f"{ph}_hidden_pct"] = (100 * max(0.0, read_s - moe.get("wait_s", 0)) / read_s
                                     if read_s else None)  # reads done while the graph computed
        else:
            m[f"{ph}_read_per_tok"] = m[f"{ph}_io_per_tok"]
            m[f"{ph}_compute_ms"] = 1000 * sec / n if n else None
        if d.get("dev_busy_s"):  # the disk's own view: rate while busy, share of the phase busy
            m[f"{ph}_dev_gbps"] = d["dev_read_bytes"] / d["dev_busy_s"] / 1e9
            m[f"{ph}_dev_busy_pct"] = 100 * d["dev_busy_s"] / sec if sec > 0 else None
    w = s.get("warmup")  # the first run after load: cold pools / page cache
    if w:
        for ph in ("pp", "tg"):
            if w[ph]["n"] and w[ph]["s"] > 0:
                m[f"cold_{ph}_tps"] = w[ph]["n"] / w[ph]["s"]
    m["peak_rss"] = s.get("peak_rss")
    m["load_s"] = s.get("load_s")
    m["cgroup_peak"] = s.get("cgroup_peak")
    m["others_cpu_pct"] = s.get("others_cpu_pct")
    probes = [p.get("gbps") for p in (s.get("drive"), s.get("drive_after")) if p and p.get("gbps")]
    m["drive_gbps"] = sum(probes) / len(probes) if probes else None
    return m


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _stdev(values):
    values = [v for v in values if v is not None]
    return statistics.stdev(values) if len(values) > 1 else None


def build_rows(bench: Bench, configs: list[Config]) -> list[dict]:
    """One row per configuration: medians over its ok samples, status otherwise."""
    rows = []
    for cfg in configs:
        mine = [s for s in bench.samples
                if s["config"] == cfg.name and s["cap"] == cfg.cap and not s.get("discarded")]
        if not mine:
            continue
        ok = [s for s in mine if s["status"] == "ok"]
        metrics = [sample_metrics(s) for s in ok]
        row = {"config": cfg.name, "cap": cfg.cap, "kind": cfg.kind, "moe_slots": cfg.moe_slots,
               "moe_policy": cfg.moe_policy,
               "n_samples": len(mine), "n_ok": len(ok),
               "status": ("ok" if len(ok) == len(mine) else f"ok {len(ok)}/{len(mine)}") if ok else mine[0]["status"],
               "error": None if ok else mine[0].get("error")}
        keys = sorted({k for m in metrics for k in m})
        for k in keys:
            row[k] = _median([m.get(k) for m in metrics])
        row["tg_tps_sd"] = _stdev([m.get("tg_tps") for m in metrics])
        row["pp_tps_sd"] = _stdev([m.get("pp_tps") for m in metrics])
        row["tg_tps_samples"] = [m.get("tg_tps") for m in metrics]
        row["pp_tps_samples"] = [m.get("pp_tps") for m in metrics]
        if ok:
            row["n_ubatch"] = ok[0].get("n_ubatch")
            row["n_tg"] = ok[0]["tg"]["n"]
            row["n_pp"] = ok[0]["pp"]["n"]
            row["slots_per_layer"] = (ok[0]["moe_slots_total"] // len(bench.index.layers)
                                      if ok[0].get("moe_slots_total") else None)
            row["moe_slots_resolved"] = ok[0].get("moe_slots_resolved", cfg.moe_slots)
            row["argmax"] = ok[0]["tg"]["argmax"]
            row["finite"] = all(s["pp"]["finite"] and s["tg"]["finite"] for s in ok)
        else:
            row["peak_rss"] = _median([s.get("peak_rss") for s in mine])
            row["cgroup_peak"] = _median([s.get("cgroup_peak") for s in mine])
        rows.append(row)

    # drive-bound ceiling for the empanel rows
    resident = _find(rows, STOCK, CAP_NONE) or _find(rows, "empanel-100%", CAP_NONE)
    resident_tps = resident.get("tg_tps") if resident else None
    global_drive = _median([d.get("gbps") for d in bench.drive])
    reference = _find(rows, STOCK, CAP_NONE)
    for row in rows:
        if not row["status"].startswith("ok"):
            continue
        if reference is not None and reference.get("argmax") and row.get("argmax"):
            ref, mine = reference["argmax"], row["argmax"]
            n = min(len(ref), len(mine))
            row["argmax_agree"] = f"{sum(x == y for x, y in zip(ref, mine))}/{n}"
        if row["kind"] != EMPANEL:
            continue
        drive = row.get("drive_gbps") or global_drive
        per_tok = row.get("tg_read_per_tok")
        if drive and per_tok:
            bound = drive * 1e9 / per_tok
            ceiling = min(bound, resident_tps) if resident_tps else bound
        elif resident_tps:  # nothing read: compute-bound
            ceiling = resident_tps
        else:
            ceiling = None
        row["ceiling_tps"] = ceiling
        row["pct_ceiling"] = 100 * row["tg_tps"] / ceiling if ceiling and row.get("tg_tps") else None
        if drive and row.get("tg_reader_gbps"):
            row["reader_pct_drive"] = 100 * row["tg_reader_gbps"] / drive
    return rows


def _find(rows, name, cap):
    for row in rows:
        if row["config"] == name and row["cap"] == cap and row["status"].startswith("ok"):
            return row
    return None


# ---------------------------------------------------------------------------------------------
# Formatting


def fmt_bytes(n, unit=None):
    if n is None:
        return "-"
    if unit is None:
        unit = "GiB" if abs(n) >= GiB else "MiB"
    return f"{n / (GiB if unit == 'GiB' else MiB):.2f} {unit}"


def fmt(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(str(c).rjust(widths[i]) if numeric[i] else str(c).ljust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = "| " + " | ".join(("-" * (w - 1) + ":") if numeric[i] else "-" * w
                            for i, w in enumerate(widths)) + " |"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _looks_numeric(cell):
    text = str(cell).split(" ")[0].rstrip("%")
    try:
        float(text)
        return True
    except ValueError:
        return text == "-"


def model_label(bench: Bench) -> str:
    ix = bench.index
    types = sorted({t.type_name for t in ix.expert_tensors()})
    return f"{ix.architecture} {ix.n_layer}L {ix.n_expert}x top-{ix.n_expert_used} {'/'.join(types)}"


def cap_label(bench: Bench, cap: str) -> str:
    if cap == CAP_NONE:
        return "none"
    return f"{bench.cap_bytes / GiB:.1f} GiB ({100 * bench.args.cap:.0f}%)"


def slots_label(bench: Bench, row) -> str:
    if row["kind"] == STOCK:
        return "- (repack)"
    if row["kind"] == MMAP:
        return "- (mmap)"
    per = row.get("slots_per_layer")
    return f"{row['moe_slots']} ({per})" if per and str(per) != str(row["moe_slots"]) else str(row["moe_slots"])


def tps_cell(row, ph) -> str:
    v, sd = row.get(f"{ph}_tps"), row.get(f"{ph}_tps_sd")
    if v is None:
        return "-"
    prec = 2 if v < 100 else 1
    return f"{v:.{prec}f} ± {sd:.{prec}f}" if sd is not None else f"{v:.{prec}f}"


def main_table(bench: Bench, rows) -> str:
    a = bench.args
    headers = ["model", "size", "config", "moe_slots", "cap", "n_ubatch", "test", "t/s", "peak RSS",
               "read/tok", "hit %", "reader GB/s", "drive GB/s", "% ceil"]
    model, size = model_label(bench), fmt_bytes(bench.model_bytes, "GiB")
    out = []
    for row in rows:
        base = [model, size, row["config"], slots_label(bench, row), cap_label(bench, row["cap"])]
        if not row["status"].startswith("ok"):
            what = {"oom": "OOM-killed", "timeout": "timeout", "skipped": "skipped"}.get(row["status"], "error")
            phase = (row.get("error") or "").replace("OOM-killed ", "")
            out.append(base + ["-", "load" if "load" in phase else phase[:24], what,
                               fmt_bytes(row.get("peak_rss")), "-", "-", "-", "-", "-"])
            continue
        for ph, n in (("pp", row.get("n_pp", a.n_prompt)), ("tg", row.get("n_tg", a.n_gen))):
            empanel = row["kind"] == EMPANEL
            out.append(base + [
                row.get("n_ubatch", "-"), f"{ph}{n}", tps_cell(row, ph), fmt_bytes(row.get("peak_rss")),
                fmt_bytes(row.get(f"{ph}_read_per_tok")),
                fmt(100 * row[f"{ph}_hit"] if empanel and row.get(f"{ph}_hit") is not None else None, ".1f"),
                fmt(row.get(f"{ph}_reader_gbps")) if empanel else "-",
                fmt(row.get("drive_gbps")) if ph == "tg" and empanel else "-",
                fmt(row.get("pct_ceiling"), ".0f") if ph == "tg" and empanel else "-",
            ])
    return markdown(headers, out)


def details_table(bench: Bench, rows) -> str:
    """Where the decode time goes, per row (medians; ms per decoded token). 'cold': the warm-up
    run right after load, before the measured one."""
    headers = ["config", "cap", "status", "load s", "cold pp t/s", "cold tg t/s", "peak RSS", "cgroup peak", "tg io/tok", "read ms",
               "write ms", "wait ms", "compute ms", "disk GB/s busy", "disk busy %", "ceiling t/s",
               "reader % drive", "others' CPU %", "argmax = stock", "pp waves", "pp read", "pp hidden %",
               "pp wait ms"]
    out = []
    for row in rows:
        status = row["status"] if row["status"].startswith("ok") else (row.get("error") or row["status"])[:40]
        out.append([row["config"], row["cap"], status, fmt(row.get("load_s"), ".1f"),
                    fmt(row.get("cold_pp_tps")), fmt(row.get("cold_tg_tps")), fmt_bytes(row.get("peak_rss")),
                    fmt_bytes(row.get("cgroup_peak")), fmt_bytes(row.get("tg_io_per_tok")),
                    fmt(row.get("tg_read_ms"), ".1f"), fmt(row.get("tg_write_ms"), ".1f"),
                    fmt(row.get("tg_wait_ms"), ".1f"), fmt(row.get("tg_compute_ms"), ".1f"),
                    fmt(row.get("tg_dev_gbps")), fmt(row.get("tg_dev_busy_pct"), ".0f"), fmt(row.get("ceiling_tps")), fmt(row.get("reader_pct_drive"), ".0f"),
                    fmt(row.get("others_cpu_pct"), ".0f"), row.get("argmax_agree", "-"),
                    fmt(row.get("pp_waves"), ".1f"), fmt_bytes(row.get("pp_read_bytes")),
                    fmt(row.get("pp_hidden_pct"), ".0f"), fmt(row.get("pp_wait_ms"), ".1f")])
    return markdown(headers, out)


def kv_bytes(bench: Bench) -> int:
    """f16 K and V cache of the context the runs use."""
    import gguf

    reader = gguf.GGUFReader(bench.model_path)
    arch = bench.index.architecture

    def get(key, default):
        f = reader.get_field(f"{arch}.{key}")
        return int(f.contents()) if f is not None else default

    n_embd = get("embedding_length", 0)
    n_head = get("attention.head_count", 1)
    n_head_kv = get("attention.head_count_kv", n_head)
    k_len = get("attention.key_length", n_embd // max(1, n_head))
    v_len = get("attention.value_length", k_len)
    return bench.index.n_layer * bench.args.n_ctx * n_head_kv * (k_len + v_len) * 2


def targets(bench: Bench, rows) -> list[str]:
    """Issue 4's targets, each measured or said why not."""
    from .sizing import DEFAULT_POLICY, plan_slots

    lines = []
    stock = _find(rows, STOCK, CAP_NONE)
    full = _find(rows, "empanel-100%", CAP_NONE)
    if stock and full:
        r = full["tg_tps"] / stock["tg_tps"]
        lines.append(f"- 100% slots vs stock resident decode: {full['tg_tps']:.2f} / {stock['tg_tps']:.2f} t/s "
                     f"= {r:.3f}x (target >= 0.99) {'MET' if r >= 0.99 else 'MISSED'}; "
                     f"tg hit rate {fmt(100 * full['tg_hit'] if full.get('tg_hit') is not None else None, '.1f')}%")
    else:
        lines.append("- 100% slots vs stock resident: not measured (needs stock@none and empanel-100%@none)")
    mmap128 = None
    for row in rows:
        if row["kind"] == MMAP and row["cap"] == CAP and row["status"].startswith("ok") and \
                (row["config"].endswith("-ra128")):
            mmap128 = row
    capped = [r for r in rows if r["kind"] == EMPANEL and r["cap"] == CAP and r["status"].startswith("ok")]
    if mmap128 and capped:
        best = max(capped, key=lambda r: r["tg_tps"])
        r = best["tg_tps"] / mmap128["tg_tps"]
        lines.append(f"- under the cap: best empanel ({best['config']}) {best['tg_tps']:.2f} t/s vs stock mmap "
                     f"@128 KiB readahead {mmap128['tg_tps']:.2f} t/s = {r:.1f}x (target >= 3) "
                     f"{'MET' if r >= 3 else 'MISSED'}")
    else:
        lines.append("- under the cap vs stock mmap @128 KiB: not measured")
    for row in rows:
        if row["kind"] != EMPANEL or not row["status"].startswith("ok"):
            continue
        parts = [f"- {row['config']}@{row['cap']}:"]
        if row.get("pct_ceiling") is not None:
            parts.append(f"{row['tg_tps']:.2f} t/s = {row['pct_ceiling']:.0f}% of ceiling "
                         f"{row['ceiling_tps']:.2f} t/s (target >= 85%) {'MET' if row['pct_ceiling'] >= 85 else 'MISSED'};")
        if row.get("reader_pct_drive") is not None:
            parts.append(f"reader {row['tg_reader_gbps']:.2f} GB/s = {row['reader_pct_drive']:.0f}% of drive "
                         f"(target >= 85%) {'MET' if row['reader_pct_drive'] >= 85 else 'MISSED'};")
        if row.get("tg_wait_ms") is not None:
            resident_ms = 1000 / stock["tg_tps"] if stock and stock.get("tg_tps") else None
            parts.append(f"per token: waiting {row['tg_wait_ms']:.1f} ms (read {fmt(row.get('tg_read_ms'), '.1f')}, "
                         f"slot writes {fmt(row.get('tg_write_ms'), '.1f')}) + compute {fmt(row.get('tg_compute_ms'), '.1f')} ms "
                         f"(resident {fmt(resident_ms, '.1f')} ms);")
        try:
            policy = row.get("moe_policy") or dict(bench.args.moe_opt).get("moe_policy", DEFAULT_POLICY)
            pools = plan_slots(bench.index, row.get("moe_slots_resolved") or row["moe_slots"], policy).pool_bytes
        except Exception:  # noqa: BLE001  (a sizing error is reported, not raised)
            pools = None
        if pools is not None and row.get("peak_rss"):
            budget = 1.05 * (bench.index.other_bytes_total + pools + kv_bytes(bench))
            base = _median([s.get("rss_baseline") for s in bench.samples
                            if s["config"] == row["config"] and s["cap"] == row["cap"] and s["status"] == "ok"
                            and not s.get("discarded")]) or 0
            ok = row["peak_rss"] - base <= budget
            parts.append(f"peak RSS {fmt_bytes(row['peak_rss'])} ({fmt_bytes(row['peak_rss'] - base)} without the "
                         f"{fmt_bytes(base)} interpreter) vs budget {fmt_bytes(budget)} "
                         f"(weights+pools+KV+5%) {'MET' if ok else 'MISSED'}")
        lines.append(" ".join(parts))
    return lines


# ---------------------------------------------------------------------------------------------
# Driver


def build_info() -> dict:
    import empanel_gguf
    from empanel_gguf import _native, _pins

    info = {"empanel_gguf": str(Path(empanel_gguf.__file__).parent), "lib_dir": str(_native.lib_dir()),
            "llama_commit": _pins.LLAMA_COMMIT, "python": sys.version.split()[0]}
    try:
        root = Path(empanel_gguf.__file__).resolve().parent.parent
        head = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            info["git"] = head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def host_info(queue_dir) -> dict:
    cpu = ""
    for line in (_read("/proc/cpuinfo", "") or "").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = meminfo()
    return {"node": platform.node(), "kernel": platform.release(), "cpu": cpu, "n_cpu": os.cpu_count(),
            "mem_total": mem.get("MemTotal"), "mem_available": mem.get("MemAvailable"),
            "block_queue": str(queue_dir) if queue_dir else None,
            "read_ahead_kb": int(_read(queue_dir / "read_ahead_kb", "0")) if queue_dir else None}


def write_json(bench: Bench, configs, rows=None, tables=None):
    if not bench.args.json:
        return
    a = bench.args
    doc = {
        "bench_version": 1,
        "started": bench.started,
        "argv": sys.argv,
        "host": host_info(bench.queue_dir),
        "build": build_info(),
        "model": {"path": str(bench.model_path), "bytes": bench.model_bytes, "label": model_label(bench),
                  "architecture": bench.index.architecture, "n_layer": bench.index.n_layer,
                  "n_expert": bench.index.n_expert, "n_expert_used": bench.index.n_expert_used,
                  "expert_bytes_total": bench.index.expert_bytes_total,
                  "other_bytes_total": bench.index.other_bytes_total,
                  "cold_bytes_per_token": bench.index.cold_bytes_per_token,
                  "expert_bytes": [l.expert_bytes for l in bench.index.layers]},
        "params": {"n_prompt": a.n_prompt, "n_gen": a.n_gen, "repetitions": a.repetitions, "threads": a.threads,
                   "warmup": not a.no_warmup, "warmup_tokens": a.warmup_tokens, "warmup_s": a.warmup_s,
                   "n_ctx": a.n_ctx, "n_batch": a.n_batch, "n_ubatch": a.n_ubatch, "cap_fraction": a.cap,
                   "cap_bytes": bench.cap_bytes, "guard_bytes": bench.guard_bytes, "max_tg_s": a.max_tg_s,
                   "timeout_s": a.timeout, "moe_opts": dict(a.moe_opt), "llama_opts": dict(a.llama_opt),
                   "probe_s": a.probe_s, "probe_chunk_bytes": bench.probe_chunk, "probe_depth": bench.probe_depth,
                   "probe_direct": bench.probe_direct, "drop_caches": not a.no_drop_caches,
                   "configs": [c.key for c in configs], "log_dir": str(bench.log_dir)},
        "notices": bench.notices,
        "drive": bench.drive,
        "samples": bench.samples,
        "rows": rows,
        "tables": tables,
    }
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, out)


def setup_arg_parser():
    p = argparse.ArgumentParser(prog="empanel-gguf bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", help="an existing MoE GGUF to benchmark")
    g.add_argument("--write-model", metavar="PATH",
                   help="write a synthetic model of the shape below to PATH (reused if identical), then bench it")
    g.add_argument("--write-only", action="store_true", help="stop after --write-model")
    d = ModelShape()
    g.add_argument("--layers", type=int, default=d.n_layer, help=f"(default: {d.n_layer})")
    g.add_argument("--experts", type=int, default=d.n_expert, help=f"(default: {d.n_expert})")
    g.add_argument("--top-k", type=int, default=d.n_expert_used, help=f"(default: {d.n_expert_used})")
    g.add_argument("--embd", type=int, default=d.n_embd, help=f"(default: {d.n_embd})")
    g.add_argument("--expert-ff", type=int, default=d.n_ff_exp, help=f"(default: {d.n_ff_exp})")
    g.add_argument("--heads", type=int, default=d.n_head, help=f"(default: {d.n_head})")
    g.add_argument("--heads-kv", type=int, default=d.n_head_kv, help=f"(default: {d.n_head_kv})")
    g.add_argument("--head-dim", type=int, default=d.head_dim, help=f"(default: {d.head_dim})")
    g.add_argument("--seed", type=int, default=d.seed, help="weights seed (default: 0)")

    g = p.add_argument_group("runs")
    g.add_argument("-r", "--repetitions", type=int, default=3, help="runs per configuration (default: 3)")
    g.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens (default: 64)")
    g.add_argument("-n", "--n-gen", type=int, default=32, help="decoded tokens (default: 32)")
    g.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    g.add_argument("-c", "--n-ctx", type=int, default=None, help="context (default: the longer of prompt and warm-up prompt, + gen + 16)")
    g.add_argument("-b", "--n-batch", type=int, default=512, help="(default: 512)")
    g.add_argument("-ub", "--n-ubatch", type=int, default=512,
                   help="(default: 512; slot runs keep it: micro-batches larger than the pools run in waves)")
    g.add_argument("--configs", default=None,
                   help="comma list of stock, stock-mmap, stock-mmap-ra<KB>, empanel-<N|P%|size|min|auto>"
                        "[/<moe_policy>]; each "
                        "runs uncapped and capped, or only as name@none / name@cap "
                        f"(default: {','.join(DEFAULT_CONFIGS)})".replace("%", "%%"))
    g.add_argument("--cap", type=float, default=0.4, help="memory cap as a share of the model file (default: 0.4)")
    g.add_argument("--no-cap", action="store_true", help="drop the capped configurations")
    g.add_argument("--no-cgroup", action="store_true",
                   help="no cgroups at all (capped configurations are then skipped)")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before runs")
    g.add_argument("--max-tg-s", type=float, default=120.0,
                   help="stop decoding a run after this many seconds (at least --min-tg tokens; default: 120)")
    g.add_argument("--min-tg", type=int, default=4, help="(default: 4)")
    g.add_argument("--no-warmup", action="store_true",
                   help="measure the first prompt and tokens after load (default: a warm-up run on "
                        "other text first, as llama-bench does)")
    g.add_argument("--warmup-tokens", type=int, default=256,
                   help="warm-up prompt tokens, then n-gen decoded (default: 256)")
    g.add_argument("--warmup-s", type=float, default=30.0,
                   help="the warm-up stops after this many seconds (default: 30)")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds per child run (default: 1800)")
    g.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each run wait up to S seconds for user processes to keep the CPUs under --idle-pct busy "
                        "(a shared machine; default: 0, no waiting)")
    g.add_argument("--idle-pct", type=float, default=15.0, help="(default: 15)")
    g.add_argument("--retry-busy", type=int, default=0, metavar="N",
                   help="run a sample again (up to N times) when other processes took more than --busy-pct "
                        "of the CPUs (user time) while it ran; the discarded samples stay in the JSON (default: 0)")
    g.add_argument("--busy-pct", type=float, default=25.0, help="(default: 25)")
    g.add_argument("--moe-opt", action="append", type=parse_opt, default=[], metavar="KEY=VALUE",
                   help="extra Llama kwarg for the empanel runs, e.g. moe_io_threads=8 moe_chunk_kb=256 "
                        "moe_direct_io=true (repeatable)")
    g.add_argument("--llama-opt", action="append", type=parse_opt, default=[], metavar="KEY=VALUE",
                   help="extra Llama kwarg for every run (repeatable)")

    g = p.add_argument_group("drive probe")
    g.add_argument("--probe-s", type=float, default=3.0,
                   help="seconds of O_DIRECT reads before and after every run, and twice that at start and end (0: off)")
    g.add_argument("--probe-chunk-kb", type=int, default=None, help="(default: moe_chunk_kb, else 256)")
    g.add_argument("--probe-depth", type=int, default=None,
                   help="threads reading at once (default: moe_io_threads + 1, else 9: the reader's 8 and the caller)")

    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="OUT", help="write every sample and the rows as JSON")
    g.add_argument("--log-dir", help="child logs and specs (default: a new folder under the temp dir)")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return p


def _configs(args, top_k) -> list[Config]:
    items = args.configs.split(",") if args.configs else list(DEFAULT_CONFIGS)
    configs = []
    for item in items:
        if item.strip():
            configs += parse_config(item, top_k)
    if args.no_cap:
        configs = [c for c in configs if c.cap != CAP]
    seen, out = set(), []
    for c in configs:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    # uncapped first (as listed), then capped
    return [c for c in out if c.cap == CAP_NONE] + [c for c in out if c.cap == CAP]


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.child:
        return child_main(args.child)

    if bool(args.model) == bool(args.write_model):
        raise SystemExit("bench: give a model (-m MODEL.gguf) or --write-model PATH")
    if args.write_model:
        shape = ModelShape(n_layer=args.layers, n_expert=args.experts, n_expert_used=args.top_k,
                           n_embd=args.embd, n_ff_exp=args.expert_ff, n_head=args.heads,
                           n_head_kv=args.heads_kv, head_dim=args.head_dim, seed=args.seed)
        model = write_model(shape, args.write_model, log=log)
        if args.write_only:
            return 0
    else:
        model = Path(args.model)

    from empanel_gguf.index import load_index

    index = load_index(model)
    if not index.is_moe:
        raise SystemExit(f"bench: {model} has no routed experts")
    longest = max(args.n_prompt, 0 if args.no_warmup else args.warmup_tokens) + args.n_gen
    args.n_ctx = args.n_ctx or max(64, longest + 16)
    moe_opts = dict(args.moe_opt)
    args.moe_opt = list(moe_opts.items())
    args.llama_opt = list(dict(args.llama_opt).items())
    configs = _configs(args, index.n_expert_used)
    model_bytes = sum(s.file_size for s in index.shards)

    started = time.strftime("%Y%m%d-%H%M%S")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=f"empanel-bench-{started}-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    cgroup, notices = None, []
    mem = meminfo()
    guard = None
    if not args.no_cgroup and (any(c.cap == CAP for c in configs) or os.geteuid() == 0):
        try:
            cgroup = MemCgroup(f"empanel-bench-{os.getpid()}")
            # uncapped runs still get a guard (available memory less 1 GiB), so an OOM kill hits the
            # measured child and not another process on the machine
            guard = max(GiB, mem.get("MemAvailable", 0) - GiB) if mem.get("MemAvailable") else None
        except OSError as e:
            notices.append(f"no memory cgroup ({e}); capped configurations are skipped")
    queue_dir = block_queue_dir(model)
    if any(c.readahead_kb is not None for c in configs) and queue_dir is None:
        notices.append(f"no block queue found for {model}; readahead configurations are skipped")
    if not args.no_drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        notices.append("/proc/sys/vm/drop_caches is not writable: runs start with whatever is cached")

    probe_chunk = (args.probe_chunk_kb or moe_opts.get("moe_chunk_kb") or 256) * 1024
    probe_depth = args.probe_depth or ((moe_opts["moe_io_threads"] + 1) if moe_opts.get("moe_io_threads") else 9)
    probe_direct = moe_opts.get("moe_direct_io", True) not in (False, 0, -1)
    bench = Bench(args=args, index=index, model_path=Path(model), model_bytes=model_bytes,
                  cap_bytes=int(args.cap * model_bytes), guard_bytes=guard, cgroup=cgroup,
                  queue_dir=queue_dir, log_dir=log_dir, probe_chunk=probe_chunk, probe_depth=probe_depth,
                  probe_direct=probe_direct, notices=notices, started=started)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)
    log(f"bench: {model} ({model_bytes / GiB:.2f} GiB; experts {index.expert_bytes_total / GiB:.2f} GiB, "
        f"rest {index.other_bytes_total / MiB:.0f} MiB; {index.cold_bytes_per_token / MiB:.0f} MiB/token cold)")
    log(f"bench: {len(configs)} configurations x {args.repetitions}: {', '.join(c.key for c in configs)}")
    log(f"bench: cap {bench.cap_bytes / GiB:.2f} GiB, guard {fmt_bytes(guard)}, readahead queue {queue_dir}, "
        f"logs in {log_dir}")
    for text in notices:
        log(f"bench: NOTE {text}")
    rows, tables = None, None
    t_start = time.perf_counter()
    try:
        if args.probe_s > 0:
            bench.drive.append({"when": "start", **(probe_drive(index, 2 * args.probe_s, probe_chunk, probe_depth,
                                                                 seed=-1, direct=probe_direct) or {})})
            log(f"bench: drive (O_DIRECT, {probe_chunk // 1024} KiB x {probe_depth}): "
                f"{fmt(bench.drive[-1].get('gbps'))} GB/s {bench.drive[-1].get('error', '')}")
        n = 0
        dead = {}  # configuration -> why it is not repeated (OOM, skipped, error, timeout at load)
        total = len(configs) * args.repetitions
        for rep in range(1, args.repetitions + 1):
            for cfg in configs:
                n += 1
                if cfg.key in dead:
                    log(f"bench: [{n}/{total}] {cfg.key} rep {rep}: not repeated ({dead[cfg.key]})")
                    continue
                for attempt in range(args.retry_busy + 1):
                    t0 = time.perf_counter()
                    s = run_child(bench, cfg, rep, n if attempt == 0 else 1000 * attempt + n)
                    bench.samples.append(s)
                    log(f"bench: [{n}/{total}] {cfg.key} rep {rep}: {_progress(s)} ({time.perf_counter() - t0:.0f} s)")
                    busy = s.get("others_cpu_pct")
                    if s["status"] != "ok" or busy is None or busy <= args.busy_pct or attempt == args.retry_busy:
                        break
                    s["discarded"] = f"other processes used {busy:.0f}% of the CPUs during the run"
                    log(f"bench:   discarded: {s['discarded']}; running it again")
                    write_json(bench, configs)
                if s["status"] in ("oom", "skipped", "error") or (s["status"] == "timeout" and s.get("phase") == "load"):
                    dead[cfg.key] = f"{s['status']} in rep {rep}"
                write_json(bench, configs)
        if args.probe_s > 0:
            bench.drive.append({"when": "end", **(probe_drive(index, 2 * args.probe_s, probe_chunk, probe_depth,
                                                               seed=-2, direct=probe_direct) or {})})
            log(f"bench: drive at the end: {fmt(bench.drive[-1].get('gbps'))} GB/s")
    except KeyboardInterrupt:
        log("bench: interrupted; reporting what was measured")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if cgroup is not None:
            cgroup.remove()
        rows = build_rows(bench, configs)
        tables = {"main": main_table(bench, rows), "details": details_table(bench, rows),
                  "targets": targets(bench, rows)}
        write_json(bench, configs, rows, tables)
    print(f"\n{tables['main']}\n")
    print(f"{tables['details']}\n")
    drives = [f"{d['when']} {d['gbps']:.2f}" for d in bench.drive if d.get("gbps")]
    per = [s["drive"]["gbps"] for s in bench.samples if (s.get("drive") or {}).get("gbps")]
    print(f"drive O_DIRECT ({probe_chunk // 1024} KiB chunks, depth {probe_depth}): "
          f"{', '.join(drives) or '-'} GB/s; before each run: median {fmt(_median(per))}, "
          f"min {fmt(min(per) if per else None)}, max {fmt(max(per) if per else None)} GB/s")
    warm = (f"after a warm-up on other text (pp{args.warmup_tokens} + tg{args.n_gen}, at most "
            f"{args.warmup_s:.0f} s)" if not args.no_warmup else "cold, right after load")
    print(f"threads {args.threads}, pp{args.n_prompt} / tg{args.n_gen} {warm}, {args.repetitions} repetitions, "
          f"t/s median ± sd; read/tok: expert bytes read (empanel) or bytes the process read from the "
          f"drive (/proc/pid/io, stock); total {time.perf_counter() - t_start:.0f} s\n")
    print("targets (issue 4):")
    for line in tables["targets"]:
        print(line)
    for text in notices:
        print(f"NOTE: {text}")
    if args.json:
        log(f"bench: JSON in {args.json}")
    return 0


def _progress(s) -> str:
    if s["status"] != "ok":
        return f"{s['status'].upper()}: {s.get('error', '')} (peak RSS {fmt_bytes(s.get('peak_rss'))})"
    m = sample_metrics(s)
    hit = f", hit {100 * m['tg_hit']:.0f}%" if m.get("tg_hit") is not None else ""
    return (f"load {m['load_s']:.1f} s, pp {fmt(m['pp_tps'])} t/s, tg {fmt(m['tg_tps'])} t/s{hit}, "
            f"read/tok {fmt_bytes(m.get('tg_read_per_tok'))}, peak RSS {fmt_bytes(m['peak_rss'])}, "
            f"drive {fmt(m.get('drive_gbps'))} GB/s, others' CPU {fmt(m.get('others_cpu_pct'), '.0f')}%")


if __name__ == "__main__":
    sys.exit(main())
