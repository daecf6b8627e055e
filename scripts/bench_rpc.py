"""Slot pools over llama.cpp's RPC backend: tok/s and bytes on the wire per token, local-only vs
one remote host vs two (loopback: this measures the protocol's cost, not a network).

    python scripts/bench_rpc.py -m ~/.cache/empanel-gguf/bench/qwen3-30b-a3b-shape.gguf --json rpc.json

Configurations (each in a fresh child process, its servers started fresh with empty caches):

    stock        Llama() without slots: every expert resident here (--configs stock)
    local        Llama(moe_slots=SLOTS): every layer and pool here, misses read from the file
    one          rpc_servers=A: every layer (n_gpu_layers=-1) and its pools on one ggml-rpc-server -c
    two          rpc_servers=A,B: the layers split over two servers (llama.cpp: by free memory)
    two-nocache  as two, the servers without -c: every miss sends the expert's bytes
    stock-two    as two without slot pools: every expert resident on the servers

Each child runs two passes over the same text (prose that does not repeat): a prompt of -p
tokens, then the text's next -n tokens decoded one at a time (so a random-weight synthetic model
routes as it would on real text, instead of repeating its own greedy tokens). Pass 1 starts with empty pools and empty host caches; pass 2 (after a reset, same
text, so the same experts) finds the hosts' caches warm: a miss there is a hash on the wire.
Reported per pass: prompt and decode tok/s (decode: median token time), and per decoded token
the bytes sent to and received from the servers, the expert bytes read from the local file, the
expert tensors the hosts wrote from their caches, the round trips (commands the client waited
for an answer to: on a network each costs its latency, which loopback hardly has), the hit
rate; and each process's peak memory.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's empanel_gguf, not an installed one

from empanel_gguf.commands.programs import program_path  # noqa: E402
from empanel_gguf.engine.stats import hit_rate  # noqa: E402

MiB = 1 << 20
from empanel_gguf.planning.profile import DEFAULT_TEXT as TEXT  # noqa: E402  (prose that does not repeat)

CHILD = textwrap.dedent("""
    import json, os, statistics, sys, time
    from empanel_gguf import Llama
    from empanel_gguf.engine import rpc

    spec = json.loads(sys.argv[1])
    kw = dict(n_ctx=spec["n_ctx"], n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False)
    if spec["servers"]:
        kw["rpc_servers"] = spec["servers"]
    if spec["slots"]:
        kw["moe_slots"] = spec["slots"]
    t0 = time.perf_counter()
    llm = Llama(spec["model"], **kw)
    load_s = time.perf_counter() - t0
    text = llm.tokenize(spec["text"].encode())
    prompt = text[: spec["n_prompt"]]
    follow = text[spec["n_prompt"]: spec["n_prompt"] + spec["n_gen"]]  # decoded one at a time

    def counters():
        stats = llm.moe_stats()
        total = stats["total"] if stats else {}
        sent, received, round_trips = rpc.wire_counts()
        return {"sent": sent, "received": received, "round_trips": round_trips, **{k: total.get(k, 0) for k in
                ("hits", "misses", "bytes_read", "copy_bytes", "remote_by_hash")}}

    def delta(a, b):
        return {k: b[k] - a[k] for k in a}

    passes = []
    for _ in range(2):
        llm.reset()
        c0 = counters()
        t0 = time.perf_counter()
        llm.eval(prompt)
        pp_s = time.perf_counter() - t0
        c1 = counters()
        times = []
        for token in follow:
            t0 = time.perf_counter()
            llm.eval([token])
            times.append(time.perf_counter() - t0)
        c2 = counters()
        passes.append({"pp": {"n": len(prompt), "s": pp_s, **delta(c0, c1)},
                       "tg": {"n": len(times), "s": sum(times), "median_s": statistics.median(times), **delta(c1, c2)}})
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    llm.close()
    print(json.dumps({"load_s": load_s, "passes": passes, "peak_rss": peak}))
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None


class Servers:
    """n ggml-rpc-server processes on loopback, each with its own (empty) cache folder."""

    def __init__(self, n, cache, threads, workdir):
        self.procs, self.endpoints, self.dirs = [], [], []
        server = program_path("ggml-rpc-server")
        for i in range(n):
            port = free_port()
            cache_dir = Path(workdir) / f"host{i}"
            cache_dir.mkdir(parents=True)
            cmd = [str(server), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)] + (["-c"] if cache else [])
            log = open(cache_dir / "server.log", "w")
            self.procs.append(subprocess.Popen(cmd, env={**os.environ, "LLAMA_CACHE": str(cache_dir)},
                                               stdout=log, stderr=subprocess.STDOUT))
            self.endpoints.append(f"127.0.0.1:{port}")
            self.dirs.append(cache_dir)
        for endpoint in self.endpoints:
            port = int(endpoint.rsplit(":", 1)[1])
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"ggml-rpc-server on {port} did not start") from None
                    time.sleep(0.1)

    def cache_bytes(self):
        return sum(p.stat().st_size for d in self.dirs for p in (d / "rpc").glob("*") if p.is_file()) \
            if any((d / "rpc").is_dir() for d in self.dirs) else 0

    def stop(self):
        peaks = [peak_rss(p.pid) for p in self.procs]
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return peaks


CONFIGS = {  # name: (servers, cache, slot pools)
    "stock": (0, False, False),
    "local": (0, False, True),
    "one": (1, True, True),
    "two": (2, True, True),
    "two-nocache": (2, False, True),
    "stock-two": (2, False, False),
}


def run_config(name, args, workdir):
    n_servers, cache, pooled = CONFIGS[name]
    servers = Servers(n_servers, cache, args.server_threads, Path(workdir) / name) if n_servers else None
    spec = {"model": args.model, "servers": ",".join(servers.endpoints) if servers else None,
            "slots": args.slots if pooled else None, "threads": args.threads, "n_ctx": args.n_prompt + args.n_gen + 16,
            "n_prompt": args.n_prompt, "n_gen": args.n_gen, "text": TEXT}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True,
                              text=True, timeout=args.timeout)
    finally:
        cache_bytes = servers.cache_bytes() if servers else 0
        host_peaks = servers.stop() if servers else []
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(config=name, host_peak_rss=host_peaks, host_cache_bytes=cache_bytes)
    return result


def per_token(phase, key):
    return phase[key] / phase["n"] if phase["n"] else 0.0


def rows(results):
    out = []
    for r in results:
        for i, p in enumerate(r["passes"]):
            pp, tg = p["pp"], p["tg"]
            out.append({
                "config": r["config"], "pass": i + 1,
                "pp_tps": pp["n"] / pp["s"], "tg_tps": 1.0 / tg["median_s"],
                "sent_mib_per_token": per_token(tg, "sent") / MiB,
                "received_mib_per_token": per_token(tg, "received") / MiB,
                "read_mib_per_token": per_token(tg, "bytes_read") / MiB,
                "experts_sent_mib_per_token": per_token(tg, "copy_bytes") / MiB,
                "by_hash_per_token": per_token(tg, "remote_by_hash"),
                "round_trips_per_token": per_token(tg, "round_trips"),
                "hit_rate": hit_rate(tg["hits"], tg["misses"], none=None),
                "peak_gib": r["peak_rss"] / (1 << 30),
                "host_peak_gib": [round(x / (1 << 30), 2) for x in r["host_peak_rss"] if x],
                "host_cache_gib": r["host_cache_bytes"] / (1 << 30),
            })
    return out


def print_table(table):
    print("| config | pass | pp t/s | tg t/s | sent MiB/tok | recv MiB/tok | experts sent MiB/tok | read here MiB/tok "
          "| by hash /tok | round trips /tok | hit | peak here GiB | hosts' peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        hit = f"{100 * row['hit_rate']:.0f} %" if row["hit_rate"] is not None else "-"
        print(f"| {row['config']} | {row['pass']} | {row['pp_tps']:.2f} | {row['tg_tps']:.2f} "
              f"| {row['sent_mib_per_token']:.1f} | {row['received_mib_per_token']:.2f} "
              f"| {row['experts_sent_mib_per_token']:.1f} | {row['read_mib_per_token']:.1f} "
              f"| {row['by_hash_per_token']:.1f} | {row['round_trips_per_token']:.1f} | {hit} | {row['peak_gib']:.2f} "
              f"| {', '.join(f'{x:.2f}' for x in row['host_peak_gib']) or '-'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--slots", default="25%", help="moe_slots of the pooled configurations (default: 25%%)")
    parser.add_argument("--configs", default="local,one,two,two-nocache", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("-p", "--n-prompt", type=int, default=64)
    parser.add_argument("-n", "--n-gen", type=int, default=24)
    parser.add_argument("-t", "--threads", type=int, default=1, help="the client's threads (default: 1)")
    parser.add_argument("--server-threads", type=int, default=1, help="each server's threads (default: 1)")
    parser.add_argument("-r", "--repetitions", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-rpc-", dir=os.environ.get("BENCH_RPC_DIR")) as workdir:
        for rep in range(args.repetitions):
            for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
                if name not in CONFIGS:
                    raise SystemExit(f"unknown config {name!r}: one of {', '.join(CONFIGS)}")
                print(f"== {name} (repetition {rep + 1})", file=sys.stderr, flush=True)
                results.append(run_config(name, args, Path(workdir) / f"r{rep}"))
                shutil.rmtree(Path(workdir) / f"r{rep}" / name, ignore_errors=True)
    table = rows(results)
    if args.repetitions > 1:  # the median of each number over the repetitions, per config and pass
        merged = {}
        for row in table:
            merged.setdefault((row["config"], row["pass"]), []).append(row)
        table = []
        for group in merged.values():
            row = dict(group[0])
            for key, value in row.items():
                if isinstance(value, float):
                    row[key] = statistics.median(g[key] for g in group)
            table.append(row)
    print_table(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
