"""`empanel-gguf run [MODEL.gguf] [-p PROMPT] ...`: complete a prompt, or chat, with a model.

With -p the completion of the prompt streams to stdout. Without -p and with a terminal on stdin it
is an interactive chat in the model's chat template (-cnv forces chat on a pipe: one user turn per
line); it ends on EOF (Ctrl-D) or /exit, and /reset clears its history. Without a model path
it runs the built-in default model (a small MoE trained on Shakespeare, shipped in the package;
a random-weight fixture written into the cache where it is missing) with slot pools of half its
experts; without -p (or -cnv) it completes a fixed prompt.

Progress goes to stderr while indexing and loading; at exit a short report, a line each:
  slots     expert slots per MoE layer, and the pools' memory against all the experts'
  experts   hit rate: routed experts found in a slot; misses were read from the file (bytes, GB/s)
  exact     the stock llama.cpp run these outputs equal bit for bit: its weight layout
            (--no-repack: plain pools; defaults: CPU repacked pools, or pools that hold every expert)
  reads     the read path: io_uring (one thread) or reader threads
  budget    elastic pools: memory held now, the lowest it went, moves down and up, bytes given back
  guess     recall: share of routed experts the gate-ahead guess named a layer early; read ahead:
            experts it read before their layer, used (then routed) or dropped unread (not routed)

Every option also reads an environment variable, as llama.cpp's tools do (LLAMA_ARG_*); an option
on the command line wins. Exit status: 0 done, 1 error, 2 usage, 3 refused or stopped by the
memory guard.
"""

import argparse
import contextlib
import os
import random
import sys
import time
from pathlib import Path

from ..planning.options import CommandParser
from ..planning.format import format_bytes
from ..progress import PromptProgress
from .options import (DEFAULT_MODEL_SLOTS, DEFAULT_PROMPT, EXIT_MEMORY, add_load_args, add_memory_args,
                      add_moe_args, add_sampling_args, default_model_path, env_arg, llama_kwargs, note,
                      plan_from_args)

def setup_arg_parser():
    parser = CommandParser(
        prog="empanel-gguf run", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="GGUF model (first shard of a split); "
                        "default: the built-in one (env: LLAMA_ARG_MODEL)")
    parser.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="the same, as an option")
    parser.add_argument("-p", "--prompt", help="prompt to complete; without it, a MODEL given and a terminal "
                        f"on stdin: chat; else (the built-in model, or no terminal) the prompt {DEFAULT_PROMPT!r}")
    parser.add_argument("-sys", "--system-prompt", help="system message of a chat")
    parser.add_argument("-cnv", "--conversation", dest="conversation", action="store_const", const=True,
                        default=None, help="chat even when stdin is not a terminal (one turn per line)")
    parser.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_const",
                        const=False, help="never chat: complete -p or the default prompt")
    parser.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    env_arg(parser, "-n", "--n-predict", env="LLAMA_ARG_N_PREDICT", type=int, default=64,
            help="tokens to generate per completion or reply, -1 = until the end of the text, 0 = none "
                 "(the prompt is evaluated, as llama.cpp's -n 0)")
    add_load_args(parser)
    add_moe_args(parser, moe_slots_default=f"auto; {DEFAULT_MODEL_SLOTS} for the built-in model")
    env_arg(parser, "--no-mmap", env="LLAMA_ARG_NO_MMAP", action="store_true", default=False,
            help="read the model into memory instead of mapping it")
    env_arg(parser, "--mlock", env="LLAMA_ARG_MLOCK", action="store_true", default=False,
            help="lock the model in memory")
    add_sampling_args(parser, temp=0.8)
    env_arg(parser, "--repeat-penalty", env="LLAMA_ARG_REPEAT_PENALTY", type=float, default=1.0,
            help="penalty for repeated tokens, 1.0 = none")
    env_arg(parser, "-s", "--seed", env="LLAMA_ARG_SEED", type=int, default=-1,
            help="sampling seed, -1 = a random one, shown in the report")
    add_memory_args(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's own log")
    return parser


# ---------------------------------------------------------------------------------------------
# progress while loading


@contextlib.contextmanager
def load_progress(name, stream=None):
    """Show llama.cpp's load progress (llama_model_params.progress_callback) as a bar on a
    terminal; one line when done otherwise."""
    from .. import llama_cpp

    stream = stream or sys.stderr
    # llama-cpp-python points fd 2 (and sys.stderr) at /dev/null while it loads quietly: draw on
    # a duplicate of the terminal's descriptor
    try:
        fd = os.dup(stream.fileno()) if stream.isatty() else None
    except (OSError, ValueError, AttributeError):
        fd = None
    module = llama_cpp.llama_cpp  # llama_cpp.llama calls llama_cpp.llama_cpp.llama_model_default_params
    original = module.llama_model_default_params
    last = [-1]

    def on_progress(progress, _user_data):
        try:
            pct = int(progress * 100)
            if fd is not None and pct != last[0]:
                last[0] = pct
                bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
                os.write(fd, f"\rempanel: loading {name} [{bar}] {pct:3d}%".encode())
        except Exception:
            pass
        return True

    callback = module.llama_progress_callback(on_progress)

    def default_params():
        params = original()
        params.progress_callback = callback
        return params

    t0 = time.perf_counter()
    module.llama_model_default_params = default_params
    try:
        yield
    finally:
        module.llama_model_default_params = original
        if fd is not None:
            if last[0] >= 0:
                os.write(fd, b"\n")
            os.close(fd)
    note(f"loaded {name} in {time.perf_counter() - t0:.2f} s")


# ---------------------------------------------------------------------------------------------
# the report


class Timings:
    """Prompt and decode time from llama.cpp's own counters (llama_perf_context): decode time
    only, without tokenization and sampling, as llama-bench counts it."""

    def __init__(self, llm):
        from .. import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llm
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)

    def read(self):
        data = self.llama_cpp.llama_perf_context(self.llm._ctx.ctx)
        # (llama.cpp reports at least 1 token of each, timed or not: no time is no token)
        return (data.n_p_eval if data.t_p_eval_ms > 0 else 0, data.t_p_eval_ms / 1e3,
                data.n_eval if data.t_eval_ms > 0 else 0, data.t_eval_ms / 1e3)


def _rate(n, seconds):
    return f"{n / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"


def format_report(name, index, plan, stats, timings, rss):
    """The lines of the end-of-run report."""
    lines = ["empanel: report"]
    if index is not None:
        moe = (f"{len(index.layers)} MoE layers of {index.n_expert} experts (top-{index.n_expert_used})"
               if index.is_moe else "no routed experts")
        lines.append(f"  model     {name}: {index.architecture}, {index.n_layer} layers, {moe}")
    if plan is not None:
        slots = sorted({n for n in plan.n_slots if n > 0})
        per_layer = (f"{slots[0]} of {plan.n_expert}" if len(slots) == 1
                     else ", ".join(str(n) for n in plan.n_slots))
        lines.append(f"  slots     {per_layer} per MoE layer: {format_bytes(plan.pool_bytes)} of pools "
                     f"for {format_bytes(index.expert_bytes_total)} of experts")
    elif index is not None and index.is_moe:
        lines.append(f"  slots     none: all {index.n_expert} experts of each layer resident")
    if timings is not None:
        n_p, t_p, n_e, t_e = timings
        lines.append(f"  prompt    {n_p} tokens in {t_p:.3f} s: {_rate(n_p, t_p)}")
        lines.append(f"  decode    {n_e} tokens in {t_e:.3f} s: {_rate(n_e, t_e)}")
    if stats is not None:
        t = stats["total"]
        gbps = t.get("read_gbps", t["bytes_read"] / t["read_s"] / 1e9 if t["read_s"] > 0 else 0.0)
        speed = f"{gbps:.2f} GB/s" if t["read_s"] > 0 else "- GB/s"
        lines.append(f"  experts   hit rate {100 * t['hit_rate']:.1f}% ({t['hits']} hits, "
                     f"{t['misses']} misses): {format_bytes(t['bytes_read'])} read in "
                     f"{t['read_s']:.4f} s, {speed}")
        if "exact_to" in stats:
            lines.append(f"  exact     bit-identical to {stats['exact_to']}" if stats["exact_to"].startswith("llama.cpp")
                         else f"  exact     {stats['exact_to']}")
        if "read_io" in stats:
            lines.append("  reads     io_uring, one thread" if stats["read_io"] == "uring"
                         else "  reads     reader threads (pread)")
        if "wire_sent" in t:
            lines.append(f"  rpc       {format_bytes(t['wire_sent'])} sent, {format_bytes(t['wire_received'])} "
                         f"received, {t['round_trips']} round trips; {format_bytes(t['copy_bytes'])} of experts "
                         f"sent, {t['remote_by_hash']} expert tensors written by the hosts from their caches")
        budget = stats.get("budget")
        if budget and (budget["elastic"] or budget["n_changes"]):
            lines.append(f"  budget    {format_bytes(budget['budget_bytes'])} of {format_bytes(budget['capacity_bytes'])}"
                         f" (lowest {format_bytes(budget['lowest_bytes'])}, {budget['n_changes']} moves, "
                         f"{format_bytes(budget['given_back_bytes'])} given back"
                         + (f"; elastic: {budget['n_shrinks']} down, {budget['n_grows']} up, "
                            f"{format_bytes(budget['reserve_bytes'])} kept free)" if budget["elastic"] else ")"))
        if t.get("substituted"):
            lines.append(f"  subst     {t['substituted']} routed experts stood in for (outputs approximate)")
        if t.get("preloaded"):
            lines.append(f"  preload   {t['preloaded']} experts read into the pools at load")
        if t.get("guess_routed"):
            ahead = (f"; read ahead {t['prefetched']} experts, {t['prefetch_used']} used, "
                     f"{t['prefetch_dropped']} dropped unread, {format_bytes(t['prefetch_wasted'])} wasted"
                     if t.get("prefetched") else "")
            lines.append(f"  guess     recall {100 * t['guess_recall']:.1f}% of the routed experts{ahead}")
    lines.append(f"  peak RSS  {format_bytes(rss)}")
    return lines


# ---------------------------------------------------------------------------------------------
# generation


def _sampling(args):
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty)


def _max_tokens(args):
    """-n as llama-cpp-python's max_tokens: None (until the end of the text) for -1 or less; -n 0
    generates nothing (complete and chat check it first: max_tokens 0 would mean no limit)."""
    return args.n_predict if args.n_predict > 0 else None


def resolve_seed(seed):
    """-s: a seed of 0 or more as given; -1 (or less) a random one, so that runs differ as
    llama.cpp's do (llama-cpp-python's default seed samples the same text every run)."""
    return seed if seed >= 0 else random.SystemRandom().randrange(2**31)


def complete(llm, args, prompt, guard, out):
    if not args.no_display_prompt:
        out.write(prompt)
        out.flush()
    stopped = False
    if args.n_predict == 0:  # the prompt only: its timing is in the report
        from .. import llama_cpp

        llm.reset()
        llm.eval(llm.tokenize(prompt.encode("utf-8"), special=True))
        llama_cpp.llama_synchronize(llm._ctx.ctx)  # (llama.cpp counts the prompt's time here)
        out.write("\n")
        out.flush()
        return stopped
    try:
        for chunk in llm.create_completion(prompt, max_tokens=_max_tokens(args), stream=True,
                                           **_sampling(args)):
            out.write(chunk["choices"][0]["text"])
            out.flush()
            if guard.tripped.is_set():
                stopped = True
                break
    except KeyboardInterrupt:
        pass
    out.write("\n")
    out.flush()
    return stopped


def chat(llm, args, guard, out, stdin, interactive):
    """One user turn per line; ends on EOF or /exit. Returns True if the memory guard stopped it."""
    messages = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    if interactive:
        note("chat: type a message; /exit or Ctrl-D ends, /reset clears the history, Ctrl-C stops a reply")
    while not guard.tripped.is_set():
        try:
            if interactive:
                line = input("> ")
            else:
                line = stdin.readline()
                if not line:
                    break
        except (EOFError, KeyboardInterrupt):
            if interactive:
                out.write("\n")
            break
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            messages = messages[:1] if args.system_prompt else []
            note("chat: history cleared")
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        if args.n_predict == 0:  # -n 0: no reply
            messages.append({"role": "assistant", "content": ""})
            continue
        try:
            for chunk in llm.create_chat_completion(messages, max_tokens=_max_tokens(args), stream=True,
                                                    **_sampling(args)):
                piece = chunk["choices"][0]["delta"].get("content") or ""
                reply.append(piece)
                out.write(piece)
                out.flush()
                if guard.tripped.is_set():
                    break
        except KeyboardInterrupt:
            pass
        except ValueError as e:  # the conversation no longer fits the context
            messages.pop()
            out.write("\n")
            note(f"{e}; /reset clears the history, -c sets a larger context")
            continue
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return guard.tripped.is_set()


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.seed < 0:
        args.seed = resolve_seed(args.seed)
        note(f"seed {args.seed} (random: -s {args.seed} repeats this run)")
    from .. import Llama
    from ..planning.guard import Watchdog
    from ..planning.host_memory import peak_rss
    from ..planning.estimate import cli_n_ctx, model_shape
    from ..planning.guard import MemoryRefused
    from ..planning.index import ModelError, load_index
    from ..planning.plan import parse_moe_slots
    from ..planning.sizing import SlotsError

    model = args.model_opt or args.model or os.environ.get("LLAMA_ARG_MODEL")
    builtin = not model
    if builtin:
        model = str(default_model_path())
    name = Path(model).name
    moe_slots = parse_moe_slots(args.moe_slots if args.moe_slots is not None
                                else (DEFAULT_MODEL_SLOTS if builtin else "auto"))
    if args.prompt is not None and args.conversation:
        parser.error("-p and -cnv: give a prompt or chat, not both")
    # the built-in model is a tiny demo: without -p it completes the default prompt
    chatting = args.conversation if args.conversation is not None else (
        args.prompt is None and not builtin and sys.stdin is not None and sys.stdin.isatty())

    try:
        t0 = time.perf_counter()
        index = load_index(model)
        note(f"indexed {name} in {time.perf_counter() - t0:.2f} s: {index.architecture}, "
             f"{len(index.layers)} MoE layers, {format_bytes(index.expert_bytes_total)} of experts, "
             f"{format_bytes(index.other_bytes_total)} of other weights")
        kwargs = llama_kwargs(args, cli_n_ctx(model_shape(index), args.ctx_size))
        load = plan_from_args(index, args, moe_slots, kwargs)
    except (ModelError, SlotsError, ValueError) as e:
        print(f"empanel-gguf run: {e}", file=sys.stderr)
        return 1
    except MemoryRefused as e:
        print(f"empanel-gguf run: refused: {e}", file=sys.stderr)
        return EXIT_MEMORY

    kwargs.update(use_mmap=not args.no_mmap, use_mlock=args.mlock,
                  seed=args.seed)
    try:
        with load_progress(name):
            llm = Llama(model, moe_load=load, **kwargs)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"empanel-gguf run: could not load {model}: {e}", file=sys.stderr)
        return 1

    llm.prompt_progress = PromptProgress()  # prompts that take over a second show progress
    # the generation loops stop when it trips (not while elastic pools can still give memory back)
    guard = Watchdog(load.floor, budget_fn=lambda: (llm.moe_stats() or {}).get("budget"))
    stopped = False
    timings = Timings(llm)
    try:
        with guard:
            if chatting:
                stopped = chat(llm, args, guard, sys.stdout, sys.stdin,
                               interactive=sys.stdin is not None and sys.stdin.isatty())
            else:
                prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
                stopped = complete(llm, args, prompt, guard, sys.stdout)
    except Exception as e:  # MoeReadError, a full context, ...
        print(f"empanel-gguf run: {type(e).__name__}: {e}", file=sys.stderr)
        stopped = None
    perf = timings.read()
    stats = llm.moe_stats()
    llm.verbose = False  # our report replaces Llama.close()'s summary line
    llm.close()
    if stopped:
        print(guard.message(), file=sys.stderr)
    for line in format_report(name, index, load.plan, stats, perf, peak_rss()):
        print(line, file=sys.stderr)
    if stopped is None:
        return 1
    return EXIT_MEMORY if stopped else 0
