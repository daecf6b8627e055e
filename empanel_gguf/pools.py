"""The sidecar's pools as Python sees them (cffi over csrc/empanel.h).

    ExpertPools   the slot pools of one loaded model: made before the load, bound to libllama's
                  pool tensors after it; stats, trace, preload, errors
    LabPool       a pool without files (empanel_lab_init): the engine's own policy code replayed
                  over routing calls, for the policy lab (policies.py, replay.py)
"""

from dataclasses import dataclass

from . import _native
from ._native import native, policy_id
from .sizing import DEFAULT_POLICY


class MoeReadError(RuntimeError):
    """Reading experts from the model file failed during a decode; nothing was returned."""


@dataclass
class PoolSetup:
    """What the sidecar's pools of one load are made of (checked arguments, no C objects): the
    same for ExpertPools in this process and for a plan handed to a program (program_plan.py)."""
    n_slots: list           # [n_layer] slots (0: resident, -1: resident and traced)
    paged: list             # the ExpertTensors with a pool
    params: dict            # struct empanel_pool_params, field by field
    guess_depth: int        # paged layers ahead that the gate-ahead guess looks (0: none)
    subst: object           # moe_subst ratio, None: exact routing


def pool_setup(index, plan, policy=DEFAULT_POLICY, io_threads=8, chunk_kb=256, direct_io=True, trace=False,
               guess=True, prefetch=0, subst=None, verify=False) -> PoolSetup:
    """The pools of a load with `plan` (sizing.SlotPlan, None: no slots); ValueError for bad
    moe_* arguments."""
    n_slots = list(plan.n_slots) if plan is not None else [0] * index.n_layer
    if trace:  # layers without a pool are observed: their routing is traced too
        n_slots = [-1 if n == 0 and il in index.moe_layers else n for il, n in enumerate(n_slots)]
    if io_threads < 0 or chunk_kb < 4:
        raise ValueError(f"moe_io_threads={io_threads}, moe_chunk_kb={chunk_kb}: need >= 0 threads, >= 4 KiB")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"moe_prefetch={prefetch!r}: give a number of layers ahead (0 = off)")
    if subst is not None and (isinstance(subst, bool) or not isinstance(subst, (int, float)) or not 0 < subst <= 1):
        raise ValueError(f"moe_subst={subst!r}: a ratio in (0, 1] (0.5: a stand-in needs half the missing "
                         "expert's score), or None")
    params = {
        "n_threads": io_threads,
        "chunk_bytes": chunk_kb * 1024,
        "direct_io": 1 if direct_io else -1,
        "policy": policy_id(policy),
        "budget_bytes": plan.budget_bytes if plan is not None else 0,
        "prefetch": prefetch,
        "subst_ratio": float(subst or 0.0),
        "verify": 1 if verify else 0,
    }
    return PoolSetup(
        n_slots=n_slots,
        paged=[t for t in index.expert_tensors() if n_slots[t.layer] > 0],
        params=params,
        # guesses: one layer ahead to order eviction, as many as prefetch reads
        guess_depth=max(1, prefetch) if (guess or prefetch) and plan is not None else 0,
        subst=subst if plan is not None else None)


class ExpertPools:
    """The sidecar's pools of one model: made before the load, bound to the pool tensors after."""

    def __init__(self, index, plan, policy=DEFAULT_POLICY, io_threads=8, chunk_kb=256, direct_io=True,
                 trace=False, guess=True, prefetch=0, subst=None, verify=False):
        self.index = index
        self.plan = plan
        self.n = native()
        ffi = self.n.ffi
        self._keep = []  # cffi buffers that must outlive the C pool
        self.n_masked = 0  # pools whose waves are masked (a GPU kernel may compute on them): bind()
        setup = pool_setup(index, plan, policy, io_threads, chunk_kb, direct_io, trace, guess, prefetch, subst,
                           verify)

        paths = [ffi.new("char[]", str(shard.path).encode()) for shard in index.shards]
        path_array = ffi.new("const char *[]", paths)
        tensors = setup.paged
        names = [ffi.new("char[]", t.name.encode()) for t in tensors]
        descs = ffi.new("struct empanel_tensor_desc[]", len(tensors))
        for i, t in enumerate(tensors):
            descs[i].layer = t.layer
            descs[i].file = t.shard
            descs[i].offset = t.offset
            descs[i].expert_size = t.stride
            descs[i].name = names[i]
        params = ffi.new("struct empanel_pool_params *")
        for key, value in setup.params.items():
            setattr(params, key, value)
        self.subst = setup.subst
        self.guess_depth = setup.guess_depth
        self.n_slots = ffi.new("int32_t[]", setup.n_slots)
        self.paged = tensors
        err = ffi.new("char[]", 512)
        self.pool = self.n.sidecar.empanel_pool_init(
            params, path_array, len(paths), index.n_layer, self.n_slots, index.n_expert,
            descs, len(tensors), err, 512)
        if self.pool == ffi.NULL:
            raise _native.NativeLibraryError(f"empanel: {ffi.string(err).decode()}")
        self._keep += [paths, path_array, names, descs]
        if trace:
            self.n.sidecar.empanel_trace_enable(self.pool, 1)

    def set_plan(self):
        """Hand the plan to libllama for the load that follows on this thread."""
        self.n.llama.llama_empanel_set_plan(self.n_slots, self.index.n_layer,
                                            self.n.sidecar.empanel_remap, self.pool)
        if self.guess_depth:
            self.n.llama.llama_empanel_set_guess(self.n.sidecar.empanel_guess, self.guess_depth)
        if self.subst:  # the router's next top-k choices are the candidates
            self.n.llama.llama_empanel_set_subst(self.n.sidecar.empanel_subst, self.index.n_expert_used)

    def clear_plan(self):
        self.n.llama.llama_empanel_clear_plan()

    def bind(self, model, ctx):
        """Point the sidecar at the pool tensors of the loaded model; stop the graph on failure."""
        model_p = self.n.ptr(model)
        n_pools = self.n.llama.llama_empanel_n_pools(model_p)
        tensors = self.paged
        if n_pools != len(tensors):
            raise _native.NativeLibraryError(
                f"empanel: llama.cpp made {n_pools} slot pools for the {len(tensors)} routed-expert "
                f"tensors of {self.index.path}; this architecture's loader is not supported yet")
        self.n_masked = 0
        for t in tensors:
            pool_tensor = self.n.llama.llama_empanel_pool(model_p, t.name.encode())
            if self.n.sidecar.empanel_pool_bind(self.pool, t.name.encode(), pool_tensor) != 0:
                raise _native.NativeLibraryError(f"empanel: {self.error()}")
            self.n_masked += bool(self.n.llama.llama_empanel_pool_masked(pool_tensor))
        self.n.llama.llama_set_abort_callback(self.n.ptr(ctx), self.n.sidecar.empanel_pool_failed, self.pool)

    def failed(self):
        return bool(self.n.sidecar.empanel_pool_failed(self.pool))

    def set_digests(self, digests):
        """Hand saved expert digests ({tensor name: uint64 [n_expert]}) to a verifying pool."""
        ffi = self.n.ffi
        for t in self.paged:
            values = ffi.new("uint64_t[]", [int(v) for v in digests[t.name]])
            if self.n.sidecar.empanel_pool_set_digests(self.pool, t.name.encode(), values, t.n_expert) != 0:
                raise ValueError(f"empanel: digests for {t.name} refused (the pool does not verify)")

    def watching(self):
        """True: the files are watched for writes (inotify); False: size, mtime and ctime checks."""
        return bool(self.n.sidecar.empanel_pool_watching(self.pool))

    def notice(self):
        return self.n.ffi.string(self.n.sidecar.empanel_pool_notice(self.pool)).decode(errors="replace")

    def error(self):
        return self.n.ffi.string(self.n.sidecar.empanel_pool_error(self.pool)).decode(errors="replace")

    def clear_error(self):
        self.n.sidecar.empanel_pool_clear_error(self.pool)

    def stats(self):
        """Per MoE layer and total: hits, misses, bytes read, read and remap time, slots; times
        in seconds (see layer_stats)."""
        out = self.n.ffi.new("struct empanel_layer_stats *")
        raw = {}
        for il in self.index.moe_layers:
            if self.n_slots[il] <= 0:
                continue  # observed only
            self.n.sidecar.empanel_stats_get(self.pool, il, out)
            raw[il] = {key: getattr(out, key) for key in RAW_COUNTERS}
        return layer_stats(raw, self.n_masked)

    def take_trace(self):
        """The routing recorded since the last call: int32 [layer, n_tokens, n_used, ids...]
        per remap call (see empanel_trace_enable)."""
        import numpy as np

        n = self.n.sidecar.empanel_trace_size(self.pool)
        out = np.empty(n, dtype=np.int32)
        got = self.n.sidecar.empanel_trace_take(self.pool, self.n.ffi.cast("int32_t *", out.ctypes.data), n)
        return out[:got]

    def preload(self):
        """Fill the empty slots with experts (lowest ids first) as far as slots and budget go;
        the number of experts read. Raises MoeReadError if a read fails."""
        n = self.n.sidecar.empanel_pool_preload(self.pool)
        if n < 0:
            message = self.error()
            self.clear_error()
            raise MoeReadError(f"preloading experts: {message}")
        return n

    def reset_stats(self):
        self.n.sidecar.empanel_stats_reset(self.pool)

    def slot_table(self, layer):
        """[n_slots] the expert each slot of the layer holds, -1 if empty."""
        return slot_table(self.n, self.pool, layer, self.n_slots[layer])

    def set_preload_order(self, profile, seed_uses=0):
        """Preload fills each paged layer's empty slots with the profile's most used experts first;
        seed_uses > 0: they start with LFU counts up to that, in proportion to their use."""
        for il, (order, uses) in preload_orders(profile, list(self.n_slots), self.index.moe_layers, seed_uses).items():
            buf = self.n.ffi.new("int32_t[]", order)
            ubuf = self.n.ffi.new("uint32_t[]", uses) if uses else self.n.ffi.NULL
            if self.n.sidecar.empanel_pool_preload_order(self.pool, il, buf, ubuf, len(order)) != 0:
                raise ValueError(f"empanel: layer {il}: the profile's preload order was refused")

    def free(self):
        if self.pool is not None:
            self.n.sidecar.empanel_pool_free(self.pool)
            self.pool = None


def slot_table(n, pool, layer, n_slots):
    """empanel_pool_slots as a list: the expert in each of the layer's n_slots slots, -1 if empty."""
    out = n.ffi.new("int32_t[]", max(1, n_slots))
    got = n.sidecar.empanel_pool_slots(pool, layer, out, n_slots)
    return list(out[0:got])


def _rate(hits, misses):
    return hits / (hits + misses) if hits + misses else 0.0


# the counters of struct empanel_layer_stats (times in ns), as the sidecar gives them; a
# program's stats file (csrc/program.c) has the same names
RAW_COUNTERS = ("n_remaps", "n_waves", "n_ids", "hits", "misses", "bytes_read", "io_bytes", "n_reads", "read_ns",
                "wait_ns", "write_ns", "copy_bytes", "remap_ns", "preloaded", "n_slots", "n_resident", "guessed",
                "guess_routed", "guess_hits", "prefetched", "prefetch_used", "prefetch_wasted", "substituted",
                "verified", "verify_ns", "remote_by_hash")


def layer_stats(raw, n_masked=0):
    """{layer: raw counters} -> {"layers": {layer: row}, "total": totals and rates}; *_ns become
    *_s (seconds)."""
    layers = {}
    total = None
    for il, counters in raw.items():
        row = {}
        for key in RAW_COUNTERS:
            value = counters.get(key, 0)
            if key.endswith("_ns"):
                row[key[:-3] + "_s"] = value / 1e9
            else:
                row[key] = value
        row["hit_rate"] = _rate(row["hits"], row["misses"])
        layers[il] = row
        if total is None:
            total = dict.fromkeys((k for k in row if k != "hit_rate"), 0)
        for key in total:
            total[key] += row[key]
    if total is None:
        total = dict.fromkeys((key[:-3] + "_s" if key.endswith("_ns") else key for key in RAW_COUNTERS), 0)
    total["hit_rate"] = _rate(total["hits"], total["misses"])
    total["read_gbps"] = total["io_bytes"] / total["read_s"] / 1e9 if total["read_s"] else 0.0
    total["copy_gbps"] = total["copy_bytes"] / total["write_s"] / 1e9 if total["write_s"] else 0.0
    total["round_trip_us"] = 1e6 * total["remap_s"] / total["n_remaps"] if total["n_remaps"] else 0.0
    # waves per micro-batch and layer; reads done while the graph computed (overlap)
    total["waves_per_batch"] = total["n_waves"] / total["n_remaps"] if total["n_remaps"] else 0.0
    total["hidden_read_s"] = max(0.0, total["read_s"] - total["wait_s"])
    total["masked_pools"] = n_masked
    # the gate-ahead guess: recall over the micro-batches it was made for; read-ahead hits
    total["guess_recall"] = total["guess_hits"] / total["guess_routed"] if total["guess_routed"] else 0.0
    total["prefetch_hit_rate"] = total["prefetch_used"] / total["prefetched"] if total["prefetched"] else 0.0
    return {"layers": layers, "total": total}


def preload_orders(profile, n_slots, moe_layers, seed_uses=0):
    """{paged layer: (experts, LFU counts or None)}: the profile's most used experts first (see
    ExpertPools.set_preload_order)."""
    orders = {}
    for il in moe_layers:
        if n_slots[il] > 0:
            order = profile.order(il)
            row = profile.counts[profile.moe_layers.index(il)]
            top = max(1, int(row.max()))
            uses = [max(1, round(seed_uses * int(row[e]) / top)) for e in order] if seed_uses else None
            orders[il] = ([int(e) for e in order], uses)
    return orders


def summary_line(stats):
    t = stats["total"]
    return (f"empanel: {t['hits']} hits, {t['misses']} misses ({100 * t['hit_rate']:.1f}% hit), "
            f"{t['bytes_read'] / 2**20:.1f} MiB read in {t['read_s']:.3f} s ({t['read_gbps']:.2f} GB/s), "
            f"{t['remap_s']:.3f} s in remap"
            + (f", {t['remote_by_hash']} expert tensors written by RPC hosts from their caches" if t["remote_by_hash"] else "")
            + (f", {t['wire_sent'] / 2**20:.1f} MiB sent to RPC hosts ({t['copy_bytes'] / 2**20:.1f} MiB of experts)"
               if "wire_sent" in t else ""))


class LabPool:
    """The engine's eviction on a pool that reads nothing: `access(layer, experts)` is one remap
    call of csrc/remap.c and returns (hits, misses) over the call's distinct experts.

    n_slots: [n_layer] slots per layer (0: not paged); expert_bytes: [n_layer] bytes of one expert
    (what the g-lru budget counts); budget_bytes: g-lru's budget."""

    def __init__(self, policy, n_slots, n_expert, expert_bytes=None, budget_bytes=0):
        self.n = native()
        ffi = self.n.ffi
        n_layer = len(n_slots)
        self.n_slots = list(n_slots)
        self._slots = ffi.new("int32_t[]", self.n_slots)
        sizes = ffi.new("uint64_t[]", list(expert_bytes) if expert_bytes is not None else [1] * n_layer)
        err = ffi.new("char[]", 512)
        pool = self.n.sidecar.empanel_lab_init(policy_id(policy), n_layer, self._slots, n_expert, sizes,
                                               budget_bytes, err, 512)
        if pool == ffi.NULL:
            raise ValueError(f"empanel lab: {ffi.string(err).decode()}")
        self.pool = ffi.gc(pool, self.n.sidecar.empanel_pool_free)
        self._ids = ffi.new("int32_t[]", max(1, n_expert))
        self._out = ffi.new("int32_t[]", max(1, n_expert))
        self.n_expert = n_expert

    def access(self, layer, experts):
        """One remap call of `layer` over distinct expert ids (at most n_expert): (hits, misses).
        Raises ValueError when the call needs more slots than the layer has (the engine would run
        it in waves) or an id is out of range."""
        n = len(experts)
        if n > self.n_expert:
            raise ValueError(f"empanel lab: {n} expert ids in one call, the model has {self.n_expert} experts")
        self._ids[0:n] = experts
        misses = self.n.sidecar.empanel_lab_access(self.pool, layer, self._ids, n, self._out)
        if misses < 0:
            message = self.n.ffi.string(self.n.sidecar.empanel_pool_error(self.pool)).decode()
            self.n.sidecar.empanel_pool_clear_error(self.pool)
            raise ValueError(f"empanel lab: {message}")
        return n - misses, misses

    def slot_table(self, layer):
        """[n_slots] the expert each slot of the layer holds, -1 if empty."""
        return slot_table(self.n, self.pool, layer, self.n_slots[layer])

    def guess(self, layer, experts):
        """A gate-ahead guess for the layer's next access (its experts are evicted last), as the
        engine's guess hook hands it over (empanel_guess)."""
        n = len(experts)
        self._ids[0:n] = experts
        self.n.sidecar.empanel_guess(self.pool, layer, 1, self._ids, n, n, 1)

    def resident_bytes(self):
        return self.n.sidecar.empanel_pool_resident_bytes(self.pool)

    def preload(self, orders=None):
        """Fill the empty slots as a load's preload does; orders: {layer: experts first} (a
        profile's order), else lowest ids. Returns the experts placed."""
        for layer, order in (orders or {}).items():
            buf = self.n.ffi.new("int32_t[]", list(order))
            if self.n.sidecar.empanel_pool_preload_order(self.pool, layer, buf, self.n.ffi.NULL, len(order)) != 0:
                raise ValueError(f"empanel lab: layer {layer}: preload order refused")
        return self.n.sidecar.empanel_pool_preload(self.pool)

    def stats(self, layer):
        out = self.n.ffi.new("struct empanel_layer_stats *")
        self.n.sidecar.empanel_stats_get(self.pool, layer, out)
        return {"n_remaps": out.n_remaps, "hits": out.hits, "misses": out.misses, "n_resident": out.n_resident}

    def reset_stats(self):
        self.n.sidecar.empanel_stats_reset(self.pool)
