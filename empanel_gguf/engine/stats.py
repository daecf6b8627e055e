"""The counters of a paged layer and what is derived from them.

The counters are declared once, in csrc/empanel.h (EMPANEL_LAYER_COUNTERS, read by abi/header.py):
the C struct, the stats file and /metrics of llama.cpp's programs (csrc/load.c), the cffi
declaration of the struct (native.py) and the names here are all made from that list.

    NAMES                 every counter's name as reported (*_ns fields as *_s, seconds)
    hit_rate(hits, misses) the share of lookups that hit (the one definition)
    layer_stats(raw)      {layer: {field: value}} -> {"layers": rows, "total": totals and rates}
    summary_line(stats)   the one-line summary Llama.close and the programs print
    read_stats_file(path) the loads a program recorded in its stats file
"""

import json
import os

from ..abi.header import COUNTERS

NAMES = tuple(c.name for c in COUNTERS)


def hit_rate(hits, misses, none=0.0):
    """hits / (hits + misses): the share of expert lookups that found the expert resident; `none`
    where there were none. The one definition: moe_stats, the programs' stats, the server's recent
    window, the lab's replay and fit all use it."""
    return hits / (hits + misses) if hits + misses else none


def layer_stats(raw, n_masked=0, n_expert_used=0):
    """{layer: {field: raw value}} (as the sidecar or a program's stats file gives them) ->
    {"layers": {layer: row}, "total": totals and rates}; *_ns fields become *_s (seconds).
    n_expert_used (top-k) gives the tokens a layer saw, for the per-token rates."""
    layers = {}
    total = dict.fromkeys(NAMES, 0)
    for il, counters in raw.items():
        row = {c.name: c.value(counters.get(c.field, 0)) for c in COUNTERS}
        row["hit_rate"] = hit_rate(row["hits"], row["misses"])
        layers[il] = row
        for name in NAMES:
            total[name] += row[name]
    total["hit_rate"] = hit_rate(total["hits"], total["misses"])
    total["read_gbps"] = total["io_bytes"] / total["read_s"] / 1e9 if total["read_s"] else 0.0
    total["copy_gbps"] = total["copy_bytes"] / total["write_s"] / 1e9 if total["write_s"] else 0.0
    total["round_trip_us"] = 1e6 * total["remap_s"] / total["n_remaps"] if total["n_remaps"] else 0.0
    # waves per micro-batch and layer; reads done while the graph computed (overlap)
    total["waves_per_batch"] = total["n_waves"] / total["n_remaps"] if total["n_remaps"] else 0.0
    total["hidden_read_s"] = max(0.0, total["read_s"] - total["wait_s"])
    total["masked_pools"] = n_masked
    # tokens evaluated: the most any paged layer saw (the last layer of a prompt runs only the
    # tokens whose outputs are wanted); waits on a device or RPC host per token
    tokens = max((row["n_ids"] for row in layers.values()), default=0) // n_expert_used if n_expert_used else 0
    total["tokens"] = tokens
    total["device_syncs_per_token"] = total["device_syncs"] / tokens if tokens else 0.0
    # the gate-ahead guess: recall over the micro-batches it was made for; read-ahead hits
    total["guess_recall"] = total["guess_hits"] / total["guess_routed"] if total["guess_routed"] else 0.0
    total["prefetch_hit_rate"] = total["prefetch_used"] / total["prefetched"] if total["prefetched"] else 0.0
    return {"layers": layers, "total": total}


def summary_line(stats):
    t = stats["total"]
    return (f"empanel: {t['hits']} hits, {t['misses']} misses ({100 * t['hit_rate']:.1f}% hit), "
            f"{t['bytes_read'] / 2**20:.1f} MiB read in {t['read_s']:.3f} s ({t['read_gbps']:.2f} GB/s), "
            f"{t['remap_s']:.3f} s in remap"
            + (f", {t['remote_by_hash']} expert tensors written by RPC hosts from their caches" if t["remote_by_hash"] else "")
            + (f", {t['host_hits']} expert tensors ({t['host_bytes'] / 2**20:.1f} MiB) from the host tier"
               if t["host_hits"] else "")
            + (f", {t['wire_sent'] / 2**20:.1f} MiB sent to RPC hosts ({t['copy_bytes'] / 2**20:.1f} MiB of experts)"
               if "wire_sent" in t else "")
            + budget_words(stats.get("budget")))


def budget_words(budget):
    """The live budget's part of the summary: where it moved ("" where it never did)."""
    if not budget or not budget.get("n_changes"):
        return ""
    return (f"; budget {budget['budget_bytes'] / 2**20:.0f} MiB of {budget['capacity_bytes'] / 2**20:.0f} "
            f"(lowest {budget['lowest_bytes'] / 2**20:.0f} MiB, {budget['n_changes']} moves"
            + (f", {budget['n_shrinks']} down and {budget['n_grows']} up for the memory left" if budget.get("elastic") else "")
            + f", {budget['given_back_bytes'] / 2**20:.0f} MiB given back)")


def read_stats_file(path):
    """The loads a program recorded in its stats file (csrc/load.c, one JSON object per line): one
    layer_stats dict per load (with "seconds" the load's lifetime), oldest first; [] if the program
    never loaded the model."""
    loads = []
    if not os.path.exists(path):
        return loads
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                stats = layer_stats({int(il): row for il, row in record["layers"].items()},
                                    record.get("masked_pools", 0), record.get("n_expert_used", 0))
                stats["seconds"] = record.get("seconds", 0.0)
                stats["read_io"] = record.get("read_io", "threads")
                stats["budget"] = record.get("budget")
                if record.get("wire_sent") or record.get("wire_received"):  # --rpc
                    stats["total"]["wire_sent"] = record["wire_sent"]
                    stats["total"]["wire_received"] = record["wire_received"]
                    stats["total"]["round_trips"] = record.get("round_trips", 0)
                loads.append(stats)
    return loads
