"""The sidecar's pools as Python sees them (cffi over csrc/empanel.h).

    ExpertPools   the slot pools of one load, made from its plan (plan.LoadPlan) by the sidecar's
                  load steps (csrc/load.c, as for llama.cpp's programs); stats, trace, errors
    LabPool       a pool without files (empanel_lab_init): the engine's own policy code replayed
                  over routing calls, for the policy lab (lab/policies.py, lab/replay.py)
    prometheus_pools, prometheus_label
                  the sidecar's Prometheus text of models' pools and its label escape
                  (csrc/metrics.c: the one writer, llama.cpp's programs' /metrics too)
"""

import numpy as np

from ..abi.header import COUNTERS, policy_id
from ..planning.plan_file import load_text
from .native import NativeLibraryError, native
from .stats import layer_stats


class MoeReadError(RuntimeError):
    """Reading experts from the model file failed during a decode; nothing was returned."""


class ExpertPools:
    """The sidecar's pools of one load, made from its plan (plan.LoadPlan) through the same C entry
    points as llama.cpp's programs (csrc/load.c): open before the model load, bind after it."""

    def __init__(self, load):
        self.index = load.index
        self.plan = load.plan
        self.n = native()
        ffi = self.n.ffi
        self.n_slots = list(load.pools.n_slots)
        self.n_masked = 0  # pools whose waves are masked (a GPU kernel may compute on them): bind()
        self.load = self.pool = None
        err = ffi.new("char[]", 512)
        text = load_text(load).encode()
        handle = self.n.sidecar.empanel_load_open(text, ffi.NULL, str(self.index.path).encode(), err, 512)
        if handle == ffi.NULL:
            raise NativeLibraryError(f"empanel: {ffi.string(err).decode(errors='replace') or 'no plan'}")
        self.load = handle
        self.pool = self.n.sidecar.empanel_load_pool(handle)
        if load.options.trace:
            self.n.sidecar.empanel_trace_enable(self.pool, 1)

    def begin(self):
        """Hand the plan to libllama for the model load that follows on this thread."""
        self.n.sidecar.empanel_load_begin(self.load)

    def clear_plan(self):
        self.n.llama.llama_empanel_clear_plan()

    def bind(self, model, ctx):
        """Point the sidecar at the pool tensors of the loaded model and hand over the preload
        order; stop the graph when a read fails."""
        err = self.n.ffi.new("char[]", 512)
        if self.n.sidecar.empanel_load_bind(self.load, self.n.ptr(model), err, 512) != 0:
            raise NativeLibraryError(f"empanel: {self.n.ffi.string(err).decode(errors='replace')}")
        self.n_masked = self.n.sidecar.empanel_load_masked(self.load)
        self.n.llama.llama_set_abort_callback(self.n.ptr(ctx), self.n.sidecar.empanel_pool_failed, self.pool)

    def failed(self):
        return bool(self.n.sidecar.empanel_pool_failed(self.pool))

    def watching(self):
        """True: the files are watched for writes (inotify); False: size, mtime and ctime checks."""
        return bool(self.n.sidecar.empanel_pool_watching(self.pool))

    def read_io(self):
        """The read path the pool took: "threads" or "uring"."""
        uring = self.n.sidecar.empanel_pool_read_io(self.pool) == self.n.sidecar.EMPANEL_READ_IO_URING
        return "uring" if uring else "threads"

    def notice(self):
        return self.n.ffi.string(self.n.sidecar.empanel_pool_notice(self.pool)).decode(errors="replace")

    def error(self):
        return self.n.ffi.string(self.n.sidecar.empanel_pool_error(self.pool)).decode(errors="replace")

    def clear_error(self):
        self.n.sidecar.empanel_pool_clear_error(self.pool)

    def stats(self):
        """Per MoE layer and total: hits, misses, bytes read, read and remap time, slots; times
        in seconds (see stats.layer_stats)."""
        out = self.n.ffi.new("struct empanel_layer_stats *")
        raw = {}
        for il in self.index.moe_layers:
            if self.n_slots[il] <= 0:
                continue  # observed only
            self.n.sidecar.empanel_stats_get(self.pool, il, out)
            raw[il] = {c.field: getattr(out, c.field) for c in COUNTERS}
        return layer_stats(raw, self.n_masked, self.index.n_expert_used)

    def take_trace(self):
        """The routing recorded since the last call: int32 [layer, n_tokens, n_used, ids...]
        per remap call (see empanel_trace_enable)."""
        n = self.n.sidecar.empanel_trace_size(self.pool)
        out = np.empty(n, dtype=np.int32)
        got = self.n.sidecar.empanel_trace_take(self.pool, self.n.ffi.cast("int32_t *", out.ctypes.data), n)
        return out[:got]

    def preload(self):
        """Fill the empty slots as the plan says (the profile's order, else lowest ids first, as
        far as slots and budget go); the number of experts read. Raises MoeReadError if a read
        fails."""
        err = self.n.ffi.new("char[]", 512)
        n = self.n.sidecar.empanel_load_preload(self.load, err, 512)
        if n < 0:
            raise MoeReadError(self.n.ffi.string(err).decode(errors="replace"))
        return n

    def reset_stats(self):
        self.n.sidecar.empanel_stats_reset(self.pool)

    def set_budget(self, budget_bytes):
        """Move the live budget of resident expert bytes over all layers (csrc/budget.c); a lower
        one gives slots back at once. ValueError from the sidecar's reason (below the floor,
        pools that cannot give memory back)."""
        err = self.n.ffi.new("char[]", 256)
        if self.n.sidecar.empanel_pool_set_budget(self.pool, int(budget_bytes), err, 256) != 0:
            raise ValueError(f"moe_set_budget: {self.n.ffi.string(err).decode(errors='replace')}")

    def watch_memory(self, sources, reserve_bytes, interval_ms=20):
        """Start the controller (csrc/pressure.c) on `sources` (host_memory.memory_sources()'s
        form), keeping reserve_bytes free; the plan does this for moe_elastic loads. ValueError
        from the sidecar's reason."""
        structs, keep = memory_sources_c(self.n, sources)
        err = self.n.ffi.new("char[]", 256)
        if self.n.sidecar.empanel_pool_watch_memory(self.pool, structs, len(sources), int(reserve_bytes),
                                                    int(interval_ms), err, 256) != 0:
            raise ValueError(f"moe_elastic: {self.n.ffi.string(err).decode(errors='replace')}")

    def budget(self):
        """The live budget and its controller: struct empanel_budget_stats as a dict
        (budget_bytes, capacity_bytes, floor_bytes, resident_bytes, lowest_bytes, n_changes,
        given_back_bytes, elastic, fixed, n_shrinks, n_grows, available_bytes (None: unknown),
        reserve_bytes, last_shrink_ms, max_shrink_ms, ceiling_bytes, n_events, n_unread,
        hears_kernel, max_lock_wait_ms, max_over_bytes)."""
        out = self.n.ffi.new("struct empanel_budget_stats *")
        self.n.sidecar.empanel_pool_budget(self.pool, out)
        figures = {name: getattr(out, name) for name, _ in self.n.ffi.typeof(out[0]).fields}
        for flag in ("elastic", "fixed", "hears_kernel"):
            figures[flag] = bool(figures[flag])
        if figures["available_bytes"] == (1 << 64) - 1:
            figures["available_bytes"] = None
        return figures

    def slot_table(self, layer):
        """[n_slots] the expert each slot of the layer holds, -1 if empty."""
        return slot_table(self.n, self.pool, layer, self.n_slots[layer])

    def settle(self):
        """The reads in flight land now: before llama.cpp frees the model's buffers (Llama.close)."""
        if self.pool is not None:
            self.n.sidecar.empanel_pool_settle(self.pool)

    def free(self):
        if self.load is not None:
            self.n.sidecar.empanel_load_close(self.load)
            self.load = self.pool = None


def slot_table(n, pool, layer, n_slots):
    """empanel_pool_slots as a list: the expert in each of the layer's n_slots slots, -1 if empty."""
    out = n.ffi.new("int32_t[]", max(1, n_slots))
    got = n.sidecar.empanel_pool_slots(pool, layer, out, n_slots)
    return list(out[0:got])


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
        self.pool = ffi.gc(pool, self.n.sidecar.empanel_lab_free)
        self._ids = ffi.new("int32_t[]", max(1, n_expert))
        self.n_expert = n_expert

    def access(self, layer, experts):
        """One remap call of `layer` over distinct expert ids, as one token routed to all of them:
        (hits, misses). Raises ValueError when an id is out of range."""
        return self.access_batch(layer, [list(experts)])

    def access_batch(self, layer, rows):
        """One remap call of `layer` over a micro-batch, rows [n_tokens][n_used] of expert ids, as
        the engine makes it (waves where its distinct experts exceed the slots): (hits, misses)
        over its distinct experts."""
        ids = np.ascontiguousarray(rows, dtype=np.int32)
        if ids.ndim != 2:
            raise ValueError(f"empanel lab: expert ids of shape {ids.shape}, expected [n_tokens, n_used]")
        n_tokens, n_used = ids.shape
        n = len(np.unique(ids)) if ids.size else 0
        misses = self.n.sidecar.empanel_lab_access(self.pool, layer, self.n.ffi.from_buffer("int32_t[]", ids),
                                                   n_used, n_tokens)
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
            if self.n.sidecar.empanel_preload_order(self.pool, layer, buf, self.n.ffi.NULL, len(order)) != 0:
                raise ValueError(f"empanel lab: layer {layer}: preload order refused")
        return self.n.sidecar.empanel_preload(self.pool)

    def stats(self, layer):
        out = self.n.ffi.new("struct empanel_layer_stats *")
        self.n.sidecar.empanel_stats_get(self.pool, layer, out)
        return {"n_remaps": out.n_remaps, "hits": out.hits, "misses": out.misses, "n_resident": out.n_resident}

    def reset_stats(self):
        self.n.sidecar.empanel_stats_reset(self.pool)


def _sidecar_text(write):
    """What write(buf, size) puts into a buffer, grown until the whole text fits (it returns the
    length of the whole text, as the sidecar's writers do)."""
    ffi = native().ffi
    size = 1 << 16
    while True:
        buf = ffi.new("char[]", size)
        n = write(buf, size)
        if n < size:
            return ffi.string(buf).decode(errors="replace")
        size = n + 4096  # (the counters grew meanwhile: try again)


def prometheus_pools(pools, models):
    """Prometheus text of models[i] and its ExpertPools pools[i] (None: a model without them):
    empanel_slot_pools, the per-layer and budget families, empanel_hit_rate, the RPC reloads;
    written by the sidecar (csrc/metrics.c), the one writer llama.cpp's programs' /metrics use too."""
    n = native()
    handles = n.ffi.new("struct empanel_pool *[]", [p.pool if p is not None else n.ffi.NULL for p in pools])
    names = [n.ffi.new("char[]", str(m).encode()) for m in models]
    labels = n.ffi.new("const char *[]", names)
    return _sidecar_text(lambda buf, size: n.sidecar.empanel_metrics_pools(handles, labels, len(pools), buf, size))


def prometheus_label(value):
    """A label value escaped as the Prometheus text format wants it (backslash, double quote,
    newline), as the sidecar escapes every label it writes (csrc/metrics.c)."""
    n = native()
    raw = str(value).encode()
    return _sidecar_text(lambda buf, size: n.sidecar.empanel_metrics_label(raw, buf, size))


def memory_sources_c(n, sources):
    """host_memory.memory_sources()'s dicts as a cffi array of struct empanel_memory_source, and
    the strings it points to (keep them alive while it is used)."""
    structs = n.ffi.new("struct empanel_memory_source[]", max(1, len(sources)))
    keep = []
    fields = {"limit": "limit_path", "high": "high_path", "usage": "usage_path", "stat": "stat_path",
              "stat_key": "stat_key", "events": "events_path", "available": "available_path",
              "available_key": "available_key"}
    for i, source in enumerate(sources):
        for key, field in fields.items():
            if source.get(key):
                keep.append(n.ffi.new("char[]", str(source[key]).encode()))
                setattr(structs[i], field, keep[-1])
    return structs, keep
