"""Check `empanel-gguf fit`'s predictions against measured runs (not a test: a benchmark).

    python scripts/fit_check.py MODEL.gguf [--slots 16,32,64] [-r 3] [-t 2] [--out DIR]

For each slot count: the peak-memory budget that buys it (the load's own estimate), fit's
predicted decode/prompt t/s and hit rate at that budget (fit --fresh: measured now), then
`empanel-gguf bench` at those slot counts (fresh processes, page cache dropped, medians of -r),
and a table of predicted against measured with the error of each. Decode is bench's tg (after its
warm-up), prompt its pp (-p 512).

--text FILE also measures each slot count on that text in fresh processes (medians of -r): its
first --text-prompt tokens as the prompt, then -n greedy tokens, decode t/s and the decode's hit
rate from moe_stats(). bench decodes after random token ids, which a model with learned routing
(the built-in one) routes unlike any text; fit measures on its own built-in text.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# one measured run on a text, in its own process: argv model, slots, threads, text file, n_prompt, n_gen
TEXT_RUN = """
import json, sys, time
from empanel_gguf import Llama
model, slots, threads, path, n_prompt, n_gen = sys.argv[1:7]
n_prompt, n_gen = int(n_prompt), int(n_gen)
llm = Llama(model, moe_slots=int(slots), moe_prefetch=0, n_threads=int(threads), n_ctx=n_prompt + n_gen + 8, verbose=False)
tokens = llm.tokenize(open(path, encoding="utf-8").read().encode())[:n_prompt]
gen = llm.generate(tokens, temp=0.0, reset=True)
next(gen)  # the prompt evaluated, its first token sampled
none = {"total": {"hits": 0, "misses": 0}}  # (pools that hold every expert: no statistics)
before, t0 = (llm.moe_stats() or none)["total"], time.perf_counter()
for _ in range(n_gen - 1):
    next(gen)
wall, after = time.perf_counter() - t0, (llm.moe_stats() or none)["total"]
hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
print(json.dumps(dict(decode_tps=(n_gen - 1) / wall, decode_hit=hits / max(1, hits + misses))))
llm.close()
"""


def text_runs(model, slots, threads, path, n_prompt, n_gen, repetitions):
    """(median decode t/s, median decode hit rate) of fresh runs on a text."""
    from empanel_gguf.lab.bench.host import drop_caches

    runs = []
    for _ in range(repetitions):
        drop_caches()
        out = subprocess.run([sys.executable, "-c", TEXT_RUN, model, str(slots), str(threads), path, str(n_prompt),
                              str(n_gen)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return (statistics.median(r["decode_tps"] for r in runs), statistics.median(r["decode_hit"] for r in runs))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--slots", default="16,32,64")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=16)
    p.add_argument("--out", default="fit-check")
    p.add_argument("--text", metavar="FILE", help="also measure each slot count decoding after this text")
    p.add_argument("--text-prompt", type=int, default=128, help="prompt tokens of --text (default: 128)")
    args = p.parse_args()

    from empanel_gguf.planning.estimate import cli_n_ctx, estimate, model_shape
    from empanel_gguf.planning.index import load_index
    from empanel_gguf.planning.plan import ESTIMATE_KWARGS
    from empanel_gguf.planning.sizing import plan_slots

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = load_index(args.model)
    shape = model_shape(index)
    params = dict(ESTIMATE_KWARGS, n_ctx=cli_n_ctx(shape, None), shape=shape)
    slots = [int(s) for s in args.slots.split(",")]
    budgets = [estimate(index, plan_slots(index, n), **params).host for n in slots]
    fit = subprocess.run([sys.executable, "-m", "empanel_gguf", "fit", args.model, "--fresh", "--json",
                          "-t", str(args.threads), "--memory", ",".join(f"{b}B" for b in budgets)],
                         capture_output=True, text=True, check=True)
    (out / "fit.json").write_text(fit.stdout)
    rows = json.loads(fit.stdout)["rows"]
    # (uncapped: the budget is the slots'; no read-ahead, as fit predicts)
    configs = ",".join(f"empanel-{r['slots']}/prefetch=0@none" for r in rows)
    subprocess.run([sys.executable, "-m", "empanel_gguf", "bench", "-m", args.model, "-p", str(args.n_prompt),
                    "-n", str(args.n_gen), "-r", str(args.repetitions), "-t", str(args.threads),
                    "--configs", configs, "--json", str(out / "bench.json")], check=True)
    bench = {str(r["moe_slots"]): r for r in json.loads((out / "bench.json").read_text())["rows"]}
    print(f"| slots | peak budget | hit predicted / measured | decode t/s predicted / measured (error) | "
          f"pp{args.n_prompt} t/s predicted / measured (error) |")
    print("|---|---|---|---|---|")
    for r in rows:
        b = bench.get(str(r["slots"]), {})
        tg, pp, hit = b.get("tg_tps"), b.get("pp_tps"), b.get("tg_hit")

        def err(pred, meas):
            return f"{100 * (pred - meas) / meas:+.0f} %" if meas else "?"
        print(f"| {r['slots']} | {r['budget'] / 2**30:.2f} GiB | {100 * r['hit_rate']:.0f} % / "
              f"{100 * hit:.0f} % | {r['decode_tps']:.2f} / {tg:.2f} ({err(r['decode_tps'], tg)}) | "
              f"{r['prompt_tps']:.1f} / {pp:.1f} ({err(r['prompt_tps'], pp)}) |" if tg and pp and hit is not None
              else f"| {r['slots']} | ? | bench row missing: {b.get('status')} |")
    if args.text:
        print(f"\non {Path(args.text).name}: {args.text_prompt} prompt tokens, {args.n_gen} decoded, "
              f"medians of {args.repetitions}")
        print("| slots | decode hit predicted / measured | decode t/s predicted / measured (error) |")
        print("|---|---|---|")
        for r in rows:
            tps, hit = text_runs(args.model, r["slots"], args.threads, args.text, args.text_prompt, args.n_gen,
                                 args.repetitions)
            print(f"| {r['slots']} | {100 * r['hit_rate']:.0f} % / {100 * hit:.0f} % | {r['decode_tps']:.2f} / "
                  f"{tps:.2f} ({100 * (r['decode_tps'] - tps) / tps:+.0f} %) |")


if __name__ == "__main__":
    main()
