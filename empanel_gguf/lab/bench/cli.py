"""`empanel-gguf bench`: the command line and the driver that runs the configurations."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .synthetic import DEFAULT_SHAPE, SHAPES, ModelShape, shape_with, write_model
from ...planning.format import GiB, MiB
from ...planning.host_memory import meminfo
from ...planning.options import READ_THREADS, CommandParser
from .host import MemCgroup, block_queue_dir, probe_drive, read_sys
from .configs import CAP, CAP_NONE, Config, DEFAULT_CONFIGS, parse_config, parse_opt
from .child import child_main
from .runs import Bench, median, build_rows, log, run_child, sample_metrics
from .report import (details_table, fmt, fmt_bytes, limit_table, main_table, model_label, neighbour_table,
                     prompt_table)


# --write-model's shape flags: flag -> ModelShape field (int)
_SHAPE_FLAGS = {"--layers": "n_layer", "--experts": "n_expert", "--top-k": "n_expert_used", "--embd": "n_embd",
                "--expert-ff": "n_ff_exp", "--heads": "n_head", "--heads-kv": "n_head_kv", "--head-dim": "head_dim"}


def build_info() -> dict:
    import empanel_gguf
    from empanel_gguf.abi import pins
    from empanel_gguf.engine import native

    info = {"empanel_gguf": str(Path(empanel_gguf.__file__).parent), "lib_dir": str(native.lib_dir()),
            "llama_commit": pins.LLAMA_COMMIT, "python": sys.version.split()[0]}
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
    for line in (read_sys("/proc/cpuinfo", "") or "").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = meminfo()
    return {"node": platform.node(), "kernel": platform.release(), "cpu": cpu, "n_cpu": os.cpu_count(),
            "mem_total": mem.get("MemTotal"), "mem_available": mem.get("MemAvailable"),
            "block_queue": str(queue_dir) if queue_dir else None,
            "read_ahead_kb": int(read_sys(queue_dir / "read_ahead_kb", "0")) if queue_dir else None}


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
                  "expert_bytes": [layer.expert_bytes for layer in bench.index.layers]},
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


def _token_or_load(text):
    """--neighbour-at: a decoded token's index, or "load" (before the model loads)."""
    return "load" if text == "load" else int(text)


def _size(text):
    from ...planning.sizing import parse_size

    size = parse_size(text)
    if not size:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB)")
    return size


def setup_arg_parser():
    p = CommandParser(prog="empanel-gguf bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", help="an existing MoE GGUF to benchmark")
    g.add_argument("--write-model", metavar="PATH",
                   help="write a model of the --shape below, random weights, to PATH (reused if identical), "
                        "then bench it")
    g.add_argument("--write-only", action="store_true", help="stop after --write-model")
    g.add_argument("--shape", choices=list(SHAPES), default=DEFAULT_SHAPE,
                   help="a real model's shape, its vocabulary size and the tensor types of its GGUF "
                        "(qwen3-30b-a3b-q4_k_m: llama-quantize's Q4_K_M; gpt-oss-20b: MXFP4 experts, Q8_0; "
                        "deepseek-v2-lite: Q4_K_M), or synthetic: Qwen3-30B-A3B's layers, every matrix Q4_K, "
                        f"401 tokens; the flags below change any of them (default: {DEFAULT_SHAPE})")
    d = SHAPES["synthetic"]
    for flag, what in _SHAPE_FLAGS.items():
        g.add_argument(flag, type=int, default=None, help=f"(default: the shape's; synthetic {getattr(d, what)})")
    g.add_argument("--seed", type=int, default=None, help="weights seed (default: 0)")
    g.add_argument("--routing-skew", type=float, default=None, metavar="S",
                   help="router rows scaled by exp(S * N(0,1)) per expert: some experts are routed to far "
                        "more often, as in trained models (default: the shape's; synthetic 0, uniform routing)")
    g.add_argument("--routing-locality", type=float, default=None, metavar="L",
                   help="attention output scaled by 1 + L: more of a token's experts are the previous "
                        "token's (default: the shape's; synthetic 0)")

    g = p.add_argument_group("runs")
    g.add_argument("-r", "--repetitions", type=int, default=3, help="runs per configuration (default: 3)")
    g.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens (default: 64)")
    g.add_argument("-n", "--n-gen", type=int, default=32, help="decoded tokens (default: 32)")
    g.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    g.add_argument("-c", "--n-ctx", type=int, default=None, help="context (default: the longer of prompt and warm-up prompt, + gen + 16)")
    g.add_argument("-b", "--n-batch", type=int, default=None,
                   help="(default: each run's own: llama-cpp-python's 512 for stock, the plan's micro-batch for "
                        "pools that page (moe_batch), the pools' for the ceiling)")
    g.add_argument("-ub", "--n-ubatch", type=int, default=None,
                   help="(default: as -b; given, every run uses it: micro-batches larger than the pools run in "
                        "waves)")
    g.add_argument("--configs", default=None,
                   help="comma list of stock, stock/plain (--no-repack), stock-mmap, stock-mmap-ra<KB>, empanel-<N|P%|size|min|auto>"
                        "[/<moe_policy>][/plain][/bounce][/sync][/<key>=<value>][/EMPANEL_<NAME>=<value>] (moe_<key>, "
                        "e.g. prefetch=1; plain: no CPU repack buffers, so plain pools that reads land in; bounce: no "
                        "read lands in place; sync: reads do not overlap the compute in decode; EMPANEL_<NAME>: an "
                        "environment switch of the run, e.g. EMPANEL_READ_AHEAD_KEEP=1); each "
                        "runs uncapped and capped, or only as name@none / name@cap "
                        f"(default: {','.join(DEFAULT_CONFIGS)})".replace("%", "%%"))
    g.add_argument("--cap", type=float, default=0.4, help="memory cap as a share of the model file (default: 0.4)")
    g.add_argument("--no-cap", action="store_true", help="drop the capped configurations")
    g.add_argument("--no-cgroup", action="store_true",
                   help="no cgroups at all (capped configurations are then skipped)")
    g.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before runs")
    g.add_argument("--tmpfs", action="store_true",
                   help="bench a copy of the model in /dev/shm (removed at the end): reads cost a copy from "
                        "memory and nothing waits for a drive, so pools meet stock where compute bounds them "
                        "(uncapped configurations: the copy's pages are not the runs' cgroup's)")
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
    g.add_argument("--neighbour", type=_size, default=None, metavar="SIZE",
                   help="another program in the run's memory cgroup takes SIZE (e.g. 2GiB), touches and holds it "
                        "mid-decode: who survives, and how fast decoding goes on (the neighbour table)")
    g.add_argument("--neighbour-at", type=_token_or_load, default=None, metavar="N|load",
                   help="the decoded token before which it comes (default: a quarter of -n); load: it holds its "
                        "memory before the model loads (pools planned around it; with --neighbour-leave, how "
                        "they grow once it is gone)")
    g.add_argument("--neighbour-in-prompt", type=float, default=None, metavar="S",
                   help="it comes S seconds into the measured prompt instead (and holds through the decode)")
    g.add_argument("--neighbour-in-load", type=float, default=None, metavar="S",
                   help="it comes S seconds into the model's load instead (a preload runs there: "
                        "--moe-opt moe_preload=true), and holds through the prompt and decode")
    g.add_argument("--neighbour-leave", type=int, default=None, metavar="N",
                   help="the decoded token before which it frees its memory and leaves (default: it stays)")
    g.add_argument("--lower-limit", type=float, default=None, metavar="SHARE",
                   help="write the run's cgroup limit down to SHARE of the model file (e.g. 0.4) mid-decode, as "
                        "`docker update --memory` does, retrying every 50 ms for up to 15 s as cgroup v1 refuses a "
                        "limit the group cannot reclaim down to: when it was taken, and decoding before and after "
                        "(the lowered-limit table)")
    g.add_argument("--lower-at", type=int, default=None, metavar="N",
                   help="the decoded token before which the limit is lowered (default: a quarter of -n)")
    g.add_argument("--rpc", metavar="HOST:PORT,...", default=None,
                   help="place the layers of every run on these ggml-rpc-server processes, as llama.cpp's --rpc "
                        "(rpc_servers=; all layers unless --llama-opt n_gpu_layers=N); the JSON gets the bytes "
                        "on the wire per phase")

    g = p.add_argument_group("drive probe")
    g.add_argument("--probe-s", type=float, default=3.0,
                   help="seconds of O_DIRECT reads before and after every run, and twice that at start and end (0: off)")
    g.add_argument("--probe-chunk-kb", type=int, default=None, help="(default: moe_chunk_kb, else 256)")
    g.add_argument("--probe-depth", type=int, default=None,
                   help=f"threads reading at once (default: moe_io_threads + 1, else {READ_THREADS + 1}: the "
                        f"reader's {READ_THREADS} and the caller)")

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


def main(argv=None, reports=()) -> int:
    """reports: (title, fn(bench, rows) -> lines) printed after the tables and kept in the JSON."""
    args = setup_arg_parser().parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.rpc:
        args.llama_opt.append(("rpc_servers", args.rpc))

    if args.neighbour_in_load is not None and (args.neighbour_in_prompt is not None or args.neighbour_at is not None):
        raise SystemExit("bench: --neighbour-in-load is a time of its own: leave out --neighbour-in-prompt and --neighbour-at")
    if bool(args.model) == bool(args.write_model):
        raise SystemExit("bench: give a model (-m MODEL.gguf) or --write-model PATH")
    if args.write_model:
        model = _write_model(args)
        if args.write_only:
            return 0
    else:
        model = Path(args.model)
    copy = _copy_to_tmpfs(model) if args.tmpfs else None
    try:
        return _bench(args, copy[0] if copy else model, reports)
    finally:
        if copy:
            for path in copy:
                path.unlink(missing_ok=True)
            copy[0].parent.rmdir()


def _copy_to_tmpfs(model):
    """bench --tmpfs: the model's files copied into a folder of /dev/shm (the first file first),
    refused where the copy would not leave 2 GiB of memory available."""
    import shutil

    from empanel_gguf.planning.index import load_index

    shards = [Path(s.path) for s in load_index(model).shards]
    size = sum(p.stat().st_size for p in shards)
    room = min(shutil.disk_usage("/dev/shm").free, meminfo().get("MemAvailable", 0))
    if size + 2 * GiB > room:
        raise SystemExit(f"bench --tmpfs: {fmt_bytes(size)} of model does not fit in /dev/shm with 2 GiB to spare "
                         f"({fmt_bytes(room)} free)")
    folder = Path(tempfile.mkdtemp(prefix="empanel-bench-", dir="/dev/shm"))
    log(f"bench: copying {fmt_bytes(size)} of model to {folder} (--tmpfs)")
    return [Path(shutil.copyfile(p, folder / p.name)) for p in shards]


def _bench(args, model, reports) -> int:
    bench, configs = _setup(args, model)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term)
    _log_setup(bench, model, configs)
    rows, tables = None, None
    t_start = time.perf_counter()
    try:
        _run_all(bench, configs)
    except KeyboardInterrupt:
        log("bench: interrupted; reporting what was measured")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if bench.cgroup is not None:
            bench.cgroup.remove()
        rows = build_rows(bench, configs)
        tables = {"main": main_table(bench, rows), "details": details_table(bench, rows)}
        if args.neighbour:
            tables["neighbour"] = neighbour_table(bench, rows)
        if args.lower_limit:
            tables["lowered limit"] = limit_table(bench, rows)
        if args.no_warmup:  # the measured prompt is cold: as a user meets it
            tables["prompt"] = prompt_table(bench, rows)
        for title, report in reports:  # e.g. an issue's targets (scripts/bench.py)
            tables[title] = report(bench, rows)
        write_json(bench, configs, rows, tables)
    _print_summary(bench, tables, reports, t_start)
    return 0


def shape_from_args(args) -> ModelShape:
    """--shape with the fields the flags give (--layers, ..., --routing-locality) changed."""
    overrides = {what: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, what in _SHAPE_FLAGS.items()}
    overrides.update(seed=args.seed, routing_skew=args.routing_skew, routing_locality=args.routing_locality)
    return shape_with(args.shape, **{k: v for k, v in overrides.items() if v is not None})


def _write_model(args) -> Path:
    """--write-model: the model of shape_from_args, written or reused."""
    return write_model(shape_from_args(args), args.write_model, log=log)


def _setup(args, model) -> tuple[Bench, list[Config]]:
    """The model's index, the arguments completed, the configurations, and the Bench that holds
    the machine's side of the runs (log folder, memory cgroup, readahead queue, drive probe)."""
    from empanel_gguf.planning.index import load_index

    index = load_index(model)
    if not index.is_moe:
        raise SystemExit(f"bench: {model} has no routed experts")
    moe_opts = dict(args.moe_opt)
    args.moe_opt = list(moe_opts.items())
    args.llama_opt = list(dict(args.llama_opt).items())
    configs = _configs(args, index.n_expert_used)
    warms_up = not args.no_warmup or any(c.pools_batch for c in configs)  # (the ceiling always does)
    longest = max(args.n_prompt, args.warmup_tokens if warms_up else 0) + args.n_gen
    args.n_ctx = args.n_ctx or max(64, longest + 16)
    model_bytes = sum(s.file_size for s in index.shards)

    started = time.strftime("%Y%m%d-%H%M%S")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix=f"empanel-bench-{started}-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    notices = []
    cgroup, guard = _memory_cgroup(args, configs, notices)
    queue_dir = block_queue_dir(model)
    if any(c.readahead_kb is not None for c in configs) and queue_dir is None:
        notices.append(f"no block queue found for {model}; readahead configurations are skipped")
    if not args.no_drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        notices.append("/proc/sys/vm/drop_caches is not writable: runs start with whatever is cached")

    probe_chunk = (args.probe_chunk_kb or moe_opts.get("moe_chunk_kb") or 256) * 1024
    probe_depth = args.probe_depth or (moe_opts.get("moe_io_threads") or READ_THREADS) + 1
    probe_direct = moe_opts.get("moe_direct_io", True) not in (False, 0, -1)
    bench = Bench(args=args, index=index, model_path=Path(model), model_bytes=model_bytes,
                  cap_bytes=int(args.cap * model_bytes), guard_bytes=guard, cgroup=cgroup,
                  queue_dir=queue_dir, log_dir=log_dir, probe_chunk=probe_chunk, probe_depth=probe_depth,
                  probe_direct=probe_direct, notices=notices, started=started)
    return bench, configs


def _memory_cgroup(args, configs, notices):
    """(the runs' memory cgroup or None, the guard for uncapped runs or None)."""
    cgroup, guard = None, None
    mem = meminfo()
    if not args.no_cgroup and (any(c.cap == CAP for c in configs) or os.geteuid() == 0):
        try:
            cgroup = MemCgroup(f"empanel-bench-{os.getpid()}")
            # uncapped runs still get a guard (available memory less 1 GiB), so an OOM kill hits the
            # measured child and not another process on the machine
            guard = max(GiB, mem.get("MemAvailable", 0) - GiB) if mem.get("MemAvailable") else None
        except OSError as e:
            notices.append(f"no memory cgroup ({e}); capped configurations are skipped")
    return cgroup, guard


def _log_setup(bench: Bench, model, configs):
    args, index = bench.args, bench.index
    log(f"bench: {model} ({bench.model_bytes / GiB:.2f} GiB; experts {index.expert_bytes_total / GiB:.2f} GiB, "
        f"rest {index.other_bytes_total / MiB:.0f} MiB; {index.cold_bytes_per_token / MiB:.0f} MiB/token cold)")
    log(f"bench: {len(configs)} configurations x {args.repetitions}: {', '.join(c.key for c in configs)}")
    log(f"bench: cap {bench.cap_bytes / GiB:.2f} GiB, guard {fmt_bytes(bench.guard_bytes)}, readahead queue "
        f"{bench.queue_dir}, logs in {bench.log_dir}")
    for text in bench.notices:
        log(f"bench: NOTE {text}")


def _run_all(bench: Bench, configs):
    """Every configuration, repetition by repetition, between drive probes at the start and end."""
    args, index = bench.args, bench.index
    if args.probe_s > 0:
        bench.drive.append({"when": "start", **(probe_drive(index, 2 * args.probe_s, bench.probe_chunk,
                                                             bench.probe_depth, seed=-1,
                                                             direct=bench.probe_direct) or {})})
        log(f"bench: drive (O_DIRECT, {bench.probe_chunk // 1024} KiB x {bench.probe_depth}): "
            f"{fmt(bench.drive[-1].get('gbps'))} GB/s {bench.drive[-1].get('error', '')}")
    n = 0
    dead = {}  # configuration -> why it is not repeated (OOM, skipped, error, timeout at load)
    total = len(configs) * args.repetitions
    for rep in range(1, args.repetitions + 1):
        for cfg in configs:
            n += 1
            _run_config(bench, configs, cfg, rep, n, total, dead)
    if args.probe_s > 0:
        bench.drive.append({"when": "end", **(probe_drive(index, 2 * args.probe_s, bench.probe_chunk,
                                                           bench.probe_depth, seed=-2,
                                                           direct=bench.probe_direct) or {})})
        log(f"bench: drive at the end: {fmt(bench.drive[-1].get('gbps'))} GB/s")


def _run_config(bench: Bench, configs, cfg: Config, rep: int, n: int, total: int, dead: dict):
    """Sample n of `total`: one run of `cfg` (again while other processes kept the CPUs busy, up to
    --retry-busy times); a configuration that cannot run is marked dead and not repeated."""
    args = bench.args
    if cfg.key in dead:
        log(f"bench: [{n}/{total}] {cfg.key} rep {rep}: not repeated ({dead[cfg.key]})")
        return
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


def _print_summary(bench: Bench, tables, reports, t_start):
    """The tables, the drive's rates, the run's parameters, the reports and the notices (stdout)."""
    args = bench.args
    print(f"\n{tables['main']}\n")
    print(f"{tables['details']}\n")
    for name in ("neighbour", "lowered limit", "prompt"):
        if name in tables:
            print(f"{tables[name]}\n")
    drives = [f"{d['when']} {d['gbps']:.2f}" for d in bench.drive if d.get("gbps")]
    per = [s["drive"]["gbps"] for s in bench.samples if (s.get("drive") or {}).get("gbps")]
    print(f"drive O_DIRECT ({bench.probe_chunk // 1024} KiB chunks, depth {bench.probe_depth}): "
          f"{', '.join(drives) or '-'} GB/s; before each run: median {fmt(median(per))}, "
          f"min {fmt(min(per) if per else None)}, max {fmt(max(per) if per else None)} GB/s")
    warm = (f"after a warm-up on other text (pp{args.warmup_tokens} + tg{args.n_gen}, at most "
            f"{args.warmup_s:.0f} s)" if not args.no_warmup else "cold, right after load")
    print(f"threads {args.threads}, pp{args.n_prompt} / tg{args.n_gen} {warm}, {args.repetitions} repetitions, "
          f"t/s median ± sd; read/tok: expert bytes read (empanel) or bytes the process read from the "
          f"drive (/proc/pid/io, stock); total {time.perf_counter() - t_start:.0f} s\n")
    for title, _ in reports:
        print(f"{title}:")
        for line in tables[title]:
            print(line)
    for text in bench.notices:
        print(f"NOTE: {text}")
    if args.json:
        log(f"bench: JSON in {args.json}")


def _progress(s) -> str:
    if s["status"] != "ok":
        return f"{s['status'].upper()}: {s.get('error', '')} (peak RSS {fmt_bytes(s.get('peak_rss'))})"
    m = sample_metrics(s)
    hit = f", hit {100 * m['tg_hit']:.0f}%" if m.get("tg_hit") is not None else ""
    return (f"load {m['load_s']:.1f} s, pp {fmt(m['pp_tps'])} t/s, tg {fmt(m['tg_tps'])} t/s{hit}, "
            f"read/tok {fmt_bytes(m.get('tg_read_per_tok'))}, peak RSS {fmt_bytes(m['peak_rss'])}, "
            f"drive {fmt(m.get('drive_gbps'))} GB/s, others' CPU {fmt(m.get('others_cpu_pct'), '.0f')}%")
