// The gate-ahead guess and what is built on it: guessed experts are evicted last by the layer's
// next remap (empanel_slots_close_guess accounts for it), read ahead with params.prefetch (the layer's
// remap drops the reads of guesses it does not route to), and routing substitution (opt-in,
// inexact) lets a resident expert stand in for a missing one.

#include "guess.h"
#include "batch.h"
#include "files.h"
#include "slots.h"
#include "trace.h"
#include "state.h"

#include <stdlib.h>

// read ahead the guessed experts of a layer that are not resident, into the slots the policy
// gives up (never a guessed expert's); an empty slot only where the budget has room: a guess
// evicts no other layer's expert. The tables say where the experts will be; the
// layer's next remap drops the reads of those it does not route to and finishes the others.
static void prefetch_guess(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    const uint64_t stamp = ++layer->tables.mark_stamp;
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = layer->tables.slot_of[layer->tables.distinct[i]];
        if (s >= 0) {
            layer->tables.slot_mark[s] = stamp; // resident and guessed: kept
        }
    }
    uint64_t staged_per_expert = 0;
    for (int32_t t = 0; t < layer->n_tensors; t++) {
        staged_per_expert += empanel_batch_staged_bytes(&layer->tensors[t]);
    }
    const uint64_t call = ++pool->call;
    int32_t n_read = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = layer->tables.distinct[i];
        if (layer->tables.slot_of[e] >= 0) {
            continue;
        }
        if (staged_per_expert * (uint64_t) (n_read + 1) > 4 * (uint64_t) EMPANEL_STAGING) {
            break; // staging for read-ahead stays bounded (32 MiB)
        }
        int32_t s = empanel_slots_pick_victim(layer, pool->config.policy, 0, layer->n_slots, layer->tables.slot_mark, stamp);
        if (s >= 0 && layer->tables.expert_in[s] < 0 &&
            pool->budget.resident_bytes + layer->expert_bytes > pool->budget.bytes) {
            // no room in the budget without evicting another layer's expert: the layer's own
            // occupied slots only
            for (int32_t t = 0; t < layer->n_slots; t++) {
                if (layer->tables.expert_in[t] < 0) {
                    layer->tables.slot_mark[t] = stamp;
                }
            }
            s = empanel_slots_pick_victim(layer, pool->config.policy, 0, layer->n_slots, layer->tables.slot_mark, stamp);
        }
        if (s < 0) {
            break;
        }
        empanel_slots_place(pool, layer, s, e, call);
        layer->tables.slot_mark[s]    = stamp;
        layer->tables.misses[n_read]  = e;
        layer->tables.victims[n_read] = s;
        n_read++;
    }
    if (n_read == 0) {
        return;
    }
    // read in the guess's order (a token's top-k by score: the likeliest first), expert after
    // expert, so that the layer's remap finds the unlikeliest still unread and drops those it
    // does not route to (empanel_batch_drop)
    layer->guess.prefetch_open = 1; // a failed read empties the slots again (reconcile)
    if (empanel_files_check(pool) == 0 && empanel_batch_post_ahead(pool, layer, layer->tables.misses, layer->tables.victims, n_read) == 0) {
        layer->stats.prefetched      += (uint64_t) n_read;
        layer->stats.prefetch_beside += (uint64_t) empanel_batch_inflight(pool, EMPANEL_LANE_DEMAND, NULL);
        for (int32_t i = 0; i < n_read; i++) {
            layer->guess.prefetch_mark[layer->tables.victims[i]] = 1;
        }
    }
}

int32_t empanel_guess(void * user, int32_t il, int32_t distance, const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t n_used, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    pthread_mutex_lock(&pool->lock);
    struct empanel_layer * layer = il >= 0 && il < pool->n_layer ? &pool->layers[il] : NULL;
    if (layer == NULL || layer->n_slots <= 0 || layer->observe || atomic_load(&pool->error.failed)) {
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    layer->stats.device_syncs += (uint64_t) layer->device; // its router's top-k came from the device
    // the guess's distinct experts, into layer->tables.distinct (free between this layer's remaps)
    const uint64_t stamp = ++layer->guess.stamp;
    int32_t n = 0;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e >= 0 && e < pool->n_expert && layer->guess.mark[e] != stamp) {
                layer->guess.mark[e] = stamp;
                layer->tables.distinct[n++] = e;
            }
        }
    }
    layer->guess.live = 1;
    layer->guess.n    = n;
    // [-(il + 1), n_tokens, n_used, ids]: the lab replays guess-ordered eviction. Out of memory
    // fails the pool (the next remap stops the graph)
    if (pool->trace.on && empanel_trace_call(pool, -(il + 1), expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        pthread_mutex_unlock(&pool->lock);
        return -1;
    }
    if (distance <= pool->config.prefetch && !pool->config.lab && !layer->waves.open && !layer->guess.prefetch_open &&
        !layer->ready.reads_open && !empanel_batch_inflight(pool, EMPANEL_LANE_AHEAD, NULL)) {
        if (empanel_batch_can_post(pool, EMPANEL_LANE_AHEAD, layer)) {
            prefetch_guess(pool, layer, n); // (queued behind the reads of the layer computing now)
        } else if (pool->reader.posted[EMPANEL_LANE_DEMAND].by_tensor && pool->deferred_guess == NULL) {
            pool->deferred_guess = layer; // after the overlapped reads of the layer computing now
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

void empanel_guess_post_deferred(struct empanel_pool * pool) {
    struct empanel_layer * layer = pool->deferred_guess;
    pool->deferred_guess = NULL;
    // the layer's live guess as it is now: a later guess of it (read-ahead depth >= 2, another
    // distance) rewrote layer->tables.distinct and guess_n, and its remap spends it (guess_live 0)
    if (layer != NULL && layer->guess.live && empanel_batch_can_post(pool, EMPANEL_LANE_AHEAD, layer) &&
        !layer->waves.open && !layer->guess.prefetch_open && !atomic_load(&pool->error.failed)) {
        prefetch_guess(pool, layer, layer->guess.n);
    }
}

