"""The benchmark's parent side: one child per run, its samples, and the rows made of them."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .host import MemCgroup, Readahead, read_sys, cpu_jiffies, drop_caches, probe_drive, wait_for_idle
from .configs import CAP, CAP_NONE, Config, EMPANEL, STOCK


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
    spec = _child_spec(bench, cfg, result_path)
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
        _before_run(bench, sample, n)
        env = _child_env(cfg)
        t0 = time.perf_counter()
        jiffies0, self0 = cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "empanel_gguf", "bench", "--child", str(spec_path)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            rusage, wait_status, timed_out = _wait(proc, t0, a.timeout)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
        sample["wall_s"] = time.perf_counter() - t0
        jiffies1, self1 = cpu_jiffies(), resource.getrusage(resource.RUSAGE_SELF)
        sample.update(_contention(jiffies0, jiffies1, self0, self1, rusage, sample["wall_s"]))
        if a.probe_s > 0:
            sample["drive_after"] = probe_drive(bench.index, a.probe_s, bench.probe_chunk, bench.probe_depth,
                                                seed=10_000 + n, direct=bench.probe_direct)
    finally:
        _clean_up(proc, ra)
    _outcome(bench, sample, proc, rusage, timed_out, limit, oom_before, result_path, log_path)
    return sample


def _child_spec(bench: Bench, cfg: Config, result_path: Path) -> dict:
    """What the child runs (lab/bench/child.py reads it), as JSON."""
    a = bench.args
    return {
        "model": str(bench.model_path), "kind": cfg.kind, "moe_slots": cfg.moe_slots,
        "n_prompt": a.n_prompt, "n_gen": a.n_gen, "n_ctx": a.n_ctx, "n_batch": a.n_batch,
        "n_ubatch": a.n_ubatch, "threads": a.threads, "max_tg_s": a.max_tg_s, "min_tg": a.min_tg,
        # (the ceiling always warms up: a fresh process first maps 15 GiB of resident weights page
        # by page, which is no compute: 18.2 against 45.1 t/s warm on a 512-token prompt, 48 layers)
        "warmup": not a.no_warmup or cfg.pools_batch, "warmup_tokens": a.warmup_tokens, "warmup_s": a.warmup_s,
        "moe_opts": dict(a.moe_opt, **({"moe_policy": cfg.moe_policy} if cfg.moe_policy else {}),
                         **(cfg.moe_opts or {})),
        "llama_opts": dict(a.llama_opt), "plain": cfg.plain, "result": str(result_path),
        "batch": pools_batch(bench) if cfg.pools_batch else None,
        "cgroup_procs": None,
        "neighbour": ({"bytes": a.neighbour, "at": a.neighbour_at if a.neighbour_at is not None else a.n_gen // 4,
                       "leave_at": a.neighbour_leave, "prompt_s": a.neighbour_in_prompt, "load_s": a.neighbour_in_load} if a.neighbour else None),
        "disk_stat": str(bench.queue_dir.parent / "stat") if bench.queue_dir else None,
        "lower": ({"bytes": int(a.lower_limit * bench.model_bytes),
                   "at": a.lower_at if a.lower_at is not None else a.n_gen // 4} if a.lower_limit else None),
    }


def pools_batch(bench: Bench) -> dict:
    """The micro-batch and attention the empanel runs plan (moe_batch "auto", or -b / -ub given):
    what the ceiling runs with."""
    from ...planning.estimate import model_shape, resolve_n_ctx
    from ...planning.plan import BATCH_KWARGS, planned_batch

    a = bench.args
    given = {key: value for key, value in (("n_batch", a.n_batch), ("n_ubatch", a.n_ubatch)) if value is not None}
    given.update({key: value for key, value in dict(a.llama_opt).items() if key in BATCH_KWARGS})
    if given:
        return {}  # every run has them
    n_ctx = resolve_n_ctx(model_shape(bench.index), a.n_ctx)
    return planned_batch(dict(a.moe_opt).get("moe_batch", "auto"), "auto", {}, n_ctx)


def _before_run(bench: Bench, sample: dict, n: int):
    """The machine made ready for run n: readahead noted, quiet CPUs awaited, caches dropped,
    the drive probed."""
    a = bench.args
    sample["read_ahead_kb"] = int(read_sys(bench.queue_dir / "read_ahead_kb", "0")) if bench.queue_dir else None
    if a.wait_idle > 0:
        sample["waited_idle_s"] = wait_for_idle(a.wait_idle, a.idle_pct)
    if not a.no_drop_caches:
        sample["caches_dropped"] = drop_caches()
    if a.probe_s > 0:
        probe = probe_drive(bench.index, a.probe_s, bench.probe_chunk, bench.probe_depth,
                            seed=n, direct=bench.probe_direct)
        sample["drive"] = probe


def _child_env(cfg: Config) -> dict:
    env = dict(os.environ)  # the child measures the very package this process uses
    pkg_root = str(Path(__file__).resolve().parents[3])  # the folder holding empanel_gguf/
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cfg.bounce:
        env["EMPANEL_READ_BOUNCE"] = "1"
    if cfg.sync:
        env["EMPANEL_READ_SYNC"] = "1"
    env.update(cfg.env or {})
    return env


def _wait(proc, t0: float, timeout: float):
    """(rusage, wait status, timed out) of the child, killed once it ran `timeout` seconds."""
    while True:
        pid, wait_status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return rusage, wait_status, False
        if time.perf_counter() - t0 > timeout:
            os.kill(proc.pid, signal.SIGKILL)
            _, wait_status, rusage = os.wait4(proc.pid, 0)
            return rusage, wait_status, True
        time.sleep(0.05)


def _clean_up(proc, ra):
    if proc is not None and proc.returncode is None:  # interrupted while it ran
        try:
            os.kill(proc.pid, signal.SIGKILL)
            os.waitpid(proc.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    if ra is not None and ra.original is not None:
        ra.__exit__(None, None, None)


def _outcome(bench: Bench, sample: dict, proc, rusage, timed_out, limit, oom_before, result_path, log_path):
    """The sample completed from the child's end: its result, or why there is none."""
    a = bench.args
    sample["returncode"] = proc.returncode
    sample["child_maxrss"] = rusage.ru_maxrss * 1024 if rusage is not None else None
    phase = read_sys(str(result_path) + ".phase", "?")
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
            # the graph stopped for the remap op and (reads that overlap the layer) the ready ops
            stalled = moe.get("remap_s", 0) + moe.get("ready_s", 0)
            m[f"{ph}_wait_ms"] = 1000 * stalled / n
            m[f"{ph}_read_ms"] = 1000 * read_s / n
            if "write_s" in moe:
                m[f"{ph}_write_ms"] = 1000 * moe["write_s"] / n
            # the readers' CPU (reads, copies out of bounce buffers, repacks, hashes) and copies
            m[f"{ph}_read_cpu_ms"] = 1000 * moe.get("read_cpu_s", 0) / n
            m[f"{ph}_bounce_per_tok"] = moe.get("bounce_bytes", 0) / n
            m[f"{ph}_compute_ms"] = 1000 * (sec - stalled) / n
            remaps = moe.get("n_remaps", 0)
            m[f"{ph}_waves"] = moe.get("n_waves", 0) / remaps if remaps else None  # per layer, micro-batch
            m[f"{ph}_read_bytes"] = moe.get("bytes_read", 0)
            m[f"{ph}_hidden_pct"] = (100 * max(0.0, read_s - moe.get("wait_s", 0)) / read_s
                                     if read_s else None)  # reads done while the graph computed
            if moe.get("guess_recall") is not None:  # the gate-ahead guess and its read-ahead
                m[f"{ph}_guess_recall"] = moe["guess_recall"]
            if moe.get("prefetched"):
                m[f"{ph}_prefetch_used_pct"] = 100 * moe.get("prefetch_used", 0) / moe["prefetched"]
                m[f"{ph}_prefetch_waste_per_tok"] = moe.get("prefetch_wasted", 0) / n
                m[f"{ph}_prefetch_dropped_pct"] = 100 * moe.get("prefetch_dropped", 0) / moe["prefetched"]
        else:
            m[f"{ph}_read_per_tok"] = m[f"{ph}_io_per_tok"]
            m[f"{ph}_compute_ms"] = 1000 * sec / n if n else None
        if ph == "tg" and n and "cpu_user_s" in d:  # the whole process, every thread (child._decode)
            m["tg_cpu_ms"] = 1000 * (d["cpu_user_s"] + d["cpu_sys_s"]) / n
            m["tg_sys_ms"] = 1000 * d["cpu_sys_s"] / n
            m["tg_switches"] = (d["voluntary_switches"] + d["involuntary_switches"]) / n
        if d.get("dev_busy_s"):  # the disk's own view: rate while busy, share of the phase busy
            m[f"{ph}_dev_gbps"] = d["dev_read_bytes"] / d["dev_busy_s"] / 1e9
            m[f"{ph}_dev_busy_pct"] = 100 * d["dev_busy_s"] / sec if sec > 0 else None
    nb = s["tg"].get("neighbour")
    if nb:  # decode before the neighbour came, while it held its memory, after it left
        times, at = s["tg"]["token_s"], nb["at"]
        leave = nb["leave_at"] if nb.get("leave_at") is not None else len(times)
        for name, part in (("before", times[:at]), ("with", times[at:leave]), ("after", times[leave:])):
            m[f"tg_{name}_tps"] = len(part) / sum(part) if part and sum(part) > 0 else None
        m["neighbour_held_s"] = nb.get("held_s")
        m["neighbour_rc"] = nb.get("rc")
        budget = s["tg"].get("budget") or {}
        m["budget_lowest"] = budget.get("lowest_bytes")
        m["budget_given_back"] = budget.get("given_back_bytes")
        m["budget_shrink_ms"] = budget.get("max_shrink_ms")
        m["budget_lock_wait_ms"] = budget.get("max_lock_wait_ms")
        m["budget_end"], m["budget_capacity"] = budget.get("budget_bytes"), budget.get("capacity_bytes")
    lw = s["tg"].get("lower")
    if lw:  # decode before the limit was written down, while it was refused, after it was taken
        times, at = s["tg"]["token_s"], lw["at"]
        taken = lw.get("taken_token", len(times)) if lw.get("taken_s") is not None else len(times)
        for name, part in (("before", times[:at]), ("refused", times[at:taken]), ("after", times[taken:])):
            m[f"tg_{name}_tps"] = len(part) / sum(part) if part and sum(part) > 0 else None
        m["limit_taken_s"], m["limit_refused"] = lw.get("taken_s"), lw.get("refused")
        m["limit_never"] = int(lw.get("taken_s") is None)  # (a median of 1: not taken in most runs)
        budget = s["tg"].get("budget") or {}
        m["budget_lowest"], m["budget_events"] = budget.get("lowest_bytes"), budget.get("n_events")
    w = s.get("warmup")  # the first run after load: cold pools / page cache
    if w:
        for ph in ("pp", "tg"):
            if w[ph]["n"] and w[ph]["s"] > 0:
                m[f"cold_{ph}_tps"] = w[ph]["n"] / w[ph]["s"]
    # the measured prompt as a user meets it (cold with --no-warmup): time to its first token from
    # the start of the load, bytes read for it (the pools', else the drive's for the process), calls
    d = s["pp"]
    m["pp_s"] = d["s"]
    m["ttft_s"] = (s.get("load_s") or 0.0) + d["s"]
    m["pp_bytes"] = d["moe"].get("bytes_read", 0) if d.get("moe") else d["io_read_bytes"]
    m["pp_calls"] = -(-d["n"] // max(1, s.get("n_batch") or 512))
    m["peak_rss"] = s.get("peak_rss")
    m["load_s"] = s.get("load_s")
    m["cgroup_peak"] = s.get("cgroup_peak")
    predicted = s.get("predicted") or {}
    m["predicted_resident"] = predicted.get("resident")  # at the context the run reached
    m["predicted_reserved"] = predicted.get("reserved")
    if predicted.get("resident") and s.get("peak_rss"):
        m["peak_over_predicted"] = s["peak_rss"] / predicted["resident"]
    m["others_cpu_pct"] = s.get("others_cpu_pct")
    probes = [p.get("gbps") for p in (s.get("drive"), s.get("drive_after")) if p and p.get("gbps")]
    m["drive_gbps"] = sum(probes) / len(probes) if probes else None
    return m


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def stdev(values):
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
            row[k] = median([m.get(k) for m in metrics])
        row["tg_tps_sd"] = stdev([m.get("tg_tps") for m in metrics])
        row["pp_tps_sd"] = stdev([m.get("pp_tps") for m in metrics])
        row["tg_tps_samples"] = [m.get("tg_tps") for m in metrics]
        row["pp_tps_samples"] = [m.get("pp_tps") for m in metrics]
        if ok:
            row["n_ubatch"] = ok[0].get("n_ubatch")
            row["n_batch"] = ok[0].get("n_batch")
            row["flash_attn"] = ok[0].get("flash_attn")
            row["n_tg"] = ok[0]["tg"]["n"]
            row["n_pp"] = ok[0]["pp"]["n"]
            row["slots_per_layer"] = (ok[0]["moe_slots_total"] // len(bench.index.layers)
                                      if ok[0].get("moe_slots_total") else None)
            row["moe_slots_resolved"] = ok[0].get("moe_slots_resolved", cfg.moe_slots)
            row["argmax"] = ok[0]["tg"]["argmax"]
            row["finite"] = all(s["pp"]["finite"] and s["tg"]["finite"] for s in ok)
        else:
            row["peak_rss"] = median([s.get("peak_rss") for s in mine])
            row["cgroup_peak"] = median([s.get("cgroup_peak") for s in mine])
        rows.append(row)

    # drive-bound ceiling for the empanel rows
    resident = find_row(rows, STOCK, CAP_NONE) or find_row(rows, "empanel-100%", CAP_NONE)
    resident_tps = resident.get("tg_tps") if resident else None
    global_drive = median([d.get("gbps") for d in bench.drive])
    reference = find_row(rows, STOCK, CAP_NONE)
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


def find_row(rows, name, cap):
    for row in rows:
        if row["config"] == name and row["cap"] == cap and row["status"].startswith("ok"):
            return row
    return None
