"""`empanel-gguf layout MODEL.gguf [-ms S] [-p N] [-n N] [-r R] [--cap C] [--moe-*]`: measure which weight layout pools that page run faster here.

Loads the model twice per round in fresh processes, once with plain pools (llama.cpp --no-repack:
reads land in the slots) and once repacked (llama.cpp's CPU repack buffers, stock's defaults: the
reader threads repack every expert they read), each in its complete default configuration at the
same slots and --moe-* options, and times a prompt and a decode of the built-in text. Repacked is chosen only where it
decodes clearly faster in every round (layout.MARGIN); anything closer keeps plain. --cap measures
under the memory a container will give the model (a share of the model file, 0.4, or a size,
6GiB): the runs load in a memory cgroup of that limit (root, cgroup v1), so their slots and their
reads are those of a load there; moe_repack="auto" follows a measurement at about its own slots
per layer. The result is
saved in the cache folder for this machine and model, where moe_repack="auto" (the default, in
Llama, `run`, `serve` and llama.cpp's programs) finds it; moe_stats()["layout_why"] quotes it.
--show prints the saved measurement, --forget removes it. Exit status: 0 measured (or nothing to
choose), 1 error.
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..planning.host_memory import parse_floor
from .options import add_memory_args, add_moe_args, command_parser, moe_options_from_args

LAYOUTS = {"plain": False, "repacked": True}


class LayoutError(Exception):
    pass


def setup_arg_parser():
    parser = command_parser("layout", __doc__)
    parser.add_argument("model", help="GGUF model (first shard of a split)")
    parser.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("-n", "--n-decode", type=int, default=32, help="decoded tokens (default: 32)")
    parser.add_argument("-r", "--rounds", type=int, default=3, help="rounds of both layouts (default: 3)")
    parser.add_argument("-t", "--threads", type=int, default=None, help="threads (default: llama-cpp-python's)")
    parser.add_argument("--show", action="store_true", help="print this machine's saved measurement and exit")
    parser.add_argument("--forget", action="store_true", help="remove this machine's saved measurement and exit")
    parser.add_argument("--cap", metavar="SHARE|SIZE", help="measure under this memory limit: a share of the model "
                        "file (0.4) or a size (6GiB); runs in a memory cgroup (root, cgroup v1)")
    parser.add_argument("--one", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)  # a measuring child's layout
    parser.add_argument("--join", help=argparse.SUPPRESS)  # its cgroup.procs (--cap), joined before the load
    add_moe_args(parser)  # the loads measured take them (--moe-repack aside: each run sets its own)
    add_memory_args(parser)
    return parser


def plan_for(index, args, layout=None):
    """The load plan of a run in `layout` (None: as the options ask) with the command's options."""
    from ..planning.plan import parse_moe_slots, plan_load

    if layout is not None:
        args.moe_repack = LAYOUTS[layout]
    kwargs = {"n_ctx": args.n_prompt + args.n_decode + 16, "n_batch": max(32, args.n_prompt), "n_threads": args.threads}
    load = plan_load(index, parse_moe_slots(args.moe_slots or "auto"), kwargs, options=moe_options_from_args(args),
                     floor=parse_floor(args.mem_floor), force=args.force, guard=layout is not None,
                     what=f"loading {Path(index.path).name}")
    return load, kwargs


def measure_one(args, layout):
    """One fresh load in `layout`: the prompt in one call, then n_decode tokens one at a time (the
    text's own next tokens: no sampling). {"prompt_tps", "decode_tps", "cpu_ms" (process CPU per
    decoded token), "hit_rate", "read_per_token" (bytes), "repack_gbps" (per reader core, 0 when
    nothing was repacked), "slots", "available" (the memory its plan saw, bytes)}."""
    from ..llama import Llama
    from ..planning.host_memory import available_memory
    from ..planning.index import load_index
    from ..planning.profile import DEFAULT_TEXT

    seen = available_memory()
    load, kwargs = plan_for(load_index(args.model), args, layout)
    llm = Llama(str(args.model), moe_load=load, verbose=False, **kwargs)
    n_prompt, n_decode = args.n_prompt, args.n_decode
    try:
        tokens = llm.tokenize(DEFAULT_TEXT.encode("utf-8"))
        while len(tokens) < n_prompt + n_decode:
            tokens += tokens
        t0 = time.perf_counter()
        llm.eval(tokens[:n_prompt])
        t1 = time.perf_counter()
        before, cpu0 = llm.moe_stats()["total"], resource.getrusage(resource.RUSAGE_SELF)
        for token in tokens[n_prompt:n_prompt + n_decode]:
            llm.eval([token])
        t2, cpu1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        stats = llm.moe_stats()
    finally:
        llm.close()
    total = stats["total"]
    hits, misses = total["hits"] - before["hits"], total["misses"] - before["misses"]  # of the decode
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return {"prompt_tps": n_prompt / (t1 - t0), "decode_tps": n_decode / (t2 - t1),
            "cpu_ms": 1e3 * cpu / n_decode, "hit_rate": hits / max(1, hits + misses),
            "read_per_token": (total["bytes_read"] - before["bytes_read"]) / n_decode, "layout": stats["layout"],
            "repack_gbps": total["repack_bytes"] / total["repack_s"] / 1e9 if total["repack_s"] else 0.0,
            "repacked_bytes": total["repack_bytes"], "bytes_read": total["bytes_read"],
            "slots": max(layer["n_slots"] for layer in stats["layers"].values()), "available": seen}


def cap_bytes(text, model_bytes):
    """--cap as bytes: a share of the model file (0 < SHARE <= 1) or a size; ValueError otherwise."""
    from ..planning.sizing import parse_size

    try:
        share = float(text)
    except ValueError:
        size = parse_size(text)
        if size is None or size <= 0:
            raise ValueError(f"--cap {text!r}: a share of the model file (0.4) or a size (6GiB)") from None
        return size
    if not 0 < share <= 1:
        raise ValueError(f"--cap {text!r}: a share of the model file is above 0 and at most 1")
    return int(share * model_bytes)


class Cap:
    """The memory cgroup of --cap (None: no cap): each run loads in it, its limit set anew; the
    parent plans as if its limit were the memory available."""

    def __init__(self, limit):
        self.limit, self.group = limit, None
        if limit is None:
            return
        from ..lab.bench.host import MemCgroup

        try:
            self.group = MemCgroup(f"empanel-layout-{os.getpid()}")
        except OSError as e:
            raise LayoutError(f"--cap needs a memory cgroup of its own (root, cgroup v1): {e}") from None

    def child_args(self):
        if self.group is None:
            return []
        self.group.prepare(self.limit)
        return ["--join", str(self.group.procs)]

    def remove(self):
        if self.group is not None:
            self.group.remove()


def run_child(argv, layout, cap=None):
    """measure_one in a fresh process (the page tables, the pools and the allocator start empty),
    in cap's memory cgroup if any."""
    cmd = [sys.executable, "-m", "empanel_gguf", "layout", *argv, "--one", layout, *(cap.child_args() if cap else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0 or not proc.stdout.strip():
        raise LayoutError(f"the {layout} run failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def nothing_to_choose(index, args):
    """Why auto needs no measurement for this load, or None: where no pool pages or waves may be
    masked the layout is stock's defaults by rule."""
    from ..planning.estimate import waves_may_be_masked

    if not index.is_moe:
        return f"{Path(index.path).name}: no routed experts ({index.architecture}): no pools, stock's layout"
    if waves_may_be_masked():
        return "waves may be masked here (a device, or EMPANEL_WAVE_MASK=1): moe_repack auto keeps stock's defaults"
    plan = plan_for(index, args)[0].plan
    if plan is None or plan.holds_all:
        return (f"at moe_slots={args.moe_slots or 'auto'} the pools hold every expert: nothing pages, moe_repack "
                "auto keeps stock's defaults")
    return None


def probe(argv, args, log=print):
    """Both layouts, args.rounds rounds in alternating order, decided (layout.decide) and saved.
    Returns (entry, path), or (None, why) where there is nothing to choose."""
    from ..planning.index import load_index
    from ..planning.layout import decide, machine, save_probe

    index = load_index(args.model)
    limit = cap_bytes(args.cap, Path(args.model).stat().st_size) if args.cap else None
    with available(limit):
        why = nothing_to_choose(index, args)
    if why is not None:
        return None, why
    cap = Cap(limit)
    try:
        runs = measure_rounds(argv, args, cap, log)
    finally:
        cap.remove()
    if runs["repacked"][0]["bytes_read"] and not runs["repacked"][0]["repacked_bytes"]:
        decision, why = "plain", "measured: ggml repacks none of these experts' types on this CPU, so both layouts are plain"
    else:
        decision, why = decide(runs["plain"], runs["repacked"])
    gbps = [run["repack_gbps"] for run in runs["repacked"] if run["repack_gbps"]]
    entry = {"machine": machine(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "moe_slots": runs["plain"][0]["slots"], "asked": str(args.moe_slots or "auto"), "threads": args.threads,
             "tokens": {"prompt": args.n_prompt, "decode": args.n_decode}, "runs": runs, "cap_bytes": limit,
             "repack_gbps": statistics.median(gbps) if gbps else None, "decision": decision, "why": why}
    return entry, save_probe(index, entry)


def measure_rounds(argv, args, cap, log):
    """args.rounds rounds of both layouts, in alternating order: {layout: [measure_one's, ...]}."""
    runs = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name in (("plain", "repacked") if r % 2 == 0 else ("repacked", "plain")):
            runs[name].append(run_child(argv, name, cap))
            got = runs[name][-1]
            log(f"  round {r + 1} {name:8s}: prompt {got['prompt_tps']:.1f} t/s, decode {got['decode_tps']:.2f} t/s")
        if runs["repacked"][0]["bytes_read"] and not runs["repacked"][0]["repacked_bytes"]:
            log("  nothing was repacked: ggml has no repacked layout for these experts' types on this CPU")
            break
    return runs


@contextlib.contextmanager
def available(limit):
    """The parent's plans see `limit` as the memory available (None: as measured)."""
    if limit is None:
        yield
        return
    before = os.environ.get("EMPANEL_MEM_AVAILABLE")
    os.environ["EMPANEL_MEM_AVAILABLE"] = str(limit)
    try:
        yield
    finally:
        if before is None:
            del os.environ["EMPANEL_MEM_AVAILABLE"]
        else:
            os.environ["EMPANEL_MEM_AVAILABLE"] = before


def print_entry(entry, path):
    m = entry["machine"]
    cap = f" under a {entry['cap_bytes'] / 2**30:.2f} GiB cap" if entry.get("cap_bytes") else ""
    print(f"layout measured {entry['date']} on {m['cpu']} ({m['cores']} cores; {' '.join(m['flags']) or 'no SIMD flags'}) "
          f"at {entry['moe_slots']} slots per layer{cap}, {entry['tokens']['prompt']}-token prompt, "
          f"{entry['tokens']['decode']} decoded, medians of {len(entry['runs']['plain'])}")
    print(f"{'layout':10s} {'prompt t/s':>10s} {'decode t/s':>10s} {'CPU ms/tok':>10s} {'hits':>6s} "
          f"{'read/tok':>10s} {'repack GB/s/core':>17s}")
    for name, runs in entry["runs"].items():
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0] if isinstance(runs[0][key], (int, float))}
        gbps = f"{med['repack_gbps']:.2f}" if med["repack_gbps"] else "-"
        print(f"{name:10s} {med['prompt_tps']:10.1f} {med['decode_tps']:10.2f} {med['cpu_ms']:10.1f} "
              f"{100 * med['hit_rate']:5.1f}% {med['read_per_token'] / 2**20:6.1f} MiB {gbps:>17s}")
    print(f"decision  {entry['decision']}: {entry['why']}")
    print(f"saved     {path}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = setup_arg_parser().parse_args(argv)
    from ..planning.index import ModelError, load_index
    from ..planning.layout import forget_probe, load_probe, probe_path

    if args.one:  # a measuring child: one JSON line on stdout
        if args.join:  # (--cap) in its memory cgroup before anything is loaded
            Path(args.join).write_text(f"{os.getpid()}\n")
        print(json.dumps(measure_one(args, args.one)))
        return 0
    try:
        if min(args.n_prompt, args.n_decode, args.rounds) < 1:
            raise ValueError("-p, -n and -r must be at least 1")
        index = load_index(args.model)
        if args.show or args.forget:
            entry = load_probe(index)
            if entry is None:
                print(f"no layout measured on this machine for {Path(args.model).name} ({probe_path(index)})")
            elif args.forget:
                print(f"removed this machine's layout from {forget_probe(index)}")
            else:
                print_entry(entry, probe_path(index))
            return 0
        print(f"measuring both layouts of {Path(args.model).name}: {args.rounds} rounds, fresh processes", file=sys.stderr)
        entry, where = probe(argv, args, log=lambda line: print(line, file=sys.stderr))
    except (OSError, ModelError, ValueError, LayoutError, RuntimeError) as e:
        print(f"empanel-gguf layout: {e}", file=sys.stderr)
        return 1
    if entry is None:
        print(f"nothing to measure: {where}")
        return 0
    print_entry(entry, where)
    return 0
