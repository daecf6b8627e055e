"""`Llama`: llama-cpp-python's Llama with expert slot pools for MoE models.

    from empanel_gguf import Llama
    llm = Llama("model.gguf", moe_slots="25%")   # any llama_cpp.Llama argument works as well

With moe_slots=None it is llama_cpp.Llama, unchanged. Otherwise each MoE layer's routed experts
live in a pool of slots; the experts the router picks are read from the GGUF file on demand by the
sidecar. Outputs are bit-identical to the model fully in memory on the same build.
"""

import sys
import time

from . import _native
from ._native import native, use_our_libraries
from .index import load_index
from .sizing import DEFAULT_POLICY, POLICIES, plan_slots

llama_cpp = use_our_libraries()


class MoeReadError(RuntimeError):
    """Reading experts from the model file failed during a decode; nothing was returned."""




class ExpertPools:
    """The sidecar's pools of one model: made before the load, bound to the pool tensors after."""

    def __init__(self, index, plan, policy=DEFAULT_POLICY, io_threads=8, chunk_kb=256, direct_io=True,
                 trace=False):
        self.index = index
        self.plan = plan
        self.n = native()
        ffi = self.n.ffi
        self._keep = []  # cffi buffers that must outlive the C pool
        self.n_masked = 0  # pools whose waves are masked (a GPU kernel may compute on them): bind()

        paths = [ffi.new("char[]", str(shard.path).encode()) for shard in index.shards]
        path_array = ffi.new("const char *[]", paths)
        n_slots = list(plan.n_slots) if plan is not None else [0] * index.n_layer
        if trace:  # layers without a pool are observed: their routing is traced too
            n_slots = [-1 if n == 0 and il in index.moe_layers else n for il, n in enumerate(n_slots)]
        paged = [t for t in index.expert_tensors() if n_slots[t.layer] > 0]
        tensors = paged
        names = [ffi.new("char[]", t.name.encode()) for t in tensors]
        descs = ffi.new("struct empanel_tensor_desc[]", len(tensors))
        for i, t in enumerate(tensors):
            descs[i].layer = t.layer
            descs[i].file = t.shard
            descs[i].offset = t.offset
            descs[i].expert_size = t.stride
            descs[i].name = names[i]
        if io_threads < 0 or chunk_kb < 4:
            raise ValueError(f"moe_io_threads={io_threads}, moe_chunk_kb={chunk_kb}: need >= 0 threads, >= 4 KiB")
        params = ffi.new("struct empanel_pool_params *")
        params.n_threads = io_threads
        params.chunk_bytes = chunk_kb * 1024
        params.direct_io = 1 if direct_io else -1
        params.policy = POLICIES[policy]
        params.budget_bytes = plan.budget_bytes if plan is not None else 0
        self.n_slots = ffi.new("int32_t[]", n_slots)
        self.paged = paged
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

    def notice(self):
        return self.n.ffi.string(self.n.sidecar.empanel_pool_notice(self.pool)).decode(errors="replace")

    def error(self):
        return self.n.ffi.string(self.n.sidecar.empanel_pool_error(self.pool)).decode(errors="replace")

    def clear_error(self):
        self.n.sidecar.empanel_pool_clear_error(self.pool)

    def stats(self):
        """Counters per MoE layer and in total (times in seconds)."""
        ffi = self.n.ffi
        out = ffi.new("struct empanel_layer_stats *")
        layers = {}
        total = dict.fromkeys(("n_remaps", "n_waves", "n_ids", "hits", "misses", "bytes_read", "io_bytes",
                               "n_reads", "read_s", "wait_s", "write_s", "copy_bytes", "remap_s",
                               "preloaded", "n_slots", "n_resident"), 0)
        for il in self.index.moe_layers:
            if self.n_slots[il] <= 0:
                continue  # observed only
            self.n.sidecar.empanel_stats_get(self.pool, il, out)
            row = {
                "n_remaps": out.n_remaps, "n_waves": out.n_waves, "n_ids": out.n_ids, "hits": out.hits,
                "misses": out.misses, "bytes_read": out.bytes_read, "io_bytes": out.io_bytes,
                "n_reads": out.n_reads, "read_s": out.read_ns / 1e9, "wait_s": out.wait_ns / 1e9,
                "write_s": out.write_ns / 1e9,
                "copy_bytes": out.copy_bytes,
                "remap_s": out.remap_ns / 1e9, "preloaded": out.preloaded,
                "n_slots": out.n_slots, "n_resident": out.n_resident,
            }
            row["hit_rate"] = _rate(row["hits"], row["misses"])
            layers[il] = row
            for key in total:
                total[key] += row[key]
        total["hit_rate"] = _rate(total["hits"], total["misses"])
        total["read_gbps"] = total["io_bytes"] / total["read_s"] / 1e9 if total["read_s"] else 0.0
        total["copy_gbps"] = total["copy_bytes"] / total["write_s"] / 1e9 if total["write_s"] else 0.0
        total["round_trip_us"] = 1e6 * total["remap_s"] / total["n_remaps"] if total["n_remaps"] else 0.0
        # waves per micro-batch and layer; reads done while the graph computed (overlap)
        total["waves_per_batch"] = total["n_waves"] / total["n_remaps"] if total["n_remaps"] else 0.0
        total["hidden_read_s"] = max(0.0, total["read_s"] - total["wait_s"])
        total["masked_pools"] = self.n_masked
        return {"layers": layers, "total": total}

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

    def free(self):
        if self.pool is not None:
            self.n.sidecar.empanel_pool_free(self.pool)
            self.pool = None


def _rate(hits, misses):
    return hits / (hits + misses) if hits + misses else 0.0


def summary_line(stats):
    t = stats["total"]
    return (f"empanel: {t['hits']} hits, {t['misses']} misses ({100 * t['hit_rate']:.1f}% hit), "
            f"{t['bytes_read'] / 2**20:.1f} MiB read in {t['read_s']:.3f} s ({t['read_gbps']:.2f} GB/s), "
            f"{t['remap_s']:.3f} s in remap")


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with expert slot pools for MoE models.

    Args:
        model_path: path to the GGUF model (the first shard of a split model).
        moe_slots: slots per MoE layer: a count (32), a share of the experts ("25%"), a memory
            budget for all pools ("6GiB"), or "auto": every expert resident if the model fits in
            the available memory (minus a floor), else the most slots that fit. None: stock
            behaviour, every expert resident.
        moe_policy: which expert a full pool evicts: "lfu-decay" (per layer, the least used,
            counts halving over time; default), "lru" (per layer, the least recent), or "g-lru"
            (one budget for all layers, the least recent expert of any layer goes; host pools
            take memory only for the experts they hold).
        moe_io_threads: reader threads besides the decoding thread (default 8).
        moe_chunk_kb: KiB per read request (default 256); an expert is read in such chunks by
            all reader threads at once.
        moe_direct_io: read experts with O_DIRECT, bypassing the page cache (default True; falls
            back to buffered reads with a notice where the file system refuses it).
        moe_trace: record every token's routed experts in every MoE layer (moe_take_trace()),
            with or without slot pools; outputs are unchanged.
        moe_preload: read experts into the empty slots at load (lowest expert ids first, as far
            as the slots and the g-lru budget go). None (default): only when every pool holds all
            its layer's experts, so that such a load is resident from the first token like a
            stock load; False: every expert is read on its first use.
        **kwargs: passed to llama_cpp.Llama unchanged (n_ubatch included: a micro-batch whose
            experts exceed the pools runs in waves that fit them, in every build).
    """

    def __init__(self, model_path, *args, moe_slots=None, moe_policy=DEFAULT_POLICY, moe_io_threads=8,
                 moe_chunk_kb=256, moe_direct_io=True, moe_trace=False, moe_preload=None, **kwargs):
        self._experts = None
        self.moe_slots = moe_slots    # as asked ("auto" resolved below)
        self.moe_policy = moe_policy
        verbose = kwargs.get("verbose", True)
        index = plan = None
        if moe_slots is not None or moe_trace:
            index = load_index(model_path)
        if moe_slots == "auto":
            moe_slots = self.moe_slots = _auto_slots(index, kwargs, verbose)
        if moe_slots is not None and not index.is_moe:
            _notice(verbose, f"{model_path}: no routed experts ({index.architecture}); "
                             "moe_slots ignored, loading as usual")
            moe_slots = None
        if moe_slots is not None:
            plan = self._plan(index, moe_slots, moe_policy, kwargs, verbose)
        if plan is None and not (moe_trace and index.is_moe):
            super().__init__(model_path, *args, **kwargs)
            return

        experts = ExpertPools(index, plan, policy=moe_policy, io_threads=moe_io_threads,
                              chunk_kb=moe_chunk_kb, direct_io=moe_direct_io, trace=moe_trace)
        if experts.notice():
            _notice(verbose, experts.notice())
        experts.set_plan()
        try:
            super().__init__(model_path, *args, **kwargs)
            experts.bind(self._model.model, self._ctx.ctx)
            if plan is not None and (plan.holds_all if moe_preload is None else moe_preload):
                _preload(experts, verbose)
        except BaseException:
            experts.clear_plan()
            if hasattr(self, "_stack"):  # llama_cpp's part loaded: free it before the pools
                super().close()
            experts.free()
            raise
        experts.clear_plan()
        self._experts = experts
        self._wrap_decode()

    @staticmethod
    def _plan(index, moe_slots, moe_policy, kwargs, verbose):
        """Slots per layer (micro-batches of any size run in waves that fit the pools)."""
        if moe_policy not in POLICIES:
            raise ValueError(f"moe_policy={moe_policy!r}: one of {', '.join(POLICIES)}")
        plan = plan_slots(index, moe_slots, moe_policy)
        for text in plan.notices:
            _notice(verbose, text)
        if plan.budget_bytes:
            _notice(verbose, f"g-lru: {plan.budget_bytes / 2**20:.1f} MiB of experts shared by "
                             f"{len(index.layers)} MoE layers, up to {plan.min_slots} of {plan.n_expert} "
                             f"per layer ({index.expert_bytes_total / 2**20:.1f} MiB of experts in all)")
        else:
            _notice(verbose, f"{plan.min_slots} of {plan.n_expert} expert slots in each of "
                             f"{len(index.layers)} MoE layers, {plan.pool_bytes / 2**20:.1f} MiB of pools "
                             f"instead of {index.expert_bytes_total / 2**20:.1f} MiB of experts")
        return plan

    prompt_progress = None  # a progress.PromptProgress: long prompt evaluations report progress

    def eval(self, tokens):
        """llama_cpp.Llama.eval; with prompt_progress set, a prompt of several tokens that takes
        long shows its progress."""
        progress = self.prompt_progress
        if progress is None or len(tokens) <= 1:
            return super().eval(tokens)
        with progress.track(self, len(tokens)):
            return super().eval(tokens)

    def moe_take_trace(self):
        """Routing recorded since the last call (moe_trace=True): int32 [layer, n_tokens, n_used,
        expert ids...] per micro-batch and MoE layer; see empanel_gguf.trace."""
        if self._experts is None:
            raise ValueError("no routing trace: load with moe_trace=True (a MoE model)")
        return self._experts.take_trace()

    def _wrap_decode(self):
        """Make a failed expert read surface as MoeReadError from every decode path."""
        ctx = self._ctx
        decode = ctx.decode
        experts = self._experts

        def decode_checked(batch):
            try:
                result = decode(batch)
            except RuntimeError as e:
                if experts.failed():
                    message = experts.error()
                    experts.clear_error()
                    raise MoeReadError(message) from e
                raise
            if experts.failed():  # failed without llama_decode noticing: never return its output
                message = experts.error()
                experts.clear_error()
                raise MoeReadError(message)
            return result

        ctx.decode = decode_checked

    def moe_stats(self):
        """Per MoE layer and total: hits, misses, bytes read, read and remap time, slots; None
        without slot pools."""
        return self._experts.stats() if self._experts is not None else None

    def close(self):
        experts, self._experts = getattr(self, "_experts", None), None
        if experts is not None and getattr(self, "verbose", False):
            print(summary_line(experts.stats()), file=sys.stderr)
        if hasattr(self, "_stack"):  # absent when __init__ failed before llama_cpp's part
            super().close()
        if experts is not None:
            experts.free()  # after the model: its graph calls into the pools


def _preload(experts, verbose):
    t0 = time.perf_counter()
    n = experts.preload()
    total = experts.stats()["total"]
    _notice(verbose, f"preloaded {n} experts ({total['bytes_read'] / 2**20:.1f} MiB) into the pools "
                     f"in {time.perf_counter() - t0:.2f} s ({total['read_gbps']:.2f} GB/s)")


def _auto_slots(index, kwargs, verbose):
    """moe_slots="auto": the most slots that fit in available memory minus the floor (see
    memory.py), or None when every expert fits."""
    from . import memory

    n_ctx = kwargs.get("n_ctx", 512)
    slots, _, est, available, floor, notes = memory.preflight(
        index, "auto", n_ctx=n_ctx if n_ctx > 0 else memory.DEFAULT_N_CTX,
        n_batch=kwargs.get("n_batch", 512), n_ubatch=kwargs.get("n_ubatch", 512),
        n_gpu_layers=kwargs.get("n_gpu_layers", 0), logits_all=kwargs.get("logits_all", False),
        force=True)
    for text in notes:
        _notice(verbose, text)
    return slots


def _notice(verbose, text):
    if verbose:
        print(f"empanel: {text}", file=sys.stderr)
