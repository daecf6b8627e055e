"""`empanel-gguf run [MODEL.gguf] -p PROMPT -n N`: complete a prompt and stream the text.

Without a model path it runs the built-in default model (written on first use into the cache).
"""

import argparse
import os
import sys
import time
from pathlib import Path

# the built-in default until a trained one ships: a tiny random-weight qwen3moe (see fixtures.py)
DEFAULT_FIXTURE = "qwen3moe-q8_0"


def default_model_path():
    from .. import fixtures

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return fixtures.write_fixture(DEFAULT_FIXTURE, Path(base) / "empanel-gguf" / "models")


def setup_arg_parser():
    parser = argparse.ArgumentParser(prog="empanel-gguf run", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="GGUF model (first shard of a split); default: built-in")
    parser.add_argument("-p", "--prompt", default="Once upon a time", help="prompt text")
    parser.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default: 32)")
    parser.add_argument("-c", "--ctx-size", type=int, default=512, help="context size (default: 512)")
    parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all)")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (default: 0, greedy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's own log")
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    from .. import llama_cpp

    model = args.model or str(default_model_path())
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model, n_ctx=args.ctx_size, n_threads=args.threads, seed=args.seed,
                          verbose=args.verbose)
    t_load = time.perf_counter() - t0
    n_out = 0
    t0 = time.perf_counter()
    sys.stdout.write(args.prompt)
    for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict,
                                       temperature=args.temp, stream=True):
        sys.stdout.write(chunk["choices"][0]["text"])
        sys.stdout.flush()
        n_out += 1
    dt = time.perf_counter() - t0
    print(f"\n\nloaded {Path(model).name} in {t_load:.2f} s; {n_out} tokens in {dt:.2f} s "
          f"({n_out / dt if dt > 0 else 0:.1f} tok/s)", file=sys.stderr)
    llm.close()
    return 0
