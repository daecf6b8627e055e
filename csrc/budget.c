// The live budget of g-lru pools. The budget of resident expert bytes over all layers is fixed
// at init by the plan; empanel_pool_set_budget moves it while the model runs. Down: the least
// recently used experts of any layer leave at once (slots.c, empanel_slots_glru_shrink), their
// pages back to the kernel, but for those the layer computing now reads and those of layers with
// reads or a plan open, which the remaps that follow evict before any read lands (make_room). Up:
// experts are admitted again as misses are read. The pools' capacity (slots per layer, the graph's
// ne[2]) never changes, so neither do the waves: outputs stay bit-identical at every budget.

#include "budget.h"
#include "slots.h"
#include "state.h"
#include "stats.h"
#include "util.h"

#include <pthread.h>

int32_t empanel_pool_set_budget(struct empanel_pool * pool, uint64_t budget_bytes, char * err, size_t err_size) {
    if (pool->config.policy != EMPANEL_POLICY_GLRU) {
        empanel_util_format_err(err, err_size, "a live budget needs moe_policy=\"g-lru\" (this pool's policy is %s)",
                                empanel_policy_name(pool->config.policy));
        return -1;
    }
    if (budget_bytes == 0) {
        empanel_util_format_err(err, err_size, "a budget of 0 bytes: the experts of one remap must fit");
        return -1;
    }
    pthread_mutex_lock(&pool->lock);
    pool->glru.budget_bytes = budget_bytes;
    pool->glru.n_changes++;
    if (budget_bytes < pool->glru.lowest_bytes) {
        pool->glru.lowest_bytes = budget_bytes;
    }
    empanel_slots_glru_shrink(pool);
    pthread_mutex_unlock(&pool->lock);
    return 0;
}

int32_t empanel_pool_budget(struct empanel_pool * pool, struct empanel_budget_stats * out) {
    if (pool->config.policy != EMPANEL_POLICY_GLRU) {
        return -1;
    }
    pthread_mutex_lock(&pool->lock);
    out->budget_bytes     = pool->glru.budget_bytes;
    out->resident_bytes   = pool->glru.resident_bytes;
    out->lowest_bytes     = pool->glru.lowest_bytes;
    out->n_changes        = pool->glru.n_changes;
    out->given_back_bytes = pool->glru.given_back_bytes;
    pthread_mutex_unlock(&pool->lock);
    return 0;
}
