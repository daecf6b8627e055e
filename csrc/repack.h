#pragma once

// repack.c: the sidecar's own repack of one expert into one of ggml-cpu's interleaved layouts
// (ggml/src/ggml-cpu/repack.cpp), written for the readers' speed. backend.c checks it against
// ggml's own repack on each pool tensor's first expert before it writes any slot with it.

#include <stdint.h>

// Q4_K -> ggml's q4_K 8x8 layout, the one ggml-cpu picks for Q4_K on AVX2 (and Arm with i8mm).
// src: [nrow, nblocks] block_q4_K (144 bytes: d, dmin, scales[12], qs[128]), row-major;
// dst: [nrow / 8, nblocks] block_q4_Kx8 (1152 bytes: d[8], dmin[8], scales[96], qs[1024]), the
// 8 rows' quants interleaved 8 bytes at a time. nrow % 8 == 0.
void empanel_repack_q4_K_8x8(uint8_t * dst, const uint8_t * src, int64_t nrow, int64_t nblocks);

// Q2_K -> ggml's q2_K 8x8 layout, the one ggml-cpu picks for Q2_K on AVX-512.
// src: [nrow, nblocks] block_q2_K (84 bytes: scales[16], qs[64], d, dmin); dst: [nrow / 8,
// nblocks] block_q2_Kx8 (672 bytes: d[8], dmin[8], scales[128], qs[512]). nrow % 8 == 0.
void empanel_repack_q2_K_8x8(uint8_t * dst, const uint8_t * src, int64_t nrow, int64_t nblocks);
