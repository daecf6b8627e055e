"""`empanel-gguf replay TRACE.npz [--slots 8,16,32] [--policies lru,belady] [--gbps 1.0]`: policy lab.

Runs a routing trace (`empanel-gguf trace`) through expert-cache policies at several cache sizes:
per-layer LRU, shared-budget LRU (g-lru), LFU, LFU with decay, SLRU, ARC, LRFU (decayed counts,
per layer and shared: g-lrfu) and Belady's optimal bound. Prompt tokens warm the cache, decode
tokens count. Prints per policy and size the hit rate, the bytes of missed experts per token (from
the model's index, stored in the trace) and the decode speed a drive of --gbps GB/s could sustain
reading them (the drive-bound ceiling). lru, lfu-decay and g-lru are the engine's own policies,
replayed exactly: a trace recorded with slots is checked against the engine's live counts.

Sizes are slots per MoE layer, as Llama's moe_slots: counts (8,16), shares of the experts
(10%,25%), budgets (2GiB), or `recorded`; g-lru takes each as its shared-budget equivalent.
Micro-batches are replayed as recorded: the engine's policies run one larger than a pool in
waves, as the engine does; the lab's own policies split it into calls that fit. --ubatch N caps
every micro-batch at N tokens. --plot writes a PNG of hit rate vs size (needs matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from ..planning.options import CommandParser


def setup_arg_parser():
    from ..lab.policies import LAB_POLICIES

    parser = CommandParser(
        prog="empanel-gguf replay", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="trace file written by `empanel-gguf trace`")
    parser.add_argument("--slots", metavar="LIST",
                        help="cache sizes per layer, comma-separated: counts, shares (25%%), budgets "
                             "(2GiB), recorded (default: top-k, 12.5%%, 25%%, 50%% and the recorded size)")
    parser.add_argument("--policies", metavar="LIST", default=",".join(LAB_POLICIES),
                        help=f"comma-separated, of {', '.join(LAB_POLICIES)} (default: all)")
    parser.add_argument("--gbps", type=float, default=1.0,
                        help="drive bandwidth in GB/s for the tok/s ceiling (default: 1.0)")
    parser.add_argument("--count", choices=("decode", "all"), default="decode",
                        help="calls that count: decode micro-batches (prompt tokens warm the cache), "
                             "or every call as the engine's own statistics do (default: decode)")
    parser.add_argument("--ubatch", type=int, default=None, metavar="N",
                        help="cap micro-batches at N tokens (default: as recorded)")
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG of hit rate vs size per policy")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    from ..lab.replay import format_report, parse_sizes, plot, replay
    from ..lab.trace import TraceError, load_trace

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("empanel-gguf replay: --plot needs matplotlib, an optional extra: "
              "pip install matplotlib", file=sys.stderr)
        return 1
    if args.gbps <= 0 or (args.ubatch is not None and args.ubatch < 1):
        parser.error("--gbps must be > 0 and --ubatch >= 1")
    try:
        trace = load_trace(args.trace)
        sizes, notes = parse_sizes(args.slots, trace) if args.slots else (None, [])
        if args.slots and not sizes:
            raise ValueError(f"--slots {args.slots}: no size left")
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        report = replay(trace, sizes=sizes, policies=policies, gbps=args.gbps, count=args.count,
                        ubatch=args.ubatch)
    except (OSError, TraceError, ValueError) as e:
        print(f"empanel-gguf replay: {e}", file=sys.stderr)
        return 1
    report["notes"] = notes + report["notes"]
    if args.json:
        json.dump(_finite(report), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(format_report(report, args.trace))
    if args.plot:
        plot(report, args.plot)
        print(f"plot      {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _finite(value):
    """JSON has no infinity: an unbounded ceiling (no misses) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
