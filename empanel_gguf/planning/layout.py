"""The weight layout of pools that page: llama.cpp's repacked CPU layout or the file's plain one.

Repacked kernels (ggml's CPU_REPACK buffers, stock's defaults) compute a token faster on most
x86 and Arm CPUs; plain pools (llama.cpp --no-repack) let the reads land in the slots, while
repacked pools cost the reader threads a repack of every expert they read. Which wins depends on
the machine's cores and the model, so `empanel-gguf layout MODEL` measures both complete default
configurations there (commands/layout.py) and saves the result in the cache folder beside the
calibration profiles, one entry per machine. moe_repack="auto" follows a saved measurement of this
machine; without one it keeps the rule (plain pools where they page, stock's defaults where they
hold every expert or waves may be masked). The decision never flips on noise: repacked must win
decode clearly in every round (and its prompts are not much slower), else plain stays.
"""

import hashlib
import json
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

from .cache import cached_path, file_identity

SUFFIX = ".layout.json"
# repacked pools are chosen only when their decode median is at least MARGIN times plain's and
# every repacked round beats every plain round, with their prompt median at least PROMPT_FLOOR
# times plain's (a short prompt's time is noisy; a large loss still vetoes)
MARGIN = 1.05
PROMPT_FLOOR = 0.8
# a measurement applies to loads whose pools have about as many slots per layer: the hit rate, so
# the bytes repacked per token, follow the slots (under a cap, repacked pools also get fewer)
SLOTS_NEAR = (0.75, 1.34)
# the CPU features that pick ggml's repacked kernels (ggml-cpu/repack.cpp) and their speed
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_int8", "asimddp", "i8mm", "sve")


@dataclass
class Layout:
    repack: bool  # llama.cpp's CPU repack buffers (stock's defaults) or not (--no-repack)
    why: str      # one line: the rule or the measurement that chose it
    warning: str = ""  # a saved measurement that could not be read (the rule chose instead)


def machine():
    """What the measurement depends on here: the CPU's name, its features and the cores this
    process may use. {"cpu", "flags", "cores", "arch", "key"}; key: 12 hex digits of it."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    desc = {"cpu": name or "unknown", "flags": sorted(flags.intersection(CPU_FLAGS)), "cores": cores,
            "arch": platform.machine()}
    desc["key"] = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:12]
    return desc


def probe_path(index):
    """The model's layout file in the cache folder (cache.cached_path)."""
    return cached_path(file_identity(index), SUFFIX)


def load_probe(index, path=None):
    """This machine's saved measurement for the model ({"decision", "why", ...}), or None. A file
    that cannot be read is reported as ValueError: the caller keeps the rule and says so."""
    path = Path(path) if path is not None else probe_path(index)
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))["machines"].get(machine()["key"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"layout file {path} unreadable ({e}); `empanel-gguf layout` measures it again") from None
    if entry is not None and entry.get("decision") not in ("plain", "repacked"):
        raise ValueError(f"layout file {path}: decision {entry.get('decision')!r} is neither plain nor repacked")
    return entry


def save_probe(index, entry, path=None):
    """Write this machine's entry into the model's layout file (other machines' entries kept)."""
    path = Path(path) if path is not None else probe_path(index)
    data = {"model": file_identity(index), "machines": {}}
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            data["machines"] = dict(old.get("machines") or {})
        except (OSError, ValueError, AttributeError):
            pass  # damaged: rewritten with this entry only
    data["machines"][entry["machine"]["key"]] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def forget_probe(index, path=None):
    """Remove this machine's entry from the model's layout file (the file too once it is empty)."""
    path = Path(path) if path is not None else probe_path(index)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["machines"].pop(machine()["key"], None)
    if data["machines"]:
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    else:
        path.unlink()
    return path


def decide(plain, repacked):
    """(decision, why) from the rounds of each layout: lists of {"decode_tps", "prompt_tps", ...}.
    Repacked only where it wins decode by MARGIN at the median and in every round, its prompts at
    least PROMPT_FLOOR of plain's; anything closer is noise and plain (the rule) stays."""
    dp, dr = ([r["decode_tps"] for r in runs] for runs in (plain, repacked))
    pp, pr = ([r["prompt_tps"] for r in runs] for runs in (plain, repacked))
    mp, mr = statistics.median(dp), statistics.median(dr)
    numbers = (f"decode {mr:.2f} vs {mp:.2f} t/s ({mr / mp:.2f}x), prompt "
               f"{statistics.median(pr):.1f} vs {statistics.median(pp):.1f}, medians of {len(dp)}")
    if mr >= MARGIN * mp and min(dr) > max(dp) and statistics.median(pr) >= PROMPT_FLOOR * statistics.median(pp):
        return "repacked", f"measured: repacked faster here: {numbers}"
    return "plain", f"measured: plain as fast here: {numbers}"


RULE_PAGED = "rule: pools that page are plain (reads land in the slots); `empanel-gguf layout MODEL` measures both"


def resolve_layout(repack, plan, probe=None, masked=False):
    """moe_repack (checked: "auto", True or False; OPTION["repack"].checked) and the pools' plan -> Layout. "auto": stock's
    defaults where no pool pages (plan None or holding every expert) or waves may be masked
    (masked); else this machine's saved measurement (probe, load_probe's entry) where there is
    one at about the load's slots per layer (SLOTS_NEAR), else the rule: plain."""
    if repack != "auto":
        return Layout(bool(repack), f"asked: moe_repack={bool(repack)}")
    if plan is None or plan.holds_all:
        return Layout(True, "rule: no pool pages, so stock's defaults (repacked where ggml repacks the type)")
    if masked:
        return Layout(True, "rule: waves may be masked (a device, or EMPANEL_WAVE_MASK=1), so stock's defaults: "
                            "masked waves over plain Q4_K pools are not exact to --no-repack")
    slots, measured = max(plan.n_slots), probe.get("moe_slots") if probe is not None else None
    if probe is not None and isinstance(measured, int) and SLOTS_NEAR[0] * measured <= slots <= SLOTS_NEAR[1] * measured:
        when = probe.get("date", "")[:10]
        cap = f", under a {probe['cap_bytes'] / 2**30:.2f} GiB cap" if probe.get("cap_bytes") else ""
        return Layout(probe["decision"] == "repacked", f"{probe['why']} ({when}, at {measured} slots{cap})")
    if probe is not None:
        return Layout(False, f"rule: pools that page are plain; the layout measured here was at {measured} slots per "
                             f"layer, far from this load's {slots} (`empanel-gguf layout MODEL -ms {slots}` measures it)")
    return Layout(False, RULE_PAGED)
