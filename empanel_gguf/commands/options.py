"""Command-line pieces every subcommand shares: llama.cpp's option names (each with its
LLAMA_ARG_* environment variable), the built-in model, notes on stderr, exit codes, and the
load plan from parsed options (plan.plan_load). The --moe-* flags are made from the MoE options' table
(planning/options.py).
"""

import argparse
import os
from pathlib import Path

from ..planning.options import OPTIONS, CommandParser, parse_bool

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
    return CommandParser(
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
    if isinstance(shown, bool):
        shown = "on" if shown else "off"  # as the values are written (--moe-direct-io on|off)
    shown = str(shown).replace("%", "%%")  # argparse %-formats help texts
    parser.add_argument(*flags, default=default, help=f"{help} (default: {shown}, env: {env})", **kwargs)


def add_memory_args(parser):
    from ..planning.host_memory import parse_floor

    env_arg(parser, "--mem-floor", env="LLAMA_ARG_MEM_FLOOR", metavar="SIZE|P%", type=checked_text(parse_floor),
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
    env_arg(parser, "-b", "--batch-size", env="LLAMA_ARG_BATCH", type=int, default=None,
            show_default="512; where pools page, --moe-batch's", help="logical batch size")
    env_arg(parser, "-ub", "--ubatch-size", env="LLAMA_ARG_UBATCH", type=int, default=None,
            show_default="512; where pools page, --moe-batch's",
            help="physical batch size (a micro-batch whose experts exceed a pool runs in waves)")
    env_arg(parser, "-fa", "--flash-attn", env="LLAMA_ARG_FLASH_ATTN", type=parse_bool, default=None,
            metavar="on|off", show_default="off; where pools page, --moe-batch's", help="flash attention")


def checked_text(check):
    """An argparse type that hands the text on as it is, once check(text) took it: a value the
    load would refuse is a usage error before anything is read."""
    def take(text):
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return take


def add_moe_args(parser, moe_slots_default="auto"):
    """-ms and the --moe-* options of Llama, from the table (planning/options.py)."""
    for o in OPTIONS:
        if not o.flags:
            continue  # (moe_trace and moe_mtp: the commands set them)
        parse = o.parse if o.parse is not None or o.check is None else checked_text(o.checked)
        extra = {key: value for key, value in (("type", parse), ("metavar", o.metavar), ("choices", o.choices))
                 if value is not None}
        show = moe_slots_default if o.name == "slots" else o.show_default
        env_arg(parser, *o.flags, env=o.env, default=o.default,
                show_default=show, help=o.help, **extra)


def llama_kwargs(args, n_ctx):
    """The Llama arguments of the options add_load_args added. With --rpc the servers are
    registered here, before the plan's estimate looks at the devices (RpcError if one cannot be
    used)."""
    kwargs = dict(n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads_batch, verbose=args.verbose)
    for key, value in (("n_batch", args.batch_size), ("n_ubatch", args.ubatch_size), ("flash_attn", args.flash_attn)):
        if value is not None:  # unset: llama-cpp-python's default, or the plan's (moe_batch)
            kwargs[key] = value
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
    from ..planning.options import moe_options

    given = {o.keyword: getattr(args, o.keyword) for o in OPTIONS if o.flags and o.name != "slots"}
    return moe_options(moe_trace=trace, **given)


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
