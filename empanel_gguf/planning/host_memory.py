"""What the machine has: total and available memory (meminfo, memory cgroups v1/v2, macOS
vm_stat), the floor kept free, and this process's peak resident set.

Available memory is the smaller of /proc/meminfo's MemAvailable and, inside a memory cgroup
(v1 or v2), its limit minus its usage not counting inactive page cache; on macOS it comes from
vm_stat. EMPANEL_MEM_AVAILABLE (a size, e.g. "8GiB") replaces the measurement: for tests, or
where the measurement is wrong.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

from ..abi.header import define
from .format import GiB, KiB
from .sizing import parse_size

def read_int(path):
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def stat_value(path, key):
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def meminfo(path="/proc/meminfo"):
    """{key: bytes} from /proc/meminfo (lines "Key: value [kB]"), {} where there is none."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (KiB if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_dirs():
    """(version, directory) of this process's memory cgroups, innermost first, that exist."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    root = Path("/sys/fs/cgroup")
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "" and (root / "cgroup.controllers").exists():
            version, base = 2, root
        elif "memory" in controllers.split(","):
            version, base = 1, root / "memory"
        else:
            continue
        d = base / rel.lstrip("/")
        while True:  # the cgroup and its ancestors: the tightest limit counts
            if d.is_dir():
                found.append((version, d))
            if d == base or base not in d.parents:
                break
            d = d.parent
        if (version, base) not in found and base.is_dir():
            found.append((version, base))  # a namespaced mount shows the cgroup as the root
    return found


NO_LIMIT = define("EMPANEL_MEMORY_NO_LIMIT")  # at or above: no limit (cgroup v1 writes 2^63 - 4096)
MAX_SOURCES = define("EMPANEL_MAX_MEMORY_SOURCES")


def memory_sources(proc="/proc/meminfo"):
    """Where the memory left is read, the one definition of it: the plan, the watchdog
    (available_memory) and the sidecar's controller (csrc/pressure.c, the same arithmetic) read
    these files. Every memory cgroup around us, whether it has a limit now or not (a limit set later,
    `docker update` or `systemctl set-property ... MemoryMax=`, is read at the next poll):
    v2: memory.max and memory.high (the lower binds), memory.current, memory.stat's inactive_file;
    v1: memory.limit_in_bytes, memory.usage_in_bytes, memory.stat's total_inactive_file, and
    memory.pressure_level, where the controller hears the kernel reclaim in the group (a limit
    lowered under what the group holds is refused until someone gives back: page cache the kernel
    takes, pools the controller empties). Page cache the kernel reclaims first counts as free. Then
    /proc/meminfo's MemAvailable. Cgroups limited now first, innermost first; at most MAX_SOURCES,
    meminfo kept. Each a dict of limit/high/usage/stat/events paths and stat_key, or
    available/available_key."""
    limited, open_ended = [], []
    for version, d in _cgroup_dirs():
        files = (("memory.max", "memory.current", "inactive_file") if version == 2 else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        if not (d / files[0]).exists() or not (d / files[1]).exists() or "\n" in str(d):
            continue
        source = {"limit": str(d / files[0]), "usage": str(d / files[1]), "stat": str(d / "memory.stat"),
                  "stat_key": files[2]}
        if version == 2 and (d / "memory.high").exists():
            source["high"] = str(d / "memory.high")
        if version == 1 and (d / "memory.pressure_level").exists():
            source["events"] = str(d / "memory.pressure_level")
        (limited if _cgroup_reading(source) is not None else open_ended).append(source)
    out = (limited + open_ended)[:MAX_SOURCES - 1]
    if os.path.exists(proc):
        out.append({"available": proc, "available_key": "MemAvailable"})
    return out


def _cgroup_reading(source):
    """(limit, usage not counting reclaimable page cache) of a cgroup source, None if it has no
    limit or cannot be read. The limit is the lower of memory.max and memory.high (v2)."""
    limits = [read_int(source[key]) for key in ("limit", "high") if source.get(key)]
    limit, usage = min((v for v in limits if v is not None), default=None), read_int(source["usage"])
    if limit is None or usage is None or limit >= NO_LIMIT:
        return None
    reclaimable = (stat_value(source["stat"], source["stat_key"]) if source.get("stat") else None) or 0
    return limit, max(0, usage - reclaimable)


def source_left(source):
    """Bytes a source (memory_sources) leaves, None if it has no limit or cannot be read."""
    if "available" in source:
        return meminfo(source["available"]).get(source["available_key"])
    reading = _cgroup_reading(source)
    return None if reading is None else max(0, reading[0] - reading[1])


def _cgroup_limits():
    """[(limit, usage excluding inactive page cache)] of every limited memory cgroup around us."""
    readings = (_cgroup_reading(source) for source in memory_sources() if "limit" in source)
    return [reading for reading in readings if reading is not None]


def _vm_stat_available():
    """macOS: free + inactive + speculative + purgeable pages."""
    try:
        text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"page size of (\d+) bytes", text)
    page = int(m.group(1)) if m else 4096
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        m = re.search(rf"{key}:\s+(\d+)", text)
        pages += int(m.group(1)) if m else 0
    return pages * page if pages else None


def total_memory():
    """Physical memory, or the memory cgroup's limit if that is lower; None if unknown."""
    values = []
    try:
        values.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    values += [limit for limit, _ in _cgroup_limits()]
    return min(values) if values else None


def available_memory():
    """Bytes that can still be allocated without swapping or the OOM killer; None if unknown: the
    least any of memory_sources() leaves (macOS: vm_stat). EMPANEL_MEM_AVAILABLE replaces the
    reading for the plan and the watchdog (the controller reads the kernel's files, so loads under
    it are not elastic unless moe_elastic asks, plan.elastic_wanted)."""
    override = os.environ.get("EMPANEL_MEM_AVAILABLE")
    if override:
        value = parse_size(override)
        if value is None:
            raise ValueError(f"EMPANEL_MEM_AVAILABLE={override!r} is not a size (e.g. 8GiB)")
        return value
    values = [v for v in (source_left(s) for s in memory_sources()) if v is not None]
    if sys.platform == "darwin" and not values:
        v = _vm_stat_available()
        if v is not None:
            values.append(v)
    return min(values) if values else None


def default_floor(total=None):
    """max(min(1 GiB, 25 % of the memory), 5 % of it): 1 GiB or 5 % where there are 4 GiB or
    more; a quarter of a smaller memory (a small cgroup limit), so that a 1.6 GiB cap does not
    keep 1 GiB of it from the pools (on the 12-layer bench model under a 40 % cap that floor let
    moe_slots="auto" plan 9 slots, decoding at 6.4 t/s where the 32 that fit decoded at 11.9)."""
    total = total_memory() if total is None else total
    return max(min(GiB, total // 4), int(0.05 * total)) if total else GiB


def parse_floor(text, total=None):
    """'2GiB', '512MiB', '10%' (of the memory), '0' (no floor), or None/'' for the default."""
    if text is None or str(text).strip() in ("", "auto", "default"):
        return default_floor(total)
    text = str(text).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1
        total = total_memory() if total is None else total
        if not 0 <= share < 1 or not total:
            raise ValueError(f"--mem-floor {text}: a share must lie in [0%, 100%) of known memory")
        return int(share * total)
    value = parse_size(text)
    if value is None:
        raise ValueError(f"--mem-floor {text!r}: not a size (2GiB, 512MiB) or a share (5%)")
    return value


def address_space_left(meminfo_path="/proc/meminfo", overcommit_path="/proc/sys/vm/overcommit_memory"):
    """Bytes of address space this process may still map; None where nothing limits it. Limits:
    RLIMIT_AS (`ulimit -v`) less what is mapped now, and strict overcommit
    (vm.overcommit_memory = 2) CommitLimit less Committed_AS, where every reservation counts."""
    values = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        values.append(max(0, soft - proc_status().get("VmSize", 0)))
    if read_int(overcommit_path) == 2:
        info = meminfo(meminfo_path)
        if "CommitLimit" in info and "Committed_AS" in info:
            values.append(max(0, info["CommitLimit"] - info["Committed_AS"]))
    return min(values) if values else None


def peak_rss():
    """This process's peak resident set in bytes: /proc/self/status's VmHWM where there is one
    (getrusage's ru_maxrss keeps the parent's peak across fork and exec: a command started by a
    large process would report that process's memory), else getrusage (KiB on Linux, bytes on
    macOS)."""
    hwm = proc_status().get("VmHWM")
    if hwm:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * KiB


def proc_status():
    """{key: bytes} of /proc/self/status's memory lines (VmHWM, VmRSS, RssAnon, RssFile); {}
    where there is none."""
    out = {}
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key.startswith(("Vm", "Rss")) and parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (KiB if parts[1:2] == ["kB"] else 1)
    return out
