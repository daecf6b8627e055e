"""The plan handed to llama.cpp's own programs: the file that csrc/plan.c reads (EMPANEL_PLAN).

    text = plan_text(index, setup, preload=True, orders=..., digests=..., stats_path=...)

A plan is what ExpertPools would make in this process (pools.pool_setup), written down for a
llama-server, llama-cli, llama-bench or llama-perplexity process: its libllama hands the file to
the sidecar at the load of the model the plan names. The records are described in csrc/plan.c;
the plan lives as long as the program runs (commands/programs.py writes it into a temporary
folder) and is never a model file.
"""

import json
import os

from .pools import layer_stats

PLAN_VERSION = 1  # EMPANEL_PLAN_VERSION in csrc/plan.c


def _mtime_ns(path):
    return os.stat(path).st_mtime_ns


def plan_text(index, setup, *, preload=False, orders=None, digests=None, stats_path=None):
    """The plan of one model's pools as text.

    index: the model (index.ModelIndex); setup: pools.PoolSetup; preload: read experts into the
    empty slots after the load; orders: {layer: (experts, LFU counts or None)} (pools.preload_orders);
    digests: {tensor name: [n_expert] digests} (digests.load) for a verifying plan; stats_path: where
    the program appends each load's counters (JSON lines)."""
    for shard in index.shards:
        if "\n" in str(shard.path):
            raise ValueError(f"{shard.path!r}: a model path with a newline cannot be handed to a program")
    p = setup.params
    lines = [f"empanel-plan {PLAN_VERSION}",
             f"model {os.path.realpath(index.path)}"]
    for shard in index.shards:
        path = os.path.realpath(shard.path)
        lines.append(f"file {os.path.getsize(path)} {_mtime_ns(path)} {path}")
    lines.append(f"shape {index.n_layer} {index.n_expert} {index.n_expert_used}")
    lines.append(f"params {p['n_threads']} {p['chunk_bytes']} {p['direct_io']} {p['policy']} {p['budget_bytes']} "
                 f"{p['prefetch']} {p['subst_ratio']!r} {p['verify']}")
    lines.append(f"guess {setup.guess_depth}")
    lines.append(f"subst {index.n_expert_used if setup.subst else 0}")
    lines.append(f"preload {1 if preload else 0}")
    lines.append("slots " + " ".join(str(n) for n in setup.n_slots))
    for t in setup.paged:
        lines.append(f"tensor {t.layer} {t.shard} {t.offset} {t.stride} {t.name}")
    for il, (experts, uses) in (orders or {}).items():
        counts = f"{len(uses)} " + " ".join(str(u) for u in uses) if uses else "0"
        lines.append(f"order {il} {len(experts)} " + " ".join(str(e) for e in experts) + f" {counts}")
    if digests is not None:
        for t in setup.paged:
            lines.append(f"digests {t.name} {len(digests[t.name])} " + " ".join(f"{int(d):x}" for d in digests[t.name]))
    if stats_path is not None:
        lines.append(f"stats {os.path.realpath(stats_path)}")
    lines.append("end")
    return "\n".join(lines) + "\n"


def read_stats(path):
    """The loads a program recorded in its stats file: one pools.layer_stats dict per load (with
    "seconds" the load's lifetime), oldest first; [] if the program never loaded the model."""
    loads = []
    if not os.path.exists(path):
        return loads
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                stats = layer_stats({int(il): row for il, row in record["layers"].items()},
                                    record.get("masked_pools", 0))
                stats["seconds"] = record.get("seconds", 0.0)
                if record.get("wire_sent") or record.get("wire_received"):  # --rpc
                    stats["total"]["wire_sent"] = record["wire_sent"]
                    stats["total"]["wire_received"] = record["wire_received"]
                    stats["total"]["round_trips"] = record.get("round_trips", 0)
                loads.append(stats)
    return loads
