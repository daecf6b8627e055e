"""`empanel-gguf run [MODEL.gguf] [-p PROMPT] ...`: complete a prompt, or chat, with a model.

With -p the completion of the prompt streams to stdout. Without -p and with a terminal on stdin it
is an interactive chat in the model's chat template (-cnv forces chat on a pipe: one user turn per
line); it ends on EOF (Ctrl-D) or /exit, and /reset clears its history. Without a model path
it runs the built-in default model (a small MoE trained on Shakespeare, shipped in the package;
a random-weight fixture written into the cache where it is missing) with slot pools of half its
experts; without -p (or -cnv) it completes a fixed prompt.

Progress goes to stderr while indexing and loading; at exit a short report: prompt and decode
tok/s, expert hit rate, bytes read and their GB/s, peak RSS, slots per layer.

Every option also reads an environment variable, as llama.cpp's tools do (LLAMA_ARG_*); an option
on the command line wins. Exit status: 0 done, 1 error, 2 usage, 3 refused or stopped by the
memory guard.
"""

import argparse
import contextlib
import os
import resource
import sys
import time
from pathlib import Path

from ..progress import PromptProgress
from ..sizing import DEFAULT_POLICY, POLICIES

# the built-in model: a small qwen3moe trained on Shakespeare (scripts/train_moe.py), shipped in
# the package (models/PROVENANCE.md); where it is missing (a checkout without it), a tiny
# random-weight fixture written into the cache instead (see fixtures.py)
BUILTIN_MODEL = Path(__file__).resolve().parent.parent / "models" / "shakespeare-moe.gguf"
DEFAULT_FIXTURE = "qwen3moe-q8_0"
DEFAULT_MODEL_SLOTS = "50%"  # the built-in model streams its experts, to show what empanel does
DEFAULT_PROMPT = "Once upon a time"
EXIT_MEMORY = 3


def default_model_path():
    if BUILTIN_MODEL.is_file():
        return BUILTIN_MODEL
    from .. import fixtures

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return fixtures.write_fixture(DEFAULT_FIXTURE, Path(base) / "empanel-gguf" / "models")


# ---------------------------------------------------------------------------------------------
# options: llama.cpp's names, each with an LLAMA_ARG_* environment variable


def _bool(text):
    value = str(text).strip().lower()
    if value in ("1", "on", "true", "yes", "y", "enabled"):
        return True
    if value in ("0", "off", "false", "no", "n", "disabled", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use on/off)")


def _auto_bool(text):
    """'auto' -> None, else on/off as _bool."""
    return None if str(text).strip().lower() == "auto" else _bool(text)


def _gpu_layers(text):
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
                default = _bool(raw)
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
            show_default="max(1 GiB, 5% of memory)",
            help="memory to keep free: refuse a load whose estimate leaves less, stop a run when "
                 "less is left; 0 turns the guard off")
    env_arg(parser, "--force", env="LLAMA_ARG_FORCE", action="store_true", default=False,
            help="load even when the memory guard estimates that it does not fit")


def setup_arg_parser():
    parser = argparse.ArgumentParser(
        prog="empanel-gguf run", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="GGUF model (first shard of a split); "
                        "default: the built-in one (env: LLAMA_ARG_MODEL)")
    parser.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="the same, as an option")
    parser.add_argument("-p", "--prompt", help="prompt to complete; without it: chat on a terminal, "
                        f"else the prompt {DEFAULT_PROMPT!r}")
    parser.add_argument("-sys", "--system-prompt", help="system message of a chat")
    parser.add_argument("-cnv", "--conversation", dest="conversation", action="store_const", const=True,
                        default=None, help="chat even when stdin is not a terminal (one turn per line)")
    parser.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_const",
                        const=False, help="never chat: complete -p or the default prompt")
    parser.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    env_arg(parser, "-n", "--n-predict", env="LLAMA_ARG_N_PREDICT", type=int, default=64,
            help="tokens to generate per completion or reply, -1 = until the end of the text")
    env_arg(parser, "-c", "--ctx-size", env="LLAMA_ARG_CTX_SIZE", type=int, default=None,
            show_default=f"{4096}, at most the model's; 0 = the model's",
            help="context size in tokens")
    env_arg(parser, "-t", "--threads", env="LLAMA_ARG_THREADS", type=int, default=None,
            show_default=f"{max(os.cpu_count() // 2, 1)}, half the CPUs", help="threads for generation")
    env_arg(parser, "-tb", "--threads-batch", env="LLAMA_ARG_THREADS_BATCH", type=int, default=None,
            show_default=f"{os.cpu_count()}, all CPUs", help="threads for the prompt")
    env_arg(parser, "-ngl", "--n-gpu-layers", "--gpu-layers", env="LLAMA_ARG_N_GPU_LAYERS",
            type=_gpu_layers, default=0, metavar="N|all", help="layers to offload to the GPU")
    env_arg(parser, "-b", "--batch-size", env="LLAMA_ARG_BATCH", type=int, default=512,
            help="logical batch size")
    env_arg(parser, "-ub", "--ubatch-size", env="LLAMA_ARG_UBATCH", type=int, default=512,
            help="physical batch size (capped so that a micro-batch's experts fit a pool)")
    env_arg(parser, "-ms", "--moe-slots", env="LLAMA_ARG_MOE_SLOTS", metavar="N|P%|SIZE|auto|none",
            show_default=f"auto; {DEFAULT_MODEL_SLOTS} for the built-in model",
            help="expert slots per MoE layer: a count, a share of the experts, a budget for all "
                 "pools (6GiB), auto (slot pools only if the experts do not fit in memory), or "
                 "none (every expert resident)")
    env_arg(parser, "--moe-policy", env="LLAMA_ARG_MOE_POLICY", default=DEFAULT_POLICY,
            choices=tuple(POLICIES),
            help="which expert a full pool evicts: lfu-decay (least used, decaying counts) and lru "
                 "per layer, g-lru with one budget for all layers")
    env_arg(parser, "--moe-io-threads", env="LLAMA_ARG_MOE_IO_THREADS", type=int, default=8,
            help="expert reader threads")
    env_arg(parser, "--moe-chunk-kb", env="LLAMA_ARG_MOE_CHUNK_KB", type=int, default=256,
            help="KiB per expert read request")
    env_arg(parser, "--moe-direct-io", env="LLAMA_ARG_MOE_DIRECT_IO", type=_bool, default=True,
            metavar="on|off", help="read experts with O_DIRECT")
    env_arg(parser, "--moe-preload", env="LLAMA_ARG_MOE_PRELOAD", type=_auto_bool, default=None,
            metavar="auto|on|off", show_default="auto",
            help="read experts into the empty slots at load; auto: only when the pools hold every "
                 "expert")
    env_arg(parser, "-fa", "--flash-attn", env="LLAMA_ARG_FLASH_ATTN", type=_bool, default=False,
            metavar="on|off", help="flash attention")
    env_arg(parser, "--no-mmap", env="LLAMA_ARG_NO_MMAP", action="store_true", default=False,
            help="read the model into memory instead of mapping it")
    env_arg(parser, "--mlock", env="LLAMA_ARG_MLOCK", action="store_true", default=False,
            help="lock the model in memory")
    add_sampling_args(parser, temp=0.8)
    env_arg(parser, "--repeat-penalty", env="LLAMA_ARG_REPEAT_PENALTY", type=float, default=1.0,
            help="penalty for repeated tokens, 1.0 = none")
    env_arg(parser, "-s", "--seed", env="LLAMA_ARG_SEED", type=int, default=-1,
            help="sampling seed, -1 = random")
    add_memory_args(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's own log")
    return parser


# ---------------------------------------------------------------------------------------------
# progress while loading


def note(text):
    print(f"empanel: {text}", file=sys.stderr, flush=True)


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


def peak_rss_bytes():
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


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
        return (data.n_p_eval, data.t_p_eval_ms / 1e3, data.n_eval, data.t_eval_ms / 1e3)


def _rate(n, seconds):
    return f"{n / seconds:.1f} tok/s" if seconds > 0 else "- tok/s"


def format_report(name, index, plan, stats, timings, rss):
    """The lines of the end-of-run report."""
    from ..memory import fmt_bytes

    lines = ["empanel: report"]
    if index is not None:
        moe = (f"{len(index.layers)} MoE layers of {index.n_expert} experts (top-{index.n_expert_used})"
               if index.is_moe else "no routed experts")
        lines.append(f"  model     {name}: {index.architecture}, {index.n_layer} layers, {moe}")
    if plan is not None:
        slots = sorted({n for n in plan.n_slots if n > 0})
        per_layer = (f"{slots[0]} of {plan.n_expert}" if len(slots) == 1
                     else ", ".join(str(n) for n in plan.n_slots))
        lines.append(f"  slots     {per_layer} per MoE layer: {fmt_bytes(plan.pool_bytes)} of pools "
                     f"for {fmt_bytes(index.expert_bytes_total)} of experts")
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
                     f"{t['misses']} misses): {fmt_bytes(t['bytes_read'])} read in "
                     f"{t['read_s']:.4f} s, {speed}")
    lines.append(f"  peak RSS  {fmt_bytes(rss)}")
    return lines


# ---------------------------------------------------------------------------------------------
# generation


def _sampling(args):
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty)


def _max_tokens(args):
    return args.n_predict if args.n_predict and args.n_predict > 0 else None


def complete(llm, args, prompt, guard, out):
    if not args.no_display_prompt:
        out.write(prompt)
        out.flush()
    stopped = False
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
    from .. import Llama, llama_cpp, memory
    from ..index import ModelError, load_index
    from ..sizing import SlotsError

    model = args.model_opt or args.model or os.environ.get("LLAMA_ARG_MODEL")
    builtin = not model
    if builtin:
        model = str(default_model_path())
    name = Path(model).name
    moe_slots = memory.parse_moe_slots(args.moe_slots if args.moe_slots is not None
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
             f"{len(index.layers)} MoE layers, {memory.fmt_bytes(index.expert_bytes_total)} of experts, "
             f"{memory.fmt_bytes(index.other_bytes_total)} of other weights")
        shape = memory.model_shape(index)
        n_ctx = memory.cli_n_ctx(shape, args.ctx_size)
        floor = memory.parse_floor(args.mem_floor)
        moe_slots, plan, est, available, floor, notices = memory.preflight(
            index, moe_slots, n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
            n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn, floor=floor,
            force=args.force, what=f"loading {name}")
    except (ModelError, SlotsError, ValueError) as e:
        print(f"empanel-gguf run: {e}", file=sys.stderr)
        return 1
    except memory.MemoryRefused as e:
        print(f"empanel-gguf run: refused: {e}", file=sys.stderr)
        return EXIT_MEMORY
    for text in notices + (plan.notices if plan is not None else []):
        note(text)
    if plan is not None:
        note(f"{plan.min_slots} of {plan.n_expert} expert slots per MoE layer, "
             f"{memory.fmt_bytes(plan.pool_bytes)} of pools instead of "
             f"{memory.fmt_bytes(index.expert_bytes_total)} of experts")
    note(f"memory: about {memory.fmt_bytes(est.host)} needed, {memory.fmt_bytes(available)} available, "
         f"{memory.fmt_bytes(floor)} kept free")

    kwargs = dict(n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                  n_threads=args.threads, n_threads_batch=args.threads_batch,
                  n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn,
                  use_mmap=not args.no_mmap, use_mlock=args.mlock,
                  seed=llama_cpp.LLAMA_DEFAULT_SEED if args.seed < 0 else args.seed,
                  verbose=args.verbose)
    try:
        with load_progress(name):
            if moe_slots is not None:
                kwargs.update(moe_policy=args.moe_policy, moe_io_threads=args.moe_io_threads,
                              moe_chunk_kb=args.moe_chunk_kb, moe_direct_io=args.moe_direct_io,
                              moe_preload=args.moe_preload)
            llm = Llama(model, moe_slots=moe_slots, **kwargs)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"empanel-gguf run: could not load {model}: {e}", file=sys.stderr)
        return 1

    llm.prompt_progress = PromptProgress()  # prompts that take over a second show progress
    guard = memory.Watchdog(floor)  # the generation loops stop when it trips
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
    for line in format_report(name, index, plan, stats, perf, peak_rss_bytes()):
        print(line, file=sys.stderr)
    if stopped is None:
        return 1
    return EXIT_MEMORY if stopped else 0
