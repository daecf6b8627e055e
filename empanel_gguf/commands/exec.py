"""`empanel-gguf exec [--moe-slots N|P%|SIZE|auto] -- PROGRAM [ARGS...]`: run an unchanged program.

An existing llama-cpp-python program (or `python -m llama_cpp.server ...`) runs with
empanel-gguf's libraries and expert slot pools, without editing its code: its plain
`import llama_cpp; llama_cpp.Llama(...)` loads the model with moe_slots from --moe-slots,
after the memory guard's check.

It runs PROGRAM with these environment variables, which can also be set by hand
(`empanel-gguf exec --moe-slots 25% --print-env` prints them):

  LLAMA_CPP_LIB_PATH   empanel-gguf's library folder: llama_cpp loads our libllama from it
  MTMD_CPP_LIB         the same folder (no libmtmd is built: keeps a foreign one out)
  PYTHONPATH           starts with empanel_gguf/_bootstrap, whose sitecustomize.py runs the
                       sitecustomize it hides (if any), then, at the program's first
                       `import llama_cpp`, makes llama_cpp.Llama empanel_gguf's Llama
  EMPANEL_MOE_SLOTS    moe_slots of every Llama(...) that does not pass one: a count, a share
                       (25%), a budget for all pools (6GiB), auto (pools only if the experts do
                       not fit in memory), or none (libraries only, every expert resident)
  EMPANEL_MEM_FLOOR    memory the guard keeps free (default max(1 GiB, 5% of memory); 0: off)
  EMPANEL_FORCE        1: load even when the guard estimates that the model does not fit
  EMPANEL_RPC_SERVERS  rpc_servers of every Llama(...) that does not pass them: HOST:PORT,... of
                       ggml-rpc-server processes that take the offloaded layers and their pools
  LLAMA_ARG_MOE_*      any other moe_* option of every Llama(...) that does not pass it, as the
                       commands' variables give it (--moe-elastic and --moe-budget set theirs:
                       LLAMA_ARG_MOE_ELASTIC, LLAMA_ARG_MOE_BUDGET)

Python started with -S or -I ignores PYTHONPATH/sitecustomize: there only the libraries change.
A Llama that the guard refuses raises empanel_gguf.planning.guard.MemoryRefused in the program.
"""

from ..planning.options import CommandParser
import argparse
import os
import shlex
import sys
from pathlib import Path

BOOTSTRAP_DIR = Path(__file__).resolve().parent.parent / "_bootstrap"


def setup_arg_parser():
    from ..planning.options import OPTION
    from .options import env_arg

    parser = CommandParser(
        prog="empanel-gguf exec", usage="empanel-gguf exec [options] -- PROGRAM [ARGS...]",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    env_arg(parser, *OPTION["slots"].flags, env=OPTION["slots"].env, default="auto",
            metavar="N|P%|SIZE|auto|none", help="slots per MoE layer for the program's models")
    env_arg(parser, "--mem-floor", env="LLAMA_ARG_MEM_FLOOR", metavar="SIZE|P%",
            show_default="max(1 GiB, 5% of memory)", help="memory the guard keeps free; 0: no guard")
    env_arg(parser, "--force", env="LLAMA_ARG_FORCE", action="store_true", default=False,
            help="load even when the memory guard estimates that a model does not fit")
    env_arg(parser, "--rpc", env="LLAMA_ARG_RPC", default=None, metavar="HOST:PORT,...", show_default="none",
            help="ggml-rpc-server processes for the program's models (rpc_servers=)")
    for name in _MOE_FLAGS:  # pools that give memory back
        o = OPTION[name]
        env_arg(parser, *o.flags, env=o.env, default=None, metavar=o.metavar, help=o.help,
                show_default=o.show_default)
    parser.add_argument("--print-env", action="store_true",
                        help="print the environment as shell exports instead of running a program")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def build_env(moe_slots="auto", mem_floor=None, force=False, base=None, rpc_servers=None, moe_env=None):
    """The environment that makes a program's llama_cpp use empanel-gguf (see the module doc);
    moe_env: {LLAMA_ARG_MOE_* variable: text} for the program's Llama(...) calls."""
    from ..engine.native import lib_dir

    env = dict(os.environ if base is None else base)
    libs = str(lib_dir())
    env["LLAMA_CPP_LIB_PATH"] = libs
    env["MTMD_CPP_LIB"] = libs
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOTSTRAP_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR)] + paths)
    env["EMPANEL_MOE_SLOTS"] = "none" if moe_slots is None else str(moe_slots)
    if mem_floor is not None:
        env["EMPANEL_MEM_FLOOR"] = str(mem_floor)
    if force:
        env["EMPANEL_FORCE"] = "1"
    if rpc_servers:
        env["EMPANEL_RPC_SERVERS"] = rpc_servers
    env.update({key: str(value) for key, value in (moe_env or {}).items() if value is not None})
    return env


_CHANGED = ("LLAMA_CPP_LIB_PATH", "MTMD_CPP_LIB", "PYTHONPATH", "EMPANEL_MOE_SLOTS",
            "EMPANEL_MEM_FLOOR", "EMPANEL_FORCE", "EMPANEL_RPC_SERVERS")
_MOE_FLAGS = ("elastic", "budget")  # exec's own moe flags besides --moe-slots (others: LLAMA_ARG_MOE_*)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        options, command = argv[:cut], argv[cut + 1:]
    else:
        options, command = argv, None
    parser = setup_arg_parser()
    args = parser.parse_args(options)
    if command is None:
        command = args.command
    from ..planning.options import OPTION

    moe_env = {OPTION[name].env: getattr(args, f"moe_{name}") for name in _MOE_FLAGS}
    env = build_env(args.moe_slots, args.mem_floor, args.force, rpc_servers=args.rpc, moe_env=moe_env)
    if args.print_env:
        for key in _CHANGED + tuple(moe_env):
            if key in env:
                print(f"export {key}={shlex.quote(env[key])}")
        return 0
    if not command:
        parser.error("no program given: empanel-gguf exec [options] -- PROGRAM [ARGS...]")
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"empanel-gguf exec: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


# ---------------------------------------------------------------------------------------------
# inside the program: called by _bootstrap/sitecustomize.py right after `import llama_cpp`

_FROM_ENV = object()


def patch_llama_cpp(module):
    """Make `module.Llama` and `module.llama.Llama` (module: llama_cpp) empanel_gguf's Llama with
    moe_slots defaulting to EMPANEL_MOE_SLOTS, checked by the memory guard first."""
    from ..llama import Llama as EmpanelLlama

    class Llama(EmpanelLlama):
        __doc__ = EmpanelLlama.__doc__

        def __init__(self, model_path, *args, moe_slots=_FROM_ENV, **kwargs):
            if os.environ.get("EMPANEL_RPC_SERVERS") and not kwargs.get("rpc_servers"):
                from ..engine.rpc import use_servers

                kwargs["rpc_servers"] = os.environ["EMPANEL_RPC_SERVERS"]
                use_servers(kwargs["rpc_servers"], kwargs)  # before the guard's estimate: it sees the devices
            if moe_slots is _FROM_ENV:
                moe_slots = None
                if kwargs.get("moe_load") is None:
                    kwargs["moe_load"], moe_slots = _load_from_env(model_path, kwargs)
            super().__init__(model_path, *args, moe_slots=moe_slots, **kwargs)

    Llama.__name__ = Llama.__qualname__ = "Llama"
    Llama.__module__ = module.llama.__name__
    module.Llama = Llama
    module.llama.Llama = Llama
    return Llama


def _load_from_env(model_path, kwargs):
    """(the plan of this load, None) for EMPANEL_MOE_SLOTS after the memory guard (which raises
    MemoryRefused); (None, moe_slots) where the file cannot be indexed (Llama reports its problem)."""
    from ..planning.host_memory import parse_floor
    from ..planning.index import ModelError, load_index
    from ..planning.options import env_options
    from ..planning.plan import moe_options, parse_moe_slots, plan_load, print_notices

    moe_slots = parse_moe_slots(os.environ.get("EMPANEL_MOE_SLOTS"))
    if kwargs.get("vocab_only"):
        return None, None
    try:
        index = load_index(model_path)
    except (ModelError, OSError):
        return None, (None if moe_slots == "auto" else moe_slots)
    force = os.environ.get("EMPANEL_FORCE", "").strip().lower() in ("1", "true", "on", "yes")
    moe = {**env_options(os.environ),
           **{key: kwargs.pop(key) for key in list(kwargs) if key.startswith("moe_") and key != "moe_load"}}
    lora = [kwargs["lora_path"]] if kwargs.get("lora_path") else []
    load = plan_load(index, moe_slots, kwargs, options=moe_options(**moe), lora_paths=lora,
                     floor=parse_floor(os.environ.get("EMPANEL_MEM_FLOOR")), force=force,
                     what=f"loading {Path(model_path).name}")
    print_notices(load.report(kwargs.get("verbose", True)))
    return load, None
