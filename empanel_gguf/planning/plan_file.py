"""A load's plan written down: the text csrc/plan_file.c reads.

    text = load_text(load, stats_path=None)          # a plan.LoadPlan
    text = plan_text(index, setup, preload=..., orders=..., digests=..., stats_path=...)

The sidecar makes a load's pools from this text, the same way in both places it runs: in this
process (pools.ExpertPools hands it over in memory) and in llama.cpp's own programs
(commands/programs.py writes it to a file named by EMPANEL_PLAN; the program's libllama hands it
to the sidecar at the load of the model it names). The records are described in
csrc/plan_file.c; a plan lives as long as its load and is never a model file.
"""

import os

from ..abi.header import define

PLAN_VERSION = define("EMPANEL_PLAN_VERSION")  # csrc/empanel.h: the version csrc/plan_file.c reads


def _mtime_ns(path):
    return os.stat(path).st_mtime_ns


def load_text(load, stats_path=None):
    """The plan of a LoadPlan with pools (load.pools is not None) as text."""
    return plan_text(load.index, load.pools, preload=load.preload, pinned=load.pinned, orders=load.orders,
                     digests=load.digests, stats_path=stats_path, controller=load.controller)


def plan_text(index, setup, *, preload=False, pinned=False, orders=None, digests=None, stats_path=None,
              controller=None):
    """The plan of one model's pools as text.

    index: the model (index.ModelIndex); setup: plan.PoolSetup; preload: read experts into the
    empty slots after the load; pinned: pools that hold every expert keep expert e in slot e and
    run stock's graph (needs preload, and no orders for them); orders: {layer: (experts, LFU
    counts or None)} (plan.preload_orders); digests: {tensor name: [n_expert] digests} (digests.load) for a verifying plan; stats_path: where
    a program appends each load's counters (JSON lines); controller: moe_elastic's (LoadPlan.controller)."""
    for shard in index.shards:
        if "\n" in str(shard.path):
            raise ValueError(f"{shard.path!r}: a model path with a newline cannot be planned")
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
    if pinned:
        lines.append("pin 1")
    if setup.host_cache:
        lines.append(f"host-cache {setup.host_cache}")
    lines.append(f"io {p['read_io']} {p['queue_depth']}")
    if p.get("prompt_ahead"):
        lines.append("prompt-ahead 1")
    if controller is not None:
        lines.append(f"elastic {controller['reserve']} {controller['interval_ms']}")
        for i, source in enumerate(controller["sources"]):
            for role, key in (("limit", None), ("high", None), ("usage", None), ("stat", "stat_key"), ("events", None),
                              ("available", "available_key")):
                if source.get(role):
                    lines.append(f"memory {i} {role} {source[key] if key else '-'} {source[role]}")
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
