#pragma once

// What every unit of the sidecar shares: the public API (empanel.h), what libllama and the
// sidecar share (llama-empanel-shared.h: constants and callback types; only load.c calls
// libllama), the limits of a pool, one routed-expert tensor of a layer and where its experts'
// bytes sit (in the file, in an O_DIRECT window).
//
// The units of csrc/, bottom up (each header says what its unit does in a line or two; a unit
// includes only the headers of the units below it: tests/test_seams.py derives the layers from
// the includes and checks that they form no circle):
//   util.c        errors, the clock, digests (the bottom)
//   repack.c      the sidecar's own repack into ggml-cpu's interleaved layouts (Q4_K, Q2_K)
//   backend.c     pool tensors through ggml's public backend API: slots, staging, pages, devices
//   subst.c       the routing substitution hook
//   files.c       the model files, their watch             ring.c       io_uring rings
//   rpc.c         ggml-rpc: servers, the wire              trace.c      the routing trace
//   plan_file.c   the plan file's records                  slots.c      the slot tables, victims, g-lru
//   host_cache.c  the host-RAM tier of device pools
//   remote.c      pools on RPC hosts: writes by hash first
//   chunk.c       one read request: read, checked, landed
//   reader.c      the reader threads and the ring thread
//   batch.c       batches of expert reads in two lanes     stats.c      what a pool reports
//   guess.c       gate-ahead guesses, read-ahead           preload.c    filling empty slots at load
//   pool.c        a pool's lifecycle, binding, recovery    metrics.c    stats JSON, Prometheus text
//   ready.c       the ready hook: overlapped reads         load.c       a load from its plan (calls libllama)
//   remap.c       the remap hook: policy, waves, the lab   program.c    llama.cpp's programs' hook API
// The state they share is declared by concern in layer.h (one layer: tables, waves, guesses),
// io.h (reads in flight) and state.h (struct empanel_pool), each part naming the unit that
// changes it.

#include "empanel.h"
#include "llama-empanel-shared.h" // what libllama and the sidecar share; only load.c calls libllama

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define EMPANEL_MAX_TENSORS 4           // gate, up, down, gate_up
#define EMPANEL_ALIGN       LLAMA_EMPANEL_READ_ALIGN // O_DIRECT offset/length/buffer alignment, bytes
#define EMPANEL_STAGING     (8u << 20)  // bytes of staging for experts on their way to non-plain pools
#define EMPANEL_MAX_CHUNK_BYTES (EMPANEL_MAX_CHUNK_KB * 1024u) // bytes of one read request at most (params.chunk_bytes)

struct empanel_remote; // remote.c: what an RPC host's cache holds of a tensor's experts

// one routed-expert tensor of a layer: its experts in the file and its pool in memory
struct empanel_tensor {
    char     name[96];
    int32_t  file;          // index into pool->files.list
    uint64_t offset;        // bytes: expert 0 in the file
    uint64_t expert_size;   // bytes of one expert, in the file and in a slot
    void   * pool;          // ggml_tensor * [ne0, ne1, n_slots], set by empanel_pool_bind
    int      direct;        // slots are plain host memory: reads land in them directly
    int      masked;        // waves are masked: kernels read every slot while a wave computes
    uint8_t * host;         // the pool's host memory (any layout), or NULL (device memory)
    int32_t * held;         // [n_slots] expert whose bytes this tensor's slot holds, -1 if none
                            // (or being read); equals the layer's expert_in outside of waves
    uint64_t * digest;      // [n_expert] XXH3-64 of each expert's file bytes, 0: not known yet
                            // (taken at its first read); NULL: reads are not verified
    struct empanel_remote * remote; // the pool is on an RPC host: what its cache holds (remote.c),
                                    // writes go by hash first; NULL unless RPC
    atomic_int repack_own;  // CPU_REPACK pools: the sidecar's own repack (repack.c) for this tensor:
                            // 0 not checked yet, 1 being checked, 2 checked equal to ggml's, 3 not used
};

static inline uint64_t empanel_align_down(uint64_t x) { return x / EMPANEL_ALIGN * EMPANEL_ALIGN; }
static inline uint64_t empanel_align_up  (uint64_t x) { return (x + EMPANEL_ALIGN - 1) / EMPANEL_ALIGN * EMPANEL_ALIGN; }
// where expert e's bytes of tensor t start in its file
static inline uint64_t empanel_expert_begin(const struct empanel_tensor * t, int32_t e) {
    return t->offset + (uint64_t) e * t->expert_size;
}
// room for one expert's whole O_DIRECT window of tensor t (bytes), so that it lands in place
static inline uint64_t empanel_window_bytes(const struct empanel_tensor * t) {
    return (t->expert_size + EMPANEL_ALIGN - 1) / EMPANEL_ALIGN * EMPANEL_ALIGN + EMPANEL_ALIGN;
}
// where expert's payload sits in such room (aligned): at its file offset modulo EMPANEL_ALIGN
static inline uint8_t * empanel_window_payload(uint8_t * room, const struct empanel_tensor * t, int32_t expert) {
    return room + empanel_expert_begin(t, expert) % EMPANEL_ALIGN;
}
