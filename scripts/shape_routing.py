"""How local and how skewed the bench's shapes route (not a test: the evidence for their routing
defaults, lab/bench/synthetic.py ROUTING_DEFAULTS; docs/performance.md, "The real shapes").

    python scripts/shape_routing.py [--shapes qwen3-30b-a3b-q4_k_m,...] [--skew 0,0.5]
        [--locality 0,0.15] [--layers N] [--tokens 544] [--dir DIR] [--json OUT.json]

Each shape (at its full layer count unless --layers, with narrow experts: --expert-ff, or 128 for
deepseek-v2-lite, and the fixtures' 401-token vocabulary, neither of which changes the routing) is
written at every routing_skew x routing_locality, and the bench's own text (the child's PROMPT_TEXT,
repeated) is evaluated as one prompt of --tokens tokens with every token's routing recorded. Per MoE
layer, then averaged over the layers (and for the first and last quarter of them):
    prev   the share of a token's top-k experts that the previous token also used
    lru    the hit rate of a per-layer LRU cache of 25 % (and 18 %) of the layer's experts, each
           token one call from a cold cache (lab/replay.py, the policy the engine runs)
    cover  the share of a layer's experts routed to at all
"""

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from empanel_gguf import Llama
from empanel_gguf.lab.bench.child import PROMPT_TEXT, token_trace
from empanel_gguf.lab.bench.synthetic import SHAPES, shape_with, write_model
from empanel_gguf.lab.recorder import Recorder
from empanel_gguf.lab.replay import replay

NARROW_FF = {"deepseek-v2-lite": 128}  # (rows of 1408 fall back to Q5_0; so do 128)


def record(path, n_tokens):
    """[tokens, MoE layers, top-k] routed experts of n_tokens of the bench's text, and the trace."""
    llm = Llama(str(path), moe_trace=True, logits_all=True, n_ctx=n_tokens + 16, n_batch=n_tokens + 16,
                n_ubatch=n_tokens + 16, verbose=False)
    try:
        prompt, cont = token_trace(llm, n_tokens, 0, PROMPT_TEXT)
        rec = Recorder(llm)
        rec.prompt(prompt + cont)  # logits_all: every layer runs every token
        trace = rec.trace()
    finally:
        llm.close()
    return trace.experts, trace


def prev_share(experts) -> np.ndarray:
    """Per layer: the mean share of token t's experts that token t - 1 also used."""
    n, n_layer, k = experts.shape
    shares = np.zeros(n_layer)
    for j in range(n_layer):
        e = experts[:, j, :]
        same = [len(set(e[t].tolist()) & set(e[t - 1].tolist())) for t in range(1, n)]
        shares[j] = np.mean(same) / k
    return shares


def lru_rates(trace, share) -> np.ndarray:
    """Per layer: the LRU hit rate with share x n_expert slots, every token one call."""
    slots = max(trace.n_expert_used, round(share * trace.n_expert))
    report = replay(trace, [slots], ["lru"], count="all", ubatch=1)
    layers = report["results"][0]["layers"].values()  # in layer order
    return np.array([layer["hits"] / max(1, layer["hits"] + layer["misses"]) for layer in layers])


def measure(shape, directory, n_tokens):
    path = write_model(shape, Path(directory) / f"{shape.name}.gguf", log=lambda *a: None)
    try:
        experts, trace = record(path, n_tokens)
    finally:
        path.unlink()  # (a 48-layer qwen3 with narrow experts is 6 GB)
    prev = prev_share(experts)
    lru25, lru18 = lru_rates(trace, 0.25), lru_rates(trace, 0.18)
    cover = np.array([len(set(experts[:, j, :].ravel().tolist())) / trace.n_expert for j in range(experts.shape[1])])
    q = max(1, len(prev) // 4)
    return {"shape": shape.name, "n_layer": shape.n_layer, "seed": shape.seed, "skew": shape.routing_skew,
            "locality": shape.routing_locality, "prev": prev.mean(), "prev_first": prev[:q].mean(),
            "prev_last": prev[-q:].mean(), "lru25": lru25.mean(), "lru25_first": lru25[:q].mean(),
            "lru25_last": lru25[-q:].mean(), "lru18": lru18.mean(), "cover": cover.mean(),
            "per_layer": {"prev": prev.round(3).tolist(), "lru25": lru25.round(3).tolist()}}


def _row(r) -> str:
    pct = {k: 100 * v for k, v in r.items() if isinstance(v, float)}
    return (f"| {r['shape']} | {r['n_layer']} | {r['skew']:g} | {r['locality']:g} | {r['seed']} | {pct['prev']:.1f} "
            f"({pct['prev_first']:.1f} / {pct['prev_last']:.1f}) | {pct['lru25']:.1f} ({pct['lru25_first']:.1f} / "
            f"{pct['lru25_last']:.1f}) | {pct['lru18']:.1f} | {pct['cover']:.0f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b-q4_k_m,gpt-oss-20b,deepseek-v2-lite")
    p.add_argument("--skew", default=None, help="comma list (default: each shape's)")
    p.add_argument("--locality", default=None, help="comma list (default: each shape's)")
    p.add_argument("--layers", type=int, default=None, help="(default: each shape's)")
    p.add_argument("--seeds", default="0", help="comma list of weight seeds, one model each (default: 0)")
    p.add_argument("--expert-ff", type=int, default=256)
    p.add_argument("--tokens", type=int, default=544, help="(default: the bench's -p 512 -n 32)")
    p.add_argument("--dir", default=None, help="where the models go (default: a temporary folder)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    print("| shape | layers | skew | locality | seed | previous token's experts % (first / last quarter) "
          "| LRU 25 % (first / last quarter) | LRU 18 % | experts used % |\n|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for name in args.shapes.split(","):
            base = SHAPES[name]
            skews = [float(x) for x in args.skew.split(",")] if args.skew else [base.routing_skew]
            localities = [float(x) for x in args.locality.split(",")] if args.locality else [base.routing_locality]
            seeds = [int(x) for x in args.seeds.split(",")]
            for skew, locality, seed in itertools.product(skews, localities, seeds):
                shape = shape_with(name, n_vocab=0, n_ff_exp=NARROW_FF.get(name, args.expert_ff),
                                   n_layer=args.layers or base.n_layer, routing_skew=skew,
                                   routing_locality=locality, seed=seed)
                rows.append(measure(shape, directory, args.tokens))
                print(_row(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
