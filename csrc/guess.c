// The gate-ahead guess and what is built on it: guessed experts are evicted last by the layer's
// next remap (empanel_slots_close_guess accounts for it), read ahead with params.prefetch (the layer's
// remap drops the reads of guesses it does not route to), and routing substitution (opt-in,
// inexact) lets a resident expert stand in for a missing one.

#include "guess.h"
#include "batch.h"
#include "slots.h"
#include "trace.h"
#include "state.h"

#include <stdlib.h>

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
            empanel_batch_read_ahead(pool, layer, n); // (queued behind the reads of the layer computing now)
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
        empanel_batch_read_ahead(pool, layer, layer->guess.n);
    }
}

