"""Mutate a load's plan (the text csrc/plan_file.c reads) and check that nothing crashes or hangs.

    python scripts/fuzz_plan.py MODEL.gguf [--cases 300] [--seed 0] [--seconds 120] [--json out.json]

The plan of MODEL at 4 slots per layer (read-ahead and digests on, so that every record kind is
there) is the base. Each case changes it by 1 to 3 edits: a number replaced by an extreme one
(-1, 0, 2^31, 2^63, 2^64, ...), a line deleted, doubled or moved, a field dropped or added, the text
cut short, a byte changed. A worker process then, for each case:
- open: the sidecar reads the plan and makes its pools (empanel_load_open), then frees them;
- load: where it opened, loads MODEL with that plan (the pools llama.cpp makes follow it, and
  bind checks them against it) and decodes a few tokens.
Each step may fail, but only with a clear error (the sidecar's message, a ValueError, MoeReadError).
A worker that dies of a signal (or a sanitizer's report: scripts/sanitize.sh runs this under ASan),
or takes longer than --case-timeout on a case, is a finding; it is restarted and the run goes on.
Exit status 1 if anything crashed, hung or failed unclearly. tests/test_plan.py runs it bounded.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for path in (REPO, SCRIPTS):  # this checkout's empanel_gguf, and the GGUF fuzzer's worker harness
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from fuzz_gguf import RESULT, Worker, _step, cap_memory, fuzz_parser, run_fuzzer, tally  # noqa: E402

BASE = "fuzz-base: "
SLOTS = 4
EXTREMES = ("-1", "0", "1", "-2147483649", "2147483647", "2147483648", "4294967296", "9223372036854775807",
            "9223372036854775808", "18446744073709551615", "18446744073709551616", "1e9", "nan", "-0", "0x10", "")


def _options():
    return dict(moe_slots=SLOTS, moe_prefetch=1, moe_verify=True, n_ctx=64, n_threads=1, verbose=False)


def base_plan(model: Path) -> str:
    """The plan a load of MODEL at SLOTS slots hands the sidecar (captured from a real load)."""
    from empanel_gguf import Llama
    from empanel_gguf.engine import pools

    captured = []
    write = pools.load_text

    def capture(load, *args, **kwargs):
        captured.append(write(load, *args, **kwargs))
        return captured[-1]

    pools.load_text = capture
    try:
        Llama(str(model), **_options()).close()
    finally:
        pools.load_text = write
    return captured[0]


def mutate(text: str, rng: random.Random) -> tuple[str, list]:
    """1 to 3 edits of the plan text; the text and what was done."""
    lines = text.split("\n")
    edits = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("number", "number", "number", "delete", "double", "move", "drop", "add", "cut", "byte"))
        i = rng.randrange(len(lines))
        fields = lines[i].split(" ")
        if kind == "number":
            numeric = [j for j, f in enumerate(fields) if re.fullmatch(r"-?[0-9]+|[0-9a-f]{16}", f)]
            if not numeric:
                continue
            j = rng.choice(numeric)
            if rng.random() < 0.8 or not re.fullmatch(r"-?[0-9]+", fields[j]):
                fields[j] = rng.choice(EXTREMES)
            else:
                fields[j] = str(int(fields[j]) + rng.choice((-1, 1)))
            lines[i] = " ".join(fields)
        elif kind == "delete":
            del lines[i]
        elif kind == "double":
            lines.insert(i, lines[i])
        elif kind == "move":
            lines.insert(rng.randrange(len(lines)), lines.pop(i))
        elif kind == "drop" and len(fields) > 1:
            del fields[rng.randrange(1, len(fields))]
            lines[i] = " ".join(fields)
        elif kind == "add":
            fields.insert(rng.randrange(1, len(fields) + 1), rng.choice(EXTREMES) or "x")
            lines[i] = " ".join(fields)
        elif kind == "cut":
            joined = "\n".join(lines)
            lines = joined[: rng.randrange(len(joined))].split("\n")
        elif kind == "byte" and lines[i]:
            j = rng.randrange(len(lines[i]))
            lines[i] = lines[i][:j] + chr(rng.randrange(1, 256)) + lines[i][j + 1:]
        else:
            continue
        edits.append((kind, i))
        if not lines:
            lines = [""]
    return "\n".join(lines), edits


# ------------------------------------------------------------------------------------------------
# worker: one case file per line on stdin, one result line per case on stdout


def _open_plan(text: str, model: Path) -> None:
    from empanel_gguf.engine.native import native

    n = native()
    err = n.ffi.new("char[]", 512)
    load = n.sidecar.empanel_load_open(text.encode("utf-8", "surrogateescape"), n.ffi.NULL, str(model).encode(), err, 512)
    if load == n.ffi.NULL:
        message = n.ffi.string(err).decode(errors="replace")
        if message:
            raise ValueError(message)  # refused, and said why
        raise ValueError("not this model's plan")
    n.sidecar.empanel_load_close(load)


def _load_with_plan(text: str, model: Path) -> None:
    from empanel_gguf import Llama
    from empanel_gguf.engine import pools
    from empanel_gguf.engine.native import NativeLibraryError

    write = pools.load_text
    pools.load_text = lambda load, *args, **kwargs: text
    try:
        llm = Llama(str(model), **_options())
    except NativeLibraryError as e:  # the sidecar refused the plan or the pools (engine/pools.py), and said why
        raise ValueError(str(e)) from None
    finally:
        pools.load_text = write
    try:
        llm.eval([1, 2, 3, 4])
        llm.eval([5])
    finally:
        llm.close()


def worker(model: Path, mem_limit_gib: float) -> None:
    cap_memory(mem_limit_gib)
    import empanel_gguf  # noqa: F401 - our libraries, before llama_cpp

    for line in sys.stdin:
        text = Path(line.strip()).read_bytes().decode("utf-8", "surrogateescape")
        results = {}
        _step("open", lambda text=text: _open_plan(text, model), results)
        if results["open"] == "ok":
            _step("load", lambda text=text: _load_with_plan(text, model), results)
        print(RESULT + json.dumps(results), flush=True)


# ------------------------------------------------------------------------------------------------
# driver


def fuzz(model: Path, cases: int, seed: int, seconds: float, case_timeout: float, mem_limit_gib: float,
         workdir: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, str(model), "--base"], capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(BASE)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the base plan of {model} could not be made:\n{proc.stderr[-2000:]}")
    base = json.loads(lines[0][len(BASE):])
    rng = random.Random(seed)
    findings, outcomes = [], {}
    t0 = time.monotonic()
    args = (str(model),)
    work = Worker(mem_limit_gib, __file__, args)
    done = 0
    case_path = workdir / "case.plan"
    for i in range(cases):
        if time.monotonic() - t0 > seconds:
            break
        text, edits = mutate(base, rng)
        case_path.write_bytes(text.encode("utf-8", "surrogateescape"))
        kind, results = work.run(case_path, case_timeout)
        done += 1
        if kind != "done":
            findings.append({"case": i, "seed": seed, "edits": edits, "kind": kind, "detail": results})
            print(f"case {i}: {kind} {results if results is not None else ''} edits={edits}", flush=True)
            (workdir / f"finding-{i}.plan").write_bytes(case_path.read_bytes())
            work = Worker(mem_limit_gib, __file__, args)
            continue
        tally(results, outcomes, findings, {"case": i, "seed": seed, "edits": edits})
    work.close()
    return {"model": str(model), "seed": seed, "cases": done, "seconds": round(time.monotonic() - t0, 1),
            "outcomes": outcomes, "findings": findings}


def main(argv=None) -> int:
    parser = fuzz_parser(__doc__, cases=300)
    parser.add_argument("--base", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.base:
        print(BASE + json.dumps(base_plan(args.model)), flush=True)
        return 0
    if args.worker:
        worker(args.model, args.mem_limit_gib)
        return 0
    return run_fuzzer(fuzz, args, "empanel-plan-fuzz-")


if __name__ == "__main__":
    sys.exit(main())
