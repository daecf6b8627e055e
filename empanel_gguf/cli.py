"""`empanel-gguf <command> ...`: dispatches to empanel_gguf.commands.<command>.main(argv)."""

import importlib
import sys

COMMANDS = {
    "run": "complete a prompt or chat with a model (default: the built-in one)",
    "serve": "OpenAI-compatible server (llama_cpp.server) with expert slot pools",
    "exec": "run an unchanged llama-cpp-python program with empanel-gguf",
    "fit": "how fast and in how much memory: predicted per budget, measured here",
    "inspect": "routed experts of a GGUF: layers, types, offsets, sizes",
    "trace": "record every token's routed experts of a run into a trace file",
    "replay": "replay a routing trace through cache policies at several sizes",
    "calibrate": "save a warm-start profile: each layer's most used experts on a text",
    "layout": "measure which weight layout paging pools run faster on this machine",
    "verify": "save (or check) the digest of every routed expert, for --moe-verify",
    "kl": "what routing substitution costs: KL divergence, top-1 agreement, reads saved",
    "bench": "benchmark against stock llama.cpp on the same model (synthetic or yours)",
    "rpc-server": "llama.cpp's ggml-rpc-server: this host's backend for other hosts' --rpc",
}

# llama.cpp's own programs on slot pools (commands/programs.py); built with EMPANEL_PROGRAMS=ON
PROGRAMS = {
    "llama-server": "llama.cpp's server (continuous batching: -np N) with slot pools",
    "llama-cli": "llama.cpp's command-line chat and completion with slot pools",
    "llama-bench": "llama.cpp's benchmark (pp/tg table) with slot pools",
    "llama-perplexity": "llama.cpp's perplexity and KL divergence with slot pools",
}


def usage():
    lines = ["usage: empanel-gguf <command> [options]", "", "commands:"]
    for name, text in COMMANDS.items():
        lines.append(f"  {name:10s} {text}")
    lines += ["", "llama.cpp's programs (their own flags, plus --moe-*; --moe-help lists ours):"]
    for name, text in PROGRAMS.items():
        lines.append(f"  {name:16s} {text}")
    lines.append("")
    lines.append("`empanel-gguf <command> --help` for a command's options")
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command in PROGRAMS:
        from .commands import programs

        return programs.main(command, rest)
    if command not in COMMANDS:
        print(f"empanel-gguf: unknown command '{command}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"empanel_gguf.commands.{command.replace('-', '_')}")
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
