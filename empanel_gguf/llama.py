"""`Llama`: llama-cpp-python's Llama with expert slot pools for MoE models.

    from empanel_gguf import Llama
    llm = Llama("model.gguf", moe_slots="25%")   # any llama_cpp.Llama argument works as well

With moe_slots=None it is llama_cpp.Llama, unchanged. Otherwise each MoE layer's routed experts
live in a pool of slots; the experts the router picks are read from the GGUF file on demand by the
sidecar. Outputs are bit-identical to the model fully in memory on the same build.
"""

import contextlib
import sys
import threading
import time
from pathlib import Path

from .engine.native import use_our_libraries
from .planning.estimate import set_offload_probe, set_unified_probe
from .planning.format import format_bytes
from .planning.index import ModelError, load_index
from .planning.plan import moe_options, plan_load, print_notices, resolve_repack, stock_equivalent
from .engine.pools import ExpertPools, MoeReadError
from .engine.rpc import lost_error, lost_servers, offload_devices, unified_devices
from .engine.rpc import use_servers as use_rpc_servers
from .engine.rpc import wire_counts as rpc_wire_counts
from .engine.stats import summary_line

llama_cpp = use_our_libraries()
set_offload_probe(lambda: offload_devices() > 0)  # the estimate's question, answered by this build
set_unified_probe(unified_devices)  # moe_host_cache's: do the offload devices share host memory

__all__ = ["Llama", "MoeReadError"]


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with expert slot pools for MoE models.

    Args:
        model_path: path to the GGUF model (the first shard of a split model).
        moe_slots: slots per MoE layer: a count (32), a share of the experts ("25%"), a memory
            budget for all pools ("6GiB"), or "auto": every expert resident if the model fits in
            the available memory (minus a floor), else the most slots that fit. None: stock
            behaviour, every expert resident.
        moe_policy: which expert a full pool evicts: "auto" (default: the policy `calibrate`
            ranked best for this file at the planned slots, from its profile; else "lfu-decay"),
            "lfu-decay" (per layer, the least used, counts halving over time), "lru" (per layer, the least recent), or "g-lru"
            (one budget for all layers, the least recent expert of any layer goes; host pools
            take memory only for the experts they hold).
        moe_io_threads: reader threads besides the decoding thread on the threads path (default
            8; 0: the decoding thread reads alone, in the remap, on either path).
        moe_chunk_kb: KiB per read request (default 256); an expert is read in such chunks by
            all reader threads at once.
        moe_read_io: how reads are issued: "threads" (moe_io_threads threads, pread each),
            "uring" (one thread keeps moe_queue_depth reads in flight with io_uring; where the
            build or the kernel has none, the threads, with a notice) or "auto" (default: io_uring
            where there is one, measured faster with less CPU: docs/performance.md).
            EMPANEL_READ_IO=threads|uring overrides it.
        moe_queue_depth: io_uring: read requests in flight at most (default 32).
        moe_direct_io: read experts with O_DIRECT, bypassing the page cache (default True; falls
            back to buffered reads with a notice where the file system refuses it).
        moe_trace: record every token's routed experts in every MoE layer (moe_take_trace()),
            with or without slot pools; outputs are unchanged.
        moe_preload: read experts into the empty slots at load (lowest expert ids first, as far
            as the slots and the g-lru budget go). None (default): only when every pool holds all
            its layer's experts, so that such a load is resident from the first token like a
            stock load; False: every expert is read on its first use.
        moe_profile: a calibration profile (empanel-gguf calibrate) whose most used experts fill
            the empty slots at load: "auto" (default) uses the saved profile of this model file
            if there is one, a path uses that file (refused if it is another model's), None
            starts cold. With a profile, moe_preload=None preloads.
        moe_guess: the gate-ahead guess (default True): while a layer runs a micro-batch that fits
            its pools, the next layer's router is applied to this layer's FFN input; the experts
            it names are evicted last by the next layer. Costs one small matmul per layer, no
            reads; outputs are unchanged.
        moe_prefetch: N > 0 also reads the guessed experts that are not resident while the
            layer N or fewer layers before computes (guesses made N layers ahead; read in a lane
            of their own behind the layer's own reads, the likeliest guesses first). When the
            guessed layer's remap comes, the reads of guesses it does not route to are dropped
            unread. "auto" (default): 1 where the pools page in the plain layout under a
            per-layer policy (measured faster there), else 0. 0: no read-ahead.
        moe_subst: routing substitution, opt-in and inexact: a ratio r in (0, 1]. When a routed expert
            is not resident, the best resident expert among the router's next top-k choices
            stands in if its score is at least r x the missing one's, with its own routing weight.
            Saves reads, changes outputs (measure with empanel-gguf kl). None (default): exact.
        moe_verify: check every expert read against its XXH3-64 digest before it is used (a
            mismatch fails the decode with MoeReadError): the digests `empanel-gguf verify` saved
            for this file, else each expert's first read. Outputs unchanged. Default False.
        moe_repack: the weight layout. "auto" (the default): stock's defaults (CPU repack
            buffers) where the pools hold every expert, and none where they page, as llama.cpp's
            --no-repack (use_extra_bufts=False), pools included: reads land in the slots, nothing
            is repacked; measured faster when paging (docs/performance.md). True / False force
            one. Outputs equal stock loaded with the same layout; moe_stats()["exact_to"] names it.
        moe_host_cache: a host-RAM tier for pools in device memory (layers offloaded to a GPU), as
            a size ("16GiB") or bytes: experts the pools read stay in host memory (pinned where the
            backend offers it), and a miss is written from there before the drive is asked. None
            (default): no tier. Refused where the pools are in host memory already, and on a
            unified-memory device (an integrated GPU, Metal), where it would hold every cached expert
            twice, unless moe_host_cache_unified=True. moe_stats() counts host_hits and host_bytes.
        moe_mtp: load the file's MTP ("nextn") blocks as llama.cpp does for MTP drafting
            (llama_model_params.load_mtp; --spec-type draft-mtp in its programs), with or without
            slots. Their MoE layers then get pools like the others. Default False: llama.cpp
            skips the blocks, and so do the pools (no pool, no memory, no reads).
        moe_resident_layers: the first N MoE layers keep every expert in memory, as a stock load
            does (llama.cpp users know the idea from --n-cpu-moe); the others get slot pools. A
            size for moe_slots covers the resident layers' experts too.
        rpc_servers: "HOST:PORT,..." of ggml-rpc-server processes (llama.cpp's --rpc; `empanel-gguf
            rpc-server` starts one): their devices are registered before the load, and the
            offloaded layers (n_gpu_layers, all by default when rpc_servers is given) go to them
            with their slot pools; a miss writes the expert there, by hash once the host's cache
            (rpc-server -c) has seen it. Outputs equal the same placement without slots.
        moe_load: a load already planned (plan.plan_load(index, moe_slots, kwargs, options=...)),
            as the commands do after printing its report and letting the memory guard decide: it
            replaces moe_slots and the other moe_* arguments, and nothing is planned again.
        **kwargs: passed to llama_cpp.Llama unchanged (n_ubatch included: a micro-batch whose
            experts exceed the pools runs in waves that fit them, in every build).
    """

    def __init__(self, model_path, *args, moe_slots=None, moe_policy="auto", moe_io_threads=8,
                 moe_chunk_kb=256, moe_read_io="auto", moe_queue_depth=32, moe_direct_io=True, moe_trace=False,
                 moe_preload=None, moe_resident_layers=0, moe_profile="auto", moe_guess=True, moe_prefetch="auto", moe_subst=None,
                 moe_verify=False, moe_repack="auto", moe_host_cache=None, moe_host_cache_unified=False,
                 moe_mtp=False, rpc_servers=None, moe_load=None, **kwargs):
        self._experts = None
        unknown = [key for key in kwargs if key.startswith("moe_")]
        if unknown:  # llama_cpp.Llama would swallow a misspelt option and load stock
            moe_options(**{key: kwargs[key] for key in unknown})  # raises, naming the valid ones
        self.rpc_servers = use_rpc_servers(rpc_servers, kwargs)
        verbose = kwargs.get("verbose", True)
        if moe_load is None and (moe_slots is not None or moe_trace):
            options = moe_options(moe_policy=moe_policy, moe_io_threads=moe_io_threads, moe_chunk_kb=moe_chunk_kb,
                                  moe_read_io=moe_read_io, moe_queue_depth=moe_queue_depth,
                                  moe_direct_io=moe_direct_io, moe_trace=moe_trace, moe_preload=moe_preload,
                                  moe_resident_layers=moe_resident_layers, moe_profile=moe_profile,
                                  moe_guess=moe_guess, moe_prefetch=moe_prefetch, moe_subst=moe_subst,
                                  moe_verify=moe_verify, moe_repack=moe_repack, moe_host_cache=moe_host_cache,
                                  moe_host_cache_unified=moe_host_cache_unified, moe_mtp=moe_mtp)
            moe_load = _plan(model_path, moe_slots, options, kwargs)
            print_notices(moe_load.warnings)  # whatever verbose is: a damaged cache file is never silent
            print_notices(moe_load.notes, verbose)
        elif moe_load is not None and Path(moe_load.index.path).resolve() != Path(model_path).resolve():
            raise ValueError(f"moe_load was planned for {moe_load.index.path}, not {model_path}")
        self.moe_load = moe_load
        self.moe_repack = moe_load.options.repack if moe_load is not None else resolve_repack(moe_repack, None)
        self.moe_mtp = moe_load.options.mtp if moe_load is not None else bool(moe_mtp)
        self.moe_slots = moe_load.moe_slots if moe_load is not None else None  # "auto" resolved
        self.moe_policy = moe_load.options.policy if moe_load is not None else moe_policy
        self.moe_prefetch = moe_load.options.prefetch if self.moe_slots is not None else 0
        if moe_load is None or moe_load.pools is None:
            self._load_llama(model_path, args, kwargs)
            if self.rpc_servers:
                self._wrap_decode()
            return

        experts = ExpertPools(moe_load)
        if experts.notice():
            print_notices([experts.notice()], verbose)
        try:
            experts.begin()
            self._load_llama(model_path, args, kwargs)
            experts.bind(self._model.model, self._ctx.ctx)
            if moe_load.preload:
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

    def _load_llama(self, model_path, args, kwargs):
        """llama_cpp.Llama's own load, its failures on a corrupt file said as ModelError (a
        ValueError): llama-cpp-python decodes every metadata value as UTF-8 and compiles every
        chat template it finds."""
        try:
            with model_params(use_extra_bufts=None if self.moe_repack else False, load_mtp=self.moe_mtp or None):
                super().__init__(model_path, *args, **kwargs)
        except UnicodeDecodeError as e:
            raise ModelError(model_path, f"a metadata value is not valid UTF-8 ({e.reason} at byte {e.start}); "
                             "the file is corrupt: download or convert it again") from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):  # TemplateSyntaxError and kin
                raise ModelError(model_path, f"its chat template (tokenizer.chat_template) does not parse: {e}; "
                                 "the file is corrupt, or fix the template in its metadata") from None
            raise

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
        expert ids...] per micro-batch and MoE layer; see empanel_gguf.lab.trace."""
        if self._experts is None:
            raise ValueError("no routing trace: load with moe_trace=True (a MoE model)")
        return self._experts.take_trace()

    def _wrap_decode(self):
        """Make a failed expert read surface as MoeReadError, and a lost RPC host as RpcError,
        from every decode path."""
        ctx = self._ctx
        decode = ctx.decode
        experts = self._experts
        hosts = bool(self.rpc_servers)

        def failure(decode_failed):
            """Why the decode's outputs are not the model's, as the exception to raise; else None.
            A host lost during a decode fails it (llama_decode returns -3, patch 0010): only a
            failed decode asks which hosts are lost."""
            lost = lost_servers() if hosts and decode_failed else []
            if lost:  # first: a lost host fails the expert writes too
                return lost_error(lost)
            if experts is not None and experts.failed():
                message = experts.error()
                experts.clear_error()
                return MoeReadError(message)
            return None

        def decode_checked(batch):
            try:
                result = decode(batch)
            except RuntimeError as e:
                error = failure(True)
                if error is not None:
                    raise error from e
                raise
            error = failure(False)  # a read failed without llama_decode noticing: never return its output
            if error is not None:
                raise error
            return result

        ctx.decode = decode_checked

    @property
    def moe_file_check(self):
        """How a change to the loaded file is noticed: "inotify" (any write, any mtime), "stat"
        (size, mtime and ctime at each remap), or None without slot pools."""
        if self._experts is None:
            return None
        return "inotify" if self._experts.watching() else "stat"

    def moe_stats(self):
        """Per MoE layer and total: hits, misses, bytes read, read and remap time, slots, and
        "exact_to": the stock llama.cpp configuration whose logits these equal bit for bit, and
        "read_io": the read path taken ("threads" or "uring"); None without slot pools. With
        rpc_servers the total also has wire_sent, wire_received (bytes this process exchanged with
        the RPC servers so far) and round_trips (commands it waited for an answer to)."""
        if self._experts is None:
            return None
        stats = self._experts.stats()
        options = self.moe_load.options if self.moe_load is not None else None
        stats["exact_to"] = stock_equivalent(self.moe_repack, options.subst if options is not None else None)
        stats["read_io"] = self._experts.read_io()
        if self.rpc_servers:
            total = stats["total"]
            total["wire_sent"], total["wire_received"], total["round_trips"] = rpc_wire_counts()
        return stats

    def close(self):
        experts = getattr(self, "_experts", None)
        if experts is not None and getattr(self, "verbose", False):
            print(summary_line(self.moe_stats()), file=sys.stderr)
        self._experts = None
        if hasattr(self, "_stack"):  # absent when __init__ failed before llama_cpp's part
            super().close()
        if experts is not None:
            experts.free()  # after the model: its graph calls into the pools


_load_fields = threading.local()  # .fields: what model_params sets for the loads of this thread
_wrapper_lock = threading.Lock()


def _wrap_model_load():
    """Once per process: llama_cpp's llama_model_load_from_file (the one function that receives the
    params, as _internals.LlamaModel calls it) sets the fields model_params gave this thread, and
    no others: a load in another thread at the same time keeps its own."""
    module = llama_cpp.llama_cpp
    with _wrapper_lock:
        if getattr(module.llama_model_load_from_file, "empanel_wrapped", False):
            return
        original = module.llama_model_load_from_file

        def load(path_model, params):
            for name, value in getattr(_load_fields, "fields", {}).items():
                setattr(params, name, value)
            return original(path_model, params)

        load.empanel_wrapped = True
        module.llama_model_load_from_file = load


@contextlib.contextmanager
def model_params(**fields):
    """Within the block, models this thread loads get these llama_model_params fields (None: left
    as llama-cpp-python sets them): use_extra_bufts=False is llama.cpp's --no-repack (no CPU
    repack buffers, weights and pools in their file layout), load_mtp=True loads the MTP blocks.
    llama_cpp.Llama has no argument for either and builds the params inside __init__; the fields
    are carried per thread (_wrap_model_load), so loads in other threads are not touched."""
    given = {name: value for name, value in fields.items() if value is not None}
    if not given:
        yield
        return
    _wrap_model_load()
    previous = getattr(_load_fields, "fields", {})
    _load_fields.fields = {**previous, **given}
    try:
        yield
    finally:
        _load_fields.fields = previous


def _preload(experts, verbose):
    t0 = time.perf_counter()
    n = experts.preload()
    total = experts.stats()["total"]
    print_notices([f"preloaded {n} experts ({format_bytes(total['bytes_read'])}) into the pools "
                   f"in {time.perf_counter() - t0:.2f} s ({total['read_gbps']:.2f} GB/s)"], verbose)


def _plan(model_path, moe_slots, options, kwargs):
    """Llama's own plan (when no moe_load is given): explicit slots as asked, without the memory
    guard; "auto" the most slots that fit (warning, never refusing, when even those do not)."""
    from .planning.estimate import DEFAULT_N_CTX

    index = load_index(model_path, mtp=options.mtp)
    llama_kwargs = dict(kwargs)
    llama_kwargs["n_ctx"] = kwargs.get("n_ctx", 512) or DEFAULT_N_CTX
    lora = [kwargs["lora_path"]] if kwargs.get("lora_path") else []
    return plan_load(index, moe_slots, llama_kwargs, options=options, lora_paths=lora, guard=moe_slots == "auto",
                     force=True)
