"""`empanel-gguf kl MODEL.gguf [-f TEXT] [-n N] --moe-slots 25% --moe-subst 0.5`: what routing
substitution costs.

Evaluates the same tokens twice with the same slot pools: exactly (as the model fully in memory
computes them) and with --moe-subst, and reports the KL divergence of the substituted next-token
distributions from the exact ones (mean and max over the tokens, in nats), how often the most
likely next token agrees, the experts substituted, and the bytes read saved. Without --moe-subst
the two runs are the same computation: KL 0. The text defaults to the calibration text
(profile.DEFAULT_TEXT). Exit status: 0 done, 1 error.
"""

import sys
from pathlib import Path

from ..planning.options import OPTION
from .options import add_text_args, command_parser


def setup_arg_parser():
    parser = command_parser("kl", __doc__)
    add_text_args(parser, "evaluate", 256, "; at most the model's training context")
    parser.add_argument(*OPTION["slots"].flags, default="25%", help="slots per MoE layer (default: 25%%)")
    parser.add_argument(*OPTION["subst"].flags, type=float, default=None, metavar="R",
                        help="substitution ratio in (0, 1] (default: none, an exact run: KL 0)")
    return parser


def log_softmax(logits):
    import numpy as np

    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare(model, text, n_tokens, moe_slots, moe_subst, n_threads=None):
    """{kl_mean, kl_max, top1_agree, substituted, bytes_exact, bytes_subst, n_tokens} for the first
    n_tokens of `text`, evaluated one token at a time as decoding does (substitution needs
    resident experts to stand in, which a cold prompt's one micro-batch has not)."""
    import numpy as np

    from .. import Llama

    runs, tokens = [], None
    for subst in (None, moe_subst):
        llm = Llama(str(model), moe_slots=moe_slots, moe_subst=subst, moe_profile=None, logits_all=True,
                    n_ctx=max(16, n_tokens), n_batch=1, n_ubatch=1, n_threads=n_threads, verbose=False)
        try:
            tokens = tokens or llm.tokenize(text.encode("utf-8"))[:n_tokens]
            llm.eval(tokens)
            logits = np.array(llm.scores[:len(tokens)], dtype=np.float64)
            runs.append((logits, llm.moe_stats()["total"]))
        finally:
            llm.close()
    (exact, stats_exact), (approx, stats_subst) = runs
    p_log, q_log = log_softmax(exact), log_softmax(approx)
    kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float((exact.argmax(axis=-1) == approx.argmax(axis=-1)).mean()),
            "substituted": int(stats_subst["substituted"]), "bytes_exact": int(stats_exact["bytes_read"]),
            "bytes_subst": int(stats_subst["bytes_read"]), "n_tokens": len(tokens)}


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    from ..planning.estimate import model_shape
    from ..planning.format import format_bytes
    from ..planning.index import ModelError, load_index
    from ..planning.plan import parse_moe_slots
    from ..planning.profile import DEFAULT_TEXT

    try:
        index = load_index(args.model)
        if not index.is_moe:
            raise ValueError(f"{args.model}: no routed experts ({index.architecture})")
        moe_slots = parse_moe_slots(args.moe_slots)
        if moe_slots in (None, "auto"):
            raise ValueError("--moe-slots: give a count, share or size (substitution needs slot pools)")
        text = Path(args.file).read_text(encoding="utf-8", errors="replace") if args.file else DEFAULT_TEXT
        n = min(args.n_tokens, model_shape(index).n_ctx_train or args.n_tokens)
        result = compare(args.model, text, n, moe_slots, args.moe_subst, args.threads)
    except (OSError, ModelError, ValueError, RuntimeError) as e:
        print(f"empanel-gguf kl: {e}", file=sys.stderr)
        return 1
    saved = result["bytes_exact"] - result["bytes_subst"]
    share = saved / result["bytes_exact"] if result["bytes_exact"] else 0.0
    print(f"kl        {Path(args.model).name}, moe_slots={args.moe_slots}, moe_subst={args.moe_subst}, "
          f"{result['n_tokens']} tokens")
    print(f"KL        mean {result['kl_mean']:.6f} nats, max {result['kl_max']:.6f} (substituted vs exact)")
    print(f"top-1     {100 * result['top1_agree']:.1f}% of the next-token argmaxes agree")
    print(f"reads     {format_bytes(result['bytes_exact'])} exact, {format_bytes(result['bytes_subst'])} with "
          f"substitution: {format_bytes(saved)} saved ({100 * share:.1f}%); {result['substituted']} experts "
          "substituted")
    return 0
