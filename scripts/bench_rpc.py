"""Slot pools over llama.cpp's RPC backend: tok/s and bytes on the wire per token, local-only vs
one remote host vs two (loopback: this measures the protocol's cost, not a network).

    python scripts/bench_rpc.py -m ~/.cache/empanel-gguf/bench/qwen3-30b-a3b-shape.gguf --json rpc.json

Configurations (each in a fresh child process, its servers started fresh with empty caches):

    stock        Llama() without slots: every expert resident here (--configs stock)
    local        Llama(moe_slots=SLOTS): every layer and pool here, misses read from the file
    stock-one    rpc_servers=A without slot pools: every layer and every expert on one server
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

--links puts a link between the client and each server (this kernel has no netem qdisc): a
proxy (scripts/rpc_link.c, compiled here with cc) delivers each direction's bytes half a round
trip after they arrived, optionally at a bounded rate. Each entry is `direct` (plain loopback) or
RTT_MS[:GBIT], e.g. `--links direct,0,0.2:1,0.5:10,2`; `0` is the proxy with no delay, which
measures the proxy's own cost (its CPU seconds are reported: client, servers and proxy share the
cores). Every configuration runs at every link.

EMPANEL_BENCH_RPC_SERVER=PATH runs another build's ggml-rpc-server as the hosts (an A/B of the
server side: a checkout's empanel_gguf/programs/ggml-rpc-server loads that checkout's libraries).
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
        kw.update(spec["moe"])
    t0 = time.perf_counter()
    llm = Llama(spec["model"], **kw)
    load_s = time.perf_counter() - t0
    text = llm.tokenize(spec["text"].encode())
    prompt = text[: spec["n_prompt"]]
    follow = text[spec["n_prompt"]: spec["n_prompt"] + spec["n_gen"]]  # decoded one at a time

    def cpu_s(pid):  # user + system CPU seconds of a process so far
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def counters():
        stats = llm.moe_stats()
        total = stats["total"] if stats else {}
        sent, received, round_trips = rpc.wire_counts()
        by_command = {f"rt_{k}": v for k, v in rpc.round_trips_by_command().items()}
        return {"sent": sent, "received": received, "round_trips": round_trips, **by_command,
                "cpu_s": time.process_time(), "host_cpu_s": sum(cpu_s(pid) for pid in spec["host_pids"]),
                **{k: total.get(k, 0)
                for k in ("hits", "misses", "bytes_read", "copy_bytes", "remote_by_hash")}}

    def delta(a, b):
        return {k: b.get(k, 0) - a.get(k, 0) for k in {**a, **b}}

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


def build_link(workdir):
    """scripts/rpc_link.c compiled into workdir: the path of the proxy."""
    exe = Path(workdir) / "rpc_link"
    if not exe.exists():
        subprocess.run(["cc", "-O2", "-pthread", str(REPO / "scripts" / "rpc_link.c"), "-o", str(exe)], check=True)
    return exe


def parse_link(text):
    """'direct' -> None; 'RTT_MS[:GBIT]' -> (one-way delay in microseconds, megabits per second or 0)."""
    if text == "direct":
        return None
    rtt, _, gbit = text.partition(":")
    try:
        return float(rtt) * 1000.0 / 2, float(gbit) * 1000.0 if gbit else 0.0
    except ValueError:
        raise SystemExit(f"--links: {text!r} is neither 'direct' nor RTT_MS[:GBIT]") from None


class Servers:
    """n ggml-rpc-server processes on loopback, each with its own (empty) cache folder, reached
    directly or through a link proxy each (link: parse_link's (delay_us, mbit))."""

    def __init__(self, n, cache, threads, workdir, link=None, link_exe=None, timeout=3600):
        self.procs, self.endpoints, self.dirs, self.proxies = [], [], [], []
        server = os.environ.get("EMPANEL_BENCH_RPC_SERVER") or program_path("ggml-rpc-server")
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
        if link is not None:  # the client reaches each server through its own proxy
            for i, endpoint in enumerate(self.endpoints):
                port = free_port()
                proxy = subprocess.Popen([str(link_exe), str(port), endpoint.rsplit(":", 1)[1], str(link[0]),
                                          str(link[1]), str(int(timeout))], stdout=subprocess.PIPE, text=True)
                if proxy.stdout.readline().strip() != "listening":
                    raise SystemExit(f"rpc_link on {port} did not start")
                self.proxies.append(proxy)
                self.endpoints[i] = f"127.0.0.1:{port}"

    def proxy_cpu_s(self):
        """Stop the proxies; the CPU seconds they used in all."""
        total = 0.0
        for proxy in self.proxies:
            proxy.terminate()
            out = proxy.communicate(timeout=30)[0]
            total += sum(float(line.split()[1]) for line in out.splitlines() if line.startswith("cpu_s "))
        self.proxies = []
        return total

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
    "stock-one": (1, False, False),
    "one": (1, True, True),
    "two": (2, True, True),
    "two-nocache": (2, False, True),
    "stock-two": (2, False, False),
}


def run_config(name, args, workdir, link=None, link_exe=None):
    n_servers, cache, pooled = CONFIGS[name]
    servers = Servers(n_servers, cache, args.server_threads, Path(workdir) / name, link, link_exe,
                      args.timeout) if n_servers else None
    spec = {"model": args.model, "servers": ",".join(servers.endpoints) if servers else None,
            "slots": args.slots if pooled else None, "threads": args.threads, "n_ctx": args.n_prompt + args.n_gen + 16,
            "n_prompt": args.n_prompt, "n_gen": args.n_gen, "text": TEXT, "moe": parse_moe(args.moe),
            "host_pids": [p.pid for p in servers.procs] if servers else []}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True,
                              text=True, timeout=args.timeout)
    finally:
        cache_bytes = servers.cache_bytes() if servers else 0
        proxy_cpu = servers.proxy_cpu_s() if servers else 0.0
        host_peaks = servers.stop() if servers else []
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(config=name, host_peak_rss=host_peaks, host_cache_bytes=cache_bytes, proxy_cpu_s=proxy_cpu)
    return result


def parse_moe(items):
    """["guess=off", ...] -> {"moe_guess": False, ...}: on/off as booleans, numbers as numbers."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        value = {"on": True, "off": False}.get(value, value)
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            pass
        out[key if key.startswith("moe_") else f"moe_{key}"] = value
    return out


def per_token(phase, key):
    return phase[key] / phase["n"] if phase["n"] else 0.0


def rows(results):
    out = []
    for r in results:
        for i, p in enumerate(r["passes"]):
            pp, tg = p["pp"], p["tg"]
            out.append({
                "config": r["config"], "link": r.get("link", "direct"), "pass": i + 1,
                "pp_tps": pp["n"] / pp["s"], "tg_tps": 1.0 / tg["median_s"],
                "sent_mib_per_token": per_token(tg, "sent") / MiB,
                "received_mib_per_token": per_token(tg, "received") / MiB,
                "read_mib_per_token": per_token(tg, "bytes_read") / MiB,
                "experts_sent_mib_per_token": per_token(tg, "copy_bytes") / MiB,
                "by_hash_per_token": per_token(tg, "remote_by_hash"),
                "round_trips_per_token": per_token(tg, "round_trips"),
                "round_trips_by_command": {k[3:]: round(per_token(tg, k), 2) for k in sorted(tg) if k.startswith("rt_")
                                           and tg[k]},
                "hit_rate": hit_rate(tg["hits"], tg["misses"], none=None),
                "peak_gib": r["peak_rss"] / (1 << 30),
                "host_peak_gib": [round(x / (1 << 30), 2) for x in r["host_peak_rss"] if x],
                "host_cache_gib": r["host_cache_bytes"] / (1 << 30),
                "proxy_cpu_s": r.get("proxy_cpu_s", 0.0),
                "wall_ms_per_token": 1000 * per_token(tg, "s"),
                "cpu_ms_per_token": 1000 * per_token(tg, "cpu_s"),
                "host_cpu_ms_per_token": 1000 * per_token(tg, "host_cpu_s"),
            })
    return out


def print_table(table):
    print("| config | link (RTT ms:Gbit/s) | pass | pp t/s | tg t/s | sent MiB/tok | recv MiB/tok | experts sent MiB/tok "
          "| read here MiB/tok | by hash /tok | round trips /tok | hit | peak here GiB | hosts' peak GiB | proxy CPU s "
          "| ms/tok: wall, client CPU, hosts' CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        hit = f"{100 * row['hit_rate']:.0f} %" if row["hit_rate"] is not None else "-"
        print(f"| {row['config']} | {row['link']} | {row['pass']} | {row['pp_tps']:.2f} | {row['tg_tps']:.2f} "
              f"| {row['sent_mib_per_token']:.1f} | {row['received_mib_per_token']:.2f} "
              f"| {row['experts_sent_mib_per_token']:.1f} | {row['read_mib_per_token']:.1f} "
              f"| {row['by_hash_per_token']:.1f} | {row['round_trips_per_token']:.1f} | {hit} | {row['peak_gib']:.2f} "
              f"| {', '.join(f'{x:.2f}' for x in row['host_peak_gib']) or '-'} | {row['proxy_cpu_s']:.1f} "
              f"| {row['wall_ms_per_token']:.0f}, {row['cpu_ms_per_token']:.0f}, {row['host_cpu_ms_per_token']:.0f} |")


def print_commands(table):
    """Round trips per decoded token by command, per config, link and pass."""
    names = sorted({k for row in table for k in row["round_trips_by_command"]})
    if not names:
        return
    print()
    print("| config | link | pass | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for row in table:
        print(f"| {row['config']} | {row['link']} | {row['pass']} | "
              + " | ".join(f"{row['round_trips_by_command'].get(k, 0):.1f}" for k in names) + " |")


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
    parser.add_argument("--links", default="direct", help="direct and/or RTT_MS[:GBIT] links, comma-separated")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--moe", action="append", default=[], metavar="KEY=VALUE",
                        help="a moe_* option of the pooled configurations (guess=off); repeatable")
    args = parser.parse_args()

    results = []
    links = [(text, parse_link(text)) for text in (t.strip() for t in args.links.split(",")) if text]
    with tempfile.TemporaryDirectory(prefix="bench-rpc-", dir=os.environ.get("BENCH_RPC_DIR")) as workdir:
        link_exe = build_link(workdir) if any(link is not None for _, link in links) else None
        for rep in range(args.repetitions):
            for text, link in links:
                for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
                    if name not in CONFIGS:
                        raise SystemExit(f"unknown config {name!r}: one of {', '.join(CONFIGS)}")
                    print(f"== {name}, link {text} (repetition {rep + 1})", file=sys.stderr, flush=True)
                    result = run_config(name, args, Path(workdir) / f"r{rep}", link, link_exe)
                    result["link"] = text
                    results.append(result)
                    shutil.rmtree(Path(workdir) / f"r{rep}" / name, ignore_errors=True)
    table = rows(results)
    if args.repetitions > 1:  # the median of each number over the repetitions, per config and pass
        merged = {}
        for row in table:
            merged.setdefault((row["config"], row["link"], row["pass"]), []).append(row)
        table = []
        for group in merged.values():
            row = dict(group[0])
            for key, value in row.items():
                if isinstance(value, float):
                    row[key] = statistics.median(g[key] for g in group)
            row["round_trips_by_command"] = {k: statistics.median(g["round_trips_by_command"].get(k, 0) for g in group)
                                             for k in {k for g in group for k in g["round_trips_by_command"]}}
            table.append(row)
    print_table(table)
    print_commands(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
