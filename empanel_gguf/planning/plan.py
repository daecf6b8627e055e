"""One planning entry point for every face (Llama, run, trace, serve, exec, bench, llama.cpp's
programs):

    load = plan_load(index, "25%", llama_kwargs, options=moe_options(moe_policy="lfu-decay"))
    print_notices(load.report())
    Llama(path, moe_load=load, **llama_kwargs)      # or plan_file.plan_text(load) for a program

plan_load decides the slots (sizing.py; "auto" against the available memory), estimates what the
load keeps resident (estimate.py), lets the memory guard refuse it (guard.py), and gathers
everything else the load needs: the pools' setup, the warm start's preload order (profile.py),
the saved expert digests (digests.py), whether to preload, and the notices. Its LoadPlan is what
the sidecar gets, in this process (pools.ExpertPools) or written down for a program
(plan_file.py): the same records either way.

Pure Python: it reads the model's header and our cache files, and loads no library.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..abi.header import READ_IO, policy_id
from .estimate import (Estimate, estimate, model_shape, resolve_n_ctx, rpc_servers_registered, unified_devices,
                       waves_may_be_masked)
from .format import format_bytes
from .guard import MemoryRefused, check, max_slots_that_fit
from .host_memory import available_memory, default_floor, memory_sources, proc_status, total_memory
from .index import adapter_expert_tensors
from .layout import load_probe, resolve_layout
from .options import OPTION, SLOTS_NONE, MoeOptions
from .options import moe_options  # noqa: F401  (the faces' plan.moe_options: planning/options.py's)
from .sizing import DEFAULT_POLICY, SlotPlan, parse_size, plan_slots, sizes_alike

# the Llama arguments the estimate reads, with llama-cpp-python's defaults
# (gpu_offload: whether n_gpu_layers can offload; None: ask the build and its devices)
ESTIMATE_KWARGS = {"n_ctx": 512, "n_batch": 512, "n_ubatch": 512, "n_gpu_layers": 0, "logits_all": False,
                   "flash_attn": False, "type_k": None, "type_v": None, "gpu_offload": None}


def resolve_repack(repack, plan) -> bool:
    """moe_repack -> whether the load keeps llama.cpp's CPU repack buffers (its defaults) or not
    (--no-repack), by layout.resolve_layout's rule: "auto" keeps stock's defaults where no pool
    pages or waves may be masked (a device to offload to, or EMPANEL_WAVE_MASK=1: masked waves
    over plain Q4_K pools are not exact to stock --no-repack, tests/test_slots.py), else plain
    pools, measured faster on every paged row of this VM (docs/performance.md, "Layouts").
    plan_load also follows this machine's saved measurement (`empanel-gguf layout`)."""
    return resolve_layout(OPTION["repack"].checked(repack), plan, None, waves_may_be_masked()).repack


def resolve_guess(guess) -> bool:
    """moe_guess -> on or off. None (auto): on, except where RPC servers are registered in this
    process: a layer on a host computes its guess there, and reading it back costs a round trip
    per layer, for 0.2 % of hit rate (the 12-layer model, one host, 25 % slots: docs/rpc.md)."""
    return not rpc_servers_registered() if guess is None else bool(guess)


def resolve_prefetch(prefetch) -> int:
    """moe_prefetch -> layers ahead whose guessed experts a decode reads. "auto" is 0: on the real
    shapes under a cap (docs/performance.md, "Read-ahead on the real shapes", 2026-12-07) that
    read-ahead cost the two cores that compute more than the waits it hid where routing is spread
    (the Qwen3-30B-A3B shape: 5.65 against 5.14 t/s without it) and tied where it is skewed; a
    number N reads N layers ahead where `bench` measures it faster (faster drives, spare cores)."""
    prefetch = OPTION["prefetch"].checked(prefetch)
    return 0 if prefetch == "auto" else prefetch


def prompt_ahead(plan, options) -> bool:
    """Whether a prompt's waves read the next paged layer's empty slots while they compute a
    layer (csrc/remap.c, read_ahead_next_layer; EMPANEL_PROMPT_AHEAD=0 turns it off): with a
    decode's read-ahead (moe_prefetch N > 0), and else where host pools page under a per-layer
    policy with the gate-ahead guess on (moe_prefetch="auto"'s rule before it turned the decode's
    read-ahead off). Not where waves may be masked (a GPU or RPC device: never measured there),
    under g-lru (no read-ahead beside another layer's reads), or where the pools hold every
    expert (nothing to read)."""
    if os.environ.get("EMPANEL_PROMPT_AHEAD", "").strip() == "0":
        return False
    if resolve_prefetch(options.prefetch) > 0:
        return True
    pages = plan is not None and not plan.holds_all
    return pages and resolve_guess(options.guess) and options.policy != "g-lru" and not waves_may_be_masked()


def stock_equivalent(repack: bool, subst=None, batch=None) -> str:
    """The stock llama.cpp configuration whose logits a load with these options reproduces bit for
    bit: the same weight layout (repack: stock's defaults, which repack on the CPU where ggml has a
    repacked layout for the type; else --no-repack), the same micro-batch and attention (batch:
    the Llama arguments the plan set, LoadPlan.micro_batch), with every expert in memory."""
    if subst is not None:
        return "none: routing substitution (moe_subst) changes the routing"
    flags = ([] if repack else ["--no-repack"]) + micro_batch_flags(batch)
    return "llama.cpp " + " ".join(flags) if flags else "llama.cpp with its defaults"


def micro_batch_flags(batch) -> list:
    """The plan's micro-batch (LoadPlan.micro_batch) as llama.cpp's flags: -b, -ub and -fa."""
    if not batch:
        return []
    flags = ["-b", str(batch["n_batch"]), "-ub", str(batch["n_ubatch"])]
    if "flash_attn" in batch:
        flags += ["-fa", "on" if batch["flash_attn"] else "off"]
    return flags


def stock_kwargs(repack: bool, subst=None, batch=None) -> dict | None:
    """stock_equivalent as the Llama(...) arguments of that stock load (moe_slots=None), None where
    there is none: what a check of the logits loads to compare."""
    if subst is not None:
        return None
    return {"moe_repack": bool(repack), **(batch or {})}


PROMPT_UBATCH = 2048  # tokens per call and micro-batch where pools page (moe_batch "auto"), at most
AUTO_UBATCHES = (2048, 1024, 512)  # moe_batch "auto"'s micro-batches, largest first
BATCH_KWARGS = ("n_batch", "n_ubatch", "flash_attn")
# moe_batch "auto" takes the largest micro-batch whose pools miss at most this share more
# experts per decoded token than the best plan's (uniform routing: (best - slots) / (n_expert -
# best)); a decode bound by its reads then loses at most as much, within this VM's run-to-run noise
DECODE_NOISE = 0.03


def planned_batch(batch, moe_slots, given, n_ctx) -> dict:
    """moe_batch -> the Llama arguments of the largest micro-batch a load with pools may plan ({}:
    the caller's own, or llama-cpp-python's 512 without flash attention); planned_batches lists
    them all."""
    batches = planned_batches(batch, moe_slots, given, n_ctx)
    return batches[0] if batches else {}


def planned_batches(batch, moe_slots, given, n_ctx) -> list:
    """moe_batch -> the micro-batches a load with pools chooses among, largest first, as Llama
    arguments ([]: the caller's own, or llama-cpp-python's 512 without flash attention). Each
    prompt call of n_batch tokens is then one micro-batch, whose waves read each expert at most
    once: a 2,048-token prompt reads the experts once, not once per 512 tokens, and flash
    attention keeps its compute buffer small (385 MiB at 2,048 tokens on the 30B shape, 2.3 GiB
    without it at n_ctx 8,448). "auto" offers 2,048, 1,024 and 512 tokens with flash attention
    where n_ctx is above 512 and none of BATCH_KWARGS is given (the caller's choice stands), and
    plan_load takes the largest that costs decode nothing (_batched_load); a number of tokens asks
    for that one (ValueError beside n_batch or n_ubatch). plan_load drops it again where the pools
    end up holding every expert: nothing pages there, and stock's defaults stand."""
    if batch == "stock" or moe_slots is None:
        return []
    if batch == "auto":
        # (not where layers are offloaded or waves may be masked: device pools, op offload)
        if any(given.get(key) is not None for key in BATCH_KWARGS) or given.get("n_gpu_layers") or \
                waves_may_be_masked() or n_ctx <= 512:
            return []
        sizes = sorted({min(n_ctx, tokens) for tokens in AUTO_UBATCHES}, reverse=True)
        return [{"n_batch": tokens, "n_ubatch": tokens, "flash_attn": True} for tokens in sizes]
    if given.get("n_batch") is not None or given.get("n_ubatch") is not None:
        raise ValueError(f"moe_batch={batch!r} with n_batch / n_ubatch: give one or the other")
    tokens = min(n_ctx, int(batch))
    out = {"n_batch": tokens, "n_ubatch": tokens}
    if given.get("flash_attn") is None:
        out["flash_attn"] = True
    return [out]


def _batched_load(index, batches, plan_with, lora_paths, weigh=True, force=False):
    """The load of the largest of `batches` (largest first) whose pools hold within DECODE_NOISE of
    the experts the best plan holds, llama-cpp-python's own micro-batch among them (plan_with({})):
    decided by what decode will read, not by what happened to fit (weigh=False: the first that
    fits, a micro-batch asked for by name). Elastic pools are weighed by their capacity (what the
    load grows into), others by the pools at load. Each is planned unforced (plan_with(batch,
    force=False)): one the guard refuses is not taken; where every one is refused, the caller's
    force decides (stock's micro-batch, forced, or its refusal). Where stock's micro-batch holds
    every expert, nothing pages and stock's defaults stand; where only a larger one does (its
    compute buffer is smaller: flash attention), that one is taken. Candidates are planned without
    what the load needs besides slots and memory (_finish_load): only the one taken reads it."""
    stock, loads, refused = None, [], None
    for batch in [{}] + batches:
        try:
            load = plan_with(batch, force=False)
        except MemoryRefused as e:
            refused = refused if batch else e  # (stock's: what a load without moe_batch would say)
            continue
        if load.plan is None or load.plan.holds_all:  # every expert held: nothing to weigh
            return _with_batch(_finish_load(load, lora_paths), batch)
        if batch:
            loads.append((batch, load))
        else:
            stock = load
    if stock is None and not loads:
        if force:
            return _finish_load(plan_with({}, force=True), lora_paths)
        raise refused if refused is not None else MemoryRefused("no micro-batch fits")
    held = [load.estimate.experts_reserved for _, load in loads] + ([stock.estimate.experts_reserved] if stock else [])
    best = max(held) if weigh else 0
    for batch, load in loads:
        if best - load.estimate.experts_reserved <= DECODE_NOISE * max(0, index.expert_bytes_total - best):
            return _with_batch(_finish_load(load, lora_paths), batch)
    stock.notes.append(f"moe-batch: llama-cpp-python's own micro-batch: calls of {batches[-1]['n_batch']} tokens "
                       "or more would hold fewer experts, and decode would read more")
    return _finish_load(stock, lora_paths)


def _with_batch(load, batch):
    """`load` with micro-batch `batch` ({}: llama-cpp-python's own, nothing to say)."""
    if not batch:
        return load
    load.micro_batch = batch
    load.notes.append(f"moe-batch: prompts in calls of up to {batch['n_batch']} tokens, one micro-batch each"
                      + (" with flash attention" if batch.get("flash_attn") else "") + ": each expert read once "
                      "per call")
    return load


def host_cache_bytes(host_cache, est, unified_devices=0, allow_unified=False) -> int:
    """moe_host_cache -> bytes of the host-RAM tier (0: none). The tier keeps experts that device
    pools read in host memory, so it needs pools in device memory (layers offloaded with
    n_gpu_layers), and on a unified-memory device (an integrated GPU, Metal) the "device" memory is
    host memory already: the tier would hold every cached expert twice and swap, so it is refused
    there unless allow_unified. ValueError says why."""
    if host_cache is None or host_cache == 0:
        return 0
    size = host_cache if isinstance(host_cache, int) and not isinstance(host_cache, bool) else \
        parse_size(str(host_cache))
    if size is None or size <= 0:
        raise ValueError(f"moe_host_cache={host_cache!r}: give a size (\"8GiB\") or a number of bytes")
    if est.host_share >= 1.0:
        raise ValueError(f"moe_host_cache={host_cache!r}: the pools are in host memory (no layer is offloaded to a "
                         "GPU: n_gpu_layers=0, or a build without one), where a host tier adds nothing; give the "
                         "memory to moe_slots instead")
    if unified_devices and not allow_unified:
        raise ValueError(f"moe_host_cache={host_cache!r}: the GPU shares host memory (an integrated GPU or Apple "
                         "Metal): a host tier would hold every cached expert twice and swap; give the memory to "
                         "moe_slots instead, or moe_host_cache_unified=True (--moe-host-cache-unified) to keep it")
    return int(size)


@dataclass
class PoolSetup:
    """What the sidecar's pools of one load are made of (checked arguments, no C objects)."""
    n_slots: list           # [n_layer] slots (0: resident, -1: resident and traced)
    paged: list             # the ExpertTensors with a pool
    params: dict            # struct empanel_pool_params, field by field
    guess_depth: int        # paged layers ahead that the gate-ahead guess looks (0: none)
    subst: object           # moe_subst ratio, None: exact routing
    host_cache: int = 0     # bytes of the host-RAM tier of device pools (moe_host_cache), 0: none


def pool_setup(index, plan, options=None) -> PoolSetup:
    """The pools of a load with `plan` (sizing.SlotPlan, None: no slots) and `options`
    (MoeOptions, checked when made, with policy and prefetch resolved; None: the defaults, under
    DEFAULT_POLICY without read-ahead)."""
    options = options or MoeOptions(policy=DEFAULT_POLICY, prefetch=0)
    n_slots = list(plan.n_slots) if plan is not None else [0] * index.n_layer
    if options.trace:  # layers without a pool are observed: their routing is traced too
        n_slots = [-1 if n == 0 and il in index.moe_layers else n for il, n in enumerate(n_slots)]
    params = {
        "n_threads": options.io_threads,
        "chunk_bytes": options.chunk_kb * 1024,
        "direct_io": 1 if options.direct_io else -1,
        "policy": policy_id(options.policy),
        "budget_bytes": (options.budget or plan.budget_bytes) if plan is not None else 0,
        "prefetch": options.prefetch,
        "subst_ratio": float(options.subst or 0.0),
        "verify": 1 if options.verify and plan is not None else 0,
        "read_io": READ_IO[options.read_io],  # enum empanel_read_io
        "queue_depth": options.queue_depth,
        "prompt_ahead": 1 if prompt_ahead(plan, options) else 0,
    }
    return PoolSetup(
        n_slots=n_slots,
        paged=[t for t in index.expert_tensors() if n_slots[t.layer] > 0],
        params=params,
        # guesses: one layer ahead to order eviction, as many as prefetch reads
        guess_depth=max(1, options.prefetch) if (resolve_guess(options.guess) or options.prefetch) and plan is not None
        else 0,
        subst=options.subst if plan is not None else None)


def preload_orders(profile, n_slots, moe_layers, seed_uses=0):
    """{paged layer: (experts, LFU counts or None)}: the profile's most used experts first, which
    the preload takes first; seed_uses > 0: they start with LFU counts up to that, in proportion
    to their use."""
    orders = {}
    for il in moe_layers:
        if n_slots[il] > 0:
            order = profile.order(il)
            row = profile.counts[profile.moe_layers.index(il)]
            top = max(1, int(row.max()))
            uses = [max(1, round(seed_uses * int(row[e]) / top)) for e in order] if seed_uses else None
            orders[il] = ([int(e) for e in order], uses)
    return orders


@dataclass
class LoadPlan:
    requested: object            # moe_slots as asked (None, "auto", 32, "25%", "6GiB")
    moe_slots: object            # what was decided: None (every expert resident) or a count/share/size
    plan: SlotPlan | None        # slots per layer, None without slot pools
    estimate: Estimate           # what the load keeps resident
    available: int | None        # bytes of memory available now (None: unknown)
    floor: int                   # bytes kept free
    notes: list = field(default_factory=list)  # what was decided and adjusted, for the log
    warnings: list = field(default_factory=list)  # what went wrong but did not stop the load: always shown
    index: object = None         # the model (index.ModelIndex)
    options: MoeOptions = field(default_factory=MoeOptions)
    pools: PoolSetup | None = None  # the sidecar's pools; None: a stock load (no pool, no trace)
    orders: dict | None = None   # warm start: {layer: (experts, LFU counts)} the preload takes first
    digests: dict | None = None  # moe_verify: the saved {tensor name: [n_expert] digests}, None: first reads
    preload: bool = False        # fill the empty slots right after the load
    pinned: bool = False         # the pools hold every expert, e in slot e: stock's graph, no remap op
    controller: dict | None = None  # moe_elastic's controller: {"reserve": bytes kept free, "interval_ms", "sources":
                                 # host_memory.memory_sources()}; None: the budget moves only when asked
    micro_batch: dict = field(default_factory=dict)  # moe_batch: Llama arguments the plan sets (n_batch,
                                 # n_ubatch, flash_attn); the faces pass them on
    layout: object = None        # layout.Layout: the weight layout (options.repack) and why it was chosen

    def report(self, verbose=True):
        """The lines a face logs before the load: the warnings always; with verbose the notices and
        the memory too."""
        if not verbose:
            return list(self.warnings)
        return self.warnings + self.notes + [f"memory: about {format_bytes(self.estimate.host)} needed, "
                                             f"{format_bytes(self.available)} available, "
                                             f"{format_bytes(self.floor)} kept free"]


def wants_preload(plan, have_profile, moe_preload):
    """Whether a load reads experts into the empty slots right after it: moe_preload None (auto)
    does when the pools hold every expert (resident from the first token, as a stock load) or a
    calibration profile says which experts to take first."""
    if plan is None:
        return False
    return (plan.holds_all or have_profile) if moe_preload is None else bool(moe_preload)


def parse_moe_slots(value):
    """CLI/env text -> what Llama(moe_slots=...) takes: None, 'auto', an int, or the text."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() in SLOTS_NONE:
        return None
    if text.lower() == "auto":
        return "auto"
    if text.isdigit():
        return int(text)
    return text


def print_notices(lines, verbose=True):
    """Every face prints a load's notices the same way: `empanel: ...` on stderr, one line each
    (tests/test_cli.py holds the built-in model's to 120 characters)."""
    if verbose:
        for line in lines:
            print(f"empanel: {line}", file=sys.stderr, flush=True)


def plan_load(index, moe_slots, llama_kwargs=None, *, options=None, lora_paths=(), floor=None, force=False,
              guard=True, available=None, total=None, what=None, address_space=None, finish=True) -> LoadPlan:
    """Decide the slots, check memory and gather what the load needs.

    moe_slots: None (every expert resident), 'auto', or anything plan_slots takes. 'auto' keeps
    every expert resident when that fits, else the most slots that fit (at least top-k).
    options: MoeOptions (moe_options(...)); resident_layers among them keep every expert.
    llama_kwargs: the Llama arguments (n_ctx, n_batch, n_ubatch, n_gpu_layers, logits_all,
    flash_attn, type_k, type_v; others are ignored). lora_paths: adapters to load with it
    (refused if they change routed experts). guard=False: estimate, but never refuse nor warn
    (Llama with an explicit moe_slots); force: warn instead of refusing. available: bytes free
    (None: measured); total: bytes the binding limit holds, which elastic "auto" pools may grow
    into (None: the limit measured where available is, else none above available). address_space:
    bytes that may still be mapped (None: measured, host_memory.address_space_left). finish=False:
    slots and memory only, without _finish_load (moe_batch's candidates). Raises guard.MemoryRefused, sizing.SlotsError for
    impossible moe_slots, ValueError for bad options, a profile or digests that cannot be used."""
    options = options or MoeOptions()
    given = llama_kwargs or {}
    # (a command's n_batch / n_ubatch / flash_attn left unset is None: llama-cpp-python's default)
    kwargs = {key: default if given.get(key) is None else given[key] for key, default in ESTIMATE_KWARGS.items()}
    kwargs["shape"] = model_shape(index)
    if available is None:
        available, total = available_memory(), total_memory() if total is None else total
    floor = default_floor() if floor is None else floor
    batches = planned_batches(options.batch, moe_slots if index.is_moe else None, given,
                              resolve_n_ctx(kwargs["shape"], kwargs["n_ctx"]))
    if batches:
        def plan_with(batch, force):
            return plan_load(index, moe_slots, {**given, **batch}, options=replace(options, batch="stock"),
                             lora_paths=lora_paths, floor=floor, force=force, guard=guard, available=available,
                             total=total, what=what, address_space=address_space, finish=False)

        return _batched_load(index, batches, plan_with, lora_paths, weigh=options.batch == "auto", force=force)
    notes = []

    # pools that give memory back may take more of it: half the floor stays free (the controller's
    # reserve), not all of it
    elastic = elastic_wanted(moe_slots, options, kwargs)
    sizing_floor = floor // 2 if elastic else floor
    decided = _decide_slots(index, moe_slots, kwargs, options.resident_layers, available, floor, notes,
                            sizing_floor)
    capacity = decided
    # (host pools are reserved without commit in the CPU's buffer types only, plain and repacked:
    # with a GPU device, llama.cpp keeps CPU layers in its pinned host buffer, which a larger
    # capacity would commit)
    if elastic and moe_slots == "auto" and isinstance(decided, int) and total and not kwargs["n_gpu_layers"] \
            and not waves_may_be_masked():
        capacity = _elastic_capacity(index, decided, kwargs, options.resident_layers, total, sizing_floor, notes)
    plan, options, layout = _plan_pools(index, capacity, options, notes)
    est = _estimate(index, plan, kwargs, options, notes)
    if capacity != decided:  # resident at load: what the live budget holds, below the capacity
        at_load = plan_slots(index, decided, options.policy, options.resident_layers)
        if options.budget is None:
            options = replace(options, budget=at_load.pool_bytes)
        est = replace(estimate(index, at_load, **kwargs), experts_reserved=est.experts_reserved)
    if guard:
        check(est, index, plan, available=available, floor=sizing_floor if plan is not None else floor,
              force=force, what=what or f"loading {Path(index.path).name}", address_space=address_space)
    load = LoadPlan(requested=moe_slots, moe_slots=capacity, plan=plan, estimate=est, available=available,
                    floor=floor, notes=notes, index=index, options=options, layout=layout)
    if layout.warning:
        load.warnings.append(layout.warning)
    return _finish_load(load, lora_paths) if finish else load


def _finish_load(load, lora_paths):
    """What a planned load needs besides its slots and memory: the sidecar's pools, adapters
    checked, the warm start and digests read (_fill_pools), the controller."""
    index, plan, options = load.index, load.plan, load.options
    if plan is None and not (options.trace and index.is_moe):
        return load  # stock: nothing for the sidecar
    load.pools = pool_setup(index, plan, options)
    load.pools.host_cache = load.estimate.host_cache
    if plan is not None:  # (else the routing is traced, every expert resident)
        _fill_pools(load, lora_paths)
        load.controller = _controller(load, load.estimate.params)
    return load


ELASTIC_INTERVAL_MS = 20  # how often the controller reads the memory left (a few microseconds each)


def elastic_wanted(requested, options, kwargs):
    """Whether a load asks for pools that give memory back: moe_elastic, or where it is None,
    moe_slots "auto" with no layer offloaded and the memory measured (not replaced by
    EMPANEL_MEM_AVAILABLE: the files the controller would read are then not what the user says is
    there). Plain and repacked host pools alike: both are reserved without commit."""
    if options.elastic is not None:
        return options.elastic
    return requested == "auto" and not kwargs.get("n_gpu_layers") and not os.environ.get("EMPANEL_MEM_AVAILABLE")


def _controller(load, kwargs):
    """The controller of a load with pools (LoadPlan.controller), or None (elastic_wanted). It
    keeps half the floor free, as the planner did for it."""
    options, notes = load.options, load.notes
    if not elastic_wanted(load.requested, options, kwargs):
        return None
    if load.pinned:
        notes.append("moe_elastic: the pools hold every expert in place (stock's graph reads them): they keep "
                     "their memory")
        return None
    sources = memory_sources()
    if not sources:
        notes.append("moe_elastic: no memory limit to watch on this system (no memory cgroup, no /proc/meminfo): "
                     "the budget moves only with moe_set_budget")
        return None
    reserve = max(load.floor // 2, 64 << 20)
    notes.append(f"moe_elastic: the pools give memory back when less than {format_bytes(reserve)} is left "
                 f"({', '.join(s.get('limit', s.get('available')) for s in sources)}) and take it again when "
                 "it is free")
    return {"reserve": reserve, "interval_ms": ELASTIC_INTERVAL_MS, "sources": sources}


def _elastic_capacity(index, budget_slots, kwargs, resident_layers, total, sizing_floor, notes):
    """The slots per layer of elastic "auto" pools: those that fit in what the binding limit
    (total bytes: the memory cgroup's, else the machine's) would leave this process alone, above the
    budget_slots that fit in what is free now. The live budget starts at budget_slots and the
    controller grows it into the rest as memory is free (csrc/pressure.c); slots never filled
    take no memory (the host pools are reserved without commit). Never every expert: that would
    pin the pools in place."""
    own = proc_status().get("VmRSS", 0)  # (this process's interpreter and libraries: not the estimate's)
    slots = max_slots_that_fit(index, total - own - sizing_floor, kwargs, resident_layers)
    slots = min(slots, max(index.n_expert - 1, index.n_expert_used))
    if slots <= budget_slots:
        return budget_slots
    notes.append(f"moe-slots auto: a capacity of {slots} slots per layer, for {format_bytes(total)} of memory "
                 f"if the load were alone; the live budget starts at {budget_slots} and grows into what is free")
    return slots


def _decide_slots(index, moe_slots, kwargs, resident_layers, available, floor, notes, sizing_floor=None):
    """moe_slots as planned: "auto" decided against the available memory (None: every expert
    resident, where it fits above the floor), None for a model without routed experts. Pools are
    sized to leave sizing_floor free (half the floor where they give memory back)."""
    sizing_floor = floor if sizing_floor is None else sizing_floor
    name = Path(index.path).name
    if moe_slots == "auto":
        if not index.is_moe:
            return None
        full = estimate(index, None, **kwargs)
        if available is None or full.host <= available - floor:
            notes.append(f"moe-slots auto: all {index.n_expert} experts per layer fit in memory"
                         + ("" if available is not None else " (available memory unknown)"))
            return None
        # the fewest slots if none fit: the guard then refuses with the advice
        moe_slots = max(max_slots_that_fit(index, available - sizing_floor, full.params, resident_layers),
                        index.n_expert_used)
        if sizing_floor < floor:  # every expert would pin the pools in place: they could not give back
            moe_slots = min(moe_slots, max(index.n_expert - 1, index.n_expert_used))
        notes.append(f"moe-slots auto: {moe_slots} of {index.n_expert} expert slots per "
                     f"layer fit in {format_bytes(available - sizing_floor)} (available minus "
                     + ("floor)" if sizing_floor == floor else "half the floor: the pools give memory back)"))
    if moe_slots is not None and not index.is_moe:
        notes.append(f"{name}: no routed experts ({index.architecture}); moe_slots ignored, loading as usual")
        return None
    return moe_slots


def _plan_pools(index, moe_slots, options, notes):
    """(slots per layer or None, options with policy, repack and prefetch resolved, the
    layout.Layout with why it was chosen). moe_policy
    "auto" plans the slots once under DEFAULT_POLICY to choose, and again only where the chosen
    policy sizes its pools otherwise (g-lru)."""
    plan = None
    if moe_slots is not None:
        policy = DEFAULT_POLICY if options.policy == "auto" else options.policy
        plan = plan_slots(index, moe_slots, policy, options.resident_layers)
        if options.policy == "auto":
            options = replace(options, policy=_auto_policy(index, plan.min_slots, options, notes))
            if not sizes_alike(options.policy, policy):
                plan = plan_slots(index, moe_slots, options.policy, options.resident_layers)
    elif options.policy == "auto":
        options = replace(options, policy=DEFAULT_POLICY)  # (no pools: no eviction)
    if plan is not None and index.n_layer_nextn:
        notes.append(_mtp_line(index))
    repack = OPTION["repack"].checked(options.repack)
    masked, probe, warning = waves_may_be_masked(), None, ""
    if repack == "auto" and plan is not None and not plan.holds_all and not masked:
        try:
            probe = load_probe(index)
        except (OSError, ValueError) as e:
            warning = f"moe_repack auto: {e}; the rule applies"
    layout = replace(resolve_layout(repack, plan, probe, masked), warning=warning)
    if repack == "auto" and plan is not None and not plan.holds_all:
        notes.append(f"moe_repack auto: {'repacked' if layout.repack else 'plain'} pools, exact to llama.cpp "
                     f"{'at its defaults' if layout.repack else '--no-repack'}")
        notes.append(f"  {layout.why}")
    guess = resolve_guess(options.guess)
    prefetch = resolve_prefetch(options.prefetch)
    return plan, replace(options, repack=layout.repack, prefetch=prefetch, guess=guess), layout


def _estimate(index, plan, kwargs, options, notes):
    """What the load keeps resident (estimate.Estimate), the host tier included."""
    est = estimate(index, plan, **kwargs)
    if plan is not None:
        notes += plan.notices
        notes.append(_slots_line(index, plan))
        est.host_cache = host_cache_bytes(options.host_cache, est, unified_devices(), options.host_cache_unified)
        if est.host_cache:
            notes.append(f"host tier: {format_bytes(est.host_cache)} of host memory keeps experts the device pools "
                         "read; a miss is served from it before the drive")
    notes += est.notes
    return est


def _fill_pools(load, lora_paths):
    """What a load with slot pools needs besides them: adapters checked, the saved digests, the
    warm start's profile and preload order, whether to preload and whether the pools are pinned."""
    index, plan, options, notes = load.index, load.plan, load.options, load.notes
    for path in lora_paths:
        check_adapter(path)
    if options.verify:
        load.digests = _saved_digests(index, notes)
    if load.pools.subst:
        notes.append(f"routing substitution on (moe_subst={options.subst}): outputs are APPROXIMATE, not those of "
                     "the model fully in memory")
    profile = _warm_start(index, options.profile, notes, load.warnings)
    load.preload = wants_preload(plan, profile is not None, options.preload)
    # pools that hold every expert, preloaded in id order, never miss: their graph is stock's
    # (no remap, guess or substitution op); a trace needs the remap op to see the routing
    # (g-lru's budget may fill a layer short of every expert: never pinned)
    load.pinned = plan.holds_all and load.preload and not options.trace and options.policy != "g-lru"
    if profile is not None and not load.pinned:
        # counts up to the pool's size: under lfu-decay they halve away with the same clock
        load.orders = preload_orders(profile, load.pools.n_slots, index.moe_layers, seed_uses=plan.min_slots)


def _mtp_line(index):
    """What the load does with the file's MTP ("nextn") blocks."""
    blocks = ", ".join(str(il) for il in index.mtp_layers)
    if index.mtp_loaded:
        return (f"MTP block {blocks}: loaded (MTP drafting); its MoE layers are paged like the others")
    skipped = f", {format_bytes(index.mtp_skipped_bytes)} left in the file" if index.mtp_skipped_bytes else ""
    return (f"MTP block {blocks}: not loaded, as llama.cpp skips it without MTP drafting (--spec-type draft-mtp): "
            f"no pool{skipped}")


def _slots_line(index, plan):
    n_paged = len(index.layers) - plan.resident_layers
    if plan.budget_bytes:
        return (f"g-lru: {format_bytes(plan.budget_bytes)} of experts shared by {n_paged} MoE layers, up to "
                f"{plan.min_slots} of {plan.n_expert} per layer ({format_bytes(index.expert_bytes_total)} of "
                "experts in all)")
    return (f"{plan.min_slots} of {plan.n_expert} expert slots in each of {n_paged} MoE layers, "
            f"{format_bytes(plan.pool_bytes)} of pools instead of {format_bytes(index.expert_bytes_total)} of experts")


def check_adapter(lora_path):
    """A LoRA adapter may change the layers' attention, dense FFNs, shared experts and output, not
    the routed experts: their pools hold some experts only, and the adapter's expert deltas are
    indexed by expert id."""
    touched = adapter_expert_tensors(lora_path)
    if touched:
        shown = ", ".join(touched[:3]) + (f" and {len(touched) - 3} more" if len(touched) > 3 else "")
        raise ValueError(f"lora_path={lora_path}: the adapter changes routed-expert weights ({shown}), which "
                         "slot pools cannot apply; load it without slot pools (moe_slots=None), or use an "
                         "adapter that leaves the routed experts alone")


def _saved_digests(index, notes):
    """moe_verify: the digests saved for this file, else None (each expert's first read gives its
    digest); ValueError for digests that cannot be used."""
    from . import digests

    try:
        saved = digests.load(index)
    except digests.DigestError as e:
        raise ValueError(f"moe_verify: {e}") from None
    if saved is None:
        notes.append("moe_verify: no saved digests for this file (empanel-gguf verify saves them); each "
                     "expert's first read gives its digest and later reads must match it")
    else:
        notes.append(f"moe_verify: expert reads checked against the digests in {digests.default_path(index)}")
    return saved


def _auto_policy(index, slots, options, notes):
    """moe_policy="auto": the policy the calibration profile's replay ranks best at `slots` per
    layer (calibrate), else DEFAULT_POLICY."""
    from .profile import ProfileError, resolve

    try:
        profile, _ = resolve(index, options.profile)
    except ProfileError:
        profile = None  # (_warm_start says why)
    chosen = profile.choose_policy(slots, DEFAULT_POLICY) if profile is not None else None
    if chosen is None:
        notes.append(f"moe-policy auto: {DEFAULT_POLICY} (no calibrated policy ranking for this file: "
                     "empanel-gguf calibrate makes one)")
        return DEFAULT_POLICY
    best, at, rates = chosen
    ranked = ", ".join(f"{name} {100 * rate:.1f}%" for name, rate in sorted(rates.items(), key=lambda kv: -kv[1]))
    notes.append(f"moe-policy auto: {best} (the profile's replay at {at} slots: {ranked})")
    return best


def _warm_start(index, moe_profile, notes, warnings):
    """The calibration profile for this load (profile.py), None without one. "auto" ignores a
    cached profile it cannot use (damaged, another file's), with a warning; a path must fit
    (ValueError)."""
    from .profile import ProfileError, resolve

    try:
        profile, where = resolve(index, moe_profile)
    except ProfileError as e:
        if moe_profile != "auto":
            raise
        warnings.append(f"warm start: {e}; starting cold")
        return None
    if profile is not None:
        notes.append(f"warm start: {where} ({profile.tokens} tokens routed): each layer's most used experts "
                     "are preloaded")
    return profile
