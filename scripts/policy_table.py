"""The eviction policies across kinds of routing traces (not a test: evidence for the default).

    python scripts/policy_table.py KIND=TRACE[,TRACE...] ... [--sizes 12.5%,25%,50%] [--policies ...]
        [--json OUT.json]

Each KIND is one or more traces (`empanel-gguf trace`) of one kind of text or model: prose,
dialogue, a skewed synthetic model, a uniform one. Every lab policy (lab/policies.py, Belady's
bound included) is replayed over every trace one token at a time (`--count all --ubatch 1`: each
token a call, as decode makes them; a cold cache at each trace's start), at each size as a share
of the experts; the hits and misses of a kind's traces are summed. Printed: one markdown table,
a row per kind and size, a column per policy's hit rate, and how much of the gap between the best
engine policy and Belady each lab policy closes.
"""

import argparse
import json
import sys

from empanel_gguf.abi.header import ENGINE_POLICIES
from empanel_gguf.lab.policies import LAB_POLICIES
from empanel_gguf.lab.replay import parse_sizes, replay
from empanel_gguf.lab.trace import load_trace


def kind_rates(paths, shares, policies):
    """{(share, policy): [hits, misses]} summed over the traces; the slots of each share; the
    traces' top-k."""
    sums, slots_of, top_k = {}, {}, set()
    for path in paths:
        trace = load_trace(path)
        top_k.add(trace.n_expert_used)
        for share in shares:
            (slots,), _ = parse_sizes(share, trace)
            slots_of.setdefault(share, set()).add(slots)
            report = replay(trace, [slots], policies, count="all", ubatch=1)
            for r in report["results"]:
                row = sums.setdefault((share, r["policy"]), [0, 0])
                row[0] += r["hits"]
                row[1] += r["misses"]
    return sums, slots_of, top_k


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kinds", nargs="+", metavar="KIND=TRACE[,TRACE...]")
    p.add_argument("--sizes", default="12.5%,25%,50%", help="shares of the experts (default: 12.5%%,25%%,50%%)")
    p.add_argument("--policies", default=",".join(LAB_POLICIES))
    p.add_argument("--json", metavar="OUT.json", help="also write the table as JSON")
    args = p.parse_args()
    policies = args.policies.split(",")
    shares = args.sizes.split(",")
    engine = [name for name in policies if name in ENGINE_POLICIES]
    if "belady" not in policies or not engine:
        sys.exit("policy_table: --policies needs belady and at least one engine policy")

    rows = []
    for item in args.kinds:
        kind, _, paths = item.partition("=")
        sums, slots_of, top_k = kind_rates(paths.split(","), shares, policies)
        for share in shares:
            if slots_of[share] == top_k:  # per-layer policies all keep the last call's experts
                print(f"{kind} at {share}: the slots are top-k, where every per-layer policy keeps just the last "
                      "call's experts; left out", file=sys.stderr)
                continue
            rate = {name: sums[share, name][0] / max(1, sum(sums[share, name])) for name in policies}
            best = max(engine, key=lambda name: rate[name])
            gap = rate["belady"] - rate[best]
            closes = {name: (rate[name] - rate[best]) / gap if gap > 0 else 0.0
                      for name in policies if name not in ENGINE_POLICIES and name != "belady"}
            rows.append(dict(kind=kind, share=share, slots=sorted(slots_of[share]), hit_rate=rate,
                             best_engine=best, gap_closed=closes,
                             accesses=sum(sums[share, policies[0]])))

    lab = [name for name in policies if name not in ENGINE_POLICIES and name != "belady"]
    print("| kind | slots | " + " | ".join(policies) + " | best engine | " +
          " | ".join(f"{name}: gap closed" for name in lab) + " |")
    print("|---|---|" + "---|" * (len(policies) + 1 + len(lab)))
    for r in rows:
        cells = [f"{100 * r['hit_rate'][name]:.1f}" for name in policies]
        closed = [f"{100 * r['gap_closed'][name]:+.0f} %" for name in lab]
        slots = "/".join(str(s) for s in r["slots"])
        print(f"| {r['kind']} | {r['share']} ({slots}) | " + " | ".join(cells) + f" | {r['best_engine']} | " +
              " | ".join(closed) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
