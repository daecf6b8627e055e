"""The benchmark's synthetic model: a real model's shape, random Q4_K blocks, written as a GGUF."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...planning.format import GiB


WRITER_VERSION = 1
FINGERPRINT_KEY = "empanel.bench.fingerprint"
Q4_K_BLOCK = 256  # values per block
Q4_K_BYTES = 144  # bytes per block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
# std of (scale * q - 7.5 * min) for uniform 6-bit scale/min and 4-bit q: sqrt(47532 + 19195);
# d = 1 / (258 * sqrt(fan_in)) gives weights of std ~1/sqrt(fan_in), mean ~0 (dmin = 7.5 d)
Q4_K_SPREAD = 258.0


@dataclass(frozen=True)
class ModelShape:
    """What determines a synthetic model file (defaults: Qwen3-30B-A3B)."""

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

    def check(self):
        for what, n in (("--embd", self.n_embd), ("--expert-ff", self.n_ff_exp),
                        ("--heads x --head-dim", self.n_head * self.head_dim)):
            if n <= 0 or n % Q4_K_BLOCK:
                raise SystemExit(f"bench: {what} is {n}; Q4_K rows must be a positive multiple of 256")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise SystemExit(f"bench: --top-k {self.n_expert_used} must lie in 1..{self.n_expert}")
        if self.n_head % self.n_head_kv:
            raise SystemExit(f"bench: --heads {self.n_head} must be a multiple of --heads-kv {self.n_head_kv}")
        if self.arch != "qwen3moe":
            raise SystemExit(f"bench: only qwen3moe shapes are written, not {self.arch}")


def shape_fingerprint(shape: ModelShape) -> str:
    skew = f":skew={shape.routing_skew!r}" if shape.routing_skew else ""
    return hashlib.sha256(f"{WRITER_VERSION}:{shape!r}{skew}".encode()).hexdigest()[:16]


def q4_k_blocks(rng, n_rows: int, ne0: int, fan_in: int, scale: float = 1.0):
    """Random Q4_K rows as raw bytes, numpy shape (n_rows, ne0 / 256 * 144), uint8.

    block_q4_K = {f16 d, f16 dmin, u8 scales[12], u8 qs[128]}: the 12 scale bytes pack 8 6-bit
    scales and 8 6-bit mins, so random bytes are random scales/mins; qs are random nibbles.
    """
    import numpy as np

    assert ne0 % Q4_K_BLOCK == 0, ne0
    n_blocks = n_rows * (ne0 // Q4_K_BLOCK)
    blocks = rng.integers(0, 256, size=(n_blocks, Q4_K_BYTES), dtype=np.uint8)
    d = np.float16(scale / (Q4_K_SPREAD * math.sqrt(fan_in)))
    head = np.array([d, np.float16(7.5 * float(d))], dtype="<f2").view(np.uint8)
    blocks[:, :4] = head
    return blocks.reshape(n_rows, ne0 // Q4_K_BLOCK * Q4_K_BYTES)


def _tensor_plan(shape: ModelShape, n_vocab: int):
    """[(name, ne in ggml order, kind, scale)], kind: q4k | norm | router (F32 like real files)."""
    s = shape
    n_q, n_kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    plan = [("token_embd.weight", (s.n_embd, n_vocab), "q4k", math.sqrt(s.n_embd))]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        plan += [
            (p + "attn_norm.weight", (s.n_embd,), "norm", 1.0),
            (p + "attn_q.weight", (s.n_embd, n_q), "q4k", 1.0),
            (p + "attn_k.weight", (s.n_embd, n_kv), "q4k", 1.0),
            (p + "attn_v.weight", (s.n_embd, n_kv), "q4k", 1.0),
            (p + "attn_output.weight", (n_q, s.n_embd), "q4k", 1.0),
            (p + "attn_q_norm.weight", (s.head_dim,), "norm", 1.0),
            (p + "attn_k_norm.weight", (s.head_dim,), "norm", 1.0),
            (p + "ffn_norm.weight", (s.n_embd,), "norm", 1.0),
            (p + "ffn_gate_inp.weight", (s.n_embd, s.n_expert), "router", s.routing_skew),
            (p + "ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "q4k", 1.0),
            (p + "ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), "q4k", 1.0),
            (p + "ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), "q4k", 1.0),
        ]
    plan += [("output_norm.weight", (s.n_embd,), "norm", 1.0),
             ("output.weight", (s.n_embd, n_vocab), "q4k", 1.0)]
    return plan


def _tensor_bytes(ne, kind) -> int:
    n = math.prod(ne)
    return n // Q4_K_BLOCK * Q4_K_BYTES if kind == "q4k" else 4 * n


def _tensor_data(rng, ne, kind, scale):
    import numpy as np

    if kind == "norm":
        return np.ones(tuple(reversed(ne)), dtype=np.float32)
    if kind == "router":  # logits with std ~1: routing changes from token to token
        w = rng.standard_normal(tuple(reversed(ne)), dtype=np.float32) * np.float32(1.0 / math.sqrt(ne[0]))
        if scale:  # skew (routing_skew): expert e's logits scaled by exp(skew * N(0, 1))
            w *= np.exp(scale * rng.standard_normal(ne[1])).astype(np.float32)[:, None]
        return w
    n_rows = math.prod(ne[1:])
    blocks = q4_k_blocks(rng, n_rows, ne[0], fan_in=ne[0], scale=scale)
    return blocks.reshape(tuple(reversed(ne[1:])) + (blocks.shape[-1],))


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


def write_model(shape: ModelShape, path, log=print) -> Path:
    """Write the synthetic model to `path` unless an identical one is there. Tensors are made and
    written one at a time (the largest, one expert tensor, is ~113 MB for Qwen3-30B-A3B), into a
    temporary name that is renamed at the end."""
    import gguf
    import numpy as np

    from empanel_gguf.models import fixtures, gguf_writer

    shape.check()
    path = Path(path)
    if model_is_current(shape, path):
        log(f"bench: reusing {path} ({path.stat().st_size / GiB:.2f} GiB, fingerprint {shape_fingerprint(shape)})")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, _, _ = fixtures.vocabulary()
    plan = _tensor_plan(shape, len(tokens))
    total = sum(_tensor_bytes(ne, kind) for _, ne, kind, _ in plan)
    free = os.statvfs(path.parent)
    if free.f_bavail * free.f_frsize < total + GiB:
        raise SystemExit(f"bench: {path.parent} has {free.f_bavail * free.f_frsize / GiB:.1f} GiB free; "
                         f"the model needs {total / GiB:.1f} GiB")
    log(f"bench: writing {path} ({total / GiB:.2f} GiB of tensors, {len(plan)} tensors)")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    t0 = time.perf_counter()
    try:
        w = gguf.GGUFWriter(tmp, shape.arch)
        s = shape
        w.add_name(f"synthetic {s.arch} {s.n_layer}x{s.n_expert} top-{s.n_expert_used} Q4_K")
        w.add_string(FINGERPRINT_KEY, shape_fingerprint(shape))
        w.add_string("empanel.bench.shape", json.dumps(asdict(shape)))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
        gguf_writer.add_model_hparams(w, n_ctx=s.context_length, n_embd=s.n_embd, n_layer=s.n_layer,
                                      n_head=s.n_head, n_head_kv=s.n_head_kv, rms_eps=fixtures.RMS_EPS,
                                      rope_base=1e6, n_expert=s.n_expert, n_expert_used=s.n_expert_used)
        w.add_feed_forward_length(s.n_ff_exp * s.n_expert_used)  # unused by qwen3moe layers
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        fixtures.add_tokenizer(w)  # the fixtures' byte-level BPE vocabulary (one definition)

        for name, ne, kind, _ in plan:
            nbytes = _tensor_bytes(ne, kind)
            if kind == "q4k":  # byte shape; the writer turns it into the element shape
                byte_shape = tuple(reversed(ne[1:])) + (ne[0] // Q4_K_BLOCK * Q4_K_BYTES,)
                w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes,
                                  raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            else:
                w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        written, last_report = 0, time.perf_counter()
        for i, (_, ne, kind, scale) in enumerate(plan):
            data = _tensor_data(np.random.default_rng([shape.seed, i]), ne, kind, scale)
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
