"""llama-server under load: aggregate decode tok/s with 1, 2, 4, 8 concurrent clients, ours vs stock.

    python scripts/bench_server.py -m ~/.cache/empanel-gguf/bench/qwen3-30b-a3b-shape.gguf \
        --clients 1,2,4,8 --tokens 24 -r 2 --json server-bench.json

Both configurations are llama.cpp's llama-server of this build with continuous batching
(-np = the most clients), one after the other, each in a fresh memory cgroup (v1) capped at
--cap x the model file (default 40 %), after dropping the page cache:

    stock     llama-server alone, --no-repack: every weight from the file's mapping (the page cache
              under the cap; with its default CPU_REPACK copy of all weights it cannot load there)
    empanel   empanel-gguf llama-server --moe-slots SLOTS (default 25 %): slot pools, the plan in the program
    empanel-plain  the same with --moe-repack off: plain pools that reads land in, nothing repacked
              (as stock here, whose weights stay in their file layout under the cap)

Each load level sends N completions at once (distinct prompts, greedy, --tokens tokens each,
the end-of-text token ignored) and waits for all; aggregate decode tok/s = tokens generated /
wall time of the level (prompts included); "while decoding" sums llama-server's own per-request
decode rates (its timings), the requests decoding side by side. Reported per level: the median
over -r repetitions, the expert bytes read per generated token and hit rate (ours, from
/metrics), the group's peak memory. Needs root for the cgroup and the cache drop.
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's empanel_gguf, not an installed one

from empanel_gguf.lab.bench.host import MemCgroup, Readahead, block_queue_dir, drop_caches  # noqa: E402
from empanel_gguf.commands.programs import program_path  # noqa: E402

GiB = 1 << 30
PROMPTS = [  # distinct openings: no prompt shares a cached prefix with another
    "The history of the northern kingdoms begins", "In the kitchen the old recipe called for",
    "Sailing past the lighthouse at dawn, the crew", "A short guide to repairing bicycles:",
    "The committee met on Tuesday to discuss", "Among the stars of the winter sky,",
    "Dear diary, today the weather finally", "The mathematics of tides is simple:",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, body=None, timeout=600):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def metric_sum(base, name):
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def moe_layout(config):
    """Our flags for the pools' layout: empanel-plain loads as llama.cpp's --no-repack."""
    if config not in ("empanel", "empanel-plain"):
        raise SystemExit(f"bench_server: unknown config {config!r} (stock, empanel, empanel-plain)")
    return ["--moe-repack", "off"] if config == "empanel-plain" else []


def start_server(config, args, cgroup, port, log):
    server_flags = ["-m", args.model, "-np", str(max(args.clients)), "-c", str(args.ctx * max(args.clients)),
                    "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port), "--metrics",
                    "--cache-ram", "0", "-ngl", "0"]
    if config == "stock":  # from the mapping: a repacked copy of every weight would not fit under the cap
        cmd = [str(program_path("llama-server")), *server_flags] + (["--no-repack"] if args.cap > 0 else [])
    else:
        cmd = [sys.executable, "-m", "empanel_gguf", "llama-server", "--moe-slots", args.slots,
               "--mem-floor", "0", *moe_layout(config), *server_flags]
    # the shell moves itself into the group before it becomes the server: all its memory counts
    shell = f"echo $$ > {cgroup.procs} && exec " + " ".join(f"'{c}'" for c in cmd)
    return subprocess.Popen(["sh", "-c", shell], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_ready(base, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def one_level(base, n_clients, tokens):
    """n_clients completions at once: (wall s, tokens generated, llama-server's per-request decode tok/s)."""
    def ask(i):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "n_predict": tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        return http_json(f"{base}/completion", body)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_clients) as pool:
        results = list(pool.map(ask, range(n_clients)))
    wall = time.perf_counter() - t0
    generated = sum(r["timings"]["predicted_n"] for r in results)
    per_request = [r["timings"]["predicted_per_second"] for r in results]
    return wall, generated, per_request


def run_config(config, args, cgroup, out_dir):
    dropped = drop_caches()
    cgroup.prepare(int(args.cap * os.path.getsize(args.model)) if args.cap > 0 else 1 << 62)  # --cap 0: none
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"server-{config}.log"
    with open(log_path, "w") as log:
        proc = start_server(config, args, cgroup, port, log)
        try:
            if not wait_ready(base, proc, args.start_timeout):
                return {"config": config, "error": f"did not start (see {log_path})", "oom_kills": cgroup.oom_kills()}
            one_level(base, 1, 4)  # warm up: first use of every buffer
            levels = []
            for n in args.clients:
                walls, rates, decode_rates, per_request, read_per_token, hit = [], [], [], [], [], []
                for _ in range(args.repetitions):
                    before = (metric_sum(base, "empanel_read_bytes_total"), metric_sum(base, "empanel_expert_hits_total"),
                              metric_sum(base, "empanel_expert_misses_total")) if config != "stock" else None
                    wall, generated, per = one_level(base, n, args.tokens)
                    walls.append(wall)
                    rates.append(generated / wall)
                    decode_rates.append(sum(per))  # the requests decode at the same time
                    per_request += per
                    if before is not None:
                        read = metric_sum(base, "empanel_read_bytes_total") - before[0]
                        hits = metric_sum(base, "empanel_expert_hits_total") - before[1]
                        misses = metric_sum(base, "empanel_expert_misses_total") - before[2]
                        read_per_token.append(read / generated)
                        hit.append(hits / (hits + misses) if hits + misses else 0.0)
                level = {"clients": n, "aggregate_tok_s": statistics.median(rates), "runs_tok_s": rates,
                         "decode_aggregate_tok_s": statistics.median(decode_rates),
                         "wall_s": statistics.median(walls), "per_request_tok_s": statistics.median(per_request)}
                if read_per_token:
                    level["read_mib_per_token"] = statistics.median(read_per_token) / 2**20
                    level["hit_rate"] = statistics.median(hit)
                levels.append(level)
                print(f"  {config:8s} {n} clients: {level['aggregate_tok_s']:.2f} tok/s aggregate, "
                      f"{level['decode_aggregate_tok_s']:.2f} while decoding ({level['per_request_tok_s']:.2f} per request)"
                      + (f", {level['read_mib_per_token']:.0f} MiB read/token, {100 * level['hit_rate']:.1f} % hit"
                         if read_per_token else ""), file=sys.stderr, flush=True)
            return {"config": config, "levels": levels, "peak_bytes": cgroup.max_usage(),
                    "oom_kills": cgroup.oom_kills(), "page_cache_dropped": dropped}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_llama_bench(config, args, cgroup, out_dir):
    """llama-bench (its own flags from --llama-bench) under the same cap: its table rows."""
    drop_caches()
    capped = args.cap > 0
    cgroup.prepare(int(args.cap * os.path.getsize(args.model)) if capped else 1 << 62)
    flags = ["-m", args.model, "-t", str(args.threads), *args.llama_bench.split()]
    if config == "stock":
        cmd = [str(program_path("llama-bench")), *flags] + (["--repack", "0"] if capped else [])
    else:
        cmd = [sys.executable, "-m", "empanel_gguf", "llama-bench", "--moe-slots", args.slots, "--mem-floor", "0",
               *moe_layout(config), *flags]
    shell = f"echo $$ > {cgroup.procs} && exec " + " ".join(f"'{c}'" for c in cmd)
    proc = subprocess.run(["sh", "-c", shell], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    (out_dir / f"llama-bench-{config}.log").write_text(proc.stdout + proc.stderr)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    for row in rows[2:]:
        print(f"  {config:8s} {row}", file=sys.stderr, flush=True)
    return {"config": config, "rc": proc.returncode, "rows": rows, "peak_bytes": cgroup.max_usage(),
            "oom_kills": cgroup.oom_kills(), "stats": [line for line in proc.stderr.splitlines() if "hits," in line]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--clients", default="1,2,4,8", help="concurrent clients per level (default 1,2,4,8)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens each request generates (default 24)")
    parser.add_argument("-r", "--repetitions", type=int, default=2, help="runs per level; the median is reported")
    parser.add_argument("--cap", type=float, default=0.4,
                        help="memory cap, share of the model file (default 0.4; 0: uncapped, stock then repacks)")
    parser.add_argument("--slots", default="25%", help="our --moe-slots (default 25%%)")
    parser.add_argument("--ctx", type=int, default=256, help="context per client (default 256)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--configs", default="stock,empanel", help="comma list of stock, empanel, empanel-plain")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--readahead-kb", type=int, default=128,
                        help="the drive's read_ahead_kb while a configuration runs (default 128, the kernel's usual; "
                             "8 MiB makes the mapping read 30x what it needs)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--llama-bench", metavar="FLAGS",
                        help="run llama-bench with these flags (e.g. \"-p 512 -n 128 -r 2\") instead of the server "
                             "levels; --cap 0: uncapped (stock then repacks as by default)")
    args = parser.parse_args()
    args.clients = [int(n) for n in args.clients.split(",")]
    out_dir = Path(args.json).resolve().parent if args.json else Path.cwd()
    cgroup = MemCgroup(f"empanel-bench-server-{os.getpid()}")
    queue = block_queue_dir(args.model)
    results = []
    try:
        for config in args.configs.split(","):
            cap = f"{args.cap * os.path.getsize(args.model) / GiB:.2f} GiB" if args.cap > 0 else "none"
            print(f"bench_server: {config}, cap {cap}, "
                  f"readahead {args.readahead_kb} KiB", file=sys.stderr)
            # the mapping's page faults read ahead by the drive's read_ahead_kb (ours reads experts with O_DIRECT)
            with Readahead(queue, args.readahead_kb) if queue is not None else contextlib.nullcontext():
                run = run_llama_bench if args.llama_bench else run_config
                results.append(run(config, args, cgroup, out_dir))
    finally:
        cgroup.remove()
    summary = {"model": args.model, "cap": args.cap, "readahead_kb": args.readahead_kb, "slots": args.slots, "tokens": args.tokens,
               "threads": args.threads, "repetitions": args.repetitions, "results": results}
    if args.llama_bench:
        for r in results:
            print(f"\n{r['config']} (peak {r['peak_bytes'] / GiB:.2f} GiB, rc {r['rc']}):")
            print("\n".join(r["rows"] + r["stats"]))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        return
    print("\n| config | " + " | ".join(f"{n} client{'s' * (n > 1)}" for n in args.clients) + " | 4 vs 1 | peak memory |")
    print("|---" * (len(args.clients) + 3) + "|")
    for r in results:
        if "levels" not in r:
            print(f"| {r['config']} | {r.get('error')} |")
            continue
        rate = {lv["clients"]: lv["aggregate_tok_s"] for lv in r["levels"]}
        ratio = f"{rate[4] / rate[1]:.2f}x" if 4 in rate and 1 in rate and rate[1] else "-"
        print(f"| {r['config']} | " + " | ".join(f"{rate[n]:.2f}" for n in args.clients)
              + f" | {ratio} | {r['peak_bytes'] / GiB:.2f} GiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
