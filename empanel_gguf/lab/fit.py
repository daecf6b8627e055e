"""What a model will do on this machine at each memory budget, before a run (`empanel-gguf fit`).

    from empanel_gguf.lab.fit import measure, predict
    m = measure("model.gguf")                    # one bounded run + a drive probe (cached)
    rows = predict(m, budgets=[4 << 30, 8 << 30])

measure() runs the model once on a built-in text with pools of a quarter of the experts (or what
fits now, if less), with the routing traced: n_prompt prompt tokens in one evaluation, then
n_decode greedy tokens or more (up to MAX_DECODE, while the readers have read less than
MIN_READ_BYTES) in segments of DECODE_SEGMENT, each after a paragraph of the text, for at most
`seconds`. From that run it keeps
    the routing trace          replayed at every budget's slot count (lab/replay.py)
    compute ms per token       the phase's wall time minus the time it waited for reads, per
                               token, prompt and decode apart (the graph is the same at any slot
                               count; tracing adds its own small cost, see `trace --overhead`)
    read GB/s                  bytes the readers read in decode / time those reads were in flight
    hidden share               of the decode's read time, the part done while the graph computed
and it probes the drive (O_DIRECT, random expert-sized ranges of the model file, 8 threads, 2 s).
On a VM whose host caches the disk the probe can read faster or slower than the readers did; the
prediction takes the readers' own rate where the run read enough (32 MiB), else the probe's.
The measurement is saved in the cache (beside calibration profiles) and reused for this model
file; `fresh=True` measures again.

predict() turns it into one row per budget:
    slots            the most slots per layer whose estimated peak fits in the budget (guard.py)
    peak             the estimated peak host memory at those slots (estimate.py)
    hit, read/token  the trace replayed under the policy at those slots: decode calls counted,
                     the prompt warming the pools (the engine's own policy code)
    decode t/s       1000 / (compute_ms + read_ms x (1 - hidden)), read_ms = bytes/token / GB/s
    prompt t/s       the same with the prompt's figures (its reads per prompt token from the replay)
    bound            "drive" where the exposed read time exceeds the compute, else "compute"
Pools that hold every expert read nothing: compute-bound, at the measured compute.
The model is of a layer's own reads (misses of the policy, hidden behind its compute): the
measuring run reads nothing ahead (moe_prefetch=0), and the rows are what a load without
read-ahead gets, as the default decodes (moe_prefetch="auto" reads nothing ahead in decode; a
prompt's waves read the next layer's empty slots, which the prompt figures here leave out).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..engine.stats import hit_rate
from ..planning.format import GiB, MiB
from ..planning.options import CHUNK_KB, READ_THREADS
from ..planning.sizing import DEFAULT_POLICY

MEASURE_SLOTS = "25%"  # pools of the measuring run (or the most that fit, if fewer)
MIN_READ_BYTES = 32 * MiB  # below this the readers' own rate is too noisy: the probe's is used
MAX_DECODE = 256  # tokens the measuring run decodes at most to read MIN_READ_BYTES
DECODE_SEGMENT = 16  # tokens decoded after each paragraph of the text
DECODE_PROMPT = 64  # prompt tokens of each paragraph before its segment
ZERO = dict(wait_s=0.0, read_s=0.0, hits=0, misses=0, io_bytes=0)  # moe_stats() totals counted
FORMAT = "empanel-gguf-fit"
VERSION = 3  # 2: read_gbps from the decode's reads; 3: decode until MIN_READ_BYTES


class FitError(ValueError):
    """A budget or model fit cannot answer for (below the minimum, not a MoE model)."""


@dataclass
class Measurement:
    model: dict                 # the file's identity (cache.file_identity)
    trace_path: str             # the routing trace of the run
    slots: int                  # slots per layer the run had (n_expert: every expert resident)
    n_threads: int | None
    n_prompt: int
    n_decode: int
    prompt_compute_ms: float    # per prompt token
    decode_compute_ms: float    # per decode token
    prompt_hidden: float        # share of the prompt's read time hidden behind compute
    decode_hidden: float
    read_gbps: float | None     # the readers' own rate in the run's decode (None: nothing read)
    read_bytes: int             # bytes the readers read in the run's decode
    drive: dict | None          # the O_DIRECT probe (host.probe_drive), or None
    seconds: float              # wall time of the run
    decode_hit_rate: float | None = None  # the engine's own hit rate over the run's decode
    when: str = ""
    notes: list = field(default_factory=list)

    @property
    def gbps(self):
        """The read rate predictions use, and where it comes from."""
        if self.read_gbps and self.read_bytes >= MIN_READ_BYTES:
            return self.read_gbps, "the readers' own rate in the run's decode"
        if self.drive and self.drive.get("gbps"):
            return self.drive["gbps"], "the O_DIRECT probe"
        return 1.0, "no measurement (1 GB/s assumed)"


def _cache_paths(identity):
    from ..planning.cache import cached_path

    return cached_path(identity, ".fit.json"), cached_path(identity, ".fit-trace.npz")


def _phase(before, after, wall, n):
    """(compute ms per token, hidden share of the read time) between two moe_stats() totals."""
    waited = (after["wait_s"] - before["wait_s"]) if before is not None else after["wait_s"]
    read = (after["read_s"] - before["read_s"]) if before is not None else after["read_s"]
    compute = max(0.0, wall - waited)
    hidden = max(0.0, min(1.0, 1.0 - waited / read)) if read > 0 else 0.0
    return 1000.0 * compute / max(1, n), hidden


def measure(model_path, *, n_prompt=512, n_decode=32, seconds=120.0, n_threads=None, fresh=False,
            probe_seconds=2.0, text=None, log=None) -> Measurement:
    """Run the model once (bounded by `seconds`), probe the drive, save both in the cache; a saved
    measurement of this file is returned instead unless `fresh`."""
    from ..planning.cache import file_identity
    from ..planning.estimate import model_shape
    from ..planning.index import load_index
    from ..planning.profile import DEFAULT_TEXT
    from .bench.host import probe_drive
    from .recorder import Recorder

    index = load_index(model_path)
    if not index.is_moe:
        raise FitError(f"{model_path}: no routed experts ({index.architecture}): every byte is read once; "
                       "fit predicts MoE models only")
    identity = file_identity(index)
    json_path, trace_path = _cache_paths(identity)
    saved = None if fresh else _saved_measurement(json_path, trace_path, identity, n_threads)
    if saved is not None:
        return saved
    say = log or (lambda _: None)
    text = text if text is not None else DEFAULT_TEXT
    n_ctx_train = model_shape(index).n_ctx_train or 4096
    n_ctx = max(DECODE_PROMPT + DECODE_SEGMENT + 8, min(n_prompt + DECODE_SEGMENT + 8, n_ctx_train))
    llm = _paging_llm(model_path, index, n_ctx, n_threads)
    notes = []
    try:
        plan = llm._experts.plan
        slots = plan.min_slots if plan is not None else index.n_expert
        rec = Recorder(llm)
        tokens = llm.tokenize(text.encode("utf-8"))
        n_prompt = max(1, min(n_prompt, n_ctx - DECODE_SEGMENT - 1))  # (a short training context)
        tokens = (tokens * (1 + n_prompt // max(1, len(tokens))))[:n_prompt]
        say(f"fit: measuring {Path(model_path).name} at {slots} slots per layer: {len(tokens)} prompt tokens, "
            f"then {n_decode} or more decoded in segments of {DECODE_SEGMENT} (at most {seconds:.0f} s)")
        t0 = time.perf_counter()
        rec.prompt(tokens)
        t1 = time.perf_counter()
        after_prompt = (llm.moe_stats() or {}).get("total") or dict(ZERO)
        # pools that hold every expert read nothing: no need to decode more for the readers' rate
        decode, n_done = _decode_segments(llm, rec, text, n_ctx, n_decode, read_more=slots < index.n_expert,
                                          deadline=t0 + seconds)
        t_end = time.perf_counter()
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        rec.save(trace_path)
    finally:
        llm.close()
    if n_done < n_decode:
        notes.append(f"decoded {n_done} of {n_decode} tokens: the {seconds:.0f} s allowed ran out, or the "
                     f"text's paragraphs (one segment of {DECODE_SEGMENT} after each)")
    prompt_ms, prompt_hidden = _phase(None, after_prompt, t1 - t0, len(tokens))
    decode_ms, decode_hidden = _phase(dict(ZERO), decode, decode["wall"], n_done)
    # the readers' rate in decode (its reads are what the prediction's decode reads; a prompt's
    # waves read at another depth)
    read_bytes, read_s = int(decode["io_bytes"]), decode["read_s"]
    drive = probe_drive(index, probe_seconds, CHUNK_KB * 1024, READ_THREADS) if probe_seconds > 0 else None
    if drive is None and probe_seconds > 0:
        notes.append("the drive probe could not read with O_DIRECT (tmpfs?)")
    m = Measurement(model=identity, trace_path=str(trace_path), slots=int(slots), n_threads=n_threads,
                    n_prompt=len(tokens), n_decode=n_done, prompt_compute_ms=prompt_ms,
                    decode_compute_ms=decode_ms, prompt_hidden=prompt_hidden, decode_hidden=decode_hidden,
                    read_gbps=read_bytes / read_s / 1e9 if read_s > 0 else None, read_bytes=read_bytes, drive=drive,
                    seconds=t_end - t0, decode_hit_rate=hit_rate(decode["hits"], decode["misses"], none=None),
                    when=time.strftime("%Y-%m-%d %H:%M"), notes=notes)
    json_path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **asdict(m)}, indent=1))
    return m


def _saved_measurement(json_path, trace_path, identity, n_threads):
    """The measurement saved for this file at these threads, None if there is none that fits."""
    if not (json_path.is_file() and trace_path.is_file()):
        return None
    try:
        data = json.loads(json_path.read_text())
        if data.get("format") == FORMAT and data.get("version") == VERSION and data.get("model") == identity:
            m = Measurement(**{k: v for k, v in data.items() if k not in ("format", "version")})
            if m.n_threads == n_threads:
                return m
    except (OSError, ValueError, TypeError):
        pass  # measured again
    return None


def _paging_llm(model_path, index, n_ctx, n_threads):
    """The model on pools that page (a quarter of the experts, or what fits if less), traced: the
    run reads, so it measures the readers' rate and the overlap as well as the compute. No
    read-ahead: the run measures a layer's own reads, which the replay prices."""
    from ..llama import Llama
    from ..planning.guard import MemoryRefused
    from ..planning.plan import moe_options, plan_load

    kwargs = dict(moe_trace=True, moe_prefetch=0, n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=n_threads,
                  verbose=False)
    slots_asked = MEASURE_SLOTS
    try:
        plan_load(index, MEASURE_SLOTS, kwargs, options=moe_options(moe_trace=True, moe_prefetch=0))
    except MemoryRefused:
        slots_asked = "auto"
    return Llama(str(model_path), moe_slots=slots_asked, **kwargs)


def _decode_segments(llm, rec, text, n_ctx, n_decode, read_more, deadline):
    """(the decode's counters summed, with "wall" its seconds; tokens decoded). It decodes in
    segments of DECODE_SEGMENT tokens, so that one continuation (a small model's greedy loop) does
    not make the hit rate: the first after the prompt (which the first paragraph opens), each next
    one after another paragraph (the context cut back, the pools kept; one segment per paragraph,
    since a paragraph again decodes the same greedy tokens): n_decode tokens, and more (up to
    MAX_DECODE) while the readers have read less than MIN_READ_BYTES (read_more), until the
    deadline."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    n_decode_max = max(n_decode, MAX_DECODE)
    decode = dict(ZERO, wall=0.0)
    n_done, segment = 0, 0
    while time.perf_counter() < deadline and segment < max(1, len(paragraphs)) and (
            n_done < n_decode or (read_more and n_done < n_decode_max and decode["io_bytes"] < MIN_READ_BYTES)):
        if segment > 0:
            head = llm.tokenize(paragraphs[segment].encode("utf-8"))
            rec.prompt_to(head[:max(1, min(DECODE_PROMPT, n_ctx - DECODE_SEGMENT - 8))])
        before, t_seg = (llm.moe_stats() or {}).get("total") or dict(ZERO), time.perf_counter()
        room = n_ctx - llm.n_tokens - 1
        step = rec.generate(max(0, min(DECODE_SEGMENT, n_decode_max - n_done, room)), stop_at_eog=False)
        decode["wall"] += time.perf_counter() - t_seg
        after = (llm.moe_stats() or {}).get("total") or dict(ZERO)
        for key in ZERO:
            decode[key] += after[key] - before[key]
        n_done += len(step)
        segment += 1
        if not step:
            break  # nothing left to decode (a full context)
    return decode, n_done


def default_budgets(index, params, available=None):
    """Peak memory at the fewest slots (top-k), at 25 %, 50 % and all experts, and what is free now
    (None where unknown): (bytes, label) pairs, by size."""
    from ..planning.estimate import estimate
    from ..planning.sizing import plan_slots

    k, e = index.n_expert_used, index.n_expert
    out = {}
    for label, n in (("fewest slots", k), ("25 % of experts", math.ceil(e / 4)), ("50 % of experts", math.ceil(e / 2))):
        if k <= n < e:
            out.setdefault(estimate(index, plan_slots(index, n), **params).host, label)
    out.setdefault(estimate(index, None, **params).host, "every expert")
    if available and available >= min(out):  # (less than the fewest slots take: not a budget)
        out[available] = "free now"
    return sorted(out.items())


def _slots_for(index, budget, label, params):
    """Slots per layer a peak-memory budget buys (n_expert where every expert fits); FitError below
    the fewest slots, saying what the minimum is."""
    from ..planning.estimate import estimate
    from ..planning.format import format_bytes
    from ..planning.guard import max_slots_that_fit
    from ..planning.sizing import plan_slots

    k, e = index.n_expert_used, index.n_expert
    if budget >= estimate(index, None, **params).host:
        return e
    slots = max_slots_that_fit(index, budget, params)
    if slots < k:
        minimum = estimate(index, plan_slots(index, k), **params).host
        raise FitError(f"{format_bytes(budget)}{f' ({label})' if label else ''} is below the least this model runs in: "
                       f"{format_bytes(minimum)} at {k} slots per layer (the experts one token uses); "
                       f"give --memory {math.ceil(minimum / MiB)}MiB or more, or a smaller -c")
    return slots


def check_budgets(index, budgets, params):
    """FitError if any budget is below the least the model runs in (before anything runs)."""
    for budget, label in budgets:
        _slots_for(index, budget, label, params)


def predict(m: Measurement, index, budgets, params, policy="auto"):
    """One dict per (bytes, label) budget: slots, peak, hit rate, read/token, predicted t/s, bound.
    A budget below the fewest slots' peak raises FitError saying what the minimum is."""
    from ..planning.estimate import estimate
    from ..planning.sizing import plan_slots
    from .replay import replay
    from .trace import load_trace

    trace = load_trace(m.trace_path)
    gbps, _ = m.gbps
    e = index.n_expert
    full = estimate(index, None, **params).host
    profile = None
    if policy == "auto":
        from ..planning.profile import ProfileError, resolve

        try:
            profile, _ = resolve(index, "auto")
        except ProfileError:
            profile = None
    rows = []
    for budget, label in budgets:
        slots = _slots_for(index, budget, label, params)
        chosen = profile.choose_policy(slots, DEFAULT_POLICY) if profile is not None else None
        row_policy = policy if policy != "auto" else chosen[0] if chosen else DEFAULT_POLICY
        peak = full if slots >= e else estimate(index, plan_slots(index, slots, row_policy), **params).host
        if slots >= e:
            hit, decode_b, prompt_b = 1.0, 0.0, 0.0
        else:
            decode = replay(trace, sizes=[slots], policies=[row_policy], count="decode")["results"][0]
            hit, decode_b = decode["hit_rate"], decode["missed_bytes_per_token"]
            prompt_b = _prompt_read_per_token(trace, slots, m.n_prompt)
        row = dict(budget=int(budget), label=label, slots=int(slots), policy=row_policy, peak=int(peak), hit_rate=hit,
                   read_per_token=decode_b, prompt_read_per_token=prompt_b)
        for phase, compute, hidden, nbytes in (("decode", m.decode_compute_ms, m.decode_hidden, decode_b),
                                               ("prompt", m.prompt_compute_ms, m.prompt_hidden, prompt_b)):
            read_ms = 1000.0 * nbytes / (gbps * 1e9)
            exposed = read_ms * (1.0 - hidden)
            row[f"{phase}_read_ms"] = read_ms
            row[f"{phase}_tps"] = 1000.0 / (compute + exposed) if compute + exposed > 0 else math.inf
            row[f"{phase}_bound"] = "drive" if exposed > compute else "compute"
        rows.append(row)
    return rows


def _prompt_read_per_token(trace, slots, n_prompt):
    """Bytes a prompt token reads at `slots` per layer, from the run's first n_prompt tokens (the
    prompt that was timed; the decode segments' paragraph heads are left out): each of its
    micro-batches' layer calls reads the experts it routes to beyond the pool's (a long micro-batch
    touches nearly every expert, so whichever `slots` are resident hit; the pools are full from
    the load's preload)."""
    from .replay import build_calls

    sizes = np.cumsum(trace.ubatch)
    k = int(np.searchsorted(sizes, n_prompt, side="right"))  # micro-batches of the first prompt
    n = int(sizes[k - 1]) if k > 0 else 0
    first = replace(trace, experts=trace.experts[:n], prompt=trace.prompt[:n], tokens=trace.tokens[:n],
                    segment=trace.segment[:n], ubatch=trace.ubatch[:k], calls=trace.calls[:k],
                    guesses=trace.guesses[:n] if trace.guesses is not None else None)
    calls, _ = build_calls(first, None, "decode")
    expert_bytes = trace.expert_bytes
    missed = sum(max(0, len(c.experts) - slots) * expert_bytes[c.layer] for c in calls if not c.counted)
    return missed / max(1, n)


def format_table(m: Measurement, rows, name):
    from ..planning.format import format_bytes

    gbps, source = m.gbps
    lines = [f"fit {name}: measured at {m.slots} slots per layer ({m.when}; {m.n_prompt} prompt + "
             f"{m.n_decode} decoded tokens in {m.seconds:.2f} s)",
             f"  compute  {m.prompt_compute_ms:.2f} ms per prompt token, {m.decode_compute_ms:.1f} ms per "
             f"decoded token (phase time minus read waits)",
             *([f"  hit      {100 * m.decode_hit_rate:.1f} % over the run's decode (the engine's own count; "
                f"fit's replay at {m.slots} slots predicts it)"] if m.decode_hit_rate is not None else []),
             f"  reads    {gbps:.2f} GB/s ({source}); {100 * m.decode_hidden:.0f} % of decode reads hidden "
             f"behind compute"]
    if m.drive and m.drive.get("gbps"):
        d = m.drive
        lines.append(f"  drive    O_DIRECT {d['gbps']:.2f} GB/s ({d['chunk_bytes'] // 1024} KiB x {d['depth']} "
                     f"threads, {d['seconds']:.1f} s; a VM's host cache can make this differ from the readers')")
    lines += [f"  note     {n}" for n in m.notes]
    lines.append("")
    head = ("memory", "", "slots", "policy", "peak", "hit", "read/token", "decode t/s", "bound", "prompt t/s", "bound")
    table = [head]
    for r in rows:
        table.append((format_bytes(r["budget"]), r["label"], str(r["slots"]), r["policy"], format_bytes(r["peak"]),
                      f"{100 * r['hit_rate']:.0f} %", format_bytes(int(r["read_per_token"])),
                      f"{r['decode_tps']:.2f}", r["decode_bound"], f"{r['prompt_tps']:.1f}", r["prompt_bound"]))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    lines.append("")
    lines.append("predicted: decode = 1000 / (compute + read x (1 - hidden)) ms; hit and read/token from the "
                 "run's routing replayed at each slot count; peak is the load's estimate; without read-ahead "
                 "(as the default decodes; a prompt's waves also read the next layer's empty slots ahead)")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["budget"] / GiB for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["decode_tps"] for r in rows], "o-", label="decode t/s")
    ax.set_xlabel("memory (GiB)")
    ax.set_ylabel("decode t/s")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * r["hit_rate"] for r in rows], "s--", color="gray", label="hit %")
    ax2.set_ylabel("hit rate (%)")
    fig.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
