"""What a load will hold, estimated from the GGUF header before loading (bytes), as two figures:
what becomes resident (the pages a run touches: what counts under a memory cap) and what is
reserved (the address space it maps; most of a large compute buffer stays untouched):

    weights   every tensor that is not a routed expert (ModelIndex.other_bytes_total): read at
              load (the file is loaded without mmap), resident
    experts   the slot pools and the resident layers' experts (SlotPlan.expert_bytes), or every
              routed expert without slot pools
    kv        the KV cache: n_ctx * n_layer * n_head_kv * (head_k + head_v) * bytes per element
              (F16 unless type_k/type_v say otherwise); MLA models (deepseek2) store
              kv_lora_rank + rope dims per token instead. Sliding-window and recurrent layers are
              counted as full attention: an upper bound. llama.cpp clears it at load: resident
    compute   llama.cpp's compute buffer for one micro-batch (F32 activations: attention scores
              without flash attention, hidden states, FFN activations, and the logits), its
              output buffer, llama-cpp-python's scores array, and the runtime (interpreter,
              libraries, the vocabulary's tables).
              reserved: the graph as llama.cpp reserves it, for n_ubatch outputs
              ([n_vocab, n_ubatch] of logits), and a scores array of n_batch rows (n_ctx with
              logits_all);
              resident: what a full micro-batch at one output per call touches (one row of
              logits; every row with logits_all, whose scores then fill up to n_ctx rows), the
              attention scores at the end of the context (Estimate.at_context: at fewer tokens)
    host      the part of it in host memory: layers offloaded with n_gpu_layers on a build that
              can offload are taken off in proportion (their weights, pools and KV cache)

tests/test_estimate.py holds the resident figure to measured peak RSS on a large-vocabulary
model, tests/test_slots_guard.py on the fixtures.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .format import MiB, format_bytes

DEFAULT_N_CTX = 4096  # the CLI's context size when none is given (capped at the model's)
RUNTIME_BYTES = 64 * MiB  # llama.cpp + Python + numpy + threads, roughly
# the vocabulary's tables in llama.cpp (token texts, the text -> id map, attributes) and in
# llama-cpp-python, per token: 151,936 tokens took 41 MiB more anonymous memory than 401
# (a 2-layer qwen3moe with 50,000 and 151,936 tokens, weights apart: 270 bytes per token)
VOCAB_BYTES_PER_TOKEN = 288
KV_CELLS_PAD = 256  # llama.cpp's attention views n_kv cells, padded to 256

# bytes per element of the KV cache types llama.cpp accepts for type_k/type_v (ggml_type ids)
_KV_TYPE_BYTES = {0: 4.0, 1: 2.0, 30: 2.0, 8: 34 / 32, 2: 18 / 32, 3: 20 / 32, 6: 22 / 32, 7: 24 / 32,
                  20: 18 / 32}  # F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL


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
    n_expert_used: int = 0  # top-k (0: no routed experts)


def model_shape(index) -> Shape:
    """The dimensions, from the header metadata the index kept (else read from `index.path`'s
    GGUF header; headers only, no tensor data)."""
    from .index import _read_header

    meta = index.metadata or _read_header(Path(index.path)).metadata
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
                 n_ff=n_ff, mla=mla, n_expert_used=index.n_expert_used if index.is_moe else 0)


@dataclass
class Estimate:
    weights: int
    experts: int
    kv: int
    compute: int  # resident (see the module's doc)
    host_share: float  # 1.0: everything in host memory
    n_ctx: int
    pooled: bool  # experts are slot pools (False: every expert resident)
    kv_per_token: int = 0
    notes: list = field(default_factory=list)
    params: dict = field(default_factory=dict)  # estimate()'s keyword arguments, to re-estimate
    host_cache: int = 0  # moe_host_cache: the host-RAM tier of device pools (host memory only)
    compute_reserved: int = 0  # address space of the compute buffers (>= compute)
    experts_reserved: int = 0  # address space of the pools: their capacity (>= experts)

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.kv + self.compute + self.host_cache

    @property
    def host(self) -> int:
        """Bytes expected resident in host memory: what counts under a cap."""
        offloadable = self.weights + self.experts + self.kv
        return int(offloadable * self.host_share) + self.compute + self.host_cache

    @property
    def host_reserved(self) -> int:
        """Bytes of host address space the load reserves (mostly untouched beyond `host`)."""
        offloadable = self.weights + max(self.experts, self.experts_reserved) + self.kv
        return int(offloadable * self.host_share) + max(self.compute, self.compute_reserved) + self.host_cache

    def at_context(self, n_ctx_used) -> "Estimate":
        """The same load when a run reaches n_ctx_used tokens of context (the planner's figure is
        for the end of n_ctx): what a measured peak is compared with."""
        p = self.params
        n_batch, n_ubatch = micro_batch(self.n_ctx, p["n_batch"], p["n_ubatch"])
        compute, _ = compute_bytes(p["shape"], self.n_ctx, n_batch, n_ubatch, p["logits_all"], p["flash_attn"],
                                   max(1, min(int(n_ctx_used), self.n_ctx)))
        return replace(self, compute=compute)

    def describe(self) -> str:
        experts = "expert pools" if self.pooled else "all experts"
        text = (f"{format_bytes(self.weights)} weights + {format_bytes(self.experts)} {experts} + "
                f"{format_bytes(self.kv)} KV cache (n_ctx {self.n_ctx}) + {format_bytes(self.compute)} "
                f"compute = {format_bytes(self.total)} resident")
        if self.host_reserved > self.host:
            text += f" ({format_bytes(self.host_reserved)} reserved)"
        if self.host_cache:
            text += f", + {format_bytes(self.host_cache)} host tier"
        if self.host_share < 1.0:
            text += f", {format_bytes(self.host)} of it in host memory"
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
    """What loading `index` with slot plan `plan` (None: every expert resident) will hold, by the
    end of n_ctx (Estimate.at_context: at fewer tokens)."""
    shape = shape or model_shape(index)
    params = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_gpu_layers=n_gpu_layers,
                  logits_all=logits_all, flash_attn=flash_attn, type_k=type_k, type_v=type_v,
                  shape=shape, gpu_offload=gpu_offload)
    n_ctx = resolve_n_ctx(shape, n_ctx)
    n_batch, n_ubatch = micro_batch(n_ctx, n_batch, n_ubatch)
    notes = []

    experts = plan.expert_bytes if plan is not None else index.expert_bytes_total
    # (g-lru maps every pool's slots, above the shared budget it fills)
    experts_reserved = max(experts, plan.capacity_bytes + plan.resident_bytes) if plan is not None else experts
    per_token = shape.n_layer * shape.n_head_kv * (shape.head_k * kv_bytes_per_element(type_k)
                                                    + shape.head_v * kv_bytes_per_element(type_v))
    kv = int(per_token * n_ctx)
    compute, compute_reserved = compute_bytes(shape, n_ctx, n_batch, n_ubatch, logits_all, flash_attn, n_ctx)

    host_share = 1.0
    ngl = _gpu_layers(n_gpu_layers, shape.n_layer)
    if ngl:
        if gpu_offload is None:
            gpu_offload = params["gpu_offload"] = _supports_gpu_offload()
        if gpu_offload:
            host_share = 1.0 - ngl / (shape.n_layer + 1)  # llama.cpp counts the output layer too
        else:
            notes.append(f"n_gpu_layers={n_gpu_layers} has no effect: this build cannot offload")
    return Estimate(weights=index.other_bytes_total, experts=experts, kv=kv, compute=compute,
                    host_share=host_share, n_ctx=n_ctx, pooled=plan is not None,
                    kv_per_token=int(math.ceil(per_token)), notes=notes, params=params,
                    compute_reserved=compute_reserved, experts_reserved=experts_reserved)


def micro_batch(n_ctx, n_batch, n_ubatch) -> tuple:
    """(n_batch, n_ubatch) as llama.cpp clamps them: each at most the one before."""
    n_batch = max(1, min(int(n_batch or 512), n_ctx))
    return n_batch, max(1, min(int(n_ubatch or 512), n_batch))


def compute_bytes(shape: Shape, n_ctx, n_batch, n_ubatch, logits_all, flash_attn, n_ctx_used) -> tuple:
    """(resident, reserved) bytes of the compute side of a load: llama.cpp's compute buffer, its
    output buffer, llama-cpp-python's scores array and the runtime (the module's doc)."""
    # F32 per token of a micro-batch: KQ, hidden states, FFN activations, and each routed expert's
    # output before their weighted sum [n_embd, n_used] (the 30B shape with flash attention: llama.cpp
    # reported 96 MiB at 512 tokens, 385 MiB at 2,048, its logits apart; this gives 89 and 356)
    per_token = 5 * shape.n_embd + 3 * shape.n_ff + shape.n_expert_used * shape.n_embd

    def activations(n_kv):
        attn = 0 if flash_attn else shape.n_head * n_kv  # KQ scores of one layer, per token
        return 4 * n_ubatch * (attn + per_token)

    n_kv_used = min(n_ctx, -(-n_ctx_used // KV_CELLS_PAD) * KV_CELLS_PAD)
    row = 4 * shape.n_vocab  # one row of F32 logits
    # llama.cpp's output buffer (cleared when allocated: resident either way) and the runtime
    fixed = row * (n_batch if logits_all else 1) + RUNTIME_BYTES + VOCAB_BYTES_PER_TOKEN * shape.n_vocab
    # the graph's logits [n_vocab, outputs], llama-cpp-python's scores (written only with
    # logits_all, a row per token evaluated)
    resident = (activations(n_kv_used) + row * (n_ubatch if logits_all else 1)
                + (row * n_ctx_used if logits_all else 0) + fixed)
    reserved = activations(n_ctx) + row * n_ubatch + row * (n_ctx if logits_all else n_batch) + fixed
    return int(resident), int(max(reserved, resident))


def _gpu_layers(n_gpu_layers, n_layer):
    if n_gpu_layers is None:
        return 0
    n = int(n_gpu_layers)
    if n < 0:
        return n_layer + 1
    return min(n, n_layer + 1)


# whether layers can be offloaded now: set by the drop-in (llama.py), which can ask the build and
# the registered RPC servers; planning itself loads no library. Unset: nothing offloads.
_offload_probe = None


def set_offload_probe(probe):
    """probe() -> True if n_gpu_layers can offload now (a GPU, or a registered RPC server's
    device; a build with the RPC backend but no servers keeps every layer here)."""
    global _offload_probe
    _offload_probe = probe


# offload devices with unified memory (integrated GPUs, Metal): set by the drop-in like the probe above
_unified_probe = None


def set_unified_probe(probe):
    """probe() -> how many of the devices layers can offload to share host memory (an integrated
    GPU as ggml marks it, Apple's Metal)."""
    global _unified_probe
    _unified_probe = probe


# devices of registered RPC servers: set by the drop-in like the probes above
_rpc_probe = None


def set_rpc_probe(probe):
    """probe() -> True if RPC servers' devices are registered in this process (layers offloaded
    go to them, with their pools)."""
    global _rpc_probe
    _rpc_probe = probe


def rpc_servers_registered():
    return bool(_ask(_rpc_probe, False))


def _ask(probe, default):
    """probe()'s answer, or default where none is set or it fails (a missing library)."""
    if probe is None:
        return default
    try:
        return probe()
    except Exception:  # the estimate must not fail on a missing library
        return default


def unified_devices():
    return int(_ask(_unified_probe, 0))


def _supports_gpu_offload():
    return bool(_ask(_offload_probe, False))


def waves_may_be_masked():
    """Whether a paged layer's waves may run masked in this process (llama-empanel-pools.cpp): a device
    layers can offload to (op offload may take plain host pools to it), or EMPANEL_WAVE_MASK=1."""
    return os.environ.get("EMPANEL_WAVE_MASK") == "1" or _supports_gpu_offload()
