// What a pool (and the library) reports: the version, the policies' names, the first failure and
// the notices, the counters of each layer (EMPANEL_LAYER_COUNTERS), what the slots hold now, the
// read path and the files' watch. It changes nothing but the counters (empanel_stats_reset).

#include "stats.h"
#include "reader.h"
#include "state.h"

#include <string.h>

int32_t empanel_sidecar_version(void) {
    return EMPANEL_SIDECAR_VERSION;
}

const char * empanel_policy_name(int32_t policy) {
#define POLICY_NAME(id, name) name,
    static const char * const names[] = { EMPANEL_POLICIES(POLICY_NAME) };
#undef POLICY_NAME
    const int32_t n = (int32_t) (sizeof(names) / sizeof(names[0]));
    return policy >= 0 && policy < n ? names[policy] : NULL;
}

_Bool empanel_pool_failed(void * user) {
    const struct empanel_pool * pool = user;
    return atomic_load(&pool->error.failed) != 0;
}

int32_t empanel_pool_read_io(struct empanel_pool * pool) {
    return empanel_reader_io(pool);
}

const char * empanel_pool_notice(struct empanel_pool * pool) {
    return pool->notice;
}

const char * empanel_pool_error(struct empanel_pool * pool) {
    return atomic_load(&pool->error.failed) ? pool->error.message : "";
}

uint64_t empanel_pool_resident_bytes(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    uint64_t bytes = 0;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        const struct empanel_layer * layer = &pool->layers[il];
        for (int32_t s = 0; s < layer->n_slots; s++) {
            bytes += layer->tables.expert_in[s] >= 0 ? layer->expert_bytes : 0;
        }
    }
    pthread_mutex_unlock(&pool->lock);
    return bytes;
}

int32_t empanel_pool_slots(struct empanel_pool * pool, int32_t il, int32_t * expert_in, int32_t max) {
    if (il < 0 || il >= pool->n_layer) {
        return 0;
    }
    pthread_mutex_lock(&pool->lock);
    const struct empanel_layer * layer = &pool->layers[il];
    for (int32_t s = 0; s < layer->n_slots && s < max; s++) {
        expert_in[s] = layer->tables.expert_in[s];
    }
    pthread_mutex_unlock(&pool->lock);
    return layer->n_slots;
}

void empanel_stats_get(struct empanel_pool * pool, int32_t il, struct empanel_layer_stats * out) {
    memset(out, 0, sizeof(*out));
    if (il < 0 || il >= pool->n_layer || pool->layers[il].n_slots == 0) {
        return;
    }
    pthread_mutex_lock(&pool->lock);
    const struct empanel_layer * layer = &pool->layers[il];
    *out = layer->stats;
    out->n_slots    = layer->n_slots;
    out->n_resident = 0;
    for (int32_t s = 0; s < layer->n_slots; s++) {
        out->n_resident += layer->tables.expert_in[s] >= 0;
    }
    pthread_mutex_unlock(&pool->lock);
}

void empanel_stats_reset(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    for (int32_t il = 0; il < pool->n_layer; il++) {
        memset(&pool->layers[il].stats, 0, sizeof(pool->layers[il].stats));
    }
    pthread_mutex_unlock(&pool->lock);
}

int32_t empanel_pool_watching(struct empanel_pool * pool) {
    return pool->files.watch_fd >= 0;
}
