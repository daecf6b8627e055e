"""Check `empanel-gguf fit`'s predictions against measured runs (not a test: a benchmark).

    python scripts/fit_check.py MODEL.gguf [--slots 16,32,64] [-r 3] [-t 2] [--out DIR]

For each slot count: the peak-memory budget that buys it (the load's own estimate), fit's
predicted decode/prompt t/s and hit rate at that budget (fit --fresh: measured now), then
`empanel-gguf bench` at those slot counts (fresh processes, page cache dropped, medians of -r),
and a table of predicted against measured with the error of each. Decode is bench's tg (after its
warm-up), prompt its pp (-p 512).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--slots", default="16,32,64")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=16)
    p.add_argument("--out", default="fit-check")
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
    configs = ",".join(f"empanel-{r['slots']}@none" for r in rows)  # (uncapped: the budget is the slots')
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


if __name__ == "__main__":
    main()
