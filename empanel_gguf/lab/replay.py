"""Replay a routing trace (trace.py) through expert-cache policies (policies.py) at several sizes.

    from empanel_gguf.lab.trace import load_trace
    from empanel_gguf.lab.replay import replay
    report = replay(load_trace("trace.npz"), sizes=[8, 16, 32], policies=["lru", "belady"])

Calls. The engine makes one remap call per micro-batch and MoE layer; the replay makes the same
calls: the trace's micro-batches as recorded (meta ubatch/calls), each layer's call with the
distinct experts its tokens route to, in order of first use. The engine's policies (lru,
lfu-decay, g-lru) take each call as the engine does: one that routes to more distinct experts
than the pool holds runs in waves, planned by the engine's own code (policies.access_batch).
Replaying the engine's own policy at the size the trace was recorded with therefore makes exactly
the engine's calls, and reproduces its hit and miss counts. The lab's own policies model calls
that fit a pool: a recorded micro-batch longer than max(1, capacity // top-k) tokens at the
replayed size is split into micro-batches of that size. `ubatch=N` caps every policy's
micro-batches at N tokens.

Counting. Prompt tokens warm the cache; the calls of decode micro-batches are counted (count=
"all" counts every call, as the engine's own statistics do). Per policy and size:
    hit rate              hits / (hits + misses) over the counted calls (distinct experts per call)
    missed bytes / token  bytes of the experts missed by counted calls / counted tokens (each
                          expert's bytes from the model's index, recorded in the trace)
    ceiling tok/s         gbps x 1e9 / missed bytes per token: the decode speed at which a drive
                          of that bandwidth is busy reading misses (inf with no misses)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from ..planning.format import format_bytes
from ..abi.header import ENGINE_POLICIES
from ..engine.stats import hit_rate
from .policies import LAB_POLICIES, make_policy
from ..planning.sizing import GLRU_HEADROOM


@dataclass
class Call:
    layer: int        # MoE layer id
    experts: list     # distinct expert ids, in order of first use
    counted: bool     # a decode micro-batch's call (counted), else warm-up
    guess: list | None = None  # the engine's gate-ahead guess for the call (trace version 2), if any
    rows: object = None  # [n_tokens, k] the call's expert ids per token (None: no tokens)


def build_calls(trace, max_tokens=None, count="decode"):
    """The remap calls of the trace: micro-batches as recorded, split into at most `max_tokens`
    tokens each (None: as recorded). Returns (calls, number of micro-batches split)."""
    experts, prompt = trace.experts, trace.prompt
    layers = trace.moe_layers
    calls, n_split = [], 0
    t0 = 0
    for u, size in enumerate(trace.ubatch.tolist()):
        step = size if max_tokens is None or size <= max_tokens else max(1, max_tokens)
        if step < size:
            n_split += 1
        for a in range(t0, t0 + size, step):
            b = min(a + step, t0 + size)
            counted = count == "all" or not bool(prompt[a:b].all())
            for j, layer in enumerate(layers):
                n = int(trace.calls[u, j])
                if n < 0:
                    continue
                lo = max(a, t0 + size - n)  # the layer ran the micro-batch's last n tokens
                if lo >= b and not (n == 0 and b == t0 + size):
                    continue
                ids = experts[lo:b, j].reshape(-1).tolist() if lo < b else []
                guessed = None
                if trace.guesses is not None and lo < b and step == size:  # as recorded: the engine's call
                    named = [e for e in trace.guesses[lo:b, j].reshape(-1).tolist() if e >= 0]
                    guessed = list(dict.fromkeys(named)) or None
                calls.append(Call(layer, list(dict.fromkeys(e for e in ids if e >= 0)), counted, guessed,
                                  experts[lo:b, j] if lo < b else None))
        t0 += size
    return calls, n_split


def run_policy(policy, calls, expert_bytes):
    """Feed the calls to the policy; hit/miss counts for counted calls, warm-up calls, and per
    layer over all calls."""
    if policy.offline:
        policy.prepare([(c.layer, c.experts) for c in calls])
    counted = dict(hits=0, misses=0, missed_bytes=0)
    warm = dict(hits=0, misses=0, missed_bytes=0)
    layers = {}
    for c in calls:
        if c.guess is not None and hasattr(policy, "guess"):  # engine policies order eviction by it
            policy.guess(c.layer, c.guess)
        if c.rows is not None and hasattr(policy, "access_batch"):  # the engine's call, waves included
            hits, misses = policy.access_batch(c.layer, c.rows)
        else:
            hits, misses = policy.access(c.layer, c.experts)
        side = counted if c.counted else warm
        side["hits"] += hits
        side["misses"] += misses
        side["missed_bytes"] += misses * expert_bytes[c.layer]
        row = layers.setdefault(c.layer, [0, 0])
        row[0] += hits
        row[1] += misses
    return counted, warm, layers


def parse_sizes(text, trace):
    """'8,16,32' / '10%,25%' / '6GiB' (each like Llama's moe_slots) -> slots per layer, sorted,
    clamped to [top-k, n_expert]; with notes on what was adjusted."""
    from ..planning.sizing import SlotsError, _wanted_slots

    index = SimpleNamespace(n_expert=trace.n_expert,
                            layers=[SimpleNamespace(expert_bytes=b) for b in trace.meta["expert_bytes"]])
    sizes, notes = set(), []
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        if item == "recorded":
            n = trace.meta.get("recorded_with", {}).get("slots")
            if n is None:
                notes.append("--slots recorded: the trace was recorded without slots")
                continue
        else:
            try:
                n = _wanted_slots(index, item)
            except SlotsError as e:
                raise ValueError(str(e)) from None
        if n < trace.n_expert_used:
            notes.append(f"{item}: {n} slots < top-{trace.n_expert_used}; using {trace.n_expert_used}")
            n = trace.n_expert_used
        if n > trace.n_expert:
            notes.append(f"{item}: {n} slots > {trace.n_expert} experts; using {trace.n_expert}")
            n = trace.n_expert
        sizes.add(n)
    return sorted(sizes), notes


def default_sizes(trace):
    """top-k, 1/8, 1/4 and 1/2 of the experts, and the size the trace was recorded with."""
    e, k = trace.n_expert, trace.n_expert_used
    sizes = {k} | {max(k, math.ceil(e * share)) for share in (0.125, 0.25, 0.5)}
    recorded = trace.meta.get("recorded_with", {}).get("slots")
    if recorded:
        sizes.add(recorded)
    return sorted(n for n in sizes if k <= n <= e)


def replay(trace, sizes=None, policies=None, gbps=1.0, count="decode", ubatch=None):
    """Every policy at every size. Returns a dict: the trace's summary, notes, and results (one
    dict per policy and size, see the module docstring)."""
    policies = list(policies or LAB_POLICIES)
    for name in policies:
        if name not in LAB_POLICIES:
            raise ValueError(f"unknown policy {name!r}: one of {', '.join(LAB_POLICIES)}")
    sizes = list(sizes or default_sizes(trace))
    notes = []
    if count == "decode" and trace.n_decode == 0:
        notes.append("no decode tokens in the trace: counting every call (prompt tokens too)")
        count = "all"
    n_counted = trace.n_tokens if count == "all" else trace.n_decode
    expert_bytes = trace.expert_bytes
    k = trace.n_expert_used
    cache = {}
    results = []
    for name in policies:
        for slots in sizes:
            policy = make_policy(name, slots, expert_bytes=expert_bytes, n_expert=trace.n_expert,
                                 n_expert_used=k)
            capacity = policy.capacity()
            # the engine's policies run a call larger than the pool in waves, as the engine
            # does; the lab's own policies take calls that fit: larger ones are split
            max_tokens = None if name in ENGINE_POLICIES else max(1, capacity // k)
            if ubatch:
                max_tokens = ubatch if max_tokens is None else min(max_tokens, ubatch)
            if max_tokens not in cache:
                cache[max_tokens] = build_calls(trace, max_tokens, count)
            calls, n_split = cache[max_tokens]
            counted, warm, layers = run_policy(policy, calls, expert_bytes)
            per_token = counted["missed_bytes"] / n_counted if n_counted else 0.0
            results.append(dict(
                policy=name, slots=slots, capacity=capacity,
                hit_rate=hit_rate(counted["hits"], counted["misses"]),
                hits=counted["hits"], misses=counted["misses"],
                missed_bytes_per_token=per_token,
                ceiling_tok_s=gbps * 1e9 / per_token if per_token > 0 else math.inf,
                warm_hits=warm["hits"], warm_misses=warm["misses"],
                total_hits=counted["hits"] + warm["hits"],
                total_misses=counted["misses"] + warm["misses"],
                layers={str(layer): {"hits": h, "misses": m}
                        for layer, (h, m) in sorted(layers.items())},
                n_calls=len(calls), n_split_ubatches=n_split))
    return dict(summary=summarize(trace), count=count, counted_tokens=n_counted, gbps=gbps,
                sizes=sizes, policies=policies, notes=notes, results=results,
                engine_check=engine_check(trace, results, ubatch))


def summarize(trace):
    meta = trace.meta
    return dict(model=meta.get("model"), architecture=meta.get("architecture"),
                moe_layers=len(trace.moe_layers), n_expert=trace.n_expert,
                n_expert_used=trace.n_expert_used,
                prompt_tokens=trace.n_prompt, decode_tokens=trace.n_decode,
                ubatches=int(len(trace.ubatch)), recorded_with=meta.get("recorded_with"),
                expert_bytes=meta.get("expert_bytes"))


def engine_check(trace, results, ubatch=None):
    """The engine's live counts against the replay of its own policy at its own size over every
    call, when the trace holds them, was recorded from freshly loaded pools and is replayed in its
    own micro-batches; else None."""
    meta = trace.meta
    rec = meta.get("recorded_with") or {}
    stats = meta.get("engine_stats")
    if (not stats or not meta.get("engine_stats_from_load")
            or rec.get("moe_policy") not in ENGINE_POLICIES or rec.get("moe_prefetch") or stats.get("prefetched")):
        return None  # read-ahead (a decode's, a prompt's) makes hits of misses: a replay of the policy alone differs
    if ubatch and len(trace.ubatch) and int(trace.ubatch.max()) > ubatch:
        return None  # replayed in smaller micro-batches than the engine ran
    for r in results:
        if r["policy"] == rec["moe_policy"] and r["slots"] == rec.get("slots"):
            live = (stats["hits"], stats["misses"])
            replayed = (r["total_hits"], r["total_misses"])
            return dict(policy=r["policy"], slots=r["slots"], engine_hits=live[0],
                        engine_misses=live[1], replay_hits=replayed[0], replay_misses=replayed[1],
                        engine_hit_rate=hit_rate(*live), replay_hit_rate=hit_rate(*replayed),
                        match=live == replayed)
    return None


# ------------------------------------------------------------------------------------------------
# output


def format_report(report, path=None):
    s = report["summary"]
    counted = ("decode tokens (prompt tokens warm the cache)" if report["count"] == "decode"
               else "every call")
    lines = [f"trace     {path + ': ' if path else ''}{s['model']} ({s['architecture']}), "
             f"{s['moe_layers']} MoE layers x {s['n_expert']} experts, top-{s['n_expert_used']}",
             f"tokens    {s['prompt_tokens']} prompt + {s['decode_tokens']} decode in "
             f"{s['ubatches']} micro-batches; counted: {counted}"]
    rec = s.get("recorded_with") or {}
    if rec.get("slots"):
        lines.append(f"recorded  {rec['slots']} slots per layer, {rec.get('moe_policy') or '?'}, "
                     f"n_ubatch {rec.get('n_ubatch')}")
    for note in report["notes"]:
        lines.append(f"note      {note}")
    lines.append("")
    lines.append(f"{'policy':<10} {'slots':>5} {'hit rate':>8} {'missed/token':>13} "
                 f"{'ceiling @ ' + format(report['gbps'], 'g') + ' GB/s':>20}")
    for r in report["results"]:
        ceiling = "inf" if math.isinf(r["ceiling_tok_s"]) else f"{r['ceiling_tok_s']:.1f} tok/s"
        slots = f"{r['slots']}" + ("*" if r["capacity"] != r["slots"] else "")
        lines.append(f"{r['policy']:<10} {slots:>5} {100 * r['hit_rate']:>7.1f}% "
                     f"{format_bytes(r['missed_bytes_per_token']):>13} {ceiling:>20}")
    if any(r["capacity"] != r["slots"] for r in report["results"]):
        lines.append(f"* g-lru, g-lrfu: a budget of that many slots per layer, shared; a layer holds up to "
                     f"min(n_expert, max({GLRU_HEADROOM}N, N + top-k))")
    split = {r["n_split_ubatches"] for r in report["results"] if r["n_split_ubatches"]}
    if split:
        lines.append("some recorded micro-batches routed to more experts than a pool holds at a "
                     "replayed size: the engine's policies run them in waves, as the engine does; "
                     "the lab's own policies (lfu, slru, arc, belady) split them")
    check = report.get("engine_check")
    if check:
        verdict = "match" if check["match"] else "DIFFER"
        lines.append(f"engine    live {check['engine_hits']} hits / {check['engine_misses']} misses "
                     f"({100 * check['engine_hit_rate']:.1f}%), replayed {check['policy']} at "
                     f"{check['slots']} slots over every call {check['replay_hits']} / "
                     f"{check['replay_misses']} ({100 * check['replay_hit_rate']:.1f}%): {verdict}")
    return "\n".join(lines)


def plot(report, path):
    """A PNG of hit rate vs slots per layer, one line per policy (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in report["policies"]:
        rows = [r for r in report["results"] if r["policy"] == name]
        ax.plot([r["slots"] for r in rows], [100 * r["hit_rate"] for r in rows], marker="o",
                linestyle="--" if name == "belady" else "-", label=name)
    ax.set_xlabel(f"slots per MoE layer (of {s['n_expert']} experts)")
    ax.set_ylabel("hit rate, %" + (" (decode)" if report["count"] == "decode" else ""))
    ax.set_title(f"{s['model']}: {s['prompt_tokens']} prompt + {s['decode_tokens']} decode tokens")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
