"""The memory guard: estimate what a load will keep resident, refuse what would not fit, and watch.

Before loading, `estimate()` adds up what the process will hold (all figures are bytes):

    weights   every tensor that is not a routed expert (ModelIndex.other_bytes_total)
    experts   the slot pools (SlotPlan.pool_bytes), or every routed expert without slot pools
    kv        the KV cache: n_ctx * n_layer * n_head_kv * (head_k + head_v) * bytes per element
              (F16 unless type_k/type_v say otherwise); MLA models (deepseek2) store
              kv_lora_rank + rope dims per token instead. Sliding-window and recurrent layers are
              counted as full attention: an upper bound.
    compute   a rough bound: llama.cpp's compute buffer for one micro-batch (logits, attention
              scores without flash attention, FFN activations, all F32) + llama-cpp-python's
              logits array (n_ctx rows with logits_all, else n_batch) + 64 MiB of runtime
    host      the part of it in host memory: layers offloaded with n_gpu_layers on a build that
              can offload are taken off in proportion (their weights, pools and KV cache)

`check()` compares the host part with the available memory minus a floor and raises
MemoryRefused, with what to set instead (fewer slots, a smaller context), unless forced.
Available memory is the smaller of /proc/meminfo's MemAvailable and, inside a memory cgroup
(v1 or v2), its limit minus its usage not counting inactive page cache; on macOS it comes from
vm_stat. EMPANEL_MEM_AVAILABLE (a size, e.g. "8GiB") replaces the measurement: for tests, or
where the measurement is wrong.

`Watchdog` polls the available memory while a model runs (twice a second, one small file read)
and calls back once when it falls below the floor, so that the command can stop cleanly before
the kernel's OOM killer stops it uncleanly.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .sizing import SlotsError, parse_size, plan_slots

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_N_CTX = 4096  # the CLI's context size when none is given (capped at the model's)
RUNTIME_BYTES = 64 * MiB  # llama.cpp + Python + numpy + threads, roughly

# bytes per element of the KV cache types llama.cpp accepts for type_k/type_v (ggml_type ids)
_KV_TYPE_BYTES = {0: 4.0, 1: 2.0, 30: 2.0, 8: 34 / 32, 2: 18 / 32, 3: 20 / 32, 6: 22 / 32, 7: 24 / 32,
                  20: 18 / 32}  # F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL


class MemoryRefused(RuntimeError):
    """The estimated resident set does not fit in the available memory minus the floor."""


# ---------------------------------------------------------------------------------------------
# what the model needs


@dataclass
class Shape:
    """The model dimensions the estimate needs, from the GGUF metadata."""

    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_k: int  # per head
    head_v: int
    n_vocab: int
    n_ff: int  # the widest FFN hidden size (dense or one expert x top-k)
    mla: bool = False


def model_shape(index) -> Shape:
    """Read the dimensions from the GGUF header of `index.path` (headers only, no tensor data)."""
    from .index import _read_header

    meta = _read_header(Path(index.path)).metadata
    arch = index.architecture

    def get(key, default=0):
        value = meta.get(f"{arch}.{key}", default)
        # per-layer arrays are kept only as their length by the header reader: use the default
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    n_embd = int(get("embedding_length", 0))
    n_head = int(get("attention.head_count", 1)) or 1
    n_head_kv = int(get("attention.head_count_kv", n_head)) or n_head
    head_k = int(get("attention.key_length", n_embd // n_head))
    head_v = int(get("attention.value_length", n_embd // n_head))
    kv_lora_rank = int(get("attention.kv_lora_rank", 0))
    mla = kv_lora_rank > 0
    if mla:  # one latent "head" per token: the compressed KV plus the rotary part of the keys
        n_head_kv, head_k, head_v = 1, kv_lora_rank + int(get("rope.dimension_count", 0)), kv_lora_rank
    n_vocab = meta.get("tokenizer.ggml.tokens") if isinstance(meta.get("tokenizer.ggml.tokens"), int) else 0
    n_vocab = n_vocab or int(get("vocab_size", 32000))
    n_ff = max(int(get("feed_forward_length", 0)),
               int(get("expert_feed_forward_length", 0)) * max(index.n_expert_used, 1), n_embd)
    return Shape(n_layer=index.n_layer, n_ctx_train=int(get("context_length", 0)), n_embd=n_embd,
                 n_head=n_head, n_head_kv=n_head_kv, head_k=head_k, head_v=head_v, n_vocab=n_vocab,
                 n_ff=n_ff, mla=mla)


@dataclass
class Estimate:
    weights: int
    experts: int
    kv: int
    compute: int
    host_share: float  # 1.0: everything in host memory
    n_ctx: int
    pooled: bool  # experts are slot pools (False: every expert resident)
    kv_per_token: int = 0
    notes: list = field(default_factory=list)
    params: dict = field(default_factory=dict)  # estimate()'s keyword arguments, to re-estimate

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.kv + self.compute

    @property
    def host(self) -> int:
        """Bytes expected in host memory."""
        offloadable = self.weights + self.experts + self.kv
        return int(offloadable * self.host_share) + self.compute

    def describe(self) -> str:
        experts = "expert pools" if self.pooled else "all experts"
        text = (f"{fmt_bytes(self.weights)} weights + {fmt_bytes(self.experts)} {experts} + "
                f"{fmt_bytes(self.kv)} KV cache (n_ctx {self.n_ctx}) + {fmt_bytes(self.compute)} "
                f"compute = {fmt_bytes(self.total)}")
        if self.host_share < 1.0:
            text += f", {fmt_bytes(self.host)} of it in host memory"
        return text


def kv_bytes_per_element(type_id) -> float:
    if type_id is None:
        return 2.0
    return _KV_TYPE_BYTES.get(int(type_id), 2.0)


def cli_n_ctx(shape: Shape, ctx_size) -> int:
    """The commands' -c: unset means DEFAULT_N_CTX (at most the model's training context), 0 the
    model's training context."""
    if ctx_size is None:
        return min(DEFAULT_N_CTX, shape.n_ctx_train or DEFAULT_N_CTX)
    return resolve_n_ctx(shape, ctx_size)


def resolve_n_ctx(shape: Shape, n_ctx) -> int:
    """n_ctx as llama-cpp-python will use it: 0 means the model's training context."""
    if not n_ctx:
        return shape.n_ctx_train or DEFAULT_N_CTX
    return int(n_ctx)


def estimate(index, plan=None, *, n_ctx=512, n_batch=512, n_ubatch=512, n_gpu_layers=0,
             logits_all=False, flash_attn=False, type_k=None, type_v=None, shape=None,
             gpu_offload=None) -> Estimate:
    """What loading `index` with slot plan `plan` (None: every expert resident) will hold."""
    shape = shape or model_shape(index)
    params = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_gpu_layers=n_gpu_layers,
                  logits_all=logits_all, flash_attn=flash_attn, type_k=type_k, type_v=type_v,
                  shape=shape, gpu_offload=gpu_offload)
    n_ctx = resolve_n_ctx(shape, n_ctx)
    n_batch = max(1, min(int(n_batch or 512), n_ctx))
    n_ubatch = max(1, min(int(n_ubatch or 512), n_batch))
    notes = []

    experts = plan.pool_bytes if plan is not None else index.expert_bytes_total
    per_token = shape.n_layer * shape.n_head_kv * (shape.head_k * kv_bytes_per_element(type_k)
                                                    + shape.head_v * kv_bytes_per_element(type_v))
    kv = int(per_token * n_ctx)

    attn = 0 if flash_attn else shape.n_head * n_ctx  # KQ scores of one layer, per token
    compute = 4 * n_ubatch * (shape.n_vocab + attn + 4 * shape.n_embd + 3 * shape.n_ff)
    compute += 4 * shape.n_vocab * (n_ctx if logits_all else n_batch)  # llama-cpp-python's scores
    compute += RUNTIME_BYTES

    host_share = 1.0
    ngl = _gpu_layers(n_gpu_layers, shape.n_layer)
    if ngl:
        if gpu_offload is None:
            gpu_offload = params["gpu_offload"] = _supports_gpu_offload()
        if gpu_offload:
            host_share = 1.0 - ngl / (shape.n_layer + 1)  # llama.cpp counts the output layer too
        else:
            notes.append(f"n_gpu_layers={n_gpu_layers} has no effect: this build cannot offload")
    return Estimate(weights=index.other_bytes_total, experts=experts, kv=kv, compute=int(compute),
                    host_share=host_share, n_ctx=n_ctx, pooled=plan is not None,
                    kv_per_token=int(math.ceil(per_token)), notes=notes, params=params)


def _gpu_layers(n_gpu_layers, n_layer):
    if n_gpu_layers is None:
        return 0
    n = int(n_gpu_layers)
    if n < 0:
        return n_layer + 1
    return min(n, n_layer + 1)


def _supports_gpu_offload():
    try:
        from . import llama_cpp
        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:  # the estimate must not fail on a missing library
        return False


# ---------------------------------------------------------------------------------------------
# what the machine has


def _read_int(path):
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path, key):
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def _meminfo():
    """{key: bytes} from /proc/meminfo, {} where there is none."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (KiB if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_dirs():
    """(version, directory) of this process's memory cgroups, innermost first, that exist."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    root = Path("/sys/fs/cgroup")
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "" and (root / "cgroup.controllers").exists():
            version, base = 2, root
        elif "memory" in controllers.split(","):
            version, base = 1, root / "memory"
        else:
            continue
        d = base / rel.lstrip("/")
        while True:  # the cgroup and its ancestors: the tightest limit counts
            if d.is_dir():
                found.append((version, d))
            if d == base or base not in d.parents:
                break
            d = d.parent
        if (version, base) not in found and base.is_dir():
            found.append((version, base))  # a namespaced mount shows the cgroup as the root
    return found


_NO_LIMIT = 1 << 60  # cgroup v1 writes 9223372036854771712 for "no limit"


def _cgroup_limits():
    """[(limit, usage excluding inactive page cache)] of every limited memory cgroup around us."""
    out = []
    for version, d in _cgroup_dirs():
        if version == 2:
            limit = _read_int(d / "memory.max")  # "max" -> None
            usage = _read_int(d / "memory.current")
            inactive = _stat_value(d / "memory.stat", "inactive_file") or 0
        else:
            limit = _read_int(d / "memory.limit_in_bytes")
            usage = _read_int(d / "memory.usage_in_bytes")
            inactive = _stat_value(d / "memory.stat", "total_inactive_file") or 0
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        out.append((limit, max(0, usage - inactive)))
    return out


def _vm_stat_available():
    """macOS: free + inactive + speculative + purgeable pages."""
    try:
        text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"page size of (\d+) bytes", text)
    page = int(m.group(1)) if m else 4096
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        m = re.search(rf"{key}:\s+(\d+)", text)
        pages += int(m.group(1)) if m else 0
    return pages * page if pages else None


def total_memory():
    """Physical memory, or the memory cgroup's limit if that is lower; None if unknown."""
    values = []
    try:
        values.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    values += [limit for limit, _ in _cgroup_limits()]
    return min(values) if values else None


def available_memory():
    """Bytes that can still be allocated without swapping or the OOM killer; None if unknown."""
    override = os.environ.get("EMPANEL_MEM_AVAILABLE")
    if override:
        value = parse_size(override)
        if value is None:
            raise ValueError(f"EMPANEL_MEM_AVAILABLE={override!r} is not a size (e.g. 8GiB)")
        return value
    values = []
    info = _meminfo()
    if "MemAvailable" in info:
        values.append(info["MemAvailable"])
    elif sys.platform == "darwin":
        v = _vm_stat_available()
        if v is not None:
            values.append(v)
    values += [max(0, limit - usage) for limit, usage in _cgroup_limits()]
    return min(values) if values else None


def default_floor(total=None):
    """max(1 GiB, 5 % of the memory)."""
    total = total_memory() if total is None else total
    return max(GiB, int(0.05 * total)) if total else GiB


def parse_floor(text, total=None):
    """'2GiB', '512MiB', '10%' (of the memory), '0' (no floor), or None/'' for the default."""
    if text is None or str(text).strip() in ("", "auto", "default"):
        return default_floor(total)
    text = str(text).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1
        total = total_memory() if total is None else total
        if not 0 <= share < 1 or not total:
            raise ValueError(f"--mem-floor {text}: a share must lie in [0%, 100%) of known memory")
        return int(share * total)
    value = parse_size(text)
    if value is None:
        raise ValueError(f"--mem-floor {text!r}: not a size (2GiB, 512MiB) or a share (5%)")
    return value


def fmt_bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------------------------
# deciding


def check(est: Estimate, index=None, plan=None, *, available, floor, force=False, what="this load"):
    """Raise MemoryRefused if est.host > available - floor (unless force); return the headroom.

    The message says what fits instead: how many slots per layer, which context size."""
    if available is None:
        return None
    budget = available - floor
    if est.host <= budget:
        return budget - est.host
    lines = [f"{what} needs about {fmt_bytes(est.host)} ({est.describe()}), but only "
             f"{fmt_bytes(available)} is available and {fmt_bytes(floor)} is kept free "
             f"(--mem-floor): {fmt_bytes(est.host - budget)} too much."]
    lines += [f"  - {text}" for text in advice(est, index, plan, budget)]
    lines.append("  - or --force to load anyway (the kernel may kill the process)")
    message = "\n".join(lines)
    if force:
        print(f"empanel: warning: {message}", file=sys.stderr)
        return budget - est.host
    raise MemoryRefused(message)


def advice(est: Estimate, index, plan, budget):
    """What to set so that the estimate fits in `budget` bytes of host memory."""
    out = []
    if index is not None and index.is_moe:
        slots = max_slots_that_fit(index, budget, est.params)
        if slots >= index.n_expert_used:
            size = slots * sum(layer.expert_bytes for layer in index.layers)
            out.append(f"fewer slots: --moe-slots {slots} (of {index.n_expert} experts per layer, "
                       f"{fmt_bytes(size)} of pools; or a budget: --moe-slots {_size_arg(size)})")
        else:
            out.append(f"even the fewest slots (--moe-slots {index.n_expert_used}, the experts one "
                       "token uses) do not fit with this context")
    if est.kv_per_token:
        fixed = est.host - int(est.kv * est.host_share)
        room = budget - fixed
        n_ctx = int(room // max(1, est.kv_per_token * est.host_share)) if room > 0 else 0
        n_ctx = n_ctx // 256 * 256
        if 256 <= n_ctx < est.n_ctx:
            out.append(f"a smaller context: -c {n_ctx} (now {est.n_ctx}, "
                       f"{fmt_bytes(est.kv_per_token)} of KV cache per token)")
    out.append("a lower --mem-floor, or free memory (other processes, page cache)")
    return out


def max_slots_that_fit(index, budget, params):
    """The most slots per layer (top-k .. n_expert) whose estimate fits in `budget`; 0 if none.
    More slots mean larger pools and larger micro-batches, so the estimate grows with them."""
    lo, hi = index.n_expert_used, index.n_expert

    def fits(n):
        return estimate(index, plan_slots(index, n), **params).host <= budget

    if not fits(lo):
        return 0
    while lo < hi:  # fits(lo) holds
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _size_arg(n):
    """A budget that plan_slots turns into no more slots than n bytes hold (rounded down)."""
    if n >= GiB:
        return f"{math.floor(n / GiB * 10) / 10:g}GiB"
    if n >= MiB:
        return f"{n // MiB}MiB"
    return f"{n // KiB}KiB"


def parse_moe_slots(value):
    """CLI/env text -> what Llama(moe_slots=...) takes: None, 'auto', an int, or the text."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() in ("", "none", "off", "no", "false", "0"):
        return None
    if text.lower() == "auto":
        return "auto"
    if text.isdigit():
        return int(text)
    return text


def preflight(index, moe_slots, *, n_ctx, n_batch=512, n_ubatch=512, n_gpu_layers=0,
              logits_all=False, flash_attn=False, type_k=None, type_v=None, floor=None,
              force=False, available=None, what=None):
    """Decide the slots and check memory before a load.

    moe_slots: None (every expert resident), 'auto', or anything plan_slots takes. 'auto' keeps
    every expert resident when that fits, else the most slots that fit (at least top-k).
    Returns (moe_slots for Llama, plan or None, estimate, available, floor, notes).
    Raises MemoryRefused, or SlotsError for impossible moe_slots."""
    notes = []
    shape = model_shape(index)
    kwargs = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_gpu_layers=n_gpu_layers,
                  logits_all=logits_all, flash_attn=flash_attn, type_k=type_k, type_v=type_v,
                  shape=shape)
    if available is None:
        available = available_memory()
    floor = default_floor() if floor is None else floor
    what = what or f"loading {Path(index.path).name}"

    if moe_slots == "auto":
        if not index.is_moe:
            moe_slots = None
        else:
            full = estimate(index, None, **kwargs)
            if available is None or full.host <= available - floor:
                moe_slots = None
                notes.append(f"moe-slots auto: all {index.n_expert} experts per layer fit in memory"
                             + ("" if available is not None else " (available memory unknown)"))
            else:
                # the fewest slots if none fit: check() below then refuses with the advice
                moe_slots = max(max_slots_that_fit(index, available - floor, full.params),
                                index.n_expert_used)
                notes.append(f"moe-slots auto: {moe_slots} of {index.n_expert} expert slots per "
                             f"layer fit in {fmt_bytes(available - floor)} (available minus floor)")
    if moe_slots is not None and not index.is_moe:
        notes.append(f"{Path(index.path).name} has no routed experts; --moe-slots ignored")
        moe_slots = None

    plan = plan_slots(index, moe_slots) if moe_slots is not None else None
    est = estimate(index, plan, **kwargs)
    notes += est.notes
    check(est, index, plan, available=available, floor=floor, force=force, what=what)
    return moe_slots, plan, est, available, floor, notes


__all__ = ["Estimate", "MemoryRefused", "Shape", "SlotsError", "Watchdog", "available_memory",
           "check", "default_floor", "estimate", "fmt_bytes", "model_shape", "parse_floor",
           "parse_moe_slots", "preflight", "total_memory"]


# ---------------------------------------------------------------------------------------------
# while running


class Watchdog:
    """Calls on_low(available, floor) once, from its own thread, when the available memory falls
    below `floor`. `tripped` tells the main loop to stop; stop() ends the thread."""

    def __init__(self, floor, on_low=None, *, interval=0.5, available_fn=available_memory):
        self.floor = floor
        self.on_low = on_low
        self.interval = interval
        self.available_fn = available_fn
        self.tripped = threading.Event()
        self.available_at_trip = None
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        if self.floor <= 0 or self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="empanel-memory-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while True:
            try:
                available = self.available_fn()
            except Exception:
                available = None
            if available is not None and available < self.floor:
                self.available_at_trip = available
                self.tripped.set()
                if self.on_low is not None:
                    self.on_low(available, self.floor)
                return
            if self._stop.wait(self.interval):
                return

    def message(self):
        return (f"empanel: stopping: available memory fell to {fmt_bytes(self.available_at_trip)}, "
                f"below the floor of {fmt_bytes(self.floor)} (--mem-floor)")

    def stop(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
