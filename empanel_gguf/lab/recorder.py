"""Recording routing traces (the format: trace.py): a Recorder drives a Llama loaded with
moe_trace=True through prompts, documents and chats, takes the sidecar's records after each
evaluation and lays them out per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .trace import FORMAT, FORMAT_VERSION, Trace, TraceError, parse_records, save_trace

TAKE_EVERY = 256  # evaluations between takes of the sidecar's records during a generation


# ------------------------------------------------------------------------------------------------
# recording


@dataclass
class _Eval:
    tokens: list
    prompt: bool
    segment: int
    batches: list = None  # its micro-batches, from parse_records, once taken from the sidecar


class Recorder:
    """Drives a Llama loaded with moe_trace=True and records its routing per token.

    prompt(tokens) evaluates tokens as prompt; generate(n, ...) samples and evaluates up to n
    tokens one at a time (decode); chat turns, documents and anything else are built from these.
    trace() assembles the Trace, save(path) writes it. Start from a freshly loaded Llama to compare
    a replay with the engine's live hit rate (meta["engine_stats_from_load"]).
    """

    def __init__(self, llm, *, moe_slots=None, moe_policy=None):
        experts = getattr(llm, "_experts", None)
        if experts is None:
            raise ValueError("Recorder: load the model with Llama(..., moe_trace=True) (a MoE model)")
        self.llm = llm
        self.index = experts.index
        self.plan = experts.plan
        self.moe_layers = list(self.index.moe_layers)
        self.moe_slots = moe_slots if moe_slots is not None else getattr(llm, "moe_slots", None)
        self.moe_policy = moe_policy or getattr(llm, "moe_policy", None)
        llm.moe_take_trace()  # routing from before the recording is not ours
        stats = llm.moe_stats()
        # untouched, empty pools: what a replay from an empty cache starts from (no preload either)
        self.from_load = stats is None or not stats["layers"] or (
            stats["total"]["n_remaps"] == 0 and stats["total"]["preloaded"] == 0)
        self.evals = []
        self.pending = 0  # evals at the end of self.evals whose records are still in the sidecar
        self.segments = []
        self.eval_s = 0.0
        self.trace_s = 0.0

    # -- evaluating

    @property
    def n_ctx(self):
        """Tokens the context holds (llama.cpp may round n_ctx up; llama-cpp-python keeps the
        n_ctx asked for)."""
        return min(self.llm.n_ctx(), len(self.llm.input_ids))

    def _eval(self, tokens, prompt):
        llm = self.llm
        if llm.n_tokens + len(tokens) > self.n_ctx:
            raise ValueError(f"the context holds {self.n_ctx} tokens: {llm.n_tokens} used, "
                             f"{len(tokens)} more do not fit (a larger n_ctx, or less text)")
        t0 = time.perf_counter()
        try:
            llm.eval(tokens)
        except BaseException:
            # a failed evaluation returns nothing and its KV cache is rolled back: keep the
            # records of the evaluations before it, drop what it left
            self._take(drop_rest=True)
            raise
        self.eval_s += time.perf_counter() - t0
        self.evals.append(_Eval(list(tokens), prompt, len(self.segments) - 1))
        self.pending += 1
        if self.pending >= TAKE_EVERY:
            self._take()

    def _take(self, drop_rest=False):
        """Take the sidecar's records and hand each pending evaluation its micro-batches (one
        llama_decode per evaluation: its micro-batches hold exactly its tokens, in order).
        drop_rest: records left over (of an evaluation that failed) are dropped."""
        if not self.pending and not drop_rest:
            return
        t0 = time.perf_counter()
        batches = parse_records(self.llm.moe_take_trace(), self.moe_layers)
        pending, self.pending = self.evals[len(self.evals) - self.pending:], 0
        i = 0
        for ev in pending:
            ev.batches, n = [], 0
            while n < len(ev.tokens) and i < len(batches):
                ev.batches.append(batches[i])
                n += batches[i][0]
                i += 1
            if n != len(ev.tokens):
                raise TraceError(f"{len(ev.tokens)} tokens evaluated, but the routing records hold "
                                 f"micro-batches of {[b[0] for b in ev.batches]} tokens")
        if i != len(batches) and not drop_rest:
            raise TraceError(f"{len(batches) - i} micro-batches of routing records left over")
        self.trace_s += time.perf_counter() - t0

    def _segment(self, kind, role=None, **extra):
        self.segments.append(dict(kind=kind, role=role, n_tokens=0, **extra))
        return self.segments[-1]

    def prompt(self, tokens, role=None):
        """Evaluate `tokens` after the context, marked prompt."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        seg = self._segment("prompt", role)
        self._eval(tokens, prompt=True)
        self._take()
        seg["n_tokens"] = len(tokens)

    def prompt_to(self, tokens, role=None):
        """Make the context hold `tokens`: evaluate (marked prompt) what follows the longest
        prefix it already holds; a context that went another way is cut back first (as
        llama-cpp-python does with a chat history). Returns the tokens evaluated."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return []
        llm = self.llm
        held = llm.input_ids[:llm.n_tokens].tolist()
        same = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)  # evaluate at least one token: its logits come next
        rewound = llm.n_tokens - same
        llm.n_tokens = same  # llm.eval drops the KV cache from here on
        new = tokens[same:]
        if new:
            seg = self._segment("prompt", role, rewound=rewound)
            self._eval(new, prompt=True)
            self._take()
            seg["n_tokens"] = len(new)
        return new

    def generate(self, n, *, temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                 seed=None, stop_at_eog=True, stop=None, role=None):
        """Sample and evaluate up to n tokens one at a time, marked decode (greedy at temperature
        0). Stops early at an end-of-generation token (not evaluated) or when the text so far
        contains one of the `stop` strings, or when the context is full (n < 0: until then).
        Returns the tokens."""
        llm = self.llm
        if llm.n_tokens == 0:
            raise ValueError("generate: evaluate a prompt first")
        if n < 0:
            n = self.n_ctx - llm.n_tokens
        from .. import llama_cpp

        if seed is not None:
            llm.set_seed(seed)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, seed=seed)
        seg = self._segment("decode", role, sampling=sampling)
        sampler = llm._init_sampler(top_k=top_k, top_p=top_p, min_p=min_p, temp=temperature,
                                    repeat_penalty=repeat_penalty)
        vocab = llm._model.vocab
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        out = []
        try:
            for _ in range(n):
                if llm.n_tokens >= self.n_ctx:
                    seg["stopped"] = "context full"
                    break
                token = sampler.sample(llm._ctx, -1)
                if stop_at_eog and llama_cpp.llama_vocab_is_eog(vocab, token):
                    seg["stopped"] = "end of generation"
                    break
                self._eval([token], prompt=False)
                out.append(token)
                seg["n_tokens"] = len(out)
                if stops:
                    text = llm.detokenize(out).decode("utf-8", errors="ignore")
                    if any(s and s in text for s in stops):
                        seg["stopped"] = "stop string"
                        break
        finally:
            sampler.close()
            self._take()
        return out

    # -- the result

    def trace(self) -> Trace:
        """Lay the records out per token (see the module docstring)."""
        self._take()
        index, k = self.index, self.index.n_expert_used
        n = sum(len(e.tokens) for e in self.evals)
        dtype = np.int16 if index.n_expert <= np.iinfo(np.int16).max else np.int32
        experts = np.full((n, len(self.moe_layers), k), -1, dtype=dtype)
        guesses = np.full_like(experts, -1)
        any_guess = False
        prompt = np.zeros(n, dtype=bool)
        tokens = np.zeros(n, dtype=np.int32)
        segment = np.zeros(n, dtype=np.int32)
        ubatch, calls = [], []
        t = 0
        for ev in self.evals:
            for size, layers, guessed in ev.batches:
                row = [-1] * len(self.moe_layers)
                for j, ids in guessed.items():
                    guesses[t + size - ids.shape[0]:t + size, j] = ids
                    any_guess = True
                for j, ids in layers.items():
                    m = ids.shape[0]
                    if ids.shape[1] != k:
                        raise TraceError(f"layer {self.moe_layers[j]}: {ids.shape[1]} experts per "
                                         f"token recorded, the model uses {k}")
                    experts[t + size - m:t + size, j] = ids
                    row[j] = m
                ubatch.append(size)
                calls.append(row)
                t += size
        t = 0
        for ev in self.evals:
            prompt[t:t + len(ev.tokens)] = ev.prompt
            tokens[t:t + len(ev.tokens)] = ev.tokens
            segment[t:t + len(ev.tokens)] = ev.segment
            t += len(ev.tokens)
        return Trace(experts=experts, prompt=prompt, tokens=tokens, segment=segment,
                     ubatch=np.array(ubatch, dtype=np.int32),
                     calls=np.array(calls, dtype=np.int32).reshape(len(ubatch), len(self.moe_layers)),
                     meta=self.meta(), guesses=guesses if any_guess else None)

    def meta(self) -> dict:
        from .. import __version__

        llm, index, plan = self.llm, self.index, self.plan
        paged = index.layers[plan.resident_layers:] if plan else index.layers
        per_slot = sum(layer.expert_bytes for layer in paged)
        recorded = dict(moe_slots=self.moe_slots, moe_policy=self.moe_policy if plan else None,
                        slots=plan.pool_bytes // per_slot if plan else None,
                        capacity=plan.min_slots if plan else None,
                        budget_bytes=plan.budget_bytes if plan else 0,
                        n_ubatch=int(llm.context_params.n_ubatch), n_batch=int(llm.n_batch),
                        n_ctx=self.n_ctx, moe_prefetch=getattr(llm, "moe_prefetch", 0) if plan else 0)
        if plan is not None and recorded["moe_policy"] is None:
            recorded["moe_policy"] = "g-lru" if plan.budget_bytes else None  # lru or lfu-decay: unknown
        stats = llm.moe_stats()
        engine = None
        if stats is not None and stats["layers"]:
            engine = dict(stats["total"])
            engine["layers"] = {str(il): {"hits": row["hits"], "misses": row["misses"],
                                          "n_remaps": row["n_remaps"]}
                                for il, row in stats["layers"].items()}
        return dict(
            format=FORMAT, version=FORMAT_VERSION, model=Path(index.path).name,
            architecture=index.architecture, n_layer=index.n_layer, n_expert=index.n_expert,
            n_expert_used=index.n_expert_used, moe_layers=self.moe_layers,
            expert_bytes=[index.layer(il).expert_bytes for il in self.moe_layers],
            recorded_with=recorded, engine_stats=engine, engine_stats_from_load=self.from_load,
            segments=self.segments, router_scores=False, eval_s=self.eval_s, trace_s=self.trace_s,
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), empanel_gguf_version=__version__)

    def save(self, path) -> Trace:
        trace = self.trace()
        save_trace(trace, path)
        return trace

    def schedule(self):
        """The evaluations made, as (tokens, is_prompt): replayed by measure_overhead."""
        return [(ev.tokens, ev.prompt) for ev in self.evals]


# ------------------------------------------------------------------------------------------------
# chats and documents


class _Captured(Exception):
    def __init__(self, prompt, stop):
        super().__init__("prompt captured")
        self.prompt, self.stop = prompt, stop


class _PromptCapture:
    """Stands in for the Llama that a llama-cpp-python chat handler drives: the handler formats
    the messages with the model's chat format and tokenizes them; we keep that prompt and stop
    before any completion runs."""

    def __init__(self, llm):
        self._llm = llm
        self.verbose = False

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def create_completion(self, prompt, stop=None, **_):
        raise _Captured(prompt, stop)


def chat_prompt(llm, messages):
    """The tokens of `messages` in the model's chat format, ready for the assistant's reply,
    exactly as Llama.create_chat_completion would build them, and the format's stop strings."""
    from llama_cpp import llama_chat_format

    handler = (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)
               or llama_chat_format.get_chat_completion_handler(llm.chat_format))
    try:
        handler(llama=_PromptCapture(llm), messages=messages)
    except _Captured as c:
        prompt = c.prompt
        if isinstance(prompt, str):
            prompt = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        stop = [c.stop] if isinstance(c.stop, str) else [s for s in (c.stop or []) if s]
        return [int(t) for t in prompt], stop
    raise TraceError(f"chat format {llm.chat_format!r} did not produce a prompt to complete")


def record_chat(rec, messages, max_tokens, **sampling):
    """Record a conversation: every user turn is a prompt (the history in the chat format, only
    what the context does not hold yet is evaluated); the assistant's reply is generated, or, when
    the next message is an assistant message with content, that content is fed as prompt tokens.
    System messages (and other roles) join the history of the next user turn. Returns the history
    with the generated replies filled in."""
    llm = rec.llm
    history = []
    i = 0
    while i < len(messages):
        message = dict(messages[i])
        i += 1
        history.append(message)
        if message.get("role") != "user":
            continue
        tokens, stop = chat_prompt(llm, history)
        rec.prompt_to(tokens, role="user")
        following = messages[i] if i < len(messages) else None
        if following is not None and following.get("role") == "assistant":
            i += 1
            if following.get("content"):
                rec.prompt(llm.tokenize(following["content"].encode("utf-8"), add_bos=False),
                           role="assistant")
                history.append(dict(following))
                continue
        reply = rec.generate(max_tokens, stop=stop, role="assistant", **sampling)
        text = llm.detokenize(reply).decode("utf-8", errors="replace")
        for s in stop:
            if s in text:
                text = text[:text.index(s)]
        history.append({"role": "assistant", "content": text})
    return history
