"""Tiny random-weight Mixture-of-Experts GGUF files for tests and scripts.

Every fixture is written with the `gguf` package from a seeded random generator, so the same
spec always gives the same bytes. Nothing is ever downloaded. The models are meaningless but
numerically tame: weights are normal with std 1/sqrt(fan_in), norms are ones, so hidden states
stay near unit RMS and logits are finite with a spread of about one; random routers make the
routing change from token to token.

Shapes in comments use ggml order, `{ne0, ne1, ne2}` (ne0 is the contiguous row, the input
dimension of a matrix); numpy arrays are the reverse, `(ne2, ne1, ne0)`.

K-quants cannot be written from numpy, so a spec with `requantize_to` is written in F16 first and
then quantized by llama.cpp itself (`llama_cpp.llama_model_quantize`, imported only there; set
LLAMA_CPP_LIB_PATH to a llama.cpp build).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import gguf

from . import gguf_writer
from .gguf_writer import BOS_TOKEN, CHAT_TEMPLATE, CONTROL_TOKENS, EOS_TOKEN  # noqa: F401  (the fixtures' tokens)

# Bump when the writer changes in a way that changes file contents: cached files are rewritten.
FORMAT_VERSION = 1

# Custom metadata key holding a digest of the spec (and FORMAT_VERSION) that wrote the file.
FINGERPRINT_KEY = "empanel.fixture.fingerprint"

CONTEXT_LENGTH = 512  # tokens (`<arch>.context_length`)
RMS_EPS = 1e-6

# A few byte-level BPE merges over GPT-2's printable byte alphabet ("Ġ" is the space byte).
# Each pair's parts are byte tokens or results of earlier merges.
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"),
    ("r", "e"), ("Ġ", "a"), ("Ġ", "s"), ("Ġ", "w"), ("o", "u"), ("e", "n"), ("Ġ", "c"),
    ("i", "s"), ("Ġ", "o"), ("Ġ", "b"), ("e", "s"), ("a", "t"), ("o", "r"), ("e", "d"),
    ("i", "t"), ("Ġ", "f"), ("Ġ", "m"), ("Ġ", "p"), ("l", "l"), ("Ġ", "h"), ("Ġ", "d"),
    ("in", "g"), ("Ġa", "n"), ("Ġan", "d"), ("Ġo", "f"), ("Ġ", "i"), ("Ġ", "l"), ("a", "r"),
    ("l", "e"), ("Ġ", "n"), ("Ġ", "e"), ("Ġ", "H"), ("Ġi", "s"), ("Ġ", "y"),
)

# llama_ftype values for `requantize_to`; quantized with `pure`, so every matrix gets this type.
_LLAMA_FTYPES = {
    "Q2_K": 10,  # LLAMA_FTYPE_MOSTLY_Q2_K
    "Q3_K": 12,  # LLAMA_FTYPE_MOSTLY_Q3_K_M
    "Q4_K": 15,  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    "Q5_K": 17,  # LLAMA_FTYPE_MOSTLY_Q5_K_M
    "Q6_K": 18,  # LLAMA_FTYPE_MOSTLY_Q6_K
}


@dataclass(frozen=True)
class MlaDims:
    """DeepSeek-V2/V3 multi-head latent attention and routing (arch deepseek2). The defaults are the
    fixtures' scaled-down V3-like layer (real V3: q_lora 1536, kv_lora 512, nope 128, rope 64, v 128)."""

    q_lora_rank: int = 32  # 0: queries straight from the hidden state (attn_q; V2-Lite)
    kv_lora_rank: int = 32  # compressed kv width
    rope_dim: int = 16  # rotary part of each q/k head
    nope_dim: int = 16  # non-rotary part of each q/k head
    v_dim: int = 16  # value head size
    n_dense_lead: int = 1  # leading layers with a dense FFN instead of experts
    n_expert_shared: int = 1  # shared experts, one dense FFN of n_expert_shared x n_ff_exp
    n_groups: int = 4  # expert groups; routing first picks the best groups (0: none, V2)
    n_groups_used: int = 2
    gating: str = "sigmoid"  # V3: sigmoid scores plus exp_probs_b to choose; V2: "softmax", no bias
    weights_norm: bool = True  # the chosen experts' weights renormalized to sum 1


@dataclass(frozen=True)
class ArchDims:
    """What the layer writers read: one architecture's widths, from which its tensor names and
    shapes (tensor_plan) and metadata (add_arch_hparams) follow. The fixtures make theirs from a
    FixtureSpec (FixtureSpec.dims); the benchmark's model writer (lab/bench/synthetic.py) from its
    shapes, real sizes included."""

    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int  # hidden size of one routed expert
    n_ff: int  # hidden size of a dense FFN (deepseek2 leading layers; feed_forward_length)
    n_ff_shexp: int  # hidden size of the shared expert (qwen2moe)
    n_head: int
    n_head_kv: int
    head_dim: int  # q/k/v head size of the GQA archs
    weight_type: str = "F32"
    expert_types: tuple[str, ...] = ()
    expert_holes: bool = False
    sliding_window: int = 64  # gpt-oss: tokens, on every other layer
    mla: MlaDims = MlaDims()

    def expert_type(self, il: int) -> str:
        return self.expert_types[il] if self.expert_types else self.weight_type


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that determines a fixture file.

    Types are ggml type names ("F32", "F16", "Q8_0", "Q4_0", "MXFP4", ...). `weight_type` applies
    to every matrix except routers (always F32) and the routed experts; `expert_types` gives the
    routed experts' type per layer (empty: `weight_type` everywhere).
    """

    name: str
    arch: str  # general.architecture: qwen3moe, qwen2moe, deepseek2, gpt-oss, llama, olmoe
    n_layer: int = 3
    n_expert: int = 16
    n_expert_used: int = 4
    n_embd: int = 64
    n_ff_exp: int = 32  # hidden size of one routed expert
    n_ff: int = 128  # hidden size of a dense FFN (deepseek2 leading layer)
    n_ff_shexp: int = 0  # hidden size of the shared expert (qwen2moe)
    n_head: int = 4
    n_head_kv: int = 2
    weight_type: str = "F32"
    expert_types: tuple[str, ...] = ()
    n_shards: int = 1  # >1: split files <stem>-0000i-of-0000n.gguf
    requantize_to: str | None = None  # a K-quant made by llama.cpp from an F16 file
    seed: int = 0
    expert_holes: bool = False  # routed experts left as holes of zeros in a sparse file (any type): a
                                # model larger than memory that takes no disk
    # tokens: the base vocabulary padded to this size (vocabulary()); 0: the base's. Out of repr:
    # the fingerprint of a spec without it is the one it always was
    n_vocab: int = field(default=0, repr=False)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def dims(self) -> ArchDims:
        return ArchDims(self.arch, self.n_layer, self.n_expert, self.n_expert_used, self.n_embd,
                        self.n_ff_exp, self.n_ff, self.n_ff_shexp, self.n_head, self.n_head_kv,
                        self.head_dim, self.weight_type, self.expert_types, self.expert_holes)


FIXTURES: dict[str, FixtureSpec] = {
    spec.name: spec
    for spec in (
        # qwen3moe in each type llama.cpp users meet; 3 layers x 16 experts, top-4
        FixtureSpec("qwen3moe-f32", "qwen3moe", seed=1),
        FixtureSpec("qwen3moe-f16", "qwen3moe", weight_type="F16", seed=2),
        FixtureSpec("qwen3moe-q8_0", "qwen3moe", weight_type="Q8_0", seed=3),
        FixtureSpec("qwen3moe-q4_0", "qwen3moe", weight_type="Q4_0", seed=4),
        # K-quant rows are 256 wide, so n_embd and the expert ff are 256 here
        FixtureSpec("qwen3moe-q4_k", "qwen3moe", n_layer=2, n_expert=8, n_expert_used=2,
                    n_embd=256, n_ff_exp=256, weight_type="F16", requantize_to="Q4_K", seed=5),
        # a different expert type in every layer
        FixtureSpec("qwen3moe-mixed", "qwen3moe", weight_type="Q8_0",
                    expert_types=("Q8_0", "Q4_0", "F16"), seed=6),
        # two shards of 20 and 19 tensors: the cut falls inside layer 1 (its experts in shard 2)
        FixtureSpec("qwen3moe-split", "qwen3moe", weight_type="F16", n_shards=2, seed=7),
        # many experts, otherwise tiny
        FixtureSpec("qwen3moe-256x", "qwen3moe", n_layer=2, n_expert=256, n_expert_used=8,
                    weight_type="F16", expert_types=("Q8_0", "Q8_0"), seed=8),
        # shared expert with a sigmoid gate (ffn_gate_inp_shexp)
        FixtureSpec("qwen2moe", "qwen2moe", n_expert=8, n_expert_used=2, n_ff_shexp=64,
                    weight_type="Q8_0", seed=9),
        # MLA, a leading dense layer, a shared expert, 4 groups of 4 experts (2 used),
        # sigmoid gating with exp_probs_b
        # (MLA stores one latent "KV head" per token, so n_head_kv is 1)
        FixtureSpec("deepseek2", "deepseek2", n_layer=3, n_expert=16, n_expert_used=4,
                    n_head_kv=1, weight_type="F16", expert_types=("F16", "Q4_0", "Q4_0"), seed=10),
        # expert biases, MXFP4 experts, attention sinks, SWA on every other layer
        FixtureSpec("gpt-oss", "gpt-oss", n_layer=2, n_expert=8, n_expert_used=2,
                    n_ff_exp=64, weight_type="F16", expert_types=("MXFP4", "MXFP4"), seed=11),
        # Mixtral: llama arch with 8 experts, top-2
        FixtureSpec("mixtral", "llama", n_layer=2, n_expert=8, n_expert_used=2, n_ff_exp=64,
                    weight_type="F16", seed=12),
        # OLMoE: q/k norms over the full width, so all heads are KV heads
        FixtureSpec("olmoe", "olmoe", n_layer=2, n_head_kv=4, seed=13),
        # larger: 256 experts of 256 x 128 in Q8_0 (~53 MB of experts, ~1 MB of the rest), big
        # enough that memory measurements see the experts a small pool does not hold
        FixtureSpec("qwen3moe-rss", "qwen3moe", n_layer=2, n_expert=256, n_expert_used=8,
                    n_embd=256, n_ff_exp=128, weight_type="F16", expert_types=("Q8_0", "Q8_0"),
                    seed=14),
    )
}

# Models without routed experts, for the "not a MoE model" paths. Kept out of FIXTURES, which the
# every-fixture tests take to be MoE models; write_fixture knows both.
DENSE_FIXTURES: dict[str, FixtureSpec] = {
    spec.name: spec
    for spec in (
        # a plain llama: no router, no experts; n_ff is the FFN's hidden size
        FixtureSpec("llama-dense", "llama", n_layer=2, n_expert=0, n_expert_used=0,
                    weight_type="F16", seed=15),
    )
}


# ---------------------------------------------------------------------------------------------
# Public entry points


def write_fixture(name: str, out_dir: str | Path) -> Path:
    """Write fixture `name` into `out_dir` unless a complete copy is already there.

    Returns the path to load: `<name>.gguf`, or `<name>-00001-of-0000n.gguf` for split files.
    """
    spec = FIXTURES[name] if name in FIXTURES else DENSE_FIXTURES[name]
    out_dir = Path(out_dir)
    path = out_dir / f"{name}.gguf"
    first = shard_paths(path, spec.n_shards)[0]
    if is_complete(spec, path):
        return first
    return write_model(spec, path)


def write_model(spec: FixtureSpec, path: str | Path) -> Path:
    """Write `spec` to `path` (or to its shards) and return the first file.

    Files are written into a temporary folder next to `path` and moved into place at the end,
    so a file that exists under its final name is always complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fixture-") as tmp:
        tmp_path = Path(tmp) / path.name
        if spec.requantize_to is None:
            _write_gguf(spec, tmp_path)
        else:
            base = Path(tmp) / f"{path.stem}-f16.gguf"
            _write_gguf(spec, base)
            _requantize(base, tmp_path, spec.requantize_to)
        for tmp_shard, shard in zip(shard_paths(tmp_path, spec.n_shards),
                                    shard_paths(path, spec.n_shards)):
            os.replace(tmp_shard, shard)
    return shard_paths(path, spec.n_shards)[0]


def shard_paths(path: str | Path, n_shards: int) -> list[Path]:
    """The files a model at `path` is written to: itself, or llama.cpp's split names."""
    path = Path(path)
    if n_shards == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i:05d}-of-{n_shards:05d}.gguf")
            for i in range(1, n_shards + 1)]


def fingerprint(spec: FixtureSpec) -> str:
    """A digest of the spec and FORMAT_VERSION, stored in the (first) file's metadata."""
    vocab = f":n_vocab={spec.n_vocab}" if spec.n_vocab else ""
    return hashlib.sha256(f"{FORMAT_VERSION}:{spec!r}{vocab}".encode()).hexdigest()[:16]


def is_complete(spec: FixtureSpec, path: str | Path) -> bool:
    """True when all shards of `path` exist, hold all their tensor data, and came from `spec`."""
    shards = shard_paths(path, spec.n_shards)
    if not all(shard.is_file() for shard in shards):
        return False
    try:
        for i, shard in enumerate(shards):
            reader = gguf.GGUFReader(shard)
            if i == 0:
                field = reader.get_field(FINGERPRINT_KEY)
                if field is None or field.contents() != fingerprint(spec):
                    return False
            data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
            if data_end > shard.stat().st_size:
                return False
    except (ValueError, IndexError, KeyError, OSError):  # truncated or not a GGUF file
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Tensors


class TensorSpec(NamedTuple):
    """One tensor of a model: its name, ggml shape `ne` (ne0 the input, fan-in, dimension), its
    ggml type, and how its values are made:
        kind "matrix": normal with std scale / sqrt(ne0); "vector": normal with std scale (biases,
        sinks); "norm": ones (RMS-norm weights); "hole": never written (zeros, _Hole). The bench's
        writer (lab/bench/synthetic.py) types them by a recipe and adds "router"."""

    name: str
    ne: tuple[int, ...]
    qtype: str
    kind: str
    scale: float


class _Tensors:
    """Collects the tensors' TensorSpecs in call order (the plan); _draw makes their values."""

    def __init__(self):
        self.plan: list[TensorSpec] = []

    def matrix(self, name: str, ne: tuple[int, ...], qtype: str, scale: float = 1.0) -> None:
        """A weight of ggml shape `ne`; ne0 is the input (fan-in) dimension."""
        self.plan.append(TensorSpec(name, tuple(ne), qtype, "matrix", scale))

    def vector(self, name: str, ne: tuple[int, ...], std: float) -> None:
        """A bias-like F32 tensor with small normal values."""
        self.plan.append(TensorSpec(name, tuple(ne), "F32", "vector", std))

    def hole(self, name: str, ne: tuple[int, ...], qtype: str) -> None:
        """A weight of ggml shape `ne` whose bytes are never written (zeros): _Hole."""
        self.plan.append(TensorSpec(name, tuple(ne), qtype, "hole", 0.0))

    def norm(self, name: str, n: int) -> None:
        """An RMS-norm weight {n}: all ones."""
        self.plan.append(TensorSpec(name, (n,), "F32", "norm", 1.0))


def _draw(plan: list[TensorSpec], seed: int) -> Iterator[tuple[str, np.ndarray, str]]:
    """(name, float32 values in numpy order or a _Hole, ggml type) per tensor, drawn in plan order
    from one generator."""
    rng = np.random.default_rng(seed)
    for t in plan:
        shape = tuple(reversed(t.ne))
        if t.kind == "matrix":
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale / math.sqrt(t.ne[0]))
        elif t.kind == "vector":
            values = rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale)
        elif t.kind == "hole":
            values = _Hole.of(shape, t.qtype)
        else:
            values = np.ones(shape, dtype=np.float32)
        yield t.name, values, t.qtype


class _Hole:
    """What gguf's writer takes for an array whose bytes it skips: the file gets a hole (zeros on
    read, no disk) where the tensor's data would be. Zero bytes are zeros in every type (a block's
    scale 0 too); raw_dtype: the ggml type of a quantized one, whose shape is then in bytes."""

    def __init__(self, shape: tuple[int, ...], dtype, raw_dtype=None):
        self.shape, self.dtype, self.raw_dtype = shape, np.dtype(dtype), raw_dtype
        self.nbytes = math.prod(shape) * self.dtype.itemsize

    @classmethod
    def of(cls, shape: tuple[int, ...], qtype: str) -> "_Hole":
        """A hole of `shape` (numpy order) values of ggml type qtype."""
        if qtype in ("F16", "F32"):
            return cls(shape, np.float16 if qtype == "F16" else np.float32)
        ggml_type = gguf.GGMLQuantizationType[qtype]
        block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        return cls((*shape[:-1], shape[-1] // block * type_bytes), np.uint8, ggml_type)

    def tofile(self, fout) -> None:
        fout.seek(self.nbytes, os.SEEK_CUR)
        fout.truncate(fout.tell())  # (a hole at the end of the file too)


def _add_embeddings(t: _Tensors, spec: ArchDims, n_vocab: int) -> None:
    # token_embd {n_embd, n_vocab}: unit-variance rows (the first norm rescales them anyway)
    t.matrix("token_embd.weight", (spec.n_embd, n_vocab), spec.weight_type,
             scale=math.sqrt(spec.n_embd))


def _add_output(t: _Tensors, spec: ArchDims, n_vocab: int) -> None:
    t.norm("output_norm.weight", spec.n_embd)
    # output {n_embd, n_vocab}: logits with std ~1 after the final norm
    t.matrix("output.weight", (spec.n_embd, n_vocab), spec.weight_type)


def _add_gqa_attention(t: _Tensors, spec: ArchDims, il: int, qkv_bias: bool = False) -> None:
    """attn_q/k/v/output for n_head query heads and n_head_kv KV heads of head_dim each."""
    p = f"blk.{il}."
    n_q = spec.n_head * spec.head_dim  # query width
    n_kv = spec.n_head_kv * spec.head_dim  # key and value width
    t.matrix(p + "attn_q.weight", (spec.n_embd, n_q), spec.weight_type)
    t.matrix(p + "attn_k.weight", (spec.n_embd, n_kv), spec.weight_type)
    t.matrix(p + "attn_v.weight", (spec.n_embd, n_kv), spec.weight_type)
    if qkv_bias:
        t.vector(p + "attn_q.bias", (n_q,), std=0.02)
        t.vector(p + "attn_k.bias", (n_kv,), std=0.02)
        t.vector(p + "attn_v.bias", (n_kv,), std=0.02)
    t.matrix(p + "attn_output.weight", (n_q, spec.n_embd), spec.weight_type)


def _add_router(t: _Tensors, spec: ArchDims, il: int) -> None:
    # ffn_gate_inp {n_embd, n_expert}, F32 as llama.cpp never quantizes routers;
    # router logits have std ~1, so the chosen experts change from token to token
    t.matrix(f"blk.{il}.ffn_gate_inp.weight", (spec.n_embd, spec.n_expert), "F32")


def _add_routed_experts(t: _Tensors, spec: ArchDims, il: int, n_ff: int) -> None:
    """ffn_{gate,up}_exps {n_embd, n_ff, n_expert} and ffn_down_exps {n_ff, n_embd, n_expert}."""
    p = f"blk.{il}."
    qtype = spec.expert_type(il)
    add = t.matrix
    if spec.expert_holes:
        add = t.hole
    add(p + "ffn_gate_exps.weight", (spec.n_embd, n_ff, spec.n_expert), qtype)
    add(p + "ffn_up_exps.weight", (spec.n_embd, n_ff, spec.n_expert), qtype)
    add(p + "ffn_down_exps.weight", (n_ff, spec.n_embd, spec.n_expert), qtype)


def _add_dense_ffn(t: _Tensors, spec: ArchDims, il: int, suffix: str, n_ff: int) -> None:
    """ffn_{gate,up}<suffix> {n_embd, n_ff} and ffn_down<suffix> {n_ff, n_embd}."""
    p = f"blk.{il}."
    t.matrix(p + f"ffn_gate{suffix}.weight", (spec.n_embd, n_ff), spec.weight_type)
    t.matrix(p + f"ffn_up{suffix}.weight", (spec.n_embd, n_ff), spec.weight_type)
    t.matrix(p + f"ffn_down{suffix}.weight", (n_ff, spec.n_embd), spec.weight_type)


def _qwen3moe_layer(t: _Tensors, spec: ArchDims, il: int) -> None:
    p = f"blk.{il}."
    t.norm(p + "attn_norm.weight", spec.n_embd)
    _add_gqa_attention(t, spec, il)
    t.norm(p + "attn_q_norm.weight", spec.head_dim)  # per-head RMS norm of q and k
    t.norm(p + "attn_k_norm.weight", spec.head_dim)
    t.norm(p + "ffn_norm.weight", spec.n_embd)
    _add_router(t, spec, il)
    _add_routed_experts(t, spec, il, spec.n_ff_exp)


def _qwen2moe_layer(t: _Tensors, spec: ArchDims, il: int) -> None:
    p = f"blk.{il}."
    t.norm(p + "attn_norm.weight", spec.n_embd)
    _add_gqa_attention(t, spec, il, qkv_bias=True)
    t.norm(p + "ffn_norm.weight", spec.n_embd)
    _add_router(t, spec, il)
    _add_routed_experts(t, spec, il, spec.n_ff_exp)
    # shared expert, scaled per token by sigmoid(ffn_gate_inp_shexp · x); {n_embd}
    t.vector(p + "ffn_gate_inp_shexp.weight", (spec.n_embd,), std=1 / math.sqrt(spec.n_embd))
    _add_dense_ffn(t, spec, il, "_shexp", spec.n_ff_shexp)


def _olmoe_layer(t: _Tensors, spec: ArchDims, il: int) -> None:
    p = f"blk.{il}."
    t.norm(p + "attn_norm.weight", spec.n_embd)
    _add_gqa_attention(t, spec, il)
    t.norm(p + "attn_q_norm.weight", spec.n_embd)  # over all heads at once
    t.norm(p + "attn_k_norm.weight", spec.n_embd)
    t.norm(p + "ffn_norm.weight", spec.n_embd)
    _add_router(t, spec, il)
    _add_routed_experts(t, spec, il, spec.n_ff_exp)


def _mixtral_layer(t: _Tensors, spec: ArchDims, il: int) -> None:
    p = f"blk.{il}."
    t.norm(p + "attn_norm.weight", spec.n_embd)
    _add_gqa_attention(t, spec, il)
    t.norm(p + "ffn_norm.weight", spec.n_embd)
    if spec.n_expert == 0:  # dense llama
        _add_dense_ffn(t, spec, il, "", spec.n_ff)
        return
    _add_router(t, spec, il)
    _add_routed_experts(t, spec, il, spec.n_ff_exp)


def _gpt_oss_layer(t: _Tensors, spec: ArchDims, il: int) -> None:
    p = f"blk.{il}."
    t.norm(p + "attn_norm.weight", spec.n_embd)
    _add_gqa_attention(t, spec, il, qkv_bias=True)
    t.vector(p + "attn_output.bias", (spec.n_embd,), std=0.02)
    t.vector(p + "attn_sinks.weight", (spec.n_head,), std=0.5)  # one sink logit per head
    t.norm(p + "post_attention_norm.weight", spec.n_embd)
    _add_router(t, spec, il)
    t.vector(p + "ffn_gate_inp.bias", (spec.n_expert,), std=0.1)
    _add_routed_experts(t, spec, il, spec.n_ff_exp)
    # per-expert biases: gate/up {n_ff_exp, n_expert}, down {n_embd, n_expert}
    t.vector(p + "ffn_gate_exps.bias", (spec.n_ff_exp, spec.n_expert), std=0.02)
    t.vector(p + "ffn_up_exps.bias", (spec.n_ff_exp, spec.n_expert), std=0.02)
    t.vector(p + "ffn_down_exps.bias", (spec.n_embd, spec.n_expert), std=0.02)


def _deepseek2_layer(t: _Tensors, spec: ArchDims, il: int) -> None:
    p = f"blk.{il}."
    m = spec.mla
    n_head = spec.n_head
    k_head = m.nope_dim + m.rope_dim
    t.norm(p + "attn_norm.weight", spec.n_embd)
    if m.q_lora_rank:
        # q: x -> q_lora {n_embd, q_lora} -> norm -> heads {q_lora, n_head * (nope + rope)}
        t.matrix(p + "attn_q_a.weight", (spec.n_embd, m.q_lora_rank), spec.weight_type)
        t.norm(p + "attn_q_a_norm.weight", m.q_lora_rank)
        t.matrix(p + "attn_q_b.weight", (m.q_lora_rank, n_head * k_head), spec.weight_type)
    else:  # q straight from x {n_embd, n_head * (nope + rope)}
        t.matrix(p + "attn_q.weight", (spec.n_embd, n_head * k_head), spec.weight_type)
    # kv: x -> compressed kv plus the shared rope key {n_embd, kv_lora + rope}
    t.matrix(p + "attn_kv_a_mqa.weight", (spec.n_embd, m.kv_lora_rank + m.rope_dim), spec.weight_type)
    t.norm(p + "attn_kv_a_norm.weight", m.kv_lora_rank)
    # per-head up-projections: k_b {nope, kv_lora, n_head}, v_b {kv_lora, v, n_head}
    t.matrix(p + "attn_k_b.weight", (m.nope_dim, m.kv_lora_rank, n_head), spec.weight_type)
    t.matrix(p + "attn_v_b.weight", (m.kv_lora_rank, m.v_dim, n_head), spec.weight_type)
    t.matrix(p + "attn_output.weight", (n_head * m.v_dim, spec.n_embd), spec.weight_type)
    t.norm(p + "ffn_norm.weight", spec.n_embd)
    if il < m.n_dense_lead:
        _add_dense_ffn(t, spec, il, "", spec.n_ff)
        return
    _add_router(t, spec, il)
    if m.gating == "sigmoid":
        # exp_probs_b {n_expert}: added to the sigmoid scores for choosing, not for weighting
        t.vector(p + "exp_probs_b.bias", (spec.n_expert,), std=0.1)
    _add_routed_experts(t, spec, il, spec.n_ff_exp)
    _add_dense_ffn(t, spec, il, "_shexp", spec.n_ff_exp * m.n_expert_shared)


_LAYER_WRITERS = {
    "qwen3moe": _qwen3moe_layer,
    "qwen2moe": _qwen2moe_layer,
    "olmoe": _olmoe_layer,
    "llama": _mixtral_layer,
    "gpt-oss": _gpt_oss_layer,
    "deepseek2": _deepseek2_layer,
}


ARCHS = tuple(_LAYER_WRITERS)


def tensor_plan(dims: ArchDims, n_vocab: int) -> list[TensorSpec]:
    """Every tensor of a model of `dims` with n_vocab tokens, in file order: token_embd, each
    layer's, output_norm, output."""
    t = _Tensors()
    _add_embeddings(t, dims, n_vocab)
    for il in range(dims.n_layer):
        _LAYER_WRITERS[dims.arch](t, dims, il)
    _add_output(t, dims, n_vocab)
    return t.plan


# ---------------------------------------------------------------------------------------------
# Metadata


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves,
    the other 68 bytes to the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    mapping = {}
    n_shifted = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n_shifted)
            n_shifted += 1
    return mapping


def vocabulary(n_vocab: int = 0) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte tokens, one token per merge, control tokens, then
    unused tokens up to n_vocab (a real model's vocabulary size: its output matrix, logits and
    tokenizer tables at their real sizes; text never tokenizes to them)."""
    tokens = list(bytes_to_unicode().values())
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    merges = []
    for left, right in MERGES:
        assert left in tokens and right in tokens, (left, right)
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        types.append(int(gguf.TokenType.NORMAL))
    for text in CONTROL_TOKENS:
        tokens.append(text)
        types.append(int(gguf.TokenType.CONTROL))
    if n_vocab > len(tokens):
        pad = n_vocab - len(tokens)
        tokens += [f"<|unused_{i}|>" for i in range(pad)]
        types += [int(gguf.TokenType.UNUSED)] * pad
    return tokens, types, merges


def add_tokenizer(w: gguf.GGUFWriter, n_vocab: int = 0) -> None:
    """The fixtures' vocabulary (also the benchmark model's), padded to n_vocab tokens."""
    gguf_writer.add_tokenizer(w, *vocabulary(n_vocab))


def add_arch_hparams(w: gguf.GGUFWriter, spec: ArchDims, n_ctx: int = CONTEXT_LENGTH,
                     rope_base: float = 10000.0) -> None:
    """The hyperparameters llama.cpp reads for `spec`'s architecture (src/models/<arch>.cpp)."""
    gguf_writer.add_model_hparams(w, n_ctx=n_ctx, n_embd=spec.n_embd, n_layer=spec.n_layer,
                                  n_head=spec.n_head, n_head_kv=spec.n_head_kv, rms_eps=RMS_EPS,
                                  rope_base=rope_base, n_expert=spec.n_expert, n_expert_used=spec.n_expert_used)

    if spec.n_expert == 0:
        w.add_feed_forward_length(spec.n_ff)
    elif spec.arch in ("llama", "olmoe"):
        # these read the routed experts' hidden size from feed_forward_length
        w.add_feed_forward_length(spec.n_ff_exp)
    else:
        w.add_feed_forward_length(spec.n_ff)
        w.add_expert_feed_forward_length(spec.n_ff_exp)

    if spec.arch == "qwen3moe":
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    if spec.arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    if spec.arch == "gpt-oss":
        w.add_sliding_window(spec.sliding_window)  # tokens; SWA on even layers (llama.cpp's default pattern)
        if spec.head_dim != spec.n_embd // spec.n_head:  # (gpt-oss-20b: 64 heads of 64 over 2880)
            w.add_key_length(spec.head_dim)
            w.add_value_length(spec.head_dim)
    if spec.arch == "deepseek2":
        _add_deepseek2_hparams(w, spec)


def _add_deepseek2_hparams(w: gguf.GGUFWriter, spec: ArchDims) -> None:
    assert spec.n_head_kv == 1, "MLA caches one latent head per token"
    m = spec.mla
    w.add_leading_dense_block_count(m.n_dense_lead)
    w.add_q_lora_rank(m.q_lora_rank)  # (0: none; read unless llama.cpp takes the model for a "lite" one)
    w.add_kv_lora_rank(m.kv_lora_rank)
    w.add_rope_dimension_count(m.rope_dim)
    # MLA caches one "head" per token: the compressed kv plus the rope key
    w.add_key_length(m.kv_lora_rank + m.rope_dim)
    w.add_value_length(m.kv_lora_rank)
    w.add_key_length_mla(m.nope_dim + m.rope_dim)
    w.add_value_length_mla(m.v_dim)
    w.add_expert_shared_count(m.n_expert_shared)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(m.weights_norm)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType[m.gating.upper()])
    if m.n_groups:
        w.add_expert_group_count(m.n_groups)
        w.add_expert_group_used_count(m.n_groups_used)


# ---------------------------------------------------------------------------------------------
# Writing


def encode_tensor(values: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """float32 values -> (array to store, raw ggml type for quantized bytes or None)."""
    if qtype == "F32":
        return values.astype(np.float32), None
    if qtype == "F16":
        return values.astype(np.float16), None
    ggml_type = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(values, ggml_type), ggml_type


def _write_gguf(spec: FixtureSpec, path: Path) -> None:
    if spec.requantize_to is not None:
        assert spec.weight_type in ("F32", "F16") and not spec.expert_types
    tokens, _, _ = vocabulary(spec.n_vocab)
    plan = tensor_plan(spec.dims, n_vocab=len(tokens))

    # shards of at most ceil(n / n_shards) tensors each; a tensor never spans two shards
    per_shard = math.ceil(len(plan) / spec.n_shards) if spec.n_shards > 1 else 0
    w = gguf.GGUFWriter(path, spec.arch, split_max_tensors=per_shard)
    w.add_name(spec.name)
    w.add_string(FINGERPRINT_KEY, fingerprint(spec))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_arch_hparams(w, spec.dims)
    add_tokenizer(w, spec.n_vocab)
    for name, values, qtype in _draw(plan, spec.seed):
        data, raw_dtype = (values, values.raw_dtype) if isinstance(values, _Hole) else encode_tensor(values, qtype)
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    written = shard_paths(path, spec.n_shards)
    assert all(p.is_file() for p in written), f"gguf wrote other shards than {written}"


def _requantize(src: Path, dst: Path, qtype: str) -> None:
    """Quantize every matrix of `src` to the K-quant `qtype` with llama.cpp's own quantizer."""
    import ctypes
    import logging

    import llama_cpp  # needs LLAMA_CPP_LIB_PATH; only K-quant fixtures get here

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _LLAMA_FTYPES[qtype]
    params.pure = True  # no per-tensor mixes: every matrix (routers excepted) becomes qtype
    params.nthread = 2
    # llama-cpp-python prints llama.cpp's log when this logger lets INFO through
    logger = logging.getLogger("llama-cpp-python")
    saved_level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                                ctypes.byref(params))
    finally:
        logger.setLevel(saved_level)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) returned {status}")

    # llama.cpp falls back to another type when rows are not a multiple of 256: check
    wanted = gguf.GGMLQuantizationType[qtype]
    for tensor in gguf.GGUFReader(dst).tensors:
        if "_exps." in tensor.name and tensor.tensor_type != wanted:
            raise RuntimeError(f"{tensor.name} came out {tensor.tensor_type.name}, not {qtype}")
