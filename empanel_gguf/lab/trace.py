"""Routing traces: every token's routed experts in every MoE layer, recorded from a real run.

    from empanel_gguf import Llama
    from empanel_gguf.lab.recorder import Recorder
    from empanel_gguf.lab.trace import load_trace

    llm = Llama("model.gguf", moe_trace=True, moe_slots="25%")   # slots optional
    rec = Recorder(llm)
    rec.prompt(llm.tokenize(b"The capital of France is"))        # marked prompt
    rec.generate(32, temperature=0.0)                             # marked decode
    rec.save("trace.npz")
    trace = load_trace("trace.npz")

The sidecar records, for every remap call (one micro-batch of one MoE layer), the expert ids the
router picked (`Llama.moe_take_trace()`); the Recorder (recorder.py) drives the Llama, takes those records after
each prompt, at the end of each generation (and every TAKE_EVERY tokens of a long one), and lays
them out per token. Recording does not change outputs. Its cost: one copy of the ids per call
inside the sidecar (and, without slot pools, the remap op that observes them), plus the takes.

File format (numpy .npz, written with np.savez_compressed; FORMAT_VERSION 2, version 1 read too)
-----------------------------------------------------------------------------
Let N = tokens evaluated, L = MoE layers (ascending layer ids, `meta["moe_layers"]`),
k = experts per token (`meta["n_expert_used"]`), U = engine micro-batches.

    experts   int16 [N, L, k]   (int32 when n_expert > 32767): the routed expert ids of token t
                                in MoE layer j, in the router's top-k order. -1 where layer j did
                                not run token t: llama.cpp computes only the tokens whose logits are
                                wanted in the last layer (for a prompt, its last token), so prompt
                                tokens other than the output have -1 there.
    prompt    bool  [N]         True for a prompt token (fed: a prompt, a document, a chat turn,
                                given assistant text), False for a decoded token (sampled by the
                                model and evaluated one at a time).
    tokens    int32 [N]         the token ids, in evaluation order.
    segment   int32 [N]         which segment (meta["segments"][i]: one prompt or one generation)
                                the token belongs to.
    ubatch    int32 [U]         tokens per engine micro-batch, in execution order (sum = N); the
                                engine runs one remap call per MoE layer and micro-batch, so a
                                replay that groups tokens like this reproduces the engine's calls.
    calls     int32 [U, L]      tokens in the remap call of micro-batch u and MoE layer j: the
                                micro-batch size, fewer in the last layer (they are the micro-
                                batch's last tokens), -1 where the layer made no call.
    guesses   like experts      (version 2, optional) the gate-ahead guess the engine had for token t
                                in MoE layer j when it remapped it (Llama(moe_guess=True) with
                                slots): the experts it named, -1 where there was none.
    meta      str (0-d)         JSON: format ("empanel-gguf-trace"), version, model (file name),
                                architecture, n_layer, n_expert, n_expert_used, moe_layers,
                                expert_bytes (bytes of one expert, all its tensors, per MoE layer,
                                aligned with moe_layers), recorded_with (moe_slots as given, slots
                                = the per-layer share N, capacity = slots per layer pool, moe_policy,
                                budget_bytes for g-lru, n_ubatch, n_batch, n_ctx), engine_stats
                                (the engine's live totals at the end: hits, misses, bytes_read, ...;
                                null without slots), engine_stats_from_load (true when the pools
                                were untouched when recording began, so a replay from an empty cache
                                can be compared with engine_stats), segments (kind, role, n_tokens,
                                sampling, rewound tokens), router_scores (false), eval_s, trace_s
                                (seconds spent evaluating, and taking the trace), created,
                                empanel_gguf_version.

Router scores are not recorded yet: the remap hook receives the expert ids after the top-k, not
the router's probabilities (meta["router_scores"] is false).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "empanel-gguf-trace"
FORMAT_VERSION = 2
READS = (1, 2)  # versions load_trace reads (1: no guesses)

ARRAYS = ("experts", "prompt", "tokens", "segment", "ubatch", "calls")
OPTIONAL = ("guesses",)


class TraceError(ValueError):
    """A trace file or a routing record that cannot be used."""


@dataclass
class Trace:
    """A routing trace in memory (see the module docstring for every array)."""

    experts: np.ndarray
    prompt: np.ndarray
    tokens: np.ndarray
    segment: np.ndarray
    ubatch: np.ndarray
    calls: np.ndarray
    meta: dict = field(default_factory=dict)
    guesses: np.ndarray | None = None  # version 2: the gate-ahead guesses, as experts; None: none recorded

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_prompt(self) -> int:
        return int(self.prompt.sum())

    @property
    def n_decode(self) -> int:
        return self.n_tokens - self.n_prompt

    @property
    def moe_layers(self) -> list:
        return list(self.meta["moe_layers"])

    @property
    def expert_bytes(self) -> dict:
        """MoE layer id -> bytes of one expert of that layer."""
        return dict(zip(self.meta["moe_layers"], self.meta["expert_bytes"]))

    @property
    def n_expert(self) -> int:
        return int(self.meta["n_expert"])

    @property
    def n_expert_used(self) -> int:
        return int(self.meta["n_expert_used"])

    def save(self, path) -> Path:
        return save_trace(self, path)


def save_trace(trace: Trace, path) -> Path:
    path = Path(path)
    meta = dict(trace.meta, format=FORMAT, version=FORMAT_VERSION)
    with open(path, "wb") as f:  # np.savez_* would append .npz to a name without it
        np.savez_compressed(f, meta=np.array(json.dumps(meta)),
                            **{name: getattr(trace, name) for name in ARRAYS},
                            **{name: getattr(trace, name) for name in OPTIONAL if getattr(trace, name) is not None})
    return path


def load_trace(path) -> Trace:
    """Read a trace file; TraceError if it is not one, or of a version this code does not read."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a routing trace (.npz): {e}") from None
    missing = [name for name in ("meta",) + ARRAYS if name not in arrays]
    if missing:
        raise TraceError(f"{path}: not a routing trace: no {', '.join(missing)}")
    meta = json.loads(str(arrays.pop("meta")))
    if meta.get("format") != FORMAT:
        raise TraceError(f"{path}: format {meta.get('format')!r}, not {FORMAT!r}")
    if meta.get("version") not in READS:
        raise TraceError(f"{path}: trace version {meta.get('version')}; this empanel-gguf reads "
                         f"versions {', '.join(map(str, READS))}")
    trace = Trace(meta=meta, **arrays)
    n, n_layers = trace.n_tokens, len(meta["moe_layers"])
    if (trace.experts.ndim != 3 or trace.experts.shape[1:] != (n_layers, meta["n_expert_used"])
            or trace.prompt.shape != (n,) or trace.tokens.shape != (n,) or trace.segment.shape != (n,)
            or int(trace.ubatch.sum()) != n or trace.calls.shape != (len(trace.ubatch), n_layers)
            or (trace.guesses is not None and trace.guesses.shape != trace.experts.shape)):
        raise TraceError(f"{path}: arrays of inconsistent shapes")
    return trace


# ------------------------------------------------------------------------------------------------
# the sidecar's records -> micro-batches


def parse_records(raw, moe_layers):
    """Split the sidecar's record stream ([layer, n_tokens, n_used, ids...] per remap call;
    -(layer + 1) for a gate-ahead guess) into micro-batches: a list of (n_tokens, {MoE layer
    position: ids [n, k]}, {MoE layer position: guessed ids [n, k]}). Within a micro-batch the
    remap records come in ascending layer order, so a layer at or below the previous record's one
    starts the next micro-batch; its size is its largest record (the last layer may hold fewer
    tokens). A layer's guess comes before its remap record; the last one counts."""
    raw = np.asarray(raw, dtype=np.int32)
    position = {layer: j for j, layer in enumerate(moe_layers)}
    batches = []
    current, last, pending = None, None, {}
    i, end = 0, len(raw)
    while i < end:
        if i + 3 > end:
            raise TraceError(f"routing record cut short at entry {i} of {end}")
        layer, n, k = int(raw[i]), int(raw[i + 1]), int(raw[i + 2])
        guess = layer < 0
        layer = -layer - 1 if guess else layer
        if layer not in position or n < 0 or k <= 0 or i + 3 + n * k > end:
            raise TraceError(f"bad routing record at entry {i}: layer {layer}, {n} tokens, {k} ids each")
        j = position[layer]
        ids = raw[i + 3:i + 3 + n * k].reshape(n, k)
        i += 3 + n * k
        if guess:
            pending[j] = ids  # for this layer's next remap record
            continue
        if current is None or j <= last:
            current = ({}, {})
            batches.append(current)
        current[0][j] = ids
        if j in pending:
            current[1][j] = pending.pop(j)
        last = j
    return [(max(ids.shape[0] for ids in layers.values()), layers, guesses) for layers, guesses in batches]
