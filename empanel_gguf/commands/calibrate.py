"""`empanel-gguf calibrate MODEL.gguf [-f TEXT] [-n N] [-o PROFILE]`: a warm-start profile.

Routes a text through the model (a built-in text of several kinds of prose when -f is not given;
every expert resident if the model fits in memory, else slot pools: routing is the same) and saves how often each MoE layer used each expert, tied to the model
file's identity (size and header digest). Llama(moe_profile="auto"), the default, and `run` /
`serve` then fill the empty slots at load with each layer's most used experts instead of the
lowest ids. Without -o the profile goes to the cache, where "auto" finds it. Outputs never change;
only which experts are resident before the first token. Exit status: 0 saved, 1 error.
"""

import sys
from pathlib import Path

import numpy as np

from .options import add_text_args, command_parser


def setup_arg_parser():
    parser = command_parser("calibrate", __doc__)
    add_text_args(parser, "route", 2048)
    parser.add_argument("-o", "--output", help="profile to write (default: the cache, for moe_profile=auto)")
    return parser


def calibrate(model_path, text=None, n_tokens=2048, n_threads=None):
    """Route `text` (DEFAULT_TEXT when None; at most n_tokens tokens, in windows of the model's
    training context) through the model and count each layer's experts. Every expert resident
    when the model fits in memory, else slot pools (moe_slots="auto"): routing is the same either
    way. Returns the Profile."""
    from ..planning.cache import file_identity
    from ..planning.estimate import model_shape
    from ..planning.index import load_index
    from ..llama import Llama
    from ..planning.profile import DEFAULT_TEXT, Profile, ProfileError, count_routing

    index = load_index(model_path)
    if not index.is_moe:
        raise ProfileError(f"{model_path}: no routed experts ({index.architecture}): nothing to calibrate")
    window = max(16, min(n_tokens, model_shape(index).n_ctx_train or 4096))
    # logits_all: the last layer runs every token too (else only the tokens whose logits are wanted)
    llm = Llama(str(model_path), moe_trace=True, moe_slots="auto", moe_profile=None, logits_all=True,
                n_ctx=window, n_batch=min(512, window), n_threads=n_threads, verbose=False)
    try:
        tokens = llm.tokenize((text if text is not None else DEFAULT_TEXT).encode("utf-8"))[:n_tokens]
        counts = np.zeros((len(index.moe_layers), index.n_expert), dtype=np.int64)
        for start in range(0, len(tokens), window):
            llm.reset()
            llm.eval(tokens[start:start + window])
            counts += count_routing(llm.moe_take_trace(), index.moe_layers, index.n_expert)
    finally:
        llm.close()
    return Profile(model=file_identity(index), n_expert=index.n_expert, n_expert_used=index.n_expert_used,
                   moe_layers=index.moe_layers, tokens=len(tokens), counts=counts)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    from ..planning.index import ModelError, load_index
    from ..planning.profile import ProfileError, default_path, save_profile

    try:
        text = Path(args.file).read_text(encoding="utf-8", errors="replace") if args.file else None
        if args.n_tokens < 1:
            raise ValueError(f"-n {args.n_tokens}: route at least one token")
        profile = calibrate(args.model, text, n_tokens=args.n_tokens, n_threads=args.threads)
        path = save_profile(profile, args.output or default_path(load_index(args.model), profile.model))
    except (OSError, ModelError, ProfileError, ValueError, RuntimeError) as e:
        print(f"empanel-gguf calibrate: {e}", file=sys.stderr)
        return 1
    k = profile.n_expert_used
    share = profile.counts.sum(axis=1)
    top = [sum(sorted(row.tolist(), reverse=True)[:max(1, profile.n_expert // 4)]) for row in profile.counts]
    covered = sum(top) / max(1, int(share.sum()))
    print(f"calibrated {Path(args.model).name}: {profile.tokens} tokens x top-{k} over "
          f"{len(profile.moe_layers)} MoE layers; the most used quarter of each layer's experts took "
          f"{100 * covered:.1f}% of the routings")
    print(f"profile   {path}")
    return 0
