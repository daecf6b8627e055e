// Preload: the empty slots of every paged layer filled at load, in a profile's order or by
// expert id, read in file order; the order's first stays resident longest.

#include "preload.h"
#include "batch.h"
#include "files.h"
#include "slots.h"
#include "util.h"
#include "state.h"

#include <stdlib.h>
#include <string.h>

// the next expert preload takes for a layer: from its preload order, then by id; -1 when none is
// left. *cursor walks the order, then the ids (offset by the order's length); *uses gets the LFU
// count it starts with
static int32_t next_preload_expert(const struct empanel_pool * pool, const struct empanel_layer * layer, int32_t * cursor,
                                   uint32_t * uses) {
    while (*cursor < layer->preload.n_order + pool->n_expert) {
        const int32_t i = (*cursor)++;
        const int32_t e = i < layer->preload.n_order ? layer->preload.order[i] : i - layer->preload.n_order;
        if (layer->tables.slot_of[e] < 0 && layer->tables.miss_mark[e] != pool->call) {
            *uses = i < layer->preload.n_order && layer->preload.uses != NULL ? layer->preload.uses[i] : 1;
            return e;
        }
    }
    return -1;
}

// the most one batch of a preload reads (a 48-layer model's layer of 68 slots is ~200 MiB): the
// wait for each lets go of the pool's lock (empanel_batch_finish_lane), so the controller
// (pressure.c) and /metrics never wait for the preload's reads
#define PRELOAD_CHUNK_BYTES (32ull << 20)

// read layer->tables.misses/victims [0, n) (in file order) in chunks of PRELOAD_CHUNK_BYTES, letting
// go of the pool's lock between them; the layer's slots stay while it does (its waves count as
// open: not evictable, slots.c). 0, or -1 (a read failed: the unread slots leave the budget too)
static int read_in_chunks(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    const uint64_t per_bytes = PRELOAD_CHUNK_BYTES / layer->expert_bytes;
    const int32_t  per       = per_bytes < 1 ? 1 : per_bytes < (uint64_t) n ? (int32_t) per_bytes : n;
    int32_t * picked = per < n ? malloc(2 * sizeof(int32_t) * (size_t) n) : NULL;
    if (picked == NULL) {
        return empanel_batch_fill_slots(pool, layer, n); // (one chunk, or no memory to split it)
    }
    struct empanel_tables * tb = &layer->tables;
    memcpy(picked, tb->misses, sizeof(int32_t) * (size_t) n);
    memcpy(picked + n, tb->victims, sizeof(int32_t) * (size_t) n);
    layer->waves.open = 1;
    int rc = 0;
    for (int32_t at = 0; at < n && rc == 0; at += per) {
        const int32_t c = per < n - at ? per : n - at;
        memcpy(tb->misses, picked + at, sizeof(int32_t) * (size_t) c);
        memcpy(tb->victims, picked + n + at, sizeof(int32_t) * (size_t) c);
        rc = empanel_batch_fill_slots(pool, layer, c);
        if (rc != 0) {
            pool->budget.resident_bytes -= (uint64_t) (n - at - c) * layer->expert_bytes;
        } else if (at + c < n) {
            pthread_mutex_unlock(&pool->lock);
            pthread_mutex_lock(&pool->lock);
        }
    }
    layer->waves.open = 0;
    memcpy(tb->misses, picked, sizeof(int32_t) * (size_t) n);
    memcpy(tb->victims, picked + n, sizeof(int32_t) * (size_t) n);
    free(picked);
    return rc;
}

// up to max_fill of one layer's empty slots, filled with the experts it lacks (its preload order
// first, then the lowest ids), read in file order; the experts read
static int32_t preload_layer(struct empanel_pool * pool, struct empanel_layer * layer, int32_t max_fill) {
    const uint64_t call = ++pool->call; // resident, least recent: the first victims of use
    int32_t n      = 0;
    int32_t cursor = 0;
    for (int32_t s = 0; s < layer->n_slots && n < max_fill; s++) {
        if (layer->tables.expert_in[s] >= 0) {
            continue;
        }
        uint32_t uses = 1;
        const int32_t e = next_preload_expert(pool, layer, &cursor, &uses);
        if (e < 0) {
            break;
        }
        if (pool->budget.resident_bytes + layer->expert_bytes > pool->budget.bytes) {
            break; // the budget is full: no eviction for a guess
        }
        pool->budget.resident_bytes += layer->expert_bytes;
        empanel_slots_note_use(layer, s, call);
        layer->tables.uses[s]       = uses > 0 ? uses : 1;
        layer->tables.miss_mark[e]  = call; // taken: not chosen twice
        layer->tables.misses[n]     = e;
        layer->tables.victims[n]    = s;
        n++;
    }
    // earlier in the preload order, evicted later: the most used of a profile last of all (the
    // clock values call + 1 .. call + n are taken for it; every later use is more recent)
    for (int32_t r = 0; r < n; r++) {
        layer->tables.last_use[layer->tables.victims[r]] = call + (uint64_t) (n - r);
    }
    pool->call += (uint64_t) n;
    empanel_slots_sort_file_order(layer, n);
    if (n > 0 && read_in_chunks(pool, layer, n) != 0) {
        return -1;
    }
    // the recency list of all layers in the same order, least recent first
    for (int32_t i = 0; i < n; i++) {
        layer->tables.order_key[i] = (layer->tables.last_use[layer->tables.victims[i]] - call) << 32 | (uint32_t) layer->tables.victims[i];
    }
    qsort(layer->tables.order_key, (size_t) n, sizeof(uint64_t), empanel_util_compare_uint64);
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = layer->lru_base + (int32_t) (layer->tables.order_key[i] & 0xffffffffu);
        empanel_slots_recent_unlink(pool, e);
        empanel_slots_recent_push(pool, e);
    }
    layer->stats.preloaded += (uint64_t) n;
    return n;
}

int32_t empanel_preload_order(struct empanel_pool * pool, int32_t il, const int32_t * experts,
                                   const uint32_t * uses, int32_t n) {
    if (il < 0 || il >= pool->n_layer || pool->layers[il].n_slots <= 0 || n < 0 || n > pool->n_expert) {
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= pool->n_expert) {
            return -1;
        }
    }
    pthread_mutex_lock(&pool->lock);
    struct empanel_layer * layer = &pool->layers[il];
    int32_t  * order  = n > 0 ? malloc(sizeof(int32_t) * (size_t) n) : NULL;
    uint32_t * counts = n > 0 && uses != NULL ? malloc(sizeof(uint32_t) * (size_t) n) : NULL;
    if ((n > 0 && order == NULL) || (n > 0 && uses != NULL && counts == NULL)) {
        free(order);
        free(counts);
        pthread_mutex_unlock(&pool->lock);
        return -1;
    }
    if (n > 0) {
        memcpy(order, experts, sizeof(int32_t) * (size_t) n);
    }
    if (counts != NULL) {
        memcpy(counts, uses, sizeof(uint32_t) * (size_t) n);
    }
    free(layer->preload.order);
    free(layer->preload.uses);
    layer->preload.order   = order;
    layer->preload.uses    = counts;
    layer->preload.n_order = n;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

int64_t empanel_preload(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    int64_t n_read = 0;
    if (atomic_load(&pool->error.failed) || empanel_batch_finish(pool) != 0 || empanel_files_check(pool) != 0) {
        n_read = -1;
    }
    // a budget below the pools' capacity (g-lru's, or one moved lower): each layer its even share
    // of it, not the first layers all of it
    const int shared = pool->budget.bytes < pool->budget.capacity_bytes;
    uint64_t per_layer_bytes = 0;
    if (shared) {
        int32_t n_paged = 0;
        for (int32_t il = 0; il < pool->n_layer; il++) {
            n_paged += pool->layers[il].n_slots > 0 && !pool->layers[il].observe;
        }
        per_layer_bytes = n_paged > 0 ? pool->budget.bytes / (uint64_t) n_paged : 0;
    }
    for (int32_t il = 0; il < pool->n_layer && n_read >= 0; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        if (layer->n_slots == 0 || layer->observe) {
            continue;
        }
        int32_t max_fill = layer->n_slots;
        if (shared) {
            const uint64_t share = per_layer_bytes / layer->expert_bytes;
            max_fill = share < (uint64_t) max_fill ? (int32_t) share : max_fill;
        }
        const int32_t n = preload_layer(pool, layer, max_fill);
        n_read = n < 0 ? -1 : n_read + n;
        if (pool->budget.resident_bytes > pool->budget.bytes) {
            empanel_slots_shrink(pool); // a budget moved down while the layer was read
        }
        pthread_mutex_unlock(&pool->lock); // (between layers too)
        pthread_mutex_lock(&pool->lock);
    }
    pthread_mutex_unlock(&pool->lock);
    return n_read;
}

int empanel_preload_check_pinned(struct empanel_pool * pool, char * err, size_t err_size) {
    pthread_mutex_lock(&pool->lock);
    int rc = 0;
    for (int32_t il = 0; il < pool->n_layer && rc == 0; il++) {
        const struct empanel_layer * layer = &pool->layers[il];
        if (layer->observe || layer->n_slots < pool->n_expert) {
            continue;
        }
        for (int32_t s = 0; s < pool->n_expert && rc == 0; s++) {
            if (layer->tables.expert_in[s] != s) {
                empanel_util_format_err(err, err_size, "pinned pools: layer %d, slot %d holds expert %d after the preload, "
                                        "not %d (load with moe_preload on, and without a preload order)", il, s,
                                        layer->tables.expert_in[s], s);
                rc = -1;
            }
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
}
