// The live budget: the bytes of resident experts over all layers, below the pools' capacity (every
// slot full). It starts where the plan puts it (g-lru's shared budget, else the capacity) and
// moves while the model runs: empanel_pool_set_budget, called by the app or by the controller
// (pressure.c). Down: the least recently used experts of any layer leave at once (slots.c,
// empanel_slots_shrink), their pages back to the kernel, but for those the layer computing now
// reads and those of layers whose waves run or whose reads are in flight, which the remaps that
// follow evict before any read lands (make_room). Up: experts are admitted again as misses are
// read. The slots per layer (the graph's ne[2]) never change, so neither do the waves: outputs
// stay bit-identical at every budget.

#include "budget.h"
#include "slots.h"
#include "state.h"
#include "util.h"

#include <pthread.h>

void empanel_budget_set_locked(struct empanel_pool * pool, uint64_t budget_bytes) {
    if (budget_bytes < pool->budget.floor_bytes) {
        budget_bytes = pool->budget.floor_bytes;
    }
    if (budget_bytes > pool->budget.capacity_bytes) {
        budget_bytes = pool->budget.capacity_bytes;
    }
    if (budget_bytes == pool->budget.bytes) {
        return;
    }
    pool->budget.bytes = budget_bytes;
    pool->budget.n_changes++;
    if (budget_bytes < pool->budget.lowest_bytes) {
        pool->budget.lowest_bytes = budget_bytes;
    }
    empanel_slots_shrink(pool);
}

void empanel_budget_settle(struct empanel_pool * pool, int32_t n_used, int pinned) {
    pthread_mutex_lock(&pool->lock);
    pool->budget.floor_bytes = 0;
    int device = 0, pinned_host = 0;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        const struct empanel_layer * layer = &pool->layers[il];
        if (layer->n_slots > 0 && !layer->observe) {
            const int32_t k = n_used < layer->n_slots ? n_used : layer->n_slots;
            pool->budget.floor_bytes += (uint64_t) k * layer->expert_bytes;
            device      |= layer->device;
            pinned_host |= layer->pinned_host;
        }
    }
    pool->budget.fixed_why = pinned ? "pinned pools (every expert in place, stock's graph reads them directly)"
                           : device ? "the pools are in device memory (a GPU or an RPC host), which does not shrink so"
                           : pinned_host ? "the pools are in a GPU backend's pinned host buffer (llama.cpp's choice for CPU "
                                           "layers where a GPU is present), whose pages the kernel does not take back"
                                         : NULL;
    pthread_mutex_unlock(&pool->lock);
}

int empanel_budget_movable(const struct empanel_pool * pool, char * err, size_t err_size) {
    if (pool->budget.fixed_why != NULL) {
        empanel_util_format_err(err, err_size, "this model's pools cannot give memory back: %s", pool->budget.fixed_why);
        return -1;
    }
    return 0;
}

int32_t empanel_pool_set_budget(struct empanel_pool * pool, uint64_t budget_bytes, char * err, size_t err_size) {
    if (budget_bytes == 0) {
        empanel_util_format_err(err, err_size, "a budget of 0 bytes: the experts of one remap must fit");
        return -1;
    }
    if (empanel_budget_movable(pool, err, err_size) != 0) {
        return -1;
    }
    if (budget_bytes < pool->budget.floor_bytes) {
        empanel_util_format_err(err, err_size, "%llu bytes is below the floor of %llu: the top-k experts of every "
                                "MoE layer, which each token needs", (unsigned long long) budget_bytes,
                                (unsigned long long) pool->budget.floor_bytes);
        return -1;
    }
    pthread_mutex_lock(&pool->lock);
    empanel_budget_set_locked(pool, budget_bytes);
    pool->budget.ceiling_bytes = pool->budget.bytes;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

int32_t empanel_pool_budget(struct empanel_pool * pool, struct empanel_budget_stats * out) {
    pthread_mutex_lock(&pool->lock);
    out->budget_bytes     = pool->budget.bytes;
    out->capacity_bytes   = pool->budget.capacity_bytes;
    out->floor_bytes      = pool->budget.floor_bytes;
    out->resident_bytes   = pool->budget.resident_bytes;
    out->lowest_bytes     = pool->budget.lowest_bytes;
    out->n_changes        = pool->budget.n_changes;
    out->given_back_bytes = pool->budget.given_back_bytes;
    out->max_over_bytes   = pool->budget.max_over_bytes;
    out->fixed            = pool->budget.fixed_why != NULL;
    out->elastic          = pool->pressure.watch != NULL;
    out->n_shrinks        = pool->pressure.n_shrinks;
    out->n_grows          = pool->pressure.n_grows;
    out->available_bytes  = atomic_load(&pool->pressure.available_bytes);
    out->reserve_bytes    = pool->pressure.reserve_bytes;
    out->last_shrink_ms   = pool->pressure.last_shrink_ms;
    out->max_shrink_ms    = pool->pressure.max_shrink_ms;
    out->ceiling_bytes    = pool->budget.ceiling_bytes != 0 ? pool->budget.ceiling_bytes : pool->budget.capacity_bytes;
    out->n_events         = atomic_load(&pool->pressure.n_events);
    out->n_unread         = atomic_load(&pool->pressure.n_unread);
    out->hears_kernel     = pool->pressure.hears_kernel;
    out->max_lock_wait_ms = pool->pressure.max_lock_wait_ms;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}
