"""`empanel-gguf fit MODEL.gguf [--memory SIZE,...] [--json] [--plot OUT.png]`: how fast and in how much memory.

For each memory budget (default: the fewest slots, 25 %, 50 % and all experts, and what is free
now): the slots per layer it buys, the peak memory, the predicted hit rate and bytes read per
token, and the predicted decode and prompt speed with what bounds each (the drive or the
compute). It measures what it needs on this machine, once per model file (saved beside the
calibration profiles; --fresh measures again): one bounded run of the model on a built-in text
with its routing traced (compute per token, the readers' rate, how much of the reads hide behind
compute) and a 2 s O_DIRECT probe of the model file. See empanel_gguf/lab/fit.py for the model.
Exit status: 0 done, 1 error (a budget below the minimum says what to give).
"""

import json
import sys
from pathlib import Path

from .options import command_parser


def _decode_help():
    from ..lab.fit import DECODE_SEGMENT, MAX_DECODE, MIN_READ_BYTES

    return (f"tokens it decodes at least, in segments of {DECODE_SEGMENT} after paragraphs of the text, and "
            f"more (up to {MAX_DECODE}) until its readers have read {MIN_READ_BYTES >> 20} MiB (default: 32)")


def setup_arg_parser():
    from ..planning.sizing import DEFAULT_POLICY

    parser = command_parser("fit", __doc__)
    parser.add_argument("model", help="GGUF model (first shard of a split)")
    parser.add_argument("--memory", metavar="LIST", help="budgets of peak memory, comma-separated (4GiB,8GiB)")
    parser.add_argument("--policy", default="auto",
                        help=f"eviction policy to predict (default: auto, as the load takes it: the calibrated "
                             f"profile's best at each budget's slots, else {DEFAULT_POLICY})")
    parser.add_argument("-c", "--ctx-size", type=int, default=None, help="context size the budgets hold (default: the commands')")
    parser.add_argument("-t", "--threads", type=int, default=None, help="threads of the measuring run (default: llama-cpp-python's)")
    parser.add_argument("--seconds", type=float, default=120.0, help="at most this long for the measuring run (default: 120)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens of the measuring run, one micro-batch (default: 512, as llama.cpp's)")
    parser.add_argument("--decode-tokens", type=int, default=32, help=_decode_help())
    parser.add_argument("--fresh", action="store_true", help="measure again (ignore the saved measurement)")
    parser.add_argument("--json", action="store_true", help="print the measurement and the rows as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG of decode t/s and hit rate vs memory (needs matplotlib)")
    return parser


def parse_budgets(text):
    from ..planning.sizing import parse_size

    out = []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        n = parse_size(item)
        if n is None or n <= 0:
            raise ValueError(f"--memory {item}: not a size (4GiB, 500MiB)")
        out.append((n, ""))  # (the size itself is the row's name)
    if not out:
        raise ValueError(f"--memory {text!r}: no size given")
    return sorted(out)


def main(argv=None):
    import importlib.util
    from dataclasses import asdict

    args = setup_arg_parser().parse_args(argv)
    from ..abi.header import ENGINE_POLICIES
    from ..lab.fit import FitError, check_budgets, default_budgets, format_table, measure, plot, predict
    from ..lab.trace import TraceError
    from ..planning.estimate import cli_n_ctx, model_shape
    from ..planning.plan import ESTIMATE_KWARGS, planned_batch
    from ..planning.host_memory import available_memory, default_floor
    from ..planning.index import ModelError, load_index

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("empanel-gguf fit: --plot needs matplotlib, an optional extra: pip install matplotlib", file=sys.stderr)
        return 1
    try:
        if args.policy != "auto" and args.policy not in ENGINE_POLICIES:
            raise ValueError(f"--policy {args.policy}: auto or one of {', '.join(ENGINE_POLICIES)}")
        index = load_index(args.model)
        if not index.is_moe:
            raise FitError(f"{args.model}: no routed experts ({index.architecture}): nothing to page; "
                           "it needs its whole file in memory")
        shape = model_shape(index)
        params = dict(ESTIMATE_KWARGS, n_ctx=cli_n_ctx(shape, args.ctx_size), shape=shape)
        params.update(planned_batch("auto", "auto", {}, params["n_ctx"]))  # paging loads' micro-batch
        if args.memory:
            budgets = parse_budgets(args.memory)
        else:
            available = available_memory()
            budgets = default_budgets(index, params, available - default_floor() if available else None)
        check_budgets(index, budgets, params)
        m = measure(args.model, n_prompt=args.prompt_tokens, n_decode=args.decode_tokens, seconds=args.seconds,
                    n_threads=args.threads, fresh=args.fresh,
                    log=lambda line: print(line, file=sys.stderr))
        predict_rows = predict(m, index, budgets, params, args.policy)
    except (OSError, ModelError, FitError, TraceError, ValueError, RuntimeError) as e:
        print(f"empanel-gguf fit: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump({"measurement": asdict(m), "read_gbps_used": m.gbps[0], "read_gbps_from": m.gbps[1],
                   "policy": args.policy, "rows": predict_rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(m, predict_rows, Path(args.model).name))
    if args.plot:
        plot(predict_rows, args.plot)
        print(f"plot      {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
