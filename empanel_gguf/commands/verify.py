"""`empanel-gguf verify MODEL.gguf [-o DIGESTS]`: digests of every routed expert, for moe_verify.

Reads every expert of every routed-expert tensor once and saves its XXH3-64 digest, tied to the
file's identity (size and header digest), in the cache next to the calibration profiles (or -o).
A load with moe_verify=True (`--moe-verify on`) then checks each expert it reads against them.
When digests are already saved for the file, the file is hashed again and compared: each expert
whose bytes changed since is listed. Exit status: 0 saved or all match, 1 error or a mismatch.
"""

import sys
import time
from pathlib import Path

from ..planning.format import format_bytes
from .options import command_parser


def setup_arg_parser():
    parser = command_parser("verify", __doc__)
    parser.add_argument("model", help="GGUF model (any shard of a split model)")
    parser.add_argument("-o", "--output", help="digest file (default: the cache, where moe_verify looks)")
    parser.add_argument("--force", action="store_true", help="hash and save again even if digests are saved")
    return parser


def _progress(t0):
    def show(done, total):
        if sys.stderr.isatty():
            rate = done / max(1e-9, time.perf_counter() - t0) / 1e9
            print(f"\r  hashed {format_bytes(done)} of {format_bytes(total)} ({rate:.2f} GB/s)", end="",
                  file=sys.stderr, flush=True)
    return show


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    from ..planning import digests
    from ..engine.native import hash64
    from ..planning.cache import file_identity
    from ..planning.index import ModelError, load_index

    try:
        index = load_index(args.model)
        if not index.is_moe:
            raise ModelError(index.path, f"no routed experts ({index.architecture}): nothing to verify")
        identity = file_identity(index)
        path = Path(args.output) if args.output else digests.default_path(index, identity)
        saved = None if args.force else digests.load(index, path, identity)
        t0 = time.perf_counter()
        if saved is not None:
            changed = digests.check(index, saved, hash64, _progress(t0))
        else:
            new = digests.compute(index, hash64, _progress(t0))
        seconds = time.perf_counter() - t0
    except (OSError, ModelError, digests.DigestError) as e:
        print(f"empanel-gguf verify: {e}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(file=sys.stderr)
    n_experts = sum(t.n_expert for t in index.expert_tensors())
    total = index.expert_bytes_total
    rate = f"{format_bytes(total)} in {seconds:.2f} s, {total / max(seconds, 1e-9) / 1e9:.2f} GB/s"
    if saved is not None:
        if changed:
            for name, e in changed[:20]:
                print(f"CHANGED  {name} expert {e}")
            print(f"{len(changed)} of {n_experts} experts differ from the digests in {path} ({rate}): "
                  "the file changed since; get it again, or `verify --force` to trust it as it is now")
            return 1
        print(f"all {n_experts} experts match the digests in {path} ({rate})")
        return 0
    digests.save(index, new, path, identity)
    print(f"saved the digests of {n_experts} experts ({len(index.layers)} MoE layers) to {path} ({rate})")
    return 0
