// The readers repack every expert they read into a CPU_REPACK pool (llama.cpp's repacked
// layout). ggml's own repack copies each group of 8 blocks twice through the stack and builds
// the 1,152-byte output block by value: 2.9 GB/s per core on this VM's Xeon for Q4_K from cold
// memory (Q2_K: 2.6 GB/s). This one moves the bytes straight from the file's layout into the slot.

#include "repack.h"

#include <string.h>

enum {
    Q4_K_BLOCK   = 144,  // bytes: d, dmin (fp16), scales[12], qs[128]
    Q4_K_SCALES  = 4,    // offset of scales[12] in a block
    Q4_K_QS      = 16,   // offset of qs[128]
    Q4_KX8_BLOCK = 1152, // bytes: d[8], dmin[8] (fp16), scales[96], qs[1024]
    Q4_KX8_SCALES = 32,
    Q4_KX8_QS    = 128,
};

// the 12 bytes of output scales for one sub-block pair of 8 rows: s[j], m[j] 6-bit each
static inline void pack_scales(uint8_t * out, const uint8_t s[8], const uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        out[j]     = (uint8_t) ((s[j] & 63) + ((s[j + 4] & 48) << 2));
        out[j + 4] = (uint8_t) ((m[j] & 63) + ((m[j + 4] & 48) << 2));
        out[j + 8] = (uint8_t) ((s[j + 4] & 15) + ((m[j + 4] & 15) << 4));
    }
}

static void block_q4_Kx8(uint8_t * out, const uint8_t * in[8]) {
    for (int r = 0; r < 8; r++) {
        memcpy(out + 2*r,      in[r],     2); // d
        memcpy(out + 16 + 2*r, in[r] + 2, 2); // dmin
    }
    // quants: output chunk (c, r) of 8 bytes is row r's chunk c  // [16 chunks][8 rows][8 bytes]
    uint8_t * qs = out + Q4_KX8_QS;
    for (int c = 0; c < 16; c++) {
        for (int r = 0; r < 8; r++) {
            memcpy(qs + (c*8 + r)*8, in[r] + Q4_K_QS + c*8, 8);
        }
    }
    // scales and mins of sub-blocks 0-3, then 4-7 (whose top bits sit in bytes 8-11)
    uint8_t s[8], m[8];
    for (int i = 0; i < 4; i++) {
        for (int r = 0; r < 8; r++) {
            const uint8_t * sc = in[r] + Q4_K_SCALES;
            s[r] = sc[i] & 63;
            m[r] = sc[i + 4] & 63;
        }
        pack_scales(out + Q4_KX8_SCALES + i*12, s, m);
    }
    for (int i = 0; i < 4; i++) {
        for (int r = 0; r < 8; r++) {
            const uint8_t * sc = in[r] + Q4_K_SCALES;
            s[r] = (uint8_t) (((sc[i] & 192) >> 2) | (sc[i + 8] & 15));
            m[r] = (uint8_t) (((sc[i + 4] & 192) >> 2) | ((sc[i + 8] & 240) >> 4));
        }
        pack_scales(out + Q4_KX8_SCALES + 48 + i*12, s, m);
    }
}

// groups of 8 rows: block x of the 8 rows -> one interleaved output block (fn); inlined into each
// caller, so that fn is a direct call there (an indirect one cost a fifth of the warm speed)
__attribute__((always_inline)) static inline void repack_8_rows(uint8_t * dst, const uint8_t * src, int64_t nrow, int64_t nblocks, int64_t in_block,
                                 int64_t out_block, void (*fn)(uint8_t * out, const uint8_t * in[8])) {
    for (int64_t b = 0; b < nrow; b += 8) {
        const uint8_t * rows = src + b*nblocks*in_block;
        for (int64_t x = 0; x < nblocks; x++) {
            const uint8_t * in[8];
            for (int r = 0; r < 8; r++) {
                in[r] = rows + (r*nblocks + x)*in_block;
            }
            fn(dst, in);
            dst += out_block;
        }
    }
}

void empanel_repack_q4_K_8x8(uint8_t * dst, const uint8_t * src, int64_t nrow, int64_t nblocks) {
    repack_8_rows(dst, src, nrow, nblocks, Q4_K_BLOCK, Q4_KX8_BLOCK, block_q4_Kx8);
}

enum {
    Q2_K_BLOCK   = 84,  // bytes: scales[16], qs[64], d, dmin (fp16)
    Q2_K_QS      = 16,
    Q2_K_D       = 80,
    Q2_KX8_BLOCK = 672, // bytes: d[8], dmin[8] (fp16), scales[128], qs[512]
    Q2_KX8_SCALES = 32,
    Q2_KX8_QS    = 160,
};

static void block_q2_Kx8(uint8_t * out, const uint8_t * in[8]) {
    for (int r = 0; r < 8; r++) {
        memcpy(out + 2*r,      in[r] + Q2_K_D,     2); // d
        memcpy(out + 16 + 2*r, in[r] + Q2_K_D + 2, 2); // dmin
    }
    uint8_t * qs = out + Q2_KX8_QS; // [8 chunks][8 rows][8 bytes]
    for (int c = 0; c < 8; c++) {
        for (int r = 0; r < 8; r++) {
            memcpy(qs + (c*8 + r)*8, in[r] + Q2_K_QS + c*8, 8);
        }
    }
    // scales: [8 sub-block pairs][8 rows][2]: row r's scales 2p and 2p + 1
    uint8_t * sc = out + Q2_KX8_SCALES;
    for (int p = 0; p < 8; p++) {
        for (int r = 0; r < 8; r++) {
            sc[p*16 + r*2]     = in[r][2*p];
            sc[p*16 + r*2 + 1] = in[r][2*p + 1];
        }
    }
}

void empanel_repack_q2_K_8x8(uint8_t * dst, const uint8_t * src, int64_t nrow, int64_t nblocks) {
    repack_8_rows(dst, src, nrow, nblocks, Q2_K_BLOCK, Q2_KX8_BLOCK, block_q2_Kx8);
}
