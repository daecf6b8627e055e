"""A neighbour taking memory mid-decode, through the faces users run: `empanel-gguf run`,
llama-server (`empanel-gguf llama-server`) and `empanel-gguf serve` (the [server] extra), each
stock (--moe-slots none: the model from its mapping) and with pools (auto), in a memory cgroup
of --cap of the model file (root, cgroup v1, as scripts/neighbour_faces.sh). Per run: a fresh
process (servers: one request alone first, the text to compare), page cache dropped, then the
measured request; the neighbour takes --neighbour of anonymous memory --at seconds into it and
holds it to the end. Reports decode tok/s (llama.cpp's own counters for run and llama-server;
serve: its streamed tokens after the first), whether every process lived (the cgroup's OOM
kills), and whether the text equals the text without the neighbour. Medians of -r runs.

    python scripts/neighbour_faces_bench.py -m q3s12.gguf --cap 0.6 --neighbour 1GiB -r 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from empanel_gguf.lab.bench.host import MemCgroup  # noqa: E402
from empanel_gguf.planning.sizing import parse_size  # noqa: E402

PROMPT = "The history of the river towns is written in their bridges. Each generation built a crossing"
NEIGHBOUR = """import mmap, sys, time
m = mmap.mmap(-1, int(sys.argv[1]))
for i in range(0, int(sys.argv[1]), 4096): m[i] = 1
print("held", flush=True); time.sleep(3600)"""
PORT = 8093


class Cgroup(MemCgroup):
    """The runs' v1 memory cgroup (the bench's), its limit set, the page cache dropped; processes
    join it at exec (preexec), and leave it killed."""

    def __init__(self, limit):
        super().__init__("empanel-faces-bench")
        self.prepare(limit)
        subprocess.run(["sync"])
        Path("/proc/sys/vm/drop_caches").write_text("3")

    def join(self):
        self.procs.write_text(str(os.getpid()))

    def close(self):
        for pid in self.procs.read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        self.remove()


def stock_env(slots):
    """Stock (none, from the mapping: --no-repack, else its CPU repack buffers copy every weight
    into anonymous memory, OOM-killed under a cap) is refused by the memory guard where the model
    does not fit: forced."""
    return dict(os.environ, LLAMA_ARG_FORCE="1") if slots == "none" else None


def start(cg, cmd, **kw):
    return subprocess.Popen(cmd, cwd=REPO, preexec_fn=cg.join, **kw)


def neighbour_after(cg, size, at):
    time.sleep(at)
    return start(cg, [sys.executable, "-c", NEIGHBOUR, str(size)], stdout=subprocess.DEVNULL)


def post(path, body, timeout=900):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def wait_up(proc, path):
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up in 150 s")


def ask_llama_server(n):
    """(text, decode tok/s by llama.cpp's counters)."""
    with post("/completion", {"prompt": PROMPT, "n_predict": n, "temperature": 0, "cache_prompt": False}) as r:
        out = json.load(r)
    return out["content"], out["timings"]["predicted_per_second"]


def ask_serve(n):
    """(text, tokens streamed after the first per second: one event a token, its text empty where
    llama-cpp-python holds bytes back)."""
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True}
    text, times = [], []
    with post("/v1/completions", body) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
                times.append(time.monotonic())
    return "".join(text), (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def later(cg, size, at):
    """The neighbour started at seconds from now on a thread: a dict that gets it as "p"."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(p=neighbour_after(cg, size, at)))
    thread.start()
    box["thread"] = thread
    return box


def run_face(args, cg, slots, size):
    """empanel-gguf run in the cgroup, the neighbour --at s after its first decoded text (none if
    size is 0: the text to compare)."""
    cmd = [sys.executable, "-m", "empanel_gguf", "run", args.model, "--moe-slots", slots, "-p", PROMPT, "-n",
           str(args.n), "--temp", "0", "-t", str(args.threads), *(["--moe-repack", "off"] if slots == "none" else [])]
    proc = start(cg, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=stock_env(slots))
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    reader.start()
    out, box = b"", None
    while chunk := os.read(proc.stdout.fileno(), 4096):
        out += chunk
        if size and box is None and len(out) > len(PROMPT.encode()):  # the prompt echoed: decoding
            box = later(cg, size, args.at)
    proc.wait()
    reader.join()
    rate = next((float(line.rsplit(":", 1)[1].split()[0]) for line in err[0].decode().splitlines()
                 if line.strip().startswith("decode ") and "tok/s" in line), 0.0)
    nb_alive = True
    if box is not None:
        box["thread"].join()
        nb_alive = box["p"].poll() is None
        box["p"].kill()
        box["p"].wait()
    return {"rc": proc.returncode, "text": out.decode(errors="replace"), "tok_s": rate, "neighbour_alive": nb_alive,
            "neighbour_in_time": box is not None or not size}


def server_face(args, cg, face, slots, size):
    """A server in the cgroup: one request alone (the text to compare), then the measured one with
    the neighbour --at s into it."""
    if face == "llama-server":
        cmd = [sys.executable, "-m", "empanel_gguf", "llama-server", "-m", args.model, "--moe-slots", slots,
               "--port", str(PORT), "-c", "1024", "-t", str(args.threads), *(["--no-repack"] if slots == "none" else [])]
        path, ask = "/health", ask_llama_server
    else:
        cmd = [sys.executable, "-m", "empanel_gguf", "serve", args.model, "--moe_slots", slots, "--port", str(PORT),
               "--n_ctx", "1024", "--n_threads", str(args.threads), *(["--moe_repack", "off"] if slots == "none" else [])]
        path, ask = "/v1/models", ask_serve
    proc = start(cg, cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=stock_env(slots))
    box = None
    try:
        wait_up(proc, path)
        alone, _ = ask(args.n)
        box = later(cg, size, args.at) if size else None
        text, rate = ask(args.n)
        nb = None
        if box is not None:
            box["thread"].join()
            nb = box["p"]
        alive = proc.poll() is None
        nb_alive = nb is None or nb.poll() is None
        return {"rc": 0 if alive else proc.returncode, "text": text, "alone": alone, "tok_s": rate,
                "neighbour_alive": nb_alive}
    except (OSError, RuntimeError) as e:
        return {"rc": proc.poll(), "text": "", "alone": None, "tok_s": 0.0, "neighbour_alive": False, "error": str(e)}
    finally:
        proc.kill()
        proc.wait()
        if box is not None and box.get("p"):
            box["p"].kill()
            box["p"].wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--cap", type=float, default=0.6, help="the cgroup's limit, a share of the model file")
    ap.add_argument("--neighbour", default="1GiB", help="anonymous memory the neighbour takes")
    ap.add_argument("--at", type=float, default=2.0, help="seconds into the measured request's decoding")
    ap.add_argument("--faces", default="run,llama-server,serve")
    ap.add_argument("--configs", default="none,auto", help="--moe-slots values: none is stock")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    limit = int(args.cap * os.path.getsize(args.model))
    size = parse_size(args.neighbour)
    rows = []
    for face in args.faces.split(","):
        for slots in args.configs.split(","):
            ref = None
            if face == "run" and slots != "none":  # its text without the neighbour (stock's is stock's)
                cg = Cgroup(limit)
                ref = run_face(args, cg, slots, 0)["text"]
                cg.close()
            for rep in range(args.repetitions):
                cg = Cgroup(limit)
                r = run_face(args, cg, slots, size) if face == "run" else server_face(args, cg, face, slots, size)
                alone = ref if face == "run" else r.get("alone")
                r.update(face=face, slots=slots, rep=rep, kills=cg.oom_kills(), same=alone is None or r["text"] == alone)
                cg.close()
                print(json.dumps({k: v for k, v in r.items() if k not in ("text", "alone")}), flush=True)
                rows.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{args.model}, cap {args.cap:.0%} of the file ({limit / 2**30:.2f} GiB), a {args.neighbour} neighbour "
          f"{args.at:g} s into decoding, medians of {args.repetitions}\n")
    print("| face | slots | decode tok/s | vs stock | all alive | OOM kills | same text (pools) |")
    print("|---|---|---|---|---|---|---|")
    for face in args.faces.split(","):
        stock = None
        for slots in args.configs.split(","):
            rs = [r for r in rows if r["face"] == face and r["slots"] == slots]
            med = statistics.median(r["tok_s"] for r in rs)
            stock = med if slots == "none" else stock
            vs = f"{med / stock:.2f}x" if stock and slots != "none" else "-"
            alive = all(r["rc"] == 0 and r["neighbour_alive"] for r in rs)
            print(f"| {face} | {slots} | {med:.2f} | {vs} | {'yes' if alive else 'no'} | "
                  f"{sum(r['kills'] for r in rs)} | {sum(r['same'] for r in rs)}/{len(rs)} |")


if __name__ == "__main__":
    main()
