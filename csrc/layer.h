#pragma once

// One layer of a pool (struct empanel_layer) and its parts by concern: the slot tables (slots.c),
// the waves of a micro-batch (remap.c), the gate-ahead guess (guess.c), the overlapped reads
// (ready.c) and the preload order (preload.c). Each part names the unit that changes it.

#include "common.h"

// Every field below is guarded by the pool's lock (struct empanel_pool.lock) and written by the
// unit named in its struct's comment; reader threads never read a layer's tables.

// the slot tables (slots.c; remap.c, guess.c, preload.c and batch.c change them only through it,
// or fill its scratch arrays)
struct empanel_tables {
    int32_t  * slot_of;     // [n_expert] slot holding the expert, or -1
    int32_t  * expert_in;   // [n_slots]  expert held by the slot, or -1
    uint64_t * last_use;    // [n_slots]  remap call that last used the slot (LRU)
    uint64_t * call_mark;   // [n_slots]  remap call that uses the slot now (never evicted in it)
    uint64_t * miss_mark;   // [n_expert] remap call that listed the expert as distinct
    uint32_t * uses;        // [n_slots]  LFU counts (halved every n_slots remaps)
    uint64_t   n_batches;   // micro-batches remapped: the LFU decay clock (stats resets leave it)
    uint64_t * slot_mark;   // [n_slots]  stamp that marked the slot: a wave's claim while planning, a
                            //            guess's resident experts, a read-ahead's routed ones
    uint64_t   mark_stamp;  // stamps so far
    // scratch of one call
    int32_t  * misses;      // [n_expert] the current call's misses
    int32_t  * victims;     // [n_expert] the slots they go to
    int32_t  * distinct;    // [n_expert] the micro-batch's distinct experts (or a guess's)
    uint64_t * order_key;   // [n_expert] misses by last use in the micro-batch, then id
};

// the waves of the current micro-batch (remap.c: remap calls with a pool tensor); the tables
// already say where every expert is at the end of it
struct empanel_waves {
    int        open;        // some tensor has waves of this plan still to run
    int32_t    n;           // waves the plan fills (the graph may run more, empty ones)
    int32_t    n_graph;     // waves the graph runs
    int32_t    next[EMPANEL_MAX_TENSORS]; // next wave of each tensor
    int32_t  * wave_of;     // [n_expert] wave of each expert of the micro-batch, else -1
    int32_t  * slot_of;     // [n_expert] the slot it is in during its wave
    int32_t  * order;       // [n_expert] the micro-batch's experts, wave by wave
    int32_t  * begin;       // [n_expert + 2] index in order of each wave's first
    int32_t  * ids;         // [ids_cap] the micro-batch's expert ids (its calls' key)
    int64_t    n_ids;
    int64_t    ids_cap;
};

// the gate-ahead guess for this layer's next micro-batch and its read-ahead (guess.c; slots.c
// accounts for it when the remap spends it)
struct empanel_guess_state {
    uint64_t * mark;          // [n_expert] guess stamp that named the expert
    uint64_t   stamp;         // guesses so far
    int        live;          // a guess waits for the next remap (which evicts its experts last)
    int32_t    n;             // distinct experts the live guess names (in tables.distinct)
    uint64_t * prefetch_mark; // [n_slots] 1: read ahead for the next micro-batch, not yet accounted
    int        prefetch_open; // read-ahead slots whose tables are set before their bytes land
};

// reads that overlap the compute (ready.c, remap.c): the remap posts a micro-batch's misses and
// returns; each pool's MUL_MAT_ID waits for its own tensor's reads first
struct empanel_ready_state {
    uint32_t   seen;        // bit i: tensor i's ready call came since the layer's last remap
    int32_t    next;        // ready calls since then
    int32_t    rank[EMPANEL_MAX_TENSORS]; // order of the tensors' ready calls: the graph's
    int        armed;       // every tensor's MUL_MAT_ID waits for its reads (seen last time)
    int        reads_open;  // misses posted, tables set before their bytes land
};

// what preload takes first (preload.c: empanel_preload_order)
struct empanel_preload_list {
    int32_t  * order;       // [n_order] experts, the first first
    uint32_t * uses;        // [n_order] their starting LFU counts, or NULL
    int32_t    n_order;
};

struct empanel_layer {
    int32_t  n_slots;       // 0: not paged
    int      observe;       // not paged, but its routing is traced
    int      device;        // a pool is not in this process's host memory (a GPU, an RPC host):
                            // each call from the graph waits for it (stats.device_syncs)
    int      pinned_host;   // a pool is in a GPU backend's pinned host buffer: no page goes back
    int32_t  n_tensors;
    uint64_t expert_bytes;  // one expert over all tensors
    int32_t  lru_base;      // g-lru: entry of slot 0 in the pool's LRU list
    struct empanel_tensor tensors[EMPANEL_MAX_TENSORS];

    struct empanel_tables      tables;
    struct empanel_waves       waves;
    struct empanel_guess_state guess;
    struct empanel_ready_state ready;
    struct empanel_preload_list preload;

    struct empanel_layer_stats stats;
};

// a plan, a read-ahead or overlapped reads of the layer left tables set before their bytes
// landed: the next remap of the layer (or a recovery) reconciles them with what the slots hold
static inline int empanel_layer_open(const struct empanel_layer * layer) {
    return layer->waves.open || layer->guess.prefetch_open || layer->ready.reads_open;
}

// the index in layer->tensors of the tensor whose slot pool is pool_tensor, or -1
static inline int32_t empanel_tensor_index(const struct empanel_layer * layer, const void * pool_tensor) {
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        if (layer->tensors[i].pool == pool_tensor) {
            return i;
        }
    }
    return -1;
}
