// The gate-ahead guess and what is built on it: guessed experts are evicted last by the layer's
// next remap (empanel_guess_close accounts for it), read ahead with params.prefetch (the layer's
// remap drops the reads of guesses it does not route to), and routing substitution (opt-in,
// inexact) lets a resident expert stand in for a missing one.

#include "empanel.h"
#include "empanel-impl.h"

#include <stdlib.h>

// the guess for this micro-batch (its n distinct experts in layer->distinct, used by `call`) is
// spent: how many routed experts it named, and which read-ahead experts were routed
void empanel_guess_close(struct empanel_layer * layer, int32_t n, uint64_t call) {
    if (layer->guess_live) {
        layer->stats.guessed      += (uint64_t) layer->guess_n;
        layer->stats.guess_routed += (uint64_t) n;
        for (int32_t i = 0; i < n; i++) {
            layer->stats.guess_hits += layer->guess_mark[layer->distinct[i]] == layer->guess_stamp;
        }
        layer->guess_live = 0;
    }
    // read-ahead slots still holding their expert (others were dropped when their slot was taken)
    for (int32_t s = 0; s < layer->n_slots; s++) {
        if (layer->prefetch_mark[s] != 0 && layer->call_mark[s] == call) {
            layer->stats.prefetch_used++;
            layer->prefetch_mark[s] = 0;
        }
        empanel_prefetch_drop(layer, s); // not routed: wasted
    }
}

// read ahead the guessed experts of a layer that are not resident, into the slots the policy
// gives up (never a guessed expert's); g-lru takes only room the budget has, evicting no other
// layer's expert (that layer may be computing). The tables say where the experts will be; the
// layer's next remap drops the reads of those it does not route to and finishes the others.
static void prefetch_guess(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    const uint64_t stamp = ++layer->wave_stamp;
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = layer->slot_of[layer->distinct[i]];
        if (s >= 0) {
            layer->wave_mark[s] = stamp; // resident and guessed: kept
        }
    }
    uint64_t staged_per_expert = 0;
    for (int32_t t = 0; t < layer->n_tensors; t++) {
        staged_per_expert += empanel_staged_bytes(&layer->tensors[t]);
    }
    const uint64_t call = ++pool->call;
    int32_t n_read = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = layer->distinct[i];
        if (layer->slot_of[e] >= 0) {
            continue;
        }
        if (staged_per_expert * (uint64_t) (n_read + 1) > 4 * (uint64_t) EMPANEL_STAGING) {
            break; // staging for read-ahead stays bounded (32 MiB)
        }
        int32_t s = empanel_pick_victim(layer, pool->policy, 0, layer->n_slots, layer->wave_mark, stamp);
        if (s >= 0 && pool->policy == EMPANEL_POLICY_GLRU && layer->expert_in[s] < 0 &&
            pool->resident_bytes + layer->expert_bytes > pool->budget_bytes) {
            // no room in the budget without evicting another layer's expert: the layer's own
            // occupied slots only
            for (int32_t t = 0; t < layer->n_slots; t++) {
                if (layer->expert_in[t] < 0) {
                    layer->wave_mark[t] = stamp;
                }
            }
            s = empanel_pick_victim(layer, pool->policy, 0, layer->n_slots, layer->wave_mark, stamp);
        }
        if (s < 0) {
            break;
        }
        empanel_place_expert(pool, layer, s, e, call);
        layer->wave_mark[s]    = stamp;
        layer->misses[n_read]  = e;
        layer->victims[n_read] = s;
        n_read++;
    }
    if (n_read == 0) {
        return;
    }
    // read in the guess's order (a token's top-k by score: the likeliest first), expert after
    // expert, so that the layer's remap finds the unlikeliest still unread and drops those it
    // does not route to (empanel_read_drop)
    layer->prefetch_open = 1; // a failed read empties the slots again (reconcile)
    if (empanel_files_check(pool) == 0 && empanel_read_post_ahead(pool, layer, layer->misses, layer->victims, n_read) == 0) {
        layer->stats.prefetched += (uint64_t) n_read;
        for (int32_t i = 0; i < n_read; i++) {
            layer->prefetch_mark[layer->victims[i]] = 1;
        }
    }
}

// a read-ahead of this layer still in flight: the guessed experts the micro-batch does not route
// to are read no further (their slots are emptied by the reconcile that follows)
void empanel_prefetch_drop_unrouted(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                                    int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    if (!pool->inflight || !pool->inflight_ahead || pool->inflight_layer != layer) {
        return;
    }
    const uint64_t stamp = ++layer->wave_stamp; // slots of the experts routed to
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e >= 0 && e < pool->n_expert && layer->slot_of[e] >= 0) {
                layer->wave_mark[layer->slot_of[e]] = stamp;
            }
        }
    }
    empanel_read_drop(pool, layer, layer->wave_mark, stamp);
}

int32_t empanel_guess(void * user, int32_t il, int32_t distance, const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t n_used, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    pthread_mutex_lock(&pool->lock);
    struct empanel_layer * layer = il >= 0 && il < pool->n_layer ? &pool->layers[il] : NULL;
    if (layer == NULL || layer->n_slots <= 0 || layer->observe || atomic_load(&pool->failed)) {
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    layer->stats.device_syncs += (uint64_t) layer->device; // its router's top-k came from the device
    // the guess's distinct experts, into layer->distinct (free between this layer's remaps)
    const uint64_t stamp = ++layer->guess_stamp;
    int32_t n = 0;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e >= 0 && e < pool->n_expert && layer->guess_mark[e] != stamp) {
                layer->guess_mark[e] = stamp;
                layer->distinct[n++] = e;
            }
        }
    }
    layer->guess_live = 1;
    layer->guess_n    = n;
    // [-(il + 1), n_tokens, n_used, ids]: the lab replays guess-ordered eviction. Out of memory
    // fails the pool (the next remap stops the graph)
    if (pool->tracing && empanel_trace_call(pool, -(il + 1), expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        pthread_mutex_unlock(&pool->lock);
        return -1;
    }
    if (distance <= pool->prefetch && !pool->lab && !layer->plan_open && !layer->prefetch_open) {
        if (!pool->inflight) {
            prefetch_guess(pool, layer, n);
        } else if (pool->inflight_ready && pool->deferred_guess == NULL) {
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
    // distance) rewrote layer->distinct and guess_n, and its remap spends it (guess_live 0)
    if (layer != NULL && layer->guess_live && !pool->inflight && !layer->plan_open && !layer->prefetch_open &&
        !atomic_load(&pool->failed)) {
        prefetch_guess(pool, layer, layer->guess_n);
    }
}

int32_t empanel_subst(void * user, int32_t il, int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used,
                      const int32_t * candidates, int64_t cand_row_stride, int32_t n_cand,
                      const float * scores, int64_t scores_row_stride, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    pthread_mutex_lock(&pool->lock);
    struct empanel_layer * layer = il >= 0 && il < pool->n_layer ? &pool->layers[il] : NULL;
    if (layer == NULL || layer->n_slots <= 0 || layer->observe || pool->subst_ratio <= 0 || atomic_load(&pool->failed)) {
        pthread_mutex_unlock(&pool->lock);
        return 0;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        int32_t       * ids   = expert_ids + (int64_t) t * ids_row_stride;
        const int32_t * cand  = candidates + (int64_t) t * cand_row_stride;
        const float   * score = scores + (int64_t) t * scores_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = ids[j];
            if (e < 0 || e >= pool->n_expert || layer->slot_of[e] >= 0) {
                continue; // resident: kept
            }
            for (int32_t c = 0; c < n_cand; c++) {
                const int32_t alt = cand[c];
                if (alt < 0 || alt >= pool->n_expert || layer->slot_of[alt] < 0 ||
                    !(score[alt] >= pool->subst_ratio * score[e])) {
                    continue;
                }
                int taken = 0;
                for (int32_t k = 0; k < n_used && !taken; k++) {
                    taken = ids[k] == alt;
                }
                if (!taken) {
                    ids[j] = alt;
                    layer->stats.substituted++;
                    break;
                }
            }
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return 0;
}
