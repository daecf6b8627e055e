"""`empanel-gguf serve [MODEL.gguf] [--moe-slots N|P%|SIZE|auto] [--host H] [--port P] ...`: serve.

llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) with expert slot pools:
every option of llama_cpp.server works as there (--n_ctx, --ngpu_layers, --chat_format,
--config_file with a `models` list, ...), plus --moe_slots (also in each model of a config file),
--mem_floor and --force. llama.cpp's spellings work too (-c/--ctx-size, -ngl, -t, -a/--alias,
--moe-slots, ...) and read llama.cpp's LLAMA_ARG_* variables; llama_cpp.server's own variables
(MODEL, N_CTX, MOE_SLOTS, CONFIG_FILE, ...) keep working. Address: 127.0.0.1:8080 unless --host and
--port say otherwise. Requests are served one at a time in order; --interrupt_requests true gives
llama_cpp.server's behaviour (a new request ends a streaming answer early). Without a model (and
without a config file) it serves the built-in model.

Endpoints: llama_cpp.server's (/v1/completions, /v1/chat/completions, /v1/models, /docs, ...),
plus GET /v1/empanel/stats (JSON) and GET /metrics (Prometheus): expert hit rate, bytes read and
read rate, slots, memory. Exit status: 0 stopped, 1 error, 2 usage, 3 refused or stopped by the
memory guard.
"""

import argparse
import os
import sys

from ..planning.options import OPTION, CommandParser
from .options import DEFAULT_MODEL_SLOTS, EXIT_MEMORY, default_model_path, gpu_layers, parse_bool

# llama.cpp's spellings of llama_cpp.server's settings: (flags, setting, type, environment variable)
LLAMA_CPP_ALIASES = (
    (("-m",), "model", str, "LLAMA_ARG_MODEL"),
    (("-a", "--alias"), "model_alias", str, "LLAMA_ARG_ALIAS"),
    (OPTION["slots"].flags, "moe_slots", str, OPTION["slots"].env),
    (("--mem-floor",), "mem_floor", str, "LLAMA_ARG_MEM_FLOOR"),
    (("-c", "--ctx-size"), "n_ctx", int, "LLAMA_ARG_CTX_SIZE"),
    (("-b", "--batch-size"), "n_batch", int, "LLAMA_ARG_BATCH"),
    (("-ub", "--ubatch-size"), "n_ubatch", int, "LLAMA_ARG_UBATCH"),
    (("-t", "--threads"), "n_threads", int, "LLAMA_ARG_THREADS"),
    (("-tb", "--threads-batch"), "n_threads_batch", int, "LLAMA_ARG_THREADS_BATCH"),
    (("-ngl", "--n-gpu-layers", "--gpu-layers"), "n_gpu_layers", gpu_layers, "LLAMA_ARG_N_GPU_LAYERS"),
    (("-fa", "--flash-attn"), "flash_attn", parse_bool, "LLAMA_ARG_FLASH_ATTN"),
    (("--rpc",), "rpc_servers", str, "LLAMA_ARG_RPC"),
    (("--chat-template-format",), "chat_format", str, "LLAMA_ARG_CHAT_FORMAT"),
    (("--api-key",), "api_key", str, "LLAMA_API_KEY"),
    (("--host",), "host", str, "LLAMA_ARG_HOST"),
    (("--port",), "port", int, "LLAMA_ARG_PORT"),
)


def setup_arg_parser():
    from llama_cpp.server.cli import add_args_from_model

    from ..server import EmpanelSettings

    parser = CommandParser(
        prog="empanel-gguf serve", conflict_handler="resolve",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_path", nargs="?", metavar="MODEL",
                        help="GGUF model (first shard of a split); default: the built-in one")
    add_args_from_model(parser, EmpanelSettings)  # llama_cpp.server's options, --moe_slots included
    for action in parser._actions:  # argparse %-formats help texts; the settings say "25%"
        if action.help and "%" in action.help and "%%" not in action.help:
            action.help = action.help.replace("%", "%%")
    parser.add_argument("--config_file", "--config-file", dest="config_file",
                        help="JSON or YAML file: server settings and a `models` list (env: CONFIG_FILE)")
    parser.add_argument("--force", dest="force", nargs="?", const=True, type=parse_bool, default=None,
                        help="load even when the memory guard estimates that it does not fit "
                             "(env: LLAMA_ARG_FORCE)")
    for flags, dest, kind, env in LLAMA_CPP_ALIASES:
        if flags == ("--host",) or flags == ("--port",):
            default = {"host": "127.0.0.1", "port": 8080}[dest]
            parser.add_argument(*flags, dest=dest, type=kind, default=None,
                                help=f"listen {dest} (default: {default}, env: {env} or {dest.upper()})")
            continue
        parser.add_argument(*flags, dest=dest, type=kind, default=None,
                            help=f"--{dest} in llama.cpp's spelling (env: {env})")
    return parser


def _apply_env(args):
    """LLAMA_ARG_* for what the command line left unset."""
    for _, dest, kind, env in LLAMA_CPP_ALIASES + ((None, "force", parse_bool, "LLAMA_ARG_FORCE"),):
        raw = os.environ.get(env)
        if getattr(args, dest, None) is None and raw not in (None, ""):
            setattr(args, dest, kind(raw))


def settings_from_args(args):
    """(server settings, [model settings], builtin) from the command line or the config file."""
    from llama_cpp.server.cli import parse_model_from_args

    from ..server import EmpanelModelSettings, EmpanelServerSettings, load_config_file

    config_file = args.config_file or os.environ.get("CONFIG_FILE")
    if config_file:
        config = load_config_file(config_file)
        if not config.models:
            raise ValueError(f"{config_file}: no models (give a `models` list)")
        server = EmpanelServerSettings.model_validate(config.model_dump(exclude={"models"}))
        return server, list(config.models), False
    model = args.model or args.model_path
    builtin = model is None and not os.environ.get("MODEL")
    if builtin:
        args.model = str(default_model_path())
        if args.moe_slots is None and not os.environ.get("MOE_SLOTS"):
            args.moe_slots = DEFAULT_MODEL_SLOTS
    else:
        args.model = model or os.environ.get("MODEL")
    return (parse_model_from_args(EmpanelServerSettings, args),
            [parse_model_from_args(EmpanelModelSettings, args)], builtin)


# what llama_cpp.server needs beyond llama-cpp-python itself: its [server] extra
SERVER_MODULES = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


def missing_server_modules():
    """The modules of llama-cpp-python's [server] extra that do not import here."""
    import importlib

    missing = []
    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv=None):
    missing = missing_server_modules()
    if missing:
        print(f"empanel-gguf serve: the server needs {', '.join(missing)} (llama-cpp-python's server extra), "
              "which this install lacks.\nHINT: pip install \"empanel-gguf[server]\"; from a checkout: "
              "CMAKE_ARGS=\"-DLLAMA_BUILD=OFF\" pip install \".[server]\"", file=sys.stderr)
        return 1
    import uvicorn

    from .. import server
    from ..planning.guard import MemoryRefused, Watchdog
    from ..planning.index import ModelError
    from ..planning.sizing import SlotsError

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    _apply_env(args)
    try:
        server_settings, model_settings, _ = settings_from_args(args)
    except (ValueError, OSError) as e:  # pydantic's ValidationError is a ValueError
        print(f"empanel-gguf serve: {e}", file=sys.stderr)
        return 2
    try:
        app = server.create_app(server_settings, model_settings)
    except (ModelError, SlotsError, ValueError, OSError) as e:
        print(f"empanel-gguf serve: {e}", file=sys.stderr)
        return 1
    except MemoryRefused as e:
        print(f"empanel-gguf serve: refused: {e}", file=sys.stderr)
        return EXIT_MEMORY

    config = uvicorn.Config(app, host=server_settings.host, port=server_settings.port,
                            ssl_keyfile=server_settings.ssl_keyfile,
                            ssl_certfile=server_settings.ssl_certfile)
    http = uvicorn.Server(config)
    proxy = server.proxy()

    def on_low(available, floor):
        http.should_exit = True

    def budget():
        llm = proxy.current()[1]
        stats = llm.moe_stats() if hasattr(llm, "moe_stats") else None
        return (stats or {}).get("budget")

    guard = Watchdog(proxy.floor or 0, on_low, budget_fn=budget)
    scheme = "https" if server_settings.ssl_certfile else "http"
    print(f"empanel: serving {proxy.current()[0]} on {scheme}://{server_settings.host}:"
          f"{server_settings.port} (OpenAI API under /v1; stats: /v1/empanel/stats, /metrics)",
          file=sys.stderr, flush=True)
    try:
        with guard:
            http.run()
    finally:
        app.state.empanel_sampler.stop()
        proxy.free()
    if guard.tripped.is_set():
        print(guard.message(), file=sys.stderr)
        return EXIT_MEMORY
    return 0
