"""`Llama`: llama-cpp-python's Llama with expert slot pools for MoE models.

    from empanel_gguf import Llama
    llm = Llama("model.gguf", moe_slots="25%")   # any llama_cpp.Llama argument works as well

With moe_slots=None it is llama_cpp.Llama, unchanged. Otherwise each MoE layer's routed experts
live in a pool of slots; the experts the router picks are read from the GGUF file on demand by the
sidecar. Outputs are bit-identical to the model fully in memory on the same build.
"""

import contextlib
import inspect
import sys
import threading
import time
import weakref
from pathlib import Path

from .engine.native import use_our_libraries
from .planning.estimate import set_offload_probe, set_rpc_probe, set_unified_probe
from .planning.format import format_bytes
from .planning.index import ModelError, load_index
from .planning.options import OPTIONS, check_known, llama_args_doc, moe_options
from .planning.plan import plan_load, print_notices, resolve_repack, stock_equivalent, stock_kwargs
from .planning.sizing import parse_size
from .engine.pools import ExpertPools, MoeReadError
from .engine.rpc import RpcError, hosts_back, lost_error, lost_servers, offload_devices, rpc_devices, unified_devices
from .engine.rpc import use_servers as use_rpc_servers
from .engine.rpc import wire_counts as rpc_wire_counts
from .engine.stats import summary_line

llama_cpp = use_our_libraries()
from llama_cpp.llama_tokenizer import LlamaTokenizer  # noqa: E402  (after our libraries are chosen)
set_offload_probe(lambda: offload_devices() > 0)  # the estimate's question, answered by this build
set_unified_probe(unified_devices)  # moe_host_cache's: do the offload devices share host memory
set_rpc_probe(lambda: rpc_devices() > 0)  # moe_guess's: are layers going to RPC hosts

__all__ = ["Llama", "MoeReadError"]


_DOC = """llama_cpp.Llama with expert slot pools for MoE models.

    Args:
        model_path: path to the GGUF model (the first shard of a split model).
MOE_ARGS
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

    The moe_* options are declared once, in empanel_gguf/planning/options.py; docs/options.md
    lists them with the commands' flags and environment variables. A misspelt moe_* keyword is a
    ValueError naming the valid ones, a value out of range one naming the option.
    """


class Llama(llama_cpp.Llama):
    __doc__ = _DOC.replace("MOE_ARGS", llama_args_doc())

    def __init__(self, model_path, *args, rpc_servers=None, moe_load=None, **kwargs):
        self._experts = None
        self._lost = None  # the RPC endpoints a decode lost (the next call loads anew once they answer)
        self._load_call = (model_path, args, rpc_servers, dict(kwargs))  # for that load
        self.rpc_reloads = 0  # loads anew after a lost RPC host (_take_back_hosts)
        moe = {key: kwargs.pop(key) for key in [key for key in kwargs if key.startswith("moe_")]}
        check_known(moe)  # llama_cpp.Llama would swallow a misspelt option and load stock
        moe_slots = moe.pop("moe_slots", None)
        self.rpc_servers = use_rpc_servers(rpc_servers, kwargs)
        verbose = kwargs.get("verbose", True)
        if moe_load is None and (moe_slots is not None or moe.get("moe_trace")):
            moe_load = _plan(model_path, moe_slots, moe_options(**moe), kwargs)
            print_notices(moe_load.warnings)  # whatever verbose is: a damaged cache file is never silent
            print_notices(moe_load.notes, verbose)
        elif moe_load is not None and Path(moe_load.index.path).resolve() != Path(model_path).resolve():
            raise ValueError(f"moe_load was planned for {moe_load.index.path}, not {model_path}")
        given = {o.name: moe.get(o.keyword, o.default) for o in OPTIONS}  # a stock load's options, unchecked
        self.moe_load = moe_load
        self.moe_micro_batch = dict(moe_load.micro_batch) if moe_load is not None else {}  # n_batch, n_ubatch, flash_attn
        kwargs.update(self.moe_micro_batch)
        self.moe_repack = moe_load.options.repack if moe_load is not None else resolve_repack(given["repack"], None)
        self.moe_mtp = moe_load.options.mtp if moe_load is not None else bool(given["mtp"])
        self.moe_slots = moe_load.moe_slots if moe_load is not None else None  # "auto" resolved
        self.moe_policy = moe_load.options.policy if moe_load is not None else given["policy"]
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
            experts.settle()
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
        long shows its progress. After a lost RPC host, the model is loaded anew on it first."""
        self._take_back_hosts()
        progress = self.prompt_progress
        try:
            if progress is None or len(tokens) <= 1:
                return super().eval(tokens)
            with progress.track(self, len(tokens)):
                return super().eval(tokens)
        except RpcError:
            self.n_tokens = 0  # the host's KV cache is gone: the next prompt is evaluated whole
            raise

    def embed(self, *args, **kwargs):
        self._take_back_hosts()
        return super().embed(*args, **kwargs)

    def _take_back_hosts(self):
        """After a decode lost RPC hosts: once they all answer again, load the model on them anew
        (the same plan, an empty KV cache, no state cache: its states may have been read from the
        lost host); until then, the same RpcError."""
        lost = self._lost
        if lost is None:
            return
        if not hosts_back(lost):
            raise lost_error(lost)
        model_path, args, rpc_servers, kwargs = self._load_call
        reloads, moe_load = self.rpc_reloads + 1, self.moe_load
        self.close()
        try:
            Llama.__init__(self, model_path, *args, rpc_servers=rpc_servers, moe_load=moe_load, **kwargs)
        except BaseException as e:
            self._lost = lost  # try again at the next call
            for name in ("_model", "_ctx", "_batch"):  # (their handles were freed by close())
                setattr(self, name, _Unloaded(self, name))
            if type(getattr(self, "tokenizer_", None)) is LlamaTokenizer:  # (it holds the model)
                self.tokenizer_ = LlamaTokenizer(self)
            if isinstance(e, ValueError) and str(e).startswith("Failed to load model"):
                # (llama_cpp's words: a host answered the probe, then failed the load's connection)
                raise lost_error(lost) from e
            raise
        self.rpc_reloads = reloads

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
                self._lost = lost
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
        "exact_to": the stock llama.cpp configuration whose logits these equal bit for bit (and
        "exact_kwargs": the arguments of that stock load here, Llama(path, moe_slots=None, ...)),
        "layout": the weight layout ("repacked": llama.cpp's CPU repack buffers, "plain": --no-repack)
        and "layout_why": the rule or measurement that chose it (`empanel-gguf layout`),
        "read_io": the read path taken ("threads" or "uring"), "budget": the live budget and its
        controller (moe_set_budget, moe_elastic); None without slot pools. With
        rpc_servers the total also has wire_sent, wire_received (bytes this process exchanged with
        the RPC servers so far), round_trips (commands it waited for an answer to) and rpc_reloads
        (loads anew on a lost host that answered again)."""
        if self._experts is None:
            return None
        stats = self._experts.stats()
        options = self.moe_load.options if self.moe_load is not None else None
        subst = options.subst if options is not None else None
        stats["exact_to"] = stock_equivalent(self.moe_repack, subst, self.moe_micro_batch)
        stats["exact_kwargs"] = stock_kwargs(self.moe_repack, subst, self.moe_micro_batch)
        layout = self.moe_load.layout if self.moe_load is not None else None
        stats["layout"] = "repacked" if self.moe_repack else "plain"
        stats["layout_why"] = layout.why if layout is not None else "no slot pools"
        stats["read_io"] = self._experts.read_io()
        stats["budget"] = self._experts.budget()
        if self.rpc_servers:
            total = stats["total"]
            total["wire_sent"], total["wire_received"], total["round_trips"] = rpc_wire_counts()
            total["rpc_reloads"] = self.rpc_reloads
        return stats

    def moe_set_budget(self, budget):
        """Move the memory the slot pools may hold while the model runs: a size ("4GiB") or bytes
        for all layers' experts. A lower budget gives the least recently used experts' memory back
        at once (those the running decode reads follow at the next layers' remaps); a higher one
        lets experts be read in again as they are routed to, up to the pools' capacity (their
        slots). Outputs do not change. Refused below the floor (the top-k experts of every MoE
        layer) and for pools that cannot give memory back (in device memory, or holding every
        expert in place). With moe_elastic the controller moves it too. moe_stats()["budget"]
        reports it."""
        if self._experts is None:
            raise ValueError("moe_set_budget: this model has no slot pools (moe_slots=None)")
        size = budget if isinstance(budget, int) and not isinstance(budget, bool) else parse_size(str(budget))
        if size is None or size <= 0:
            raise ValueError(f"moe_set_budget({budget!r}): give a size (\"4GiB\") or a number of bytes")
        self._experts.set_budget(size)

    def close(self):
        experts = getattr(self, "_experts", None)
        if experts is not None and getattr(self, "verbose", False):
            print(summary_line(self.moe_stats()), file=sys.stderr)
        self._experts = None
        if experts is not None:
            experts.settle()  # no read ahead may land in a slot once the model's buffers are freed
        if hasattr(self, "_stack"):  # absent when __init__ failed before llama_cpp's part
            super().close()
        if experts is not None:
            experts.free()  # after the model: its graph calls into the pools


class _Unloaded:
    """What stands for a Llama's model, context or batch (name) while its load anew after a lost
    RPC host has failed: any use first tries that load again (the host may answer by now) and
    then goes to the new one, or raises its RpcError; never a freed handle."""

    def __init__(self, llama, name):
        self._llama = weakref.ref(llama)
        self._name = name

    def __getattr__(self, attr):
        llama = self._llama()
        if llama is None or attr.startswith("__"):
            raise AttributeError(attr)
        llama._take_back_hosts()
        loaded = getattr(llama, self._name)
        if isinstance(loaded, _Unloaded):  # (taken back by none: nothing was lost)
            raise RuntimeError(f"Llama.{self._name}: not loaded (its load anew after a lost RPC host failed)")
        return getattr(loaded, attr)


def _signature():
    """Llama.__init__'s signature as help(Llama) shows it: the moe_* keywords with their defaults,
    from the table (the function takes them as **kwargs)."""
    P = inspect.Parameter
    return inspect.Signature(
        [P("self", P.POSITIONAL_OR_KEYWORD), P("model_path", P.POSITIONAL_OR_KEYWORD), P("args", P.VAR_POSITIONAL)]
        + [P(o.keyword, P.KEYWORD_ONLY, default=o.default) for o in OPTIONS]
        + [P("rpc_servers", P.KEYWORD_ONLY, default=None), P("moe_load", P.KEYWORD_ONLY, default=None),
           P("kwargs", P.VAR_KEYWORD)])


Llama.__init__.__signature__ = _signature()

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
