"""`empanel-gguf calibrate MODEL.gguf [-f TEXT] [-n N] [-o PROFILE]`: a warm-start profile.

Routes a text through the model (a built-in text of several kinds of prose when -f is not given;
every expert resident if the model fits in memory, else slot pools: routing is the same) and saves how often each MoE layer used each expert, tied to the model
file's identity (size and header digest). Llama(moe_profile="auto"), the default, and `run` /
`serve` then fill the empty slots at load with each layer's most used experts instead of the
lowest ids. Without -o the profile goes to the cache, where "auto" finds it. Outputs never change;
only which experts are resident before the first token. Exit status: 0 saved, 1 error.
"""

import math
import sys
from pathlib import Path

import numpy as np

from .options import add_text_args, command_parser


RANK_WARMUP = 64  # tokens of the first window that warm the pools before the ranking counts


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
        records = []
        for start in range(0, len(tokens), window):
            llm.reset()
            llm.eval(tokens[start:start + window])
            records.append(llm.moe_take_trace())
            counts += count_routing(records[-1], index.moe_layers, index.n_expert)
    finally:
        llm.close()
    return Profile(model=file_identity(index), n_expert=index.n_expert, n_expert_used=index.n_expert_used,
                   moe_layers=index.moe_layers, tokens=len(tokens), counts=counts,
                   policies=rank_policies(index, records))


def rank_policies(index, records):
    """The engine's eviction policies replayed over the routing records one token at a time (as
    decode calls them), the first RANK_WARMUP tokens warming the pools: {"slots": [...],
    "hit_rate": {policy: [...]}} at top-k, 12.5 %, 25 % and 50 % of the experts."""
    from ..abi.header import ENGINE_POLICIES
    from ..lab.policies import make_policy
    from ..lab.replay import Call, run_policy

    k, e = index.n_expert_used, index.n_expert
    expert_bytes = {layer.layer: layer.expert_bytes for layer in index.layers}
    order = {il: j for j, il in enumerate(index.moe_layers)}
    keyed = []  # ((window, token, layer order), call)
    for w, raw in enumerate(records):  # [layer, n_tokens, n_used, ids...] per remap call
        pos = dict.fromkeys(index.moe_layers, 0)  # each layer's tokens so far in this window
        i = 0
        while i < len(raw):
            il, n_tokens, n_used = int(raw[i]), int(raw[i + 1]), int(raw[i + 2])
            ids = np.asarray(raw[i + 3:i + 3 + n_tokens * n_used]).reshape(n_tokens, n_used)
            for t in range(n_tokens if il in order else 0):  # (an MTP block's layer: not ranked)
                token = pos[il] + t
                experts = list(dict.fromkeys(int(x) for x in ids[t] if x >= 0))
                keyed.append(((w, token, order[il]), Call(il, experts, w > 0 or token >= RANK_WARMUP, rows=ids[t:t + 1])))
            pos[il] = pos.get(il, 0) + n_tokens
            i += 3 + n_tokens * n_used
    calls = [c for _, c in sorted(keyed, key=lambda kc: kc[0])]  # decode's order: token by token
    sizes = sorted({n for n in (k, math.ceil(e / 8), math.ceil(e / 4), math.ceil(e / 2)) if k <= n < e})
    rates = {}
    for name in ENGINE_POLICIES:
        row = []
        for n in sizes:
            policy = make_policy(name, n, expert_bytes=expert_bytes, n_expert=e, n_expert_used=k)
            counted, _, _ = run_policy(policy, calls, expert_bytes)
            row.append(counted["hits"] / max(1, counted["hits"] + counted["misses"]))
        rates[name] = row
    return {"slots": sizes, "hit_rate": rates} if sizes else None


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    from ..planning.index import ModelError, load_index
    from ..planning.profile import ProfileError, default_path, save_profile
    from ..planning.sizing import DEFAULT_POLICY

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
    if profile.policies:
        ranking = profile.policies
        for j, n in enumerate(ranking["slots"]):
            rates = ", ".join(f"{name} {100 * row[j]:.1f}%" for name, row in ranking["hit_rate"].items())
            best = profile.choose_policy(n, DEFAULT_POLICY)[0]
            print(f"policies  at {n} slots: {rates} -> moe_policy=auto takes {best}")
    print(f"profile   {path}")
    return 0
