#!/usr/bin/env python3
"""Where a decoded token's CPU time goes: one fresh process decodes after a warm-up while
`perf record -e cpu-clock` samples it (this VM has no hardware counters), then the share of each
symbol is printed, with the project's own timers beside it.

    python3 scripts/profile_decode.py M12.gguf --moe-slots 25% -n 32
    python3 scripts/profile_decode.py M12.gguf --stock --no-repack -n 32   # stock in the same layout

A run without --stock uses Llama(path, moe_slots=...); --stock loads every expert (use_mmap, as
stock holds a model that fits). The decode is the forced continuation of a fixed text, one token
per call, as the bench's. Needs perf (linux-perf) and permission to sample (root, or
perf_event_paranoid <= 1)."""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, resource, sys, time
from empanel_gguf import Llama
spec = json.loads(sys.argv[1])
kwargs = dict(n_ctx=512, n_threads=spec["threads"], verbose=False, **spec["kwargs"])
llm = Llama(spec["model"], **kwargs)
text = b"The history of the city begins with a small settlement by the river, where traders met. "
tokens = llm.tokenize(text * 8)
llm.eval(tokens[:32])
for t in tokens[32:32 + spec["warmup"]]:
    llm.eval([t])
before = llm.moe_stats()["total"] if hasattr(llm, "moe_stats") and llm.moe_stats() else {}
print("READY", flush=True)
sys.stdin.readline()
ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
n = spec["n"]
for t in tokens[32 + spec["warmup"]:32 + spec["warmup"] + n]:
    llm.eval([t])
wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
after = llm.moe_stats()["total"] if hasattr(llm, "moe_stats") and llm.moe_stats() else {}
delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
print("DONE", json.dumps({"wall_s": wall, "n": n, "cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
                          "moe": delta}), flush=True)
sys.stdin.readline()
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--moe-slots", default="25%")
    p.add_argument("--stock", action="store_true", help="every expert resident (no pools)")
    p.add_argument("--no-repack", action="store_true", help="stock in the plain layout (--no-repack)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="another Llama keyword (JSON value)")
    p.add_argument("-n", type=int, default=32, help="tokens decoded while sampled")
    p.add_argument("--warmup", type=int, default=16, help="tokens decoded before sampling")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="symbols shown")
    args = p.parse_args(argv)

    kwargs = {}
    if args.stock:
        kwargs["moe_repack"] = not args.no_repack
    else:
        slots = args.moe_slots
        kwargs["moe_slots"] = int(slots) if slots.isdigit() else slots
    for opt in args.opt:
        key, _, value = opt.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    spec = {"model": args.model, "kwargs": kwargs, "threads": args.threads, "n": args.n, "warmup": args.warmup}
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        try:
            if child.stdout.readline().strip() != "READY":
                sys.exit("profile: the model did not load (see above)")
            perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-o", str(data),
                                     "-p", str(child.pid)], stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # (perf attaches to every thread)
            child.stdin.write("\n")
            child.stdin.flush()
            done = child.stdout.readline()
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=60)
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
        if not done.startswith("DONE"):
            sys.exit("profile: the decode did not finish")
        result = json.loads(done.split(" ", 1)[1])
        report(result, data, args.top)


def report(result, data, top):
    n = result["n"]
    print(f"decode: {n} tokens, {1000 * result['wall_s'] / n:.1f} ms per token, process CPU "
          f"{1000 * result['cpu_s'] / n:.1f} ms per token")
    moe = result["moe"]
    if moe:
        per = {k: 1000 * moe.get(k, 0) / n for k in ("remap_s", "wait_s", "ready_s", "read_s", "read_cpu_s")}
        print("sidecar per token: " + ", ".join(f"{k[:-2]} {v:.2f} ms" for k, v in per.items())
              + f", misses {moe.get('misses', 0) / n:.1f}")
    # (by symbol only: ggml's threads and the readers all carry the interpreter's name)
    out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,symbol",
                          "--percent-limit", "0.5"], capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("#")]
    print("\nshare of samples (cpu-clock) by symbol")
    for line in lines[:top]:
        print("  " + line.strip())


if __name__ == "__main__":
    main()
