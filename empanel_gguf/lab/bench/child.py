"""The benchmark's child: one measured run of one configuration in its own process."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...planning.host_memory import proc_status
from .host import read_sys
from .configs import EMPANEL, MMAP, STOCK


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


# another program in the same memory cgroup (bench --neighbour): it takes `size` bytes, touches
# every page and holds them until a line comes on stdin. Not first in line for the OOM killer as the
# measured child is (oom_score_adj 1000, inherited): an ordinary program
NEIGHBOUR_SCRIPT = """
import mmap, sys, time
try:
    open("/proc/self/oom_score_adj", "w").write("0")
except OSError:
    pass
t0 = time.monotonic()
size = int(sys.argv[1])
m = mmap.mmap(-1, size)
for i in range(0, size, 4096):
    m[i] = 1
print(f"HELD {time.monotonic() - t0:.3f}", flush=True)
sys.stdin.readline()
"""


class Neighbour:
    """The neighbour process of a run (NEIGHBOUR_SCRIPT), started mid-decode, told to leave later."""

    def __init__(self, size, t_decode):
        self.size = size
        self.start_s = time.perf_counter() - t_decode  # into the decode
        self.held_s = None  # from its start to every page touched
        self.left_s = None
        self.proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR_SCRIPT, str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        line = self.proc.stdout.readline()
        if line.startswith("HELD"):
            self.held_s = float(line.split()[1])

    def leave(self, t_decode):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        self.left_s = time.perf_counter() - t_decode

    def outcome(self) -> dict:
        return {"bytes": self.size, "start_s": self.start_s, "held_s": self.held_s, "left_s": self.left_s,
                "rc": self.proc.returncode}


class LimitLowering:
    """bench --lower-limit: the run's cgroup limit written down mid-decode, as `docker update
    --memory` does, tried again every 50 ms for up to 15 s (cgroup v1 refuses, EBUSY, a limit the
    group cannot reclaim down to), from a thread, while the decode goes on."""

    def __init__(self, limit_file, limit, t_decode, token):
        self.limit_file, self.limit = limit_file, limit
        self.start_s = time.perf_counter() - t_decode
        self.token = token          # the decode's token index now (the loop moves it)
        self.taken_s = self.taken_token = None
        self.refused = 0
        self.error = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.is_set() and time.perf_counter() - t0 < 15:
            try:
                with open(self.limit_file, "w") as f:
                    f.write(f"{self.limit}\n")
                self.taken_s, self.taken_token = time.perf_counter() - t0, self.token
                return
            except OSError as e:
                self.refused += 1
                self.error = str(e)
                self._stop.wait(0.05)

    def end(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def outcome(self) -> dict:
        return {"bytes": self.limit, "start_s": self.start_s, "taken_s": self.taken_s,
                "taken_token": self.taken_token, "refused": self.refused, "error": self.error}


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


def _proc_io() -> dict:
    out = {}
    for line in (read_sys("/proc/self/io", "") or "").splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def _disk(stat_path) -> tuple[int, float] | None:
    """(bytes read, seconds busy) of the whole disk so far, from /sys/block/<dev>/stat (sectors
    read is field 3, io_ticks field 10). Counts every process's I/O on that disk."""
    if not stat_path:
        return None
    fields = (read_sys(stat_path, "") or "").split()
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
        if key.endswith("_gbps") or key in ("hit_rate", "guess_recall", "prefetch_hit_rate"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and key not in ("n_slots", "n_resident"):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    lookups = out.get("hits", 0) + out.get("misses", 0)
    out["hit_rate"] = out.get("hits", 0) / lookups if lookups else None
    routed = out.get("guess_routed", 0)
    out["guess_recall"] = out.get("guess_hits", 0) / routed if routed else None
    return out


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    phase_path = Path(spec["result"] + ".phase")

    def phase(name):
        phase_path.write_text(name)

    phase("cgroup")
    _join_cgroup(spec)
    phase("import")
    import numpy  # noqa: F401  (imported in this phase, before the baseline RSS, as the steps use it)

    from empanel_gguf import Llama

    baseline_rss = proc_status().get("VmRSS")
    kwargs = _llama_kwargs(spec)
    _neighbour_before_load(spec)
    phase("load")
    arrival = _neighbour_timer(spec, "load_s")
    t0 = time.perf_counter()
    llm = _load(Llama, spec, kwargs)
    load_s = time.perf_counter() - t0
    if arrival is not None:
        arrival.cancel()  # (a load done sooner: it comes in the prompt's first moments instead)
        if spec.get("_neighbour") is None:
            spec["_neighbour"] = Neighbour(spec["neighbour"]["bytes"], t0)
    after_load = proc_status()
    prompt, trace = token_trace(llm, spec["n_prompt"], spec["n_gen"])
    warmup = _warm_up(llm, spec, phase) if spec.get("warmup") else None

    disk = spec.get("disk_stat")
    counts0 = _counts(llm, disk)
    phase("pp")
    arrival = _neighbour_timer(spec, "prompt_s")
    pp = _eval_prompt(llm, prompt)
    if arrival is not None:
        arrival.cancel()  # (a prompt done sooner: it comes with the first decoded token instead)
    counts1 = _counts(llm, disk)
    phase("tg")
    tg = _decode(llm, trace, spec)
    counts2 = _counts(llm, disk)
    rss = {"baseline": baseline_rss, "after_load": after_load, "end": proc_status()}

    result = _result(spec, llm, load_s, rss, warmup, {**pp, **_phase_counts(counts1, counts0)},
                     {**tg, **_phase_counts(counts2, counts1)}, counts2[1])
    Path(spec["result"]).write_text(json.dumps(result))
    phase("close")
    llm.close()
    phase("done")
    return 0


def _join_cgroup(spec):
    """This process first in line for the OOM killer, and in the run's memory cgroup if any."""
    try:  # if memory runs out machine-wide, the measured child goes first, not a bystander
        Path("/proc/self/oom_score_adj").write_text("1000\n")
    except OSError:
        pass
    if spec.get("cgroup_procs"):
        Path(spec["cgroup_procs"]).write_text(f"{os.getpid()}\n")  # before anything big is loaded


def _llama_kwargs(spec) -> dict:
    kwargs = dict(n_ctx=spec["n_ctx"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                  logits_all=False, seed=0, verbose=True)
    for key in ("n_batch", "n_ubatch"):
        if spec.get(key) is not None:  # else each run's own: 512 for stock, the plan's for pools (moe_batch)
            kwargs[key] = spec[key]
    kwargs.update(spec.get("batch") or {})  # the ceiling: the pools' micro-batch
    kwargs.update(spec.get("llama_opts") or {})
    if spec["kind"] == EMPANEL:
        kwargs.update(spec.get("moe_opts") or {})
        kwargs["moe_slots"] = spec["moe_slots"]
    return kwargs


def _load(Llama, spec, kwargs):
    if spec["kind"] in (EMPANEL, STOCK) and spec.get("plain"):  # no CPU_REPACK: plain pools, or stock --no-repack
        return Llama(spec["model"], **dict(kwargs, moe_repack=False))  # its moe_stats() say what it ran
    if spec["kind"] == MMAP:  # stock from the mapping: what stock can run where the model does not fit
        from empanel_gguf.llama import model_params

        with model_params(use_extra_bufts=False):
            return Llama(spec["model"], **kwargs)
    return Llama(spec["model"], **kwargs)


def _warm_up(llm, spec, phase) -> dict:
    """Like llama-bench, a warm-up run first (other text), so that the measured run sees the
    steady state (warm pools / page cache), not the first reads after load: a prompt of up to
    warmup_tokens in pieces of n_prompt, then n_gen decoded tokens, within warmup_s seconds."""
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
    return {"pp": {"n": n_pp, "s": w_pp_s}, "tg": {"n": n_tg, "s": w_tg_s},
            "moe": _delta(_total(llm), moe_w0)}


def _counts(llm, disk):
    """(this process's I/O, the pools' totals, the disk's counters) now."""
    return _proc_io(), _total(llm), _disk(disk)


def _phase_counts(after, before) -> dict:
    """What a phase read: bytes from the drive (/proc/self/io), the pools' counters, the disk's."""
    return {"io_read_bytes": after[0].get("read_bytes", 0) - before[0].get("read_bytes", 0),
            "moe": _delta(after[1], before[1]), **_disk_delta(after[2], before[2])}


def _neighbour_before_load(spec):
    """bench --neighbour-at load: the neighbour takes and touches its memory before the model
    loads (kept in spec["_neighbour"] for the decode, which tells it to leave)."""
    plan = spec.get("neighbour")
    if not plan or plan["at"] != "load":
        return
    neighbour = Neighbour(plan["bytes"], time.perf_counter())
    deadline = time.monotonic() + 120
    while neighbour.held_s is None and neighbour.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    spec["_neighbour"] = neighbour


def _neighbour_timer(spec, key):
    """bench --neighbour-in-prompt S / --neighbour-in-load S (key prompt_s / load_s): a timer that
    starts the neighbour S seconds into the measured prompt or into the load (a preload runs in
    it), kept in spec["_neighbour"] for the decode that follows; None without one."""
    plan = spec.get("neighbour")
    if not plan or plan.get(key) is None:
        return None
    t0 = time.perf_counter()

    def arrive():
        spec["_neighbour"] = Neighbour(plan["bytes"], t0)

    timer = threading.Timer(plan[key], arrive)
    timer.start()
    return timer


def _eval_prompt(llm, prompt) -> dict:
    import numpy as np

    t0 = time.perf_counter()
    llm.eval(prompt)
    pp_s = time.perf_counter() - t0
    logits = last_logits(llm)
    return {"n": len(prompt), "s": pp_s, "finite": bool(np.isfinite(logits).all()), "logit_std": float(logits.std())}


def _decode(llm, trace, spec) -> dict:
    """The forced continuation, one token per eval, until max_tg_s (at least min_tg tokens); with
    spec["neighbour"], another program takes memory before token `at` and leaves before `leave_at`."""
    import numpy as np

    times, argmax, finite = [], [], True
    plan, neighbour = spec.get("neighbour"), spec.get("_neighbour")
    lower, lowering = spec.get("lower"), None
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t_start = time.perf_counter()
    for i, tok in enumerate(trace):
        if plan and i == plan["at"] and neighbour is None:
            neighbour = Neighbour(plan["bytes"], t_start)
        if lower and i == lower["at"] and spec.get("cgroup_procs"):
            lowering = LimitLowering(Path(spec["cgroup_procs"]).with_name("memory.limit_in_bytes"), lower["bytes"],
                                     t_start, i)
        if lowering is not None:
            lowering.token = i
        if neighbour is not None and i == plan.get("leave_at"):
            neighbour.leave(t_start)
        t0 = time.perf_counter()
        llm.eval([tok])
        t1 = time.perf_counter()
        times.append(t1 - t0)
        logits = last_logits(llm)
        argmax.append(int(np.argmax(logits)))
        finite = finite and bool(np.isfinite(logits).all())
        if t1 - t_start > spec["max_tg_s"] and len(times) >= spec["min_tg"]:
            break
    if neighbour is not None and neighbour.left_s is None:
        neighbour.leave(t_start)
    if lowering is not None:
        lowering.end()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    # the process's CPU over every thread (compute, readers, io_uring's workers) and its context
    # switches, over the decode (the kernel's interrupt work for the drive is in no process's clock)
    cpu = {"cpu_user_s": ru1.ru_utime - ru0.ru_utime, "cpu_sys_s": ru1.ru_stime - ru0.ru_stime,
           "voluntary_switches": ru1.ru_nvcsw - ru0.ru_nvcsw, "involuntary_switches": ru1.ru_nivcsw - ru0.ru_nivcsw}
    out = {"n": len(times), "s": sum(times), "token_s": times, "finite": finite, "argmax": argmax, **cpu}
    if neighbour is not None:
        early = spec.get("_neighbour") is not None  # (in the prompt, or before the load)
        out["neighbour"] = {**neighbour.outcome(), "at": 0 if early else plan["at"], "leave_at": plan.get("leave_at"),
                            "in_prompt": early and plan["at"] != "load" and plan.get("load_s") is None,
                            "in_load": plan.get("load_s") is not None, "at_load": plan["at"] == "load"}
    if lowering is not None:
        out["lower"] = {**lowering.outcome(), "at": lower["at"]}
    if neighbour is not None or lowering is not None:
        stats = llm.moe_stats() if hasattr(llm, "moe_stats") else None
        out["budget"] = (stats or {}).get("budget")
    return out


def _result(spec, llm, load_s, rss, warmup, pp, tg, moe_total) -> dict:
    import empanel_gguf

    lib = empanel_gguf.engine.native.lib_dir() / "libempanel.so"
    status = rss["end"]
    return {
        "status": "ok",
        "pid": os.getpid(),
        "empanel_gguf": str(Path(empanel_gguf.__file__).parent),
        "libempanel_mtime": os.stat(lib).st_mtime if lib.exists() else None,
        "load_s": load_s,
        "n_ubatch": int(llm.context_params.n_ubatch),
        "n_batch": int(llm.n_batch),
        "flash_attn": bool(llm.context_params.flash_attn_type > 0),
        "n_threads": spec["threads"],
        "rss_baseline": rss["baseline"],
        "rss_after_load": rss["after_load"].get("VmRSS"),
        "peak_rss": status.get("VmHWM"),
        "rss_end": status.get("VmRSS"),
        "rss_anon_end": status.get("RssAnon"),
        "rss_file_end": status.get("RssFile"),
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "predicted": _predicted(spec, llm),
        "moe_slots_total": (moe_total or {}).get("n_slots"),
        "moe_slots_resolved": getattr(llm, "moe_slots", None),
        "warmup": warmup,
        "pp": pp,
        "tg": tg,
        "moe_total": moe_total,
    }


def _predicted(spec, llm) -> dict:
    """The planner's figures for this run (planning/estimate.py): resident at the context the run
    reached (what its peak RSS is held to), resident at the end of n_ctx (what the plan sized
    by), reserved. Stock loads: the estimate with every expert resident."""
    from empanel_gguf.planning.estimate import estimate
    from empanel_gguf.planning.index import load_index

    load = getattr(llm, "moe_load", None)
    if load is not None:
        est = load.estimate
    else:
        kwargs = {key: value for key, value in _llama_kwargs(spec).items()
                  if key in ("n_ctx", "n_batch", "n_ubatch", "logits_all", "flash_attn")}
        est = estimate(load_index(spec["model"]), None, **kwargs)
    return {"resident": est.at_context(llm.n_tokens).host, "resident_at_n_ctx": est.host,
            "reserved": est.host_reserved}


def _total(llm):
    """The pools' totals, and the bytes on the wire to RPC servers so far."""
    stats = llm.moe_stats() if hasattr(llm, "moe_stats") else None
    total = dict(stats["total"]) if stats else None
    if getattr(llm, "rpc_servers", None) and total is None:  # stock: no pools, the wire still counts
        from empanel_gguf.engine.rpc import wire_counts

        total = {}
        total["wire_sent"], total["wire_received"], total["round_trips"] = wire_counts()
    return total
