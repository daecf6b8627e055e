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

from .options import add_text_args, command_parser


def setup_arg_parser():
    parser = command_parser("calibrate", __doc__)
    add_text_args(parser, "route", 2048)
    parser.add_argument("-o", "--output", help="profile to write (default: the cache, for moe_profile=auto)")
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    from ..index import ModelError, load_index
    from ..profile import ProfileError, calibrate, default_path, save_profile

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
