"""Command-line pieces every subcommand shares: llama.cpp's option names (each with its
LLAMA_ARG_* environment variable), the built-in model, notes on stderr, exit codes, and the
load plan from parsed options (plan.plan_load).
"""

import argparse
import os
from pathlib import Path

from ..engine.header import ENGINE_POLICIES
from ..planning.sizing import DEFAULT_POLICY

EXIT_MEMORY = 3  # refused or stopped by the memory guard

# the built-in model: a small qwen3moe trained on Shakespeare (scripts/train_moe.py), shipped in
# the package (models/PROVENANCE.md); where it is missing (a checkout without it), a tiny
# random-weight fixture written into the cache instead (see models/fixtures.py)
BUILTIN_MODEL = Path(__file__).resolve().parent.parent / "models" / "shakespeare-moe.gguf"
DEFAULT_FIXTURE = "qwen3moe-q8_0"
DEFAULT_MODEL_SLOTS = "50%"  # the built-in model streams its experts, to show what empanel does
DEFAULT_PROMPT = "Once upon a time"


def default_model_path():
    if BUILTIN_MODEL.is_file():
        return BUILTIN_MODEL
    from ..models import fixtures

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return fixtures.write_fixture(DEFAULT_FIXTURE, Path(base) / "empanel-gguf" / "models")


def command_parser(prog, doc):
    """An ArgumentParser for `empanel-gguf <prog>` from its module docstring: the first paragraph
    after the usage line is the description, the rest the epilog."""
    return argparse.ArgumentParser(
        prog=f"empanel-gguf {prog}", description=doc.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(doc.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)


def add_text_args(parser, what, n_tokens, more=""):
    """MODEL, -f TEXT and -n N of the commands that run a text through a model."""
    parser.add_argument("model", help="GGUF model (first shard of a split)")
    parser.add_argument("-f", "--file", help=f"text to {what} (default: the built-in calibration text)")
    parser.add_argument("-n", "--n-tokens", type=int, default=n_tokens, help=f"tokens of it (default: {n_tokens}{more})")
    parser.add_argument("-t", "--threads", type=int, default=None, help="threads (default: llama-cpp-python's)")


# ---------------------------------------------------------------------------------------------
# options: llama.cpp's names, each with an LLAMA_ARG_* environment variable


def parse_repack(text):
    """--moe-repack: auto, or a boolean."""
    return "auto" if str(text).strip().lower() == "auto" else parse_bool(text)


def parse_prefetch(text):
    """--moe-prefetch: auto, or a number of layers ahead (0: off)."""
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"not auto or a number of layers: {text!r}")


def parse_bool(text):
    value = str(text).strip().lower()
    if value in ("1", "on", "true", "yes", "y", "enabled"):
        return True
    if value in ("0", "off", "false", "no", "n", "disabled", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use on/off)")


def auto_bool(text):
    """'auto' -> None, else on/off as parse_bool."""
    return None if str(text).strip().lower() == "auto" else parse_bool(text)


def gpu_layers(text):
    value = str(text).strip().lower()
    if value in ("all", "auto"):
        return -1
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a layer count: {text!r} (a number, or all)") from None


def add_sampling_args(parser, temp):
    """--temp, --top-k, --top-p, --min-p, llama.cpp's defaults except the temperature."""
    env_arg(parser, "--temp", env="LLAMA_ARG_TEMP", type=float, default=temp,
            help="temperature, 0 = greedy")
    env_arg(parser, "--top-k", env="LLAMA_ARG_TOP_K", type=int, default=40, help="top-k sampling")
    env_arg(parser, "--top-p", env="LLAMA_ARG_TOP_P", type=float, default=0.95, help="top-p sampling")
    env_arg(parser, "--min-p", env="LLAMA_ARG_MIN_P", type=float, default=0.05, help="min-p sampling")


def env_arg(parser, *flags, env, default=None, help="", show_default=None, **kwargs):
    """add_argument whose default comes from `env` when set; help ends in (default: .., env: ..)."""
    raw = os.environ.get(env)
    if kwargs.get("action") == "store_true":
        if raw not in (None, ""):
            try:
                default = parse_bool(raw)
            except argparse.ArgumentTypeError:
                parser.error(f"{env}={raw!r}: use 1/0, on/off, true/false")
    elif raw not in (None, ""):
        default = raw  # a string default goes through `type` like a command-line value
    shown = show_default if show_default is not None else default
    if raw not in (None, ""):
        shown = raw
    shown = str(shown).replace("%", "%%")  # argparse %-formats help texts
    parser.add_argument(*flags, default=default, help=f"{help} (default: {shown}, env: {env})", **kwargs)


def add_memory_args(parser):
    env_arg(parser, "--mem-floor", env="LLAMA_ARG_MEM_FLOOR", metavar="SIZE|P%",
            show_default="max(1 GiB, 5% of memory); 25% below 4 GiB",
            help="memory to keep free: refuse a load whose estimate leaves less, stop a run when "
                 "less is left; 0 turns the guard off")
    env_arg(parser, "--force", env="LLAMA_ARG_FORCE", action="store_true", default=False,
            help="load even when the memory guard estimates that it does not fit")


def add_load_args(parser):
    """-c, -t, -tb, -ngl, --rpc, -b, -ub, -fa: how the model is loaded and run."""
    env_arg(parser, "-c", "--ctx-size", env="LLAMA_ARG_CTX_SIZE", type=int, default=None,
            show_default="4096, at most the model's; 0 = the model's", help="context size in tokens")
    env_arg(parser, "-t", "--threads", env="LLAMA_ARG_THREADS", type=int, default=None,
            show_default=f"{max(os.cpu_count() // 2, 1)}, half the CPUs", help="threads for generation")
    env_arg(parser, "-tb", "--threads-batch", env="LLAMA_ARG_THREADS_BATCH", type=int, default=None,
            show_default=f"{os.cpu_count()}, all CPUs", help="threads for the prompt")
    env_arg(parser, "-ngl", "--n-gpu-layers", "--gpu-layers", env="LLAMA_ARG_N_GPU_LAYERS",
            type=gpu_layers, default=None, metavar="N|all", show_default="0; all with --rpc",
            help="layers to offload to the GPU or the RPC servers")
    env_arg(parser, "--rpc", env="LLAMA_ARG_RPC", default=None, metavar="HOST:PORT,...", show_default="none",
            help="ggml-rpc-server processes to place the offloaded layers (and their slot pools) on, as "
                 "llama.cpp's --rpc (empanel-gguf rpc-server starts one)")
    env_arg(parser, "-b", "--batch-size", env="LLAMA_ARG_BATCH", type=int, default=512,
            help="logical batch size")
    env_arg(parser, "-ub", "--ubatch-size", env="LLAMA_ARG_UBATCH", type=int, default=512,
            help="physical batch size (a micro-batch whose experts exceed a pool runs in waves)")
    env_arg(parser, "-fa", "--flash-attn", env="LLAMA_ARG_FLASH_ATTN", type=parse_bool, default=False,
            metavar="on|off", help="flash attention")


def add_moe_args(parser, moe_slots_default="auto"):
    """-ms and the --moe-* options of Llama."""
    env_arg(parser, "-ms", "--moe-slots", env="LLAMA_ARG_MOE_SLOTS", metavar="N|P%|SIZE|auto|none",
            default=None, show_default=moe_slots_default,
            help="expert slots per MoE layer: a count, a share of the experts, a budget for all "
                 "pools (6GiB), auto (slot pools only if the experts do not fit in memory), or "
                 "none (every expert resident)")
    env_arg(parser, "--moe-policy", env="LLAMA_ARG_MOE_POLICY", default="auto",
            choices=("auto",) + tuple(ENGINE_POLICIES),
            help="which expert a full pool evicts: auto (the one `calibrate` ranked best for this "
                 f"file at the planned slots, else {DEFAULT_POLICY}), lfu-decay (least used, decaying "
                 "counts) and lru per layer, g-lru with one budget for all layers")
    env_arg(parser, "--moe-io-threads", env="LLAMA_ARG_MOE_IO_THREADS", type=int, default=8,
            help="expert reader threads besides the decoding thread (0: it reads alone)")
    env_arg(parser, "--moe-chunk-kb", env="LLAMA_ARG_MOE_CHUNK_KB", type=int, default=256,
            help="KiB per expert read request")
    env_arg(parser, "--moe-read-io", env="LLAMA_ARG_MOE_READ_IO", default="auto", choices=("auto", "threads", "uring"),
            help="how reads are issued: threads (--moe-io-threads preads), uring (one thread, io_uring at "
                 "--moe-queue-depth; the threads where there is none) or auto (the path measured best)")
    env_arg(parser, "--moe-queue-depth", env="LLAMA_ARG_MOE_QUEUE_DEPTH", type=int, default=32,
            help="io_uring: read requests in flight at most")
    env_arg(parser, "--moe-direct-io", env="LLAMA_ARG_MOE_DIRECT_IO", type=parse_bool, default=True,
            metavar="on|off", help="read experts with O_DIRECT")
    env_arg(parser, "--moe-preload", env="LLAMA_ARG_MOE_PRELOAD", type=auto_bool, default=None,
            metavar="auto|on|off", show_default="auto",
            help="read experts into the empty slots at load; auto: only when the pools hold every "
                 "expert")
    env_arg(parser, "--moe-resident-layers", env="LLAMA_ARG_MOE_RESIDENT_LAYERS", type=int, default=0,
            metavar="N", help="the first N MoE layers keep every expert in memory (no pool)")
    env_arg(parser, "--moe-guess", env="LLAMA_ARG_MOE_GUESS", type=parse_bool, default=True, metavar="on|off",
            help="the gate-ahead guess: the next layer's router on this layer's input; its experts are "
                 "evicted last (no reads)")
    env_arg(parser, "--moe-prefetch", env="LLAMA_ARG_MOE_PREFETCH", type=parse_prefetch, default="auto",
            metavar="auto|N",
            help="also read the guessed experts that are not resident, N layers ahead, behind the layer's own "
                 "reads; reads of guesses the layer does not route to are dropped when it comes. auto (default): "
                 "1 where the pools page in the plain layout under a per-layer policy, else 0 (off)")
    env_arg(parser, "--moe-verify", env="LLAMA_ARG_MOE_VERIFY", type=parse_bool, default=False, metavar="on|off",
            help="check every expert read against its XXH3-64 digest (those empanel-gguf verify saved, else "
                 "its first read's); a mismatch fails the decode")
    env_arg(parser, "--moe-subst", env="LLAMA_ARG_MOE_SUBST", type=float, default=None, metavar="R",
            help="routing substitution, INEXACT: a resident expert among the router's next choices stands "
                 "in for a missing one if its score is at least R x the missing one's (empanel-gguf kl "
                 "measures the cost)")
    env_arg(parser, "--moe-repack", env="LLAMA_ARG_MOE_REPACK", type=parse_repack, default="auto",
            metavar="auto|on|off",
            help="auto (default): stock's CPU repack buffers where the pools hold every expert, none where they "
                 "page (plain pools: reads land in the slots, nothing is repacked; faster there); on: stock's "
                 "defaults always; off: as llama.cpp's --no-repack always. The report names the stock command "
                 "the outputs equal")
    env_arg(parser, "--moe-host-cache", env="LLAMA_ARG_MOE_HOST_CACHE", default=None, metavar="SIZE",
            help="a host-RAM tier for pools in device memory (offloaded layers): experts they read stay in "
                 "host memory and a miss is served from there before the drive (e.g. 16GiB)")
    env_arg(parser, "--moe-host-cache-unified", env="LLAMA_ARG_MOE_HOST_CACHE_UNIFIED", type=parse_bool,
            default=False, metavar="on|off",
            help="keep the host tier even on a unified-memory GPU (integrated, Metal), where it holds every "
                 "cached expert twice")
    env_arg(parser, "--moe-profile", env="LLAMA_ARG_MOE_PROFILE", default="auto", metavar="auto|PATH|none",
            help="warm start from a calibration profile (empanel-gguf calibrate): auto uses this model "
                 "file's saved one if there is one")


def llama_kwargs(args, n_ctx):
    """The Llama arguments of the options add_load_args added. With --rpc the servers are
    registered here, before the plan's estimate looks at the devices (RpcError if one cannot be
    used)."""
    kwargs = dict(n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=args.ubatch_size, n_threads=args.threads,
                  n_threads_batch=args.threads_batch, flash_attn=args.flash_attn, verbose=args.verbose)
    kwargs["n_gpu_layers"] = args.n_gpu_layers
    if args.rpc:
        from ..engine.rpc import use_servers

        use_servers(args.rpc, kwargs)
        kwargs["rpc_servers"] = args.rpc
    if kwargs["n_gpu_layers"] is None:
        kwargs["n_gpu_layers"] = 0
    return kwargs


def moe_options_from_args(args, trace=False):
    """plan.MoeOptions of the options add_moe_args added (moe_slots aside)."""
    from ..planning.plan import moe_options

    return moe_options(moe_policy=args.moe_policy, moe_io_threads=args.moe_io_threads,
                       moe_chunk_kb=args.moe_chunk_kb, moe_read_io=args.moe_read_io,
                       moe_queue_depth=args.moe_queue_depth, moe_direct_io=args.moe_direct_io, moe_trace=trace,
                       moe_preload=args.moe_preload, moe_resident_layers=args.moe_resident_layers,
                       moe_guess=args.moe_guess, moe_prefetch=args.moe_prefetch, moe_subst=args.moe_subst,
                       moe_verify=args.moe_verify, moe_profile=args.moe_profile, moe_repack=args.moe_repack,
                       moe_host_cache=args.moe_host_cache, moe_host_cache_unified=args.moe_host_cache_unified)


def plan_from_args(index, args, moe_slots, kwargs, trace=False, lora_paths=()):
    """plan.plan_load with the options, floor and --force; logs its report as notes. Give the
    result to Llama(moe_load=...) or plan_file.load_text: nothing is planned twice."""
    from ..planning.host_memory import parse_floor
    from ..planning.plan import plan_load, print_notices

    load = plan_load(index, moe_slots, kwargs, options=moe_options_from_args(args, trace), lora_paths=lora_paths,
                     floor=parse_floor(args.mem_floor), force=args.force, what=f"loading {Path(index.path).name}")
    print_notices(load.report())
    return load


def note(text):
    from ..planning.plan import print_notices

    print_notices([text])
