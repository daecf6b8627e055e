"""Flip random bytes in the header of a GGUF model and check that nothing crashes or hangs.

    python scripts/fuzz_gguf.py MODEL.gguf [--cases 200] [--seed 0] [--seconds 120] [--json out.json]

Each case is a copy of MODEL.gguf with 1 to 4 random bytes of its header region (metadata and
tensor infos: everything before the tensor data) replaced. A worker process takes the cases one
after another and, for each, runs `inspect` (our index), loads it with slot pools and decodes a
few tokens, then loads it as stock llama.cpp does (no slots) and decodes again. Every step may
fail, but only with a clear Python error (ValueError and its kin). A worker that dies of a
signal, or takes longer than --case-timeout on one case, is a finding; the worker is restarted
and the run goes on with the next case. The worker's address space is capped (--mem-limit-gib),
so a corrupt count that asks for terabytes fails with an error instead of taking the machine.

Prints one line per finding and a summary; exit status 1 if anything crashed, hung or failed
unclearly. The tests run it bounded (tests/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # this checkout's empanel_gguf, also in the worker
    sys.path.insert(0, str(REPO))

# errors a corrupt file may clearly end in: ModelError and llama-cpp-python's "Failed to load
# model from file" are ValueErrors; MoeReadError is a RuntimeError
CLEAR_ERRORS = (ValueError, RuntimeError, MemoryError, OSError)

RESULT = "fuzz-result: "  # the worker's result lines; anything else it prints is passed over


def mutate(data: bytes, header_end: int, rng: random.Random) -> tuple[bytes, list]:
    """1 to 4 bytes of data[0, header_end) replaced (never the magic); the new bytes and where."""
    out = bytearray(data)
    flips = []
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(4, header_end)
        value = out[pos] ^ rng.randrange(1, 256)
        out[pos] = value
        flips.append((pos, value))
    return bytes(out), flips


def header_end(path: Path) -> int:
    """Where the tensor data begins: the header region ends there."""
    from empanel_gguf.planning.index import load_index

    return load_index(path).shards[0].data_offset


# ------------------------------------------------------------------------------------------------
# worker: one case per line on stdin, one JSON line per case on stdout


def _step(name, fn, results):
    try:
        fn()
        results[name] = "ok"
    except CLEAR_ERRORS as e:
        results[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    except Exception as e:  # noqa: BLE001 - an unclear error is a finding, reported, not raised
        results[name] = f"UNCLEAR: {type(e).__name__}: {e!s:.160}"


def _load_and_decode(path, moe_slots):
    from empanel_gguf import Llama

    llm = Llama(str(path), moe_slots=moe_slots, n_ctx=64, n_threads=1, verbose=False)
    try:
        tokens = llm.tokenize(b"Hello there", add_bos=True)[:8] or [0]
        llm.eval(tokens)
        llm.eval([tokens[-1]])
    finally:
        llm.close()


def cap_memory(mem_limit_gib: float) -> None:
    """Cap this process's address space, so that a corrupt count that asks for terabytes fails with
    an error. Not under a sanitizer (scripts/sanitize.sh): its shadow memory is terabytes of
    address space itself."""
    import resource

    if not os.environ.get("EMPANEL_SANITIZER"):
        limit = int(mem_limit_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def worker(mem_limit_gib: float) -> None:
    cap_memory(mem_limit_gib)
    import io
    from contextlib import redirect_stdout

    import empanel_gguf  # noqa: F401 - our libraries, before llama_cpp
    from empanel_gguf.commands import inspect

    for line in sys.stdin:
        path = Path(line.strip())
        results = {}

        def run_inspect(path=path):
            with redirect_stdout(io.StringIO()):
                code = inspect.main([str(path)])
            if code not in (0, 1, None):
                raise AssertionError(f"inspect exited {code}")

        _step("inspect", run_inspect, results)
        _step("slots", lambda path=path: _load_and_decode(path, "25%"), results)
        _step("stock", lambda path=path: _load_and_decode(path, None), results)
        print(RESULT + json.dumps(results), flush=True)


# ------------------------------------------------------------------------------------------------
# driver


class Worker:
    """A worker process (`script --worker --mem-limit-gib N ...`) that takes case paths on stdin and
    answers each with a RESULT line; scripts/fuzz_plan.py drives its own worker with it."""

    def __init__(self, mem_limit_gib, script=__file__, args=()):
        env = dict(os.environ, EMPANEL_PROFILE_DIR=os.environ.get("EMPANEL_PROFILE_DIR", tempfile.mkdtemp()))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--worker", "--mem-limit-gib", str(mem_limit_gib), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def run(self, path, timeout):
        """The case's results, or ("signal", n) / ("hang", None) / ("exit", code)."""
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            return "hang", None
        deadline = time.monotonic() + timeout
        while True:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                return ("signal", -code) if code < 0 else ("exit", code)
            if line.startswith(RESULT):
                return "done", json.loads(line[len(RESULT):])
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self.kill()
                return "hang", None

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def tally(results: dict, outcomes: dict, findings: list, case: dict) -> None:
    """Count a finished case's step results by kind (ok, error: Type); an unclear one is a finding."""
    for step, result in results.items():
        first = result.split(":")[0] if result != "ok" else "ok"
        outcomes.setdefault(step, {})
        outcomes[step][first] = outcomes[step].get(first, 0) + 1
        if result.startswith("UNCLEAR"):
            findings.append({**case, "kind": "unclear", "step": step, "detail": result})
            print(f"case {case['case']}: {step} {result} {case}", flush=True)


def fuzz(model: Path, cases: int, seed: int, seconds: float, case_timeout: float, mem_limit_gib: float,
         workdir: Path) -> dict:
    data = model.read_bytes()
    end = header_end(model)
    rng = random.Random(seed)
    findings, outcomes = [], {"inspect": {}, "slots": {}, "stock": {}}
    t0 = time.monotonic()
    worker = Worker(mem_limit_gib)
    done = 0
    case_path = workdir / "case.gguf"
    for i in range(cases):
        if time.monotonic() - t0 > seconds:
            break
        mutated, flips = mutate(data, end, rng)
        case_path.write_bytes(mutated)
        kind, results = worker.run(case_path, case_timeout)
        done += 1
        if kind != "done":
            findings.append({"case": i, "seed": seed, "flips": flips, "kind": kind, "detail": results})
            print(f"case {i}: {kind} {results if results is not None else ''} flips={flips}", flush=True)
            (workdir / f"finding-{i}.gguf").write_bytes(mutated)
            worker = Worker(mem_limit_gib)
            continue
        tally(results, outcomes, findings, {"case": i, "seed": seed, "flips": flips})
    worker.close()
    return {"model": str(model), "seed": seed, "cases": done, "header_bytes": end,
            "seconds": round(time.monotonic() - t0, 1), "outcomes": outcomes, "findings": findings}


def fuzz_parser(doc: str, cases: int, model_optional: bool = False) -> argparse.ArgumentParser:
    """The options every fuzzer here takes (this one and fuzz_plan.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model", nargs="?" if model_optional else None, type=Path)
    parser.add_argument("--cases", type=int, default=cases)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=120, help="stop starting cases after this long")
    parser.add_argument("--case-timeout", type=float, default=60, help="seconds one case may take: a hang")
    parser.add_argument("--mem-limit-gib", type=float, default=4)
    parser.add_argument("--workdir", type=Path, help="where cases and findings go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def run_fuzzer(fuzz_fn, args, prefix: str, what: str = "") -> int:
    """Run fuzz_fn over args' cases in args.workdir (or a new temporary folder), print and write the
    summary; 1 if anything was found."""
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    summary = fuzz_fn(args.model, args.cases, args.seed, args.seconds, args.case_timeout, args.mem_limit_gib, workdir)
    print(f"{summary['cases']} cases in {summary['seconds']} s{what.format(**summary)}, "
          f"{len(summary['findings'])} findings; outcomes: {json.dumps(summary['outcomes'])}")
    if summary["findings"]:
        print(f"findings kept in {workdir}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["findings"] else 0


def main(argv=None) -> int:
    parser = fuzz_parser(__doc__, cases=200, model_optional=True)
    args = parser.parse_args(argv)
    if args.worker:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        worker(args.mem_limit_gib)
        return 0
    if args.model is None:
        parser.error("give a GGUF model")
    return run_fuzzer(fuzz, args, "empanel-fuzz-", " ({header_bytes} header bytes)")


if __name__ == "__main__":
    sys.exit(main())
