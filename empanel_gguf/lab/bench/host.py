"""The machine the benchmark runs on: memory cgroups, the page cache, readahead, CPU load, the drive's own O_DIRECT rate."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path


ALIGN = 4096  # O_DIRECT alignment used by the drive probe (as the sidecar's reader)


def read_sys(path, default=None):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


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
        for line in (read_sys("/proc/self/cgroup", "") or "").splitlines():
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
        for line in (read_sys(self.path / "memory.oom_control", "") or "").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def max_usage(self) -> int:
        return int(read_sys(self.path / "memory.max_usage_in_bytes", "0") or 0)

    def failcnt(self) -> int:
        return int(read_sys(self.path / "memory.failcnt", "0") or 0)

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
        for line in (read_sys("/proc/self/mountinfo", "") or "").splitlines():
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
    fields = [int(x) for x in (read_sys("/proc/stat", "cpu 0") or "cpu 0").splitlines()[0].split()[1:]]
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
