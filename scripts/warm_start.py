"""Hit rate of the first decoded tokens: cold, preloaded by lowest ids, preloaded from a profile.

    python scripts/warm_start.py [MODEL.gguf] [--slots 25%] [-n 64] [--profile PROFILE.json]

Each arm is a fresh load in this process: the same prompt, then n greedy tokens; the hit rate is
over the decoded tokens' remap calls (the prompt's reads are the warm-up every arm has). Without
--profile the model is calibrated first on the built-in text (into a temporary file).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from empanel_gguf import Llama  # noqa: E402
from empanel_gguf.commands.options import BUILTIN_MODEL  # noqa: E402
from empanel_gguf.commands.calibrate import calibrate  # noqa: E402
from empanel_gguf.planning.profile import save_profile  # noqa: E402

PROMPT = b"ROMEO. What light is this?"


def decode_hit_rate(model, moe_slots, n_tokens, **moe):
    """(hit rate of the decoded tokens, their hits, their misses, experts preloaded)."""
    # read-ahead off: which read-ahead lands before its layer comes (and so stays as a hit)
    # depends on the drive's timing, which would blur a comparison of starts to a tenth of a point
    llm = Llama(str(model), moe_slots=moe_slots, n_ctx=256, n_threads=2, verbose=False, moe_prefetch=0, **moe)
    try:
        llm.eval(llm.tokenize(PROMPT))
        before = llm.moe_stats()["total"]
        for _ in range(n_tokens):
            llm.eval([llm.sample(temp=0.0)])
        after = llm.moe_stats()["total"]
    finally:
        llm.close()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return hits / max(1, hits + misses), hits, misses, after["preloaded"]


def compare(model, moe_slots="25%", n_tokens=64, profile=None):
    """{arm: decode_hit_rate(...)} for cold, lowest-id preload and profile preload."""
    return {
        "cold": decode_hit_rate(model, moe_slots, n_tokens, moe_preload=False, moe_profile=None),
        "lowest ids": decode_hit_rate(model, moe_slots, n_tokens, moe_preload=True, moe_profile=None),
        "profile": decode_hit_rate(model, moe_slots, n_tokens, moe_profile=str(profile)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(BUILTIN_MODEL))
    parser.add_argument("--slots", default="25%")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--profile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.profile or save_profile(calibrate(args.model), os.path.join(tmp, "profile.json"))
        rows = compare(args.model, args.slots, args.n, profile)
    print(f"{Path(args.model).name}, moe_slots={args.slots}, first {args.n} decoded tokens after {PROMPT!r}:")
    for arm, (rate, hits, misses, preloaded) in rows.items():
        print(f"  {arm:10s} hit rate {100 * rate:5.1f}% ({hits} hits, {misses} misses; {preloaded} preloaded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
