"""`empanel-gguf llama-server|llama-cli|llama-bench|llama-perplexity [--moe-* ...] PROGRAM FLAGS`: llama.cpp's own programs on slot pools.

empanel-gguf plans the load as it does for Llama (index, slot sizing, auto, the memory guard),
writes the plan to a file and runs llama.cpp's program, built from the same patched tree and the
same libllama, with EMPANEL_PLAN=<the plan>. The program's libllama hands the plan to the sidecar
at the load of the model it names: the pools, the reader threads and the policy run inside the
program, with no Python in it. Every flag that is not one of the options below goes to the
program unchanged, with its own meaning (`-m MODEL` is the model; LLAMA_ARG_MODEL works too).

At the end of the program, each load's expert statistics are printed (and saved with
--moe-stats-json). llama-server started with --metrics also shows them live on /metrics, as
empanel_* series next to its own llamacpp:* ones. With -np N (continuous batching) a step decodes
up to N sequences at once, and each expert the step needs is read once for all of them.

The programs are built with the package when its build has EMPANEL_PROGRAMS=ON:
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DEMPANEL_PROGRAMS=ON" pip install .
Exit status: the program's; 1 error, 2 usage, 3 refused by the memory guard.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..planning.options import CommandParser
from .options import EXIT_MEMORY, add_memory_args, add_moe_args, note

PROGRAMS = ("llama-server", "llama-cli", "llama-bench", "llama-perplexity")


def programs_dir():
    """Where the programs are: EMPANEL_GGUF_PROGRAMS_DIR, else programs/ next to the library
    folder (engine.native.lib_dir(), the package's lib/ unless EMPANEL_GGUF_LIB_DIR names another
    build's): a program loads the libllama of ../lib, and its sidecar must be that build's."""
    from ..engine.native import lib_dir

    return Path(os.environ.get("EMPANEL_GGUF_PROGRAMS_DIR") or lib_dir().parent / "programs")


def program_path(name):
    """The program's executable; FileNotFoundError, saying how to build it, when it is missing."""
    path = programs_dir() / (name + (".exe" if sys.platform == "win32" else ""))
    if not path.is_file():
        raise FileNotFoundError(
            f"{name} is not built in this install ({programs_dir()} has no {path.name}). llama.cpp's programs "
            "are built with EMPANEL_PROGRAMS=ON: CMAKE_ARGS=\"-DLLAMA_BUILD=OFF -DEMPANEL_PROGRAMS=ON\" pip install "
            "empanel-gguf (or `pip install .` in a checkout)")
    return path


def setup_arg_parser(name):
    parser = CommandParser(
        prog=f"empanel-gguf {name}", usage=f"empanel-gguf {name} [--moe-* options] {name.upper()}-FLAGS...",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False, add_help=False)
    parser.add_argument("--moe-help", action="help", help="show these options and exit (--help is the program's)")
    add_moe_args(parser)
    add_memory_args(parser)
    parser.add_argument("--moe-stats-json", metavar="PATH",
                        help="save each load's expert statistics to PATH (a JSON list, one entry per load)")
    return parser


def split_args(parser, argv):
    """(our options, the program's flags): a token is ours only if it is exactly one of the
    parser's option strings (or `--option=value`), so that no program flag is taken for an
    abbreviation of ours (-m is the program's model, not -ms)."""
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    ours, theirs = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0] if token.startswith("--") else token
        action = actions.get(name)
        if action is None:
            theirs.append(token)
        else:
            ours.append(token)
            if action.nargs != 0 and "=" not in token and i + 1 < len(argv):
                ours.append(argv[i + 1])
                i += 1
        i += 1
    return ours, theirs


# the program flags the plan needs (llama.cpp's names, common/arg.cpp; llama-bench's own)
_MODEL_FLAGS = ("-m", "--model")
_VALUE_FLAGS = {"-c": "ctx", "--ctx-size": "ctx", "-b": "batch", "--batch-size": "batch", "-ub": "ubatch",
                "--ubatch-size": "ubatch", "-ngl": "ngl", "--gpu-layers": "ngl", "--n-gpu-layers": "ngl",
                "-p": "n_prompt", "--n-prompt": "n_prompt", "-n": "n_gen", "--n-gen": "n_gen",
                "--rpc": "rpc", "--spec-type": "spec_type", "-fa": "fa", "--flash-attn": "fa"}
_LORA_FLAGS = ("--lora", "--lora-scaled")


def program_flags(flags, lists=False):
    """The values of the flags the plan reads ({"model": [paths], "lora": [paths], "ctx": "4096",
    ...}) as the program will see them: `-m X` or `--model=X`, else LLAMA_ARG_MODEL,
    LLAMA_ARG_CTX_SIZE and kin from the environment. lists: llama-bench's comma-separated values
    (-m a,b) are split, and the first value of the others is taken."""
    found = {"model": [], "lora": []}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag.startswith("--") and "=" in flag:
            flag, value = flag.split("=", 1)
            i += 1
        elif i + 1 < len(flags):
            value = flags[i + 1]
            i += 2 if (flag in _MODEL_FLAGS or flag in _VALUE_FLAGS or flag in _LORA_FLAGS) else 1
        else:
            value = None
            i += 1
        if value is None:
            continue
        if flag in _MODEL_FLAGS:
            found["model"] += [v for v in value.split(",") if v] if lists else [value]
        elif flag in _LORA_FLAGS:
            found["lora"] += [v for v in value.split(",") if v]
        elif flag in _VALUE_FLAGS:
            found[_VALUE_FLAGS[flag]] = value.split(",")[0] if lists else value
    if not found["model"] and os.environ.get("LLAMA_ARG_MODEL"):
        found["model"] = [os.environ["LLAMA_ARG_MODEL"]]
    for key, env in (("ctx", "LLAMA_ARG_CTX_SIZE"), ("batch", "LLAMA_ARG_BATCH"), ("ubatch", "LLAMA_ARG_UBATCH"),
                     ("ngl", "LLAMA_ARG_N_GPU_LAYERS"), ("rpc", "LLAMA_ARG_RPC"),
                     ("spec_type", "LLAMA_ARG_SPEC_TYPE"), ("fa", "LLAMA_ARG_FLASH_ATTN")):
        if key not in found and os.environ.get(env):
            found[key] = os.environ[env]
    return found


def planned_n_ctx(name, values, shape):
    """The context the program will make, as far as the plan can tell: -c (0: the model's
    training context); else each program's own default: llama-server and llama-cli the training
    context (llama.cpp may shrink it to fit), llama-perplexity 512, llama-bench -p + -n."""
    from ..planning.estimate import resolve_n_ctx

    ctx = _int_or(values.get("ctx"), None)
    if ctx is not None:
        return resolve_n_ctx(shape, ctx)
    if name == "llama-perplexity":
        return 512
    if name == "llama-bench":
        return max(1, _int_or(values.get("n_prompt"), 512) + _int_or(values.get("n_gen"), 128))
    return resolve_n_ctx(shape, 0)


def _int_or(text, default):
    try:
        return int(text)
    except (TypeError, ValueError):
        return default


def plan_for_program(name, args, flags):
    """The LoadPlan of the program's model, or None when the program runs stock (no -m, no slot
    pools wanted, no MoE, or every expert fits with --moe-slots auto)."""
    from ..planning.estimate import model_shape, set_rpc_probe
    from ..planning.index import load_index
    from ..planning.plan import parse_moe_slots
    from .options import plan_from_args

    values = program_flags(flags, lists=name == "llama-bench")
    models = values["model"]
    if not models:  # --help, --version, -hf downloads: the program as it is
        note(f"no -m MODEL given: {name} runs without slot pools (downloads with -hf are not planned)")
        return None
    if len(models) > 1:
        note(f"{len(models)} models given: slot pools for {models[0]}, the others load as usual")
    # --spec-type draft-mtp loads the model's MTP blocks (common.cpp: load_mtp): page them too
    loads_mtp = "draft-mtp" in (values.get("spec_type") or "").split(",")
    index = load_index(models[0], mtp=loads_mtp)
    moe_slots = parse_moe_slots(args.moe_slots if args.moe_slots is not None else "auto")
    shape = model_shape(index)
    kwargs = {"n_ctx": planned_n_ctx(name, values, shape), "n_gpu_layers": _int_or(values.get("ngl"), 0)}
    fa_off = values.get("fa") in ("off", "0", "false")
    if name not in BATCH_PROGRAMS or fa_off or values.get("batch") is not None or values.get("ubatch") is not None:
        # the program's own micro-batch (else the plan's, --moe-batch: main gives its flags)
        kwargs.update(n_batch=_int_or(values.get("batch"), 2048), n_ubatch=_int_or(values.get("ubatch"), 512),
                      flash_attn=not fa_off)
    if values.get("rpc"):  # the program registers the servers: their layers are not held here
        kwargs["gpu_offload"] = True
        kwargs["n_gpu_layers"] = _int_or(values.get("ngl"), -1)
        set_rpc_probe(lambda: True)  # moe_guess auto: its layers are on the hosts
    load = plan_from_args(index, args, moe_slots, kwargs, lora_paths=values["lora"])
    return load if load.pools is not None else None


# the programs whose prompts the plan's micro-batch serves (--moe-batch); llama-bench measures the
# -b / -ub it is given, llama-perplexity sizes its batches from its own -c
BATCH_PROGRAMS = ("llama-server", "llama-cli")


def run_program(path, flags, env):
    """Run the program in the foreground; its exit status (128 + N when signal N ended it, as a
    shell says). Ctrl-C reaches it (same process group) and ends it as it ends alone; a SIGTERM or
    SIGHUP to us is passed on, and we wait for it to end."""
    child = None
    pending = []

    def forward(signum, frame):
        if child is None:
            pending.append(signum)  # arrived before the program started
        else:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        child = subprocess.Popen([str(path), *flags], env=env)
        # after Popen: an ignored SIGINT would be inherited by the program
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for signum in pending:
            child.send_signal(signum)
        rc = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - rc if rc < 0 else rc


def main(name, argv=None):
    from ..planning.guard import MemoryRefused
    from ..planning.index import ModelError
    from ..planning.plan import micro_batch_flags, resolve_repack, stock_equivalent
    from ..planning.plan_file import load_text
    from ..planning.sizing import SlotsError
    from ..engine.stats import read_stats_file, summary_line

    parser = setup_arg_parser(name)
    ours, flags = split_args(parser, list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(ours)
    try:
        path = program_path(name)
    except FileNotFoundError as e:
        print(f"empanel-gguf {name}: {e}", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if k not in ("EMPANEL_PLAN", "EMPANEL_SIDECAR")}
    with tempfile.TemporaryDirectory(prefix="empanel-plan-") as tmp:
        plan_path = Path(tmp) / "plan.txt"
        stats_path = Path(tmp) / "stats.jsonl"
        try:
            load = plan_for_program(name, args, flags)
            if load is not None:
                plan_path.write_text(load_text(load, stats_path=stats_path))
        except (ModelError, SlotsError, ValueError, OSError) as e:
            print(f"empanel-gguf {name}: {e}", file=sys.stderr)
            return 1
        except MemoryRefused as e:
            print(f"empanel-gguf {name}: refused: {e}", file=sys.stderr)
            return EXIT_MEMORY
        repack = load.options.repack if load is not None else resolve_repack(args.moe_repack, None)
        if not repack:  # llama.cpp's own flag for use_extra_bufts = false
            flags = flags + (["--repack", "0"] if name == "llama-bench" else ["--no-repack"])
        if load is None:
            note(f"{name} runs without slot pools")
            return run_program(path, flags, env)
        flags = flags + micro_batch_flags(load.micro_batch)  # (-fa on: llama.cpp's -fa auto turns it on
        # for the CPU as well; said here as the stock command the outputs equal names it)
        # the program's libllama loads the libempanel next to itself (the same build)
        env["EMPANEL_PLAN"] = str(plan_path)
        rc = run_program(path, flags, env)
        try:
            loads = read_stats_file(stats_path)
        except (OSError, ValueError) as e:
            note(f"the program's statistics could not be read ({e})")
            return rc
    if not loads and rc == 0:
        note(f"{name} never loaded the planned model (another -m, or another libllama on its library path): "
             "it ran without slot pools")
    # llama.cpp's programs may first load the model without memory to size it (common's fit):
    # such a load never runs, and only the loads that did are reported
    ran = [stats for stats in loads if stats["total"]["n_remaps"] or stats["total"]["preloaded"]] or loads[-1:]
    exact_to = stock_equivalent(repack, getattr(args, "moe_subst", None), load.micro_batch)
    for i, stats in enumerate(ran):
        prefix = f"load {i + 1} of {len(ran)}: " if len(ran) > 1 else ""
        note(prefix + summary_line(stats).removeprefix("empanel: ") +
             (f"; outputs bit-identical to {exact_to}" if exact_to.startswith("llama.cpp") else f"; exact to {exact_to}"))
        stats["exact_to"] = exact_to
    if args.moe_stats_json:
        import json

        Path(args.moe_stats_json).write_text(json.dumps(loads, indent=1))
    return rc
