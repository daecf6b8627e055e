"""The benchmark's model writer: a real model's shape with random weights, written as a GGUF.

Shapes (SHAPES; `empanel-gguf bench --write-model PATH --shape NAME`):

    qwen3-30b-a3b-q4_k_m  (the default) qwen3moe, 48 layers x 128 experts top-8, n_embd 2048, expert
                          ff 768, 32 q / 4 kv heads of 128, 151,936 tokens, the types llama-quantize's
                          Q4_K_M recipe gives it (recipe.py): ~18.6 GB like Qwen3-30B-A3B-Q4_K_M.gguf
    gpt-oss-20b           gpt-oss, 24 layers x 32 experts top-4, n_embd 2880, expert ff 2880, 64 q /
                          8 kv heads of 64, sliding window 128 on every other layer, attention sinks,
                          biases, 201,088 tokens; experts MXFP4, the other matrices Q8_0 (as the public
                          ggml-org/gpt-oss-20b-GGUF file: its 459 tensors mix Q8_0 and MXFP4, and
                          10.2 GB of MXFP4 experts plus the other 1.8 B weights in Q8_0 make its 12.1 GB)
    deepseek-v2-lite      deepseek2, 27 layers (the first dense, ff 10944), 64 routed experts top-6 and
                          2 shared (ff 2 x 1408), expert ff 1408, n_embd 2048, 16 heads of MLA
                          (kv_lora 512, no q lora, rope 64, nope 128, v 128), 102,400 tokens, Q4_K_M
                          recipe types (1408-wide rows cannot be K-quants: Q5_0 / Q8_0)
    synthetic             the benchmark's first model (and file): Qwen3-30B-A3B's layers but every
                          matrix Q4_K and the fixtures' 401 tokens; --layers/--experts/... change it

The tensors' names and shapes and the metadata are the fixtures' (models/fixtures.py: tensor_plan,
add_arch_hparams; one definition per arch); the types follow the recipe; the values are random
blocks (blocks.py) with std scale / sqrt(fan_in), streamed one tensor at a time. The vocabulary is
the fixtures' byte-level BPE one padded with unused tokens to the real size, so the output matrix,
the logits and the tokenizer tables are the real model's sizes while text tokenizes as before.
Left out: the real tokenizers (o200k, DeepSeek's, Qwen's merges), rope scaling (gpt-oss's and
DeepSeek's YaRN) and the real context lengths (4096 here): metadata the bench does not exercise.

Routing (ModelShape.routing_skew, .routing_locality). A random router makes every expert alike and
a token's experts nearly independent of the previous token's; trained routers do neither.
- routing_skew S: router row e scaled by exp(S * N(0, 1)), so that some experts win the top-k far
  more often (hot experts).
- routing_locality L: the attention output (attn_output.weight) scaled by 1 + L. Random attention
  mixes nearly all earlier tokens alike, so its output changes slowly from token to token; the
  larger its share of the residual stream, the more of a token's experts the previous token also
  used. The share grows with depth (each layer adds its mix to the next one's input), so deep
  layers are more local than early ones at any L, and a model with fewer layers than its shape
  under-states the locality. It depends on the types too: Q4_K's random blocks carry random
  sub-block offsets (dmin x min) that pass the mix on more strongly than Q6_K's, so an all-Q4_K
  model is more local at the same L than the Q4_K_M recipe's (attn_v Q6_K on half the layers).

Measured (scripts/shape_routing.py; docs/performance.md, "The real shapes") on the bench's own text,
544 tokens each one call, each shape at its full layer count with narrow experts (ff 256; 128 for
deepseek-v2-lite) and the 401-token vocabulary (neither changes the hidden states' scale: weights
are scaled by their fan-in; the types stay the recipe's), per layer then averaged: the share of a
token's experts the previous token also used; the LRU hit rate with 25 % and 18 % of a layer's
experts as slots (each token one call, from a cold cache); the share of a layer's experts used.
ROUTING_DEFAULTS below are the values taken; why, with the published figures they aim at:
{routing}
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

from ...models import fixtures
from ...models.fixtures import TensorSpec
from ...planning.format import GiB
from .blocks import FLOAT_TYPES, Q4_K_BLOCK, random_rows, row_bytes
from .blocks import q4_k_blocks  # noqa: F401  (the synthetic shape's writer, re-exported)
from .recipe import RECIPES, tensor_types

WRITER_VERSION = 1
FINGERPRINT_KEY = "empanel.bench.fingerprint"
SHAPE_KEY = "empanel.bench.shape"
ARCHS = ("qwen3moe", "gpt-oss", "deepseek2")  # the archs the named shapes need (fixtures know more)
_FILE_TYPES = {"pure-q4_k": "MOSTLY_Q4_K_M", "q4_k_m": "MOSTLY_Q4_K_M", "mxfp4_moe": "MOSTLY_MXFP4_MOE"}


@dataclass(frozen=True)
class ModelShape:
    """What determines a model file the bench writes. The defaults are the synthetic shape
    (Qwen3-30B-A3B's layers, every matrix Q4_K, 401 tokens); SHAPES names the real ones."""

    arch: str = "qwen3moe"
    n_layer: int = 48
    n_expert: int = 128
    n_expert_used: int = 8
    n_embd: int = 2048
    n_ff_exp: int = 768
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    context_length: int = 4096
    seed: int = 0
    # routing skew: router rows scaled by exp(skew * N(0, 1)) per expert, so that some experts win
    # the top-k far more often (0: every expert alike, as random weights route). Out of repr: the
    # fingerprint of an unskewed model is the one it always was
    routing_skew: float = field(default=0.0, repr=False)
    # The rest: out of repr too, and in the fingerprint only where not at the default, so that the
    # synthetic shape's file and fingerprint stay what they were
    name: str = field(default="synthetic", repr=False)
    recipe: str = field(default="pure-q4_k", repr=False)  # RECIPES
    n_vocab: int = field(default=0, repr=False)  # tokens (0: the fixtures' 401)
    n_ff: int = field(default=0, repr=False)  # feed_forward_length, the dense FFNs' (0: n_ff_exp x top-k)
    rope_base: float = field(default=1e6, repr=False)
    sliding_window: int = field(default=128, repr=False)  # gpt-oss: tokens, every other layer
    mla: fixtures.MlaDims = field(default=fixtures.MlaDims(), repr=False)  # deepseek2
    routing_locality: float = field(default=0.0, repr=False)  # attn_output scaled by 1 + this

    @property
    def dims(self) -> fixtures.ArchDims:
        """The widths fixtures' tensor_plan / add_arch_hparams read."""
        return fixtures.ArchDims(self.arch, self.n_layer, self.n_expert, self.n_expert_used, self.n_embd,
                                 self.n_ff_exp, self.n_ff or self.n_ff_exp * self.n_expert_used, 0,
                                 self.n_head, self.n_head_kv, self.head_dim,
                                 sliding_window=self.sliding_window, mla=self.mla)

    @property
    def vocab_size(self) -> int:
        return len(fixtures.vocabulary(self.n_vocab)[0])

    def check(self):
        if self.arch not in ARCHS:
            raise SystemExit(f"bench: the shapes written are {', '.join(ARCHS)}, not {self.arch}")
        if self.recipe not in RECIPES:
            raise SystemExit(f"bench: recipe {self.recipe!r} is not one of {', '.join(RECIPES)}")
        if self.recipe == "pure-q4_k":
            for what, n in (("--embd", self.n_embd), ("--expert-ff", self.n_ff_exp),
                            ("--heads x --head-dim", self.n_head * self.head_dim)):
                if n <= 0 or n % Q4_K_BLOCK:
                    raise SystemExit(f"bench: {what} is {n}; Q4_K rows must be a positive multiple of 256")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise SystemExit(f"bench: --top-k {self.n_expert_used} must lie in 1..{self.n_expert}")
        if self.n_head % self.n_head_kv:
            raise SystemExit(f"bench: --heads {self.n_head} must be a multiple of --heads-kv {self.n_head_kv}")
        if self.arch == "deepseek2" and self.n_head_kv != 1:
            raise SystemExit("bench: deepseek2 (MLA) caches one latent head per token: --heads-kv 1")


# Routing defaults per named shape: (routing_skew, routing_locality), measured and chosen as the
# module docstring says
ROUTING_DEFAULTS = {
    "qwen3-30b-a3b-q4_k_m": (0.0, 0.7),
    "gpt-oss-20b": (0.0, 0.1),
    "deepseek-v2-lite": (0.0, 1.5),
}
_ROUTING_WHY = """
  shape             skew  locality  previous token's     LRU 25 %            LRU 18 %  experts
                                    experts (first /     (first / last q.)             used
                                    last quarter)
  qwen3-30b-a3b     0     0.7       37.9 (12.9 / 56.5)   78.6 (43.9 / 96.7)  69.8      67 %
  gpt-oss-20b       0     0.1       33.8 (20.3 / 46.7)   56.4 (37.2 / 72.4)  46.1      97 %
  deepseek-v2-lite  0     1.5       21.3 (13.1 / 29.7)   47.3 (32.6 / 62.3)  37.7      98 %
  (in %, 2026-12-07, seed 0; at locality 0 the three give 12.6 / 29.4 / 12.0 % and LRU 18 % 32.3 /
  40.8 / 22.5 %. Depth matters: qwen3 with 12 layers gives 9.1 % at locality 0, with 48 12.6 %)
  - Published: the previous token's experts cover 18-38 % of a token's in trained models
    (../shared/docs/field.md, "Predicting the next layer's experts"). Replayed on real traces with a
    3,000 MiB budget (BigMoeOnEdge, field.md "The Belady gap"), LRU hits 70.6 % on Qwen3-30B-A3B, where
    3,000 MiB holds 18 % of its experts (17.6 GB of Q4_K_M experts), and 44.8 % on gpt-oss-120b, where
    it holds ~5 % (6.6 of 128 per layer, ~1.6 tokens of top-4). Liang et al., "Not All Models Suit
    Expert Offloading" (arXiv 2505.16056, 2025; 20 MoE models): models with MoE in every layer and no
    shared experts route the most consistently from token to token; shared experts lower it.
  - qwen3-30b-a3b: locality 0.7 puts LRU at 18 % on 69.8 % (70.6 published) with the previous
    token's share at 37.9 %, the top of the published range (0.5: 61.4 % / 30.6 %; 1.0: 79.0 / 47.0).
  - gpt-oss-20b (no shared experts, 32 experts): at 0 already 29.4 % / 40.8 %; 0.1 puts LRU at 18 %
    (6 slots of 32, ~1.5 tokens of top-4, as gpt-oss-120b's 5 %) on 46.1 % (44.8 published for 120b).
  - deepseek-v2-lite (2 shared experts, a dense first layer): its routing moves least with locality
    (1.0: 16.2 %); 1.5 puts the previous token's share at 21.3 %, the low end of the published range,
    as Liang et al. find for shared-expert models. No published LRU figure; 37.7 % at 18 %.
  - Skew stays 0: trained routers are balanced over a text (their auxiliary losses), and skew 0.3 on
    top of qwen3's locality 0.5 lowered the previous token's share (27.2 %), the LRU rate (58.3 %
    at 18 %) and the experts used (74 %) together. Locality costs the deep layers their variety too
    (qwen3 at 0.7 uses 67 % of a layer's experts over 544 tokens): the bench's text repeats itself.
"""


def _named(name: str, **widths) -> ModelShape:
    skew, locality = ROUTING_DEFAULTS[name]
    return ModelShape(name=name, routing_skew=skew, routing_locality=locality, **widths)


SHAPES: dict[str, ModelShape] = {
    "qwen3-30b-a3b-q4_k_m": _named("qwen3-30b-a3b-q4_k_m", recipe="q4_k_m", n_vocab=151936, n_ff=6144),
    "gpt-oss-20b": _named("gpt-oss-20b", arch="gpt-oss", recipe="mxfp4_moe", n_layer=24, n_expert=32,
                          n_expert_used=4, n_embd=2880, n_ff_exp=2880, n_head=64, n_head_kv=8, head_dim=64,
                          n_vocab=201088, n_ff=2880, rope_base=150000.0, sliding_window=128),
    "deepseek-v2-lite": _named("deepseek-v2-lite", arch="deepseek2", recipe="q4_k_m", n_layer=27, n_expert=64,
                               n_expert_used=6, n_embd=2048, n_ff_exp=1408, n_head=16, n_head_kv=1,
                               head_dim=192, n_vocab=102400, n_ff=10944, rope_base=10000.0,  # (head_dim: unread, MLA)
                               mla=fixtures.MlaDims(q_lora_rank=0, kv_lora_rank=512, rope_dim=64, nope_dim=128,
                                                    v_dim=128, n_dense_lead=1, n_expert_shared=2, n_groups=0,
                                                    n_groups_used=0, gating="softmax", weights_norm=False)),
    "synthetic": ModelShape(),
}
DEFAULT_SHAPE = "qwen3-30b-a3b-q4_k_m"
__doc__ = __doc__.format(routing=_ROUTING_WHY.rstrip())


# ---------------------------------------------------------------------------------------------
# The plan: every tensor's name, shape, type and values


def tensor_plan(shape: ModelShape) -> list[TensorSpec]:
    """Every tensor of `shape` in file order (the fixtures' TensorSpec: name, ggml shape `ne`, ne0
    the fan-in) with the type its recipe gives it and its values' kind: "matrix" random blocks of
    std scale / sqrt(ne0); "router" F32 of std 1 / sqrt(ne0), rows scaled by the skew `scale`;
    "vector" F32 normal of std `scale`; "norm" F32 ones. Computes, writes nothing."""
    specs = fixtures.tensor_plan(shape.dims, shape.vocab_size)
    types = tensor_types([(t.name, t.ne) for t in specs], shape.recipe, shape.n_expert, shape.n_layer)
    return [_planned(t, types[t.name], shape) for t in specs]


def _planned(t: TensorSpec, qtype: str, shape: ModelShape) -> TensorSpec:
    if t.kind == "matrix" and t.name.endswith("ffn_gate_inp.weight"):  # F32 like real files
        return t._replace(qtype="F32", kind="router", scale=shape.routing_skew)
    if t.kind == "matrix":
        gain = 1.0 + shape.routing_locality if t.name.endswith("attn_output.weight") else 1.0
        return t._replace(qtype=qtype, scale=t.scale * gain)
    assert t.kind in ("vector", "norm") and t.qtype == "F32", t
    return t


def tensor_bytes(t: TensorSpec) -> int:
    """Bytes in the file (before alignment padding)."""
    return math.prod(t.ne[1:]) * row_bytes(t.qtype, t.ne[0])


def plan_bytes(plan: list[TensorSpec]) -> int:
    """The tensor data's bytes (the file adds its metadata and a few bytes of alignment)."""
    return sum(tensor_bytes(t) for t in plan)


def plan_types(plan: list[TensorSpec]) -> dict[str, dict[str, int]]:
    """Per tensor kind (the name without its layer, blk.*.ffn_down_exps.weight), how many tensors
    have each type: {"blk.*.attn_v.weight": {"Q4_K": 24, "Q6_K": 24}, ...}."""
    kinds: dict[str, dict[str, int]] = {}
    for t in plan:
        kind = "blk.*." + t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
        counts = kinds.setdefault(kind, {})
        counts[t.qtype] = counts.get(t.qtype, 0) + 1
    return kinds


# ---------------------------------------------------------------------------------------------
# Fingerprint and reuse


def _extras(shape: ModelShape) -> dict:
    """The out-of-repr fields (routing_skew aside) that differ from their defaults."""
    return {f.name: getattr(shape, f.name) for f in fields(shape)
            if not f.repr and f.name != "routing_skew" and getattr(shape, f.name) != f.default}


def shape_fingerprint(shape: ModelShape) -> str:
    skew = f":skew={shape.routing_skew!r}" if shape.routing_skew else ""
    extras = "".join(f":{k}={v!r}" for k, v in _extras(shape).items())
    return hashlib.sha256(f"{WRITER_VERSION}:{shape!r}{skew}{extras}".encode()).hexdigest()[:16]


def _shape_json(shape: ModelShape) -> str:
    """The shape as the file's metadata holds it: the repr fields and routing_skew (what the
    synthetic shape always wrote), then the other fields that are not at their default."""
    kept = {f.name: getattr(shape, f.name) for f in fields(shape) if f.repr or f.name == "routing_skew"}
    extras = {k: asdict(v) if is_dataclass(v) else v for k, v in _extras(shape).items()}  # (mla)
    return json.dumps({**kept, **extras})


def model_is_current(shape: ModelShape, path: Path) -> bool:
    """The file at `path` was written complete from `shape` (same fingerprint, all data there)."""
    import gguf

    if not path.is_file():
        return False
    try:
        reader = gguf.GGUFReader(path)
        f = reader.get_field(FINGERPRINT_KEY)
        if f is None or f.contents() != shape_fingerprint(shape):
            return False
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
        return end <= path.stat().st_size
    except (ValueError, IndexError, KeyError, OSError):
        return False


# ---------------------------------------------------------------------------------------------
# Writing


def write_model(shape: ModelShape, path, log=print) -> Path:
    """Write `shape` to `path` unless an identical one is there. Tensors are made and written one at
    a time (the largest: gpt-oss-20b's token_embd / output, 615 MB each in Q8_0; one Qwen3-30B-A3B
    expert tensor is 113-165 MB), into a temporary name that is renamed at the end."""
    import gguf
    import numpy as np

    shape.check()
    path = Path(path)
    if model_is_current(shape, path):
        log(f"bench: reusing {path} ({path.stat().st_size / GiB:.2f} GiB, fingerprint {shape_fingerprint(shape)})")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = tensor_plan(shape)
    total = plan_bytes(plan)
    free = os.statvfs(path.parent)
    if free.f_bavail * free.f_frsize < total + GiB:
        raise SystemExit(f"bench: {path.parent} has {free.f_bavail * free.f_frsize / GiB:.1f} GiB free; "
                         f"the model needs {total / GiB:.1f} GiB")
    log(f"bench: writing {path} ({shape.name}: {total / GiB:.2f} GiB of tensors, {len(plan)} tensors)")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    t0 = time.perf_counter()
    try:
        w = gguf.GGUFWriter(tmp, shape.arch)
        _add_metadata(w, shape)
        for t in plan:
            _add_tensor_info(w, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        written, last_report = 0, time.perf_counter()
        for i, t in enumerate(plan):
            data = _tensor_data(np.random.default_rng([shape.seed, i]), t)
            w.write_tensor_data(data)
            written += data.nbytes
            if time.perf_counter() - last_report > 10:
                last_report = time.perf_counter()
                log(f"bench:   {written / GiB:.1f} / {total / GiB:.1f} GiB "
                    f"({written / (last_report - t0) / 1e9:.2f} GB/s)")
        w.close()
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    dt = time.perf_counter() - t0
    log(f"bench: wrote {path} in {dt:.1f} s ({total / dt / 1e9:.2f} GB/s)")
    return path


def _add_metadata(w, shape: ModelShape):
    import gguf

    s = shape
    if s.name == "synthetic":
        w.add_name(f"synthetic {s.arch} {s.n_layer}x{s.n_expert} top-{s.n_expert_used} Q4_K")
    else:
        w.add_name(f"synthetic {s.name}: {s.arch} {s.n_layer}x{s.n_expert} top-{s.n_expert_used} {s.recipe}")
    w.add_string(FINGERPRINT_KEY, shape_fingerprint(shape))
    w.add_string(SHAPE_KEY, _shape_json(shape))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[s.recipe]]))
    fixtures.add_arch_hparams(w, s.dims, n_ctx=s.context_length, rope_base=s.rope_base)
    fixtures.add_tokenizer(w, s.n_vocab)  # the fixtures' byte-level BPE vocabulary (one definition)


def _add_tensor_info(w, t: TensorSpec):
    import gguf
    import numpy as np

    if t.qtype in FLOAT_TYPES:
        w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(FLOAT_TYPES[t.qtype]), tensor_bytes(t))
    else:  # byte shape; the writer turns it into the element shape
        byte_shape = tuple(reversed(t.ne[1:])) + (row_bytes(t.qtype, t.ne[0]),)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), tensor_bytes(t),
                          raw_dtype=gguf.GGMLQuantizationType[t.qtype])


def _tensor_data(rng, t: TensorSpec):
    """The values of `t`, numpy array in numpy order (quantized: its rows' bytes)."""
    import numpy as np

    shape = tuple(reversed(t.ne))
    if t.kind == "norm":
        return np.ones(shape, dtype=np.float32)
    if t.kind == "vector":  # biases, attention sinks
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale)
    if t.kind == "router":  # logits with std ~1: routing changes from token to token
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(t.ne[0]))
        if t.scale:  # skew (routing_skew): expert e's logits scaled by exp(skew * N(0, 1))
            w *= np.exp(t.scale * rng.standard_normal(t.ne[1])).astype(np.float32)[:, None]
        return w
    rows = random_rows(rng, t.qtype, math.prod(t.ne[1:]), t.ne[0], scale=t.scale)
    return rows.reshape(tuple(reversed(t.ne[1:])) + (rows.shape[-1],))


def shape_with(name: str, **overrides) -> ModelShape:
    """SHAPES[name] with some fields changed (the bench's --layers, ...; tests' scaled-down shapes)."""
    if name not in SHAPES:
        raise SystemExit(f"bench: --shape {name!r} is not one of {', '.join(SHAPES)}")
    return replace(SHAPES[name], **overrides)
