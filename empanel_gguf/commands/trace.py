"""`empanel-gguf trace MODEL.gguf -o trace.npz [-p TEXT | -f FILE | --chat CHAT.json]`: record every
token's routed experts in every MoE layer.

Runs the model on a prompt (-p), a long document (-f) or a conversation (--chat: a JSON list of
{"role", "content"} messages; each user turn is a prompt in the model's chat format, the
assistant's reply is generated, or fed as prompt tokens where the file gives its content) and
records every token's routed experts in every MoE layer into a trace file (see
empanel_gguf/lab/trace.py for its format). -n tokens are generated after a prompt or document, and
for each reply of a chat. Without -p/-f/--chat: the prompt 'Once upon a time'.

Slots are optional (routing is the same with or without them); with --moe-slots the engine's live
hit rate is stored with the trace, for `empanel-gguf replay` to check itself against. --overhead
times the same evaluations again with and without tracing (fresh loads, each evaluation's best of
3) and prints what tracing costs. Exit status: 0 done, 1 error, 2 usage, 3 refused by the memory guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..planning.options import CommandParser
from ..progress import PromptProgress
from .options import (DEFAULT_PROMPT, EXIT_MEMORY, add_load_args, add_memory_args, add_moe_args,
                      add_sampling_args, env_arg, llama_kwargs, note, plan_from_args)


def setup_arg_parser():
    parser = CommandParser(
        prog="empanel-gguf trace", description=" ".join(__doc__.split("\n\n")[0].split(": ", 1)[1].split()),
        epilog="\n\n".join(__doc__.split("\n\n")[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="GGUF model (first shard of a split)")
    parser.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("-p", "--prompt", help="prompt text")
    source.add_argument("-f", "--file", help="a document: its text is the prompt")
    source.add_argument("--chat", metavar="CHAT.json",
                        help="a conversation: JSON list of {role, content}; user turns are prompts, "
                             "assistant replies generated (or fed, where given)")
    env_arg(parser, "-n", "--n-predict", env="LLAMA_ARG_N_PREDICT", type=int, default=64,
            help="tokens to generate after the prompt or document, and per chat reply (0: none, "
                 "-1: until the end of the text or a full context)")
    add_load_args(parser)
    add_moe_args(parser)
    add_sampling_args(parser, temp=0.0)
    env_arg(parser, "-s", "--seed", env="LLAMA_ARG_SEED", type=int, default=-1,
            help="sampling seed, -1 = random")
    parser.add_argument("--overhead", action="store_true",
                        help="time the same evaluations with and without tracing and print the cost")
    add_memory_args(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's own log")
    return parser


def _load_chat(path):
    with open(path, encoding="utf-8") as f:
        messages = json.load(f)
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"{path}: a chat is a JSON list of {{\"role\": ..., \"content\": ...}}")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{path}: no user message")
    return messages


def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    from .. import Llama, llama_cpp
    from ..planning.estimate import cli_n_ctx, model_shape
    from ..planning.guard import MemoryRefused
    from ..planning.index import ModelError, load_index
    from ..planning.plan import parse_moe_slots
    from ..planning.sizing import SlotsError
    from ..lab.bench.trace_overhead import measure_overhead
    from ..lab.recorder import Recorder, record_chat
    from ..lab.trace import TraceError

    name = Path(args.model).name
    try:
        messages = _load_chat(args.chat) if args.chat else None
        text = Path(args.file).read_text(encoding="utf-8", errors="replace") if args.file else None
        index = load_index(args.model)
        if not index.is_moe:
            raise ValueError(f"{name}: no routed experts ({index.architecture}): nothing to trace")
        kwargs = llama_kwargs(args, cli_n_ctx(model_shape(index), args.ctx_size))
        load = plan_from_args(index, args, parse_moe_slots(args.moe_slots or "auto"), kwargs, trace=True)
    except (OSError, ModelError, SlotsError, ValueError) as e:
        print(f"empanel-gguf trace: {e}", file=sys.stderr)
        return 1
    except MemoryRefused as e:
        print(f"empanel-gguf trace: refused: {e}", file=sys.stderr)
        return EXIT_MEMORY

    moe_slots, plan = load.moe_slots, load.plan
    kwargs["seed"] = llama_cpp.LLAMA_DEFAULT_SEED if args.seed < 0 else args.seed
    try:
        llm = Llama(args.model, moe_load=load, **kwargs)
        llm.prompt_progress = PromptProgress()
    except (ValueError, RuntimeError, OSError) as e:
        print(f"empanel-gguf trace: could not load {args.model}: {e}", file=sys.stderr)
        return 1
    sampling = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    rec = Recorder(llm, moe_slots=moe_slots, moe_policy=llm.moe_policy if moe_slots is not None else None)
    t0 = time.perf_counter()
    stopped = None
    try:
        if messages is not None:
            record_chat(rec, messages, args.n_predict, **sampling)
        else:
            tokens = llm.tokenize((text if text is not None else args.prompt or DEFAULT_PROMPT).encode("utf-8"))
            room = rec.n_ctx - max(args.n_predict, 0)
            if len(tokens) > room:
                note(f"the text is {len(tokens)} tokens: its first {room} are traced (-c sets a larger context)")
                tokens = tokens[:max(room, 1)]
            rec.prompt(tokens)
            if args.n_predict != 0:
                rec.generate(args.n_predict, **sampling)
    except (ValueError, RuntimeError) as e:  # a full context, MoeReadError: keep what was recorded
        stopped = f"{type(e).__name__}: {e}"
        note(f"stopped: {stopped}; writing what was recorded")
    wall = time.perf_counter() - t0
    try:
        trace = rec.save(args.output)
    except (OSError, TraceError) as e:
        print(f"empanel-gguf trace: {e}", file=sys.stderr)
        llm.close()
        return 1
    stats = llm.moe_stats()
    schedule = rec.schedule()
    llm.verbose = False
    llm.close()

    for line in format_summary(trace, args.output, wall, stats if plan is not None else None):
        print(line)
    if args.overhead and trace.n_tokens:
        del kwargs["seed"]
        result = measure_overhead(args.model, schedule, **kwargs)
        print(f"overhead  tracing {100 * result['overhead']:+.1f}% (prompt "
              f"{100 * result['prompt_overhead']:+.1f}%, decode {100 * result['decode_overhead']:+.1f}%): "
              f"{result['traced_s']:.3f} s traced vs {result['plain_s']:.3f} s without (the same "
              f"evaluations on fresh loads, each one's best of {result['repeats']})")
    return 1 if stopped and trace.n_tokens == 0 else 0


def format_summary(trace, path, wall, stats):
    from ..planning.format import format_bytes

    meta = trace.meta
    rec = meta["recorded_with"]
    lines = [f"trace     {meta['model']} ({meta['architecture']}): {len(trace.moe_layers)} MoE layers x "
             f"{trace.n_expert} experts, top-{trace.n_expert_used}",
             f"recorded  {trace.n_prompt} prompt + {trace.n_decode} decode tokens in {len(trace.ubatch)} "
             f"micro-batches (n_ubatch {rec['n_ubatch']}), {len(meta['segments'])} segments, {wall:.2f} s",
             f"cost      {meta['trace_s']:.4f} s taking the trace, "
             f"{100 * meta['trace_s'] / meta['eval_s'] if meta['eval_s'] else 0:.2f}% of "
             f"{meta['eval_s']:.3f} s evaluating"]
    if stats is not None:
        t = stats["total"]
        lines.append(f"slots     {rec['slots']} per layer ({rec['moe_policy']}): live hit rate "
                     f"{100 * t['hit_rate']:.1f}% ({t['hits']} hits, {t['misses']} misses)")
    else:
        lines.append("slots     none: every expert resident")
    lines.append("scores    router scores not recorded (the remap hook sees expert ids only)")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    lines.append(f"written   {path} ({format_bytes(size)})")
    return lines
