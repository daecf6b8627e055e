"""Random weights in every ggml type the benchmark's model writer uses, as the bytes a GGUF holds.

A quantized row is random bytes with its blocks' scale fields set: finite by construction (never
drawn from random f16 bytes), chosen so that the dequantized weights are zero-mean with std
scale / sqrt(ne0). With scale 1 a matrix keeps its input's RMS (ne0 is the fan-in), so hidden
states stay near unit RMS and logits finite, as in the fixtures (models/fixtures.py).

SPREAD[type]: the std of a dequantized weight for a block scale d = 1 when the quants (and the
sub-block scales of the K-quants) are uniform random, as random bytes make them. Layouts: ggml's
ggml-common.h (block_q4_K, ...), sizes from gguf's GGML_QUANT_SIZES.
"""

from __future__ import annotations

import math

import numpy as np

QK_K = 256  # values per K-quant super-block
Q4_K_BLOCK = QK_K
Q4_K_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
# std of (scale * q - 7.5 * min) for uniform 6-bit scale/min and 4-bit q: sqrt(47532 + 19195);
# d = 1 / (258 * sqrt(fan_in)) gives weights of std ~1/sqrt(fan_in), mean ~0 (dmin = 7.5 d)
Q4_K_SPREAD = 258.0

# value = f(d, random quants); std with d = 1 (see each maker below)
SPREAD = {
    "Q4_K": Q4_K_SPREAD,
    "Q5_K": math.sqrt(1333.5 * 325.5 - 31 * 31.5 * 15.5 * 31.5 + 15.5**2 * 1333.5),  # 527.2
    "Q6_K": math.sqrt(5461.5 * 341.5),  # int8 scale x (6-bit q - 32): 1365.7
    "Q8_0": math.sqrt(5461.5),  # int8 q: 73.9
    "Q5_0": math.sqrt(85.5),  # 5-bit q - 16: 9.25
    "Q5_1": math.sqrt(85.25),  # 5-bit q + m, m = -15.5 d: 9.23
    "MXFP4": math.sqrt(34.25),  # E2M1 x 2 (kvalues_mxfp4) x 2^(e - 128): 5.85
}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def block_layout(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def row_bytes(qtype: str, ne0: int) -> int:
    """Bytes of one row of ne0 values (ggml_row_size; F32 / F16 too)."""
    block, size = block_layout(qtype)
    assert ne0 % block == 0, (qtype, ne0)
    return ne0 // block * size


def random_rows(rng, qtype: str, n_rows: int, ne0: int, scale: float = 1.0):
    """n_rows random rows of ne0 weights of `qtype`, std scale / sqrt(ne0): uint8 (n_rows, row
    bytes) for a block type, float16 / float32 (n_rows, ne0) for F16 / F32."""
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal((n_rows, ne0), dtype=np.float32) * np.float32(scale / math.sqrt(ne0))
        return values.astype(FLOAT_TYPES[qtype])
    if qtype == "Q4_K":
        return q4_k_blocks(rng, n_rows, ne0, fan_in=ne0, scale=scale)
    d = scale / (SPREAD[qtype] * math.sqrt(ne0))  # the block scale that gives the wanted std
    blocks = _random_blocks(rng, qtype, n_rows, ne0)
    _SET_SCALES[qtype](rng, blocks, d)
    return blocks.reshape(n_rows, row_bytes(qtype, ne0))


def q4_k_blocks(rng, n_rows: int, ne0: int, fan_in: int, scale: float = 1.0):
    """Random Q4_K rows as raw bytes, numpy shape (n_rows, ne0 / 256 * 144), uint8.

    block_q4_K = {f16 d, f16 dmin, u8 scales[12], u8 qs[128]}: the 12 scale bytes pack 8 6-bit
    scales and 8 6-bit mins, so random bytes are random scales/mins; qs are random nibbles.
    """
    assert ne0 % Q4_K_BLOCK == 0, ne0
    n_blocks = n_rows * (ne0 // Q4_K_BLOCK)
    blocks = rng.integers(0, 256, size=(n_blocks, Q4_K_BYTES), dtype=np.uint8)
    d = np.float16(scale / (Q4_K_SPREAD * math.sqrt(fan_in)))
    head = np.array([d, np.float16(7.5 * float(d))], dtype="<f2").view(np.uint8)
    blocks[:, :4] = head
    return blocks.reshape(n_rows, ne0 // Q4_K_BLOCK * Q4_K_BYTES)


def _random_blocks(rng, qtype: str, n_rows: int, ne0: int):
    """(n_blocks, bytes per block) uint8 of random bytes."""
    block, size = block_layout(qtype)
    assert ne0 % block == 0, (qtype, ne0)
    return rng.integers(0, 256, size=(n_rows * (ne0 // block), size), dtype=np.uint8)


def _f16_bytes(*values) -> np.ndarray:
    return np.array(values, dtype="<f2").view(np.uint8)


def _set_q5_k(rng, blocks, d):
    # block_q5_K = {f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]}: value d * sc * q - dmin * m,
    # sc, m 6-bit, q 5-bit (mean 15.5): dmin = 15.5 d centres it
    blocks[:, :4] = _f16_bytes(d, 15.5 * float(np.float16(d)))


def _set_q6_k(rng, blocks, d):
    # block_q6_K = {u8 ql[128], u8 qh[64], i8 scales[16], f16 d}: value d * scale * (q - 32), q 6-bit;
    # random int8 scales have mean ~0, so the values do too
    blocks[:, 208:210] = _f16_bytes(d)


def _set_q8_0(rng, blocks, d):
    # block_q8_0 = {f16 d, i8 qs[32]}: value d * q
    blocks[:, :2] = _f16_bytes(d)


def _set_q5_0(rng, blocks, d):
    # block_q5_0 = {f16 d, u8 qh[4], u8 qs[16]}: value d * (q - 16), q 5-bit
    blocks[:, :2] = _f16_bytes(d)


def _set_q5_1(rng, blocks, d):
    # block_q5_1 = {f16 d, f16 m, u8 qh[4], u8 qs[16]}: value d * q + m, q 5-bit; m = -15.5 d centres it
    blocks[:, :4] = _f16_bytes(d, -15.5 * float(np.float16(d)))


def _set_mxfp4(rng, blocks, d):
    # block_mxfp4 = {u8 e, u8 qs[16]}: value kvalues_mxfp4[nibble] * 2^(e - 128), a power of two per
    # block: a share p of the blocks gets 2^k and the rest 2^(k+1), so that the mean square is d^2
    k = math.floor(math.log2(d))
    lo, hi = 4.0**k, 4.0 ** (k + 1)
    p = (hi - d * d) / (hi - lo)
    e = np.where(rng.random(blocks.shape[0]) < p, k + 128, k + 129)
    blocks[:, 0] = np.clip(e, 2, 254).astype(np.uint8)


_SET_SCALES = {"Q5_K": _set_q5_k, "Q6_K": _set_q6_k, "Q8_0": _set_q8_0, "Q5_0": _set_q5_0,
               "Q5_1": _set_q5_1, "MXFP4": _set_mxfp4}
TYPES = ("F32", "F16", "Q4_K", *_SET_SCALES)  # the types random_rows makes
