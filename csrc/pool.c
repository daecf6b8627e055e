// Expert slot pools, their lifecycle: made (with their files, reader threads and tables), bound
// to llama.cpp's pool tensors, freed; the policy lab's pools (no files); the error's recovery and
// the digests. Which expert goes where is slots.c's and remap.c's; reads are batch.c's; what a
// pool reports is stats.c's.
//
// One empanel_pool per model (state.h); one empanel_layer per layer of it (layer.h).

#include "pool.h"
#include "backend.h"
#include "batch.h"
#include "files.h"
#include "host_cache.h"
#include "pressure.h"
#include "reader.h"
#include "remote.h"
#include "rpc.h"
#include "slots.h"
#include "util.h"
#include "state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void empanel_pool_clear_error(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    // a batch still in flight (the graph stopped before waiting for it) ends here, its slots
    // holding nothing; plans cut short are closed, so the next micro-batch plans afresh
    empanel_batch_finish(pool);
    pool->deferred_guess = NULL;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        if (empanel_layer_open(&pool->layers[il])) {
            empanel_slots_reconcile(pool, &pool->layers[il]);
        }
    }
    atomic_store(&pool->error.failed, 0); // no reader threads run now: the message is free again
    pool->error.message[0] = '\0';
    atomic_store(&pool->error.claimed, 0);
    pthread_mutex_unlock(&pool->lock);
}

// ------------------------------------------------------------------------------------------------
// init / free

static int layer_alloc(struct empanel_layer * layer, int32_t n_slots, int32_t n_expert) {
    layer->n_slots   = n_slots;
    layer->tables.slot_of   = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] slot or -1
    layer->tables.miss_mark = calloc(n_expert, sizeof(uint64_t));   // [n_expert] call that found it missing
    layer->tables.expert_in = malloc(sizeof(int32_t)  * n_slots);   // [n_slots] expert or -1
    layer->tables.last_use  = calloc(n_slots, sizeof(uint64_t));    // [n_slots] call of last use
    layer->tables.call_mark = calloc(n_slots, sizeof(uint64_t));    // [n_slots] call that uses it now
    layer->tables.misses    = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] scratch: this call's misses
    layer->tables.victims   = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] scratch: their slots
    layer->tables.uses      = calloc(n_slots, sizeof(uint32_t));    // [n_slots] LFU counts
    layer->tables.slot_mark = calloc(n_slots, sizeof(uint64_t));    // [n_slots] wave that claimed it
    layer->tables.order_key = malloc(sizeof(uint64_t) * n_expert);  // [n_expert] scratch: miss order
    layer->tables.distinct  = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] scratch: distinct experts
    layer->waves.wave_of  = malloc(sizeof(int32_t) * n_expert);  // [n_expert] wave of each expert
    layer->waves.slot_of  = malloc(sizeof(int32_t) * n_expert);  // [n_expert] its slot then
    layer->waves.order = malloc(sizeof(int32_t) * n_expert);  // [n_expert] experts wave by wave
    layer->waves.begin = malloc(sizeof(int32_t) * (n_expert + 2)); // [waves + 1] first of each wave
    layer->guess.mark    = calloc(n_expert, sizeof(uint64_t));   // [n_expert] guess that named it
    layer->guess.prefetch_mark = calloc(n_slots, sizeof(uint64_t));    // [n_slots] micro-batch read ahead for
    if (!layer->tables.slot_of || !layer->tables.miss_mark || !layer->tables.expert_in || !layer->tables.last_use ||
        !layer->tables.call_mark || !layer->tables.misses || !layer->tables.victims || !layer->tables.uses || !layer->tables.slot_mark || !layer->tables.order_key ||
        !layer->tables.distinct || !layer->waves.wave_of || !layer->waves.slot_of || !layer->waves.order || !layer->waves.begin ||
        !layer->guess.mark || !layer->guess.prefetch_mark) {
        return -1;
    }
    for (int32_t e = 0; e < n_expert; e++) {
        layer->tables.slot_of[e] = -1;
    }
    for (int32_t s = 0; s < n_slots; s++) {
        layer->tables.expert_in[s] = -1;
    }
    return 0;
}

static void layer_free(struct empanel_layer * layer) {
    free(layer->tables.slot_of);
    free(layer->tables.miss_mark);
    free(layer->tables.expert_in);
    free(layer->tables.last_use);
    free(layer->tables.call_mark);
    free(layer->tables.misses);
    free(layer->tables.victims);
    free(layer->tables.uses);
    free(layer->tables.slot_mark);
    free(layer->tables.order_key);
    free(layer->tables.distinct);
    free(layer->waves.wave_of);
    free(layer->waves.slot_of);
    free(layer->waves.order);
    free(layer->waves.begin);
    free(layer->guess.mark);
    free(layer->guess.prefetch_mark);
    free(layer->waves.ids);
    free(layer->preload.order);
    free(layer->preload.uses);
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        free(layer->tensors[i].held);
        free(layer->tensors[i].digest);
        empanel_remote_free(layer->tensors[i].remote);
    }
}

// the tables every pool has: layers with their slots, the policy; NULL with the reason in err
static struct empanel_pool * pool_new(int32_t policy, int32_t n_layer, const int32_t * n_slots, int32_t n_expert,
                                      char * err, size_t err_size) {
    if (n_layer <= 0 || n_expert <= 0) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: need layers and experts");
        return NULL;
    }
    if (policy != EMPANEL_POLICY_LRU && policy != EMPANEL_POLICY_LFU_DECAY && policy != EMPANEL_POLICY_GLRU) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: unknown policy %d", policy);
        return NULL;
    }
    struct empanel_pool * pool = calloc(1, sizeof(*pool));
    if (pool == NULL) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: out of memory");
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    atomic_init(&pool->error.failed, 0);
    atomic_init(&pool->error.claimed, 0);
    atomic_init(&pool->fault.n_requests, 0);
    atomic_init(&pool->pressure.available_bytes, UINT64_MAX);
    const char * fault = getenv("EMPANEL_FAULT_READ_AFTER");
    pool->fault.after = fault != NULL ? atoll(fault) : 0;
    const char * fault_count = getenv("EMPANEL_FAULT_READ_COUNT");
    pool->fault.count = fault_count != NULL ? atoll(fault_count) : 0;
    const char * fault_short = getenv("EMPANEL_FAULT_SHORT_READS");
    pool->fault.short_reads = fault_short != NULL && atoi(fault_short) != 0;
    const char * fault_delay = getenv("EMPANEL_FAULT_READ_DELAY_MS");
    pool->fault.delay_us = fault_delay != NULL && atoll(fault_delay) > 0 ? atoll(fault_delay) * 1000 : 0;
    pool->n_layer      = n_layer;
    pool->n_expert     = n_expert;
    pool->config.policy       = policy;
    pool->files.watch_fd     = -1;
    pool->files.changed = -1;
    pool->layers   = calloc(n_layer, sizeof(struct empanel_layer));
    if (pool->layers == NULL) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: out of memory");
        empanel_pool_free(pool);
        return NULL;
    }
    for (int32_t il = 0; il < n_layer; il++) {
        pool->layers[il].observe = n_slots[il] < 0;
        if (n_slots[il] <= 0) {
            continue;
        }
        if (n_slots[il] > n_expert) {
            empanel_util_format_err(err, err_size, "layer %d: %d slots for %d experts", il, n_slots[il], n_expert);
            empanel_pool_free(pool);
            return NULL;
        }
        if (layer_alloc(&pool->layers[il], n_slots[il], n_expert) != 0) {
            empanel_util_format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", il);
            empanel_pool_free(pool);
            return NULL;
        }
    }
    return pool;
}

// the recency list over the slots of every layer and the budget: budget_bytes, or the capacity
// (every slot full) where 0 or more; 0 or -1
static int pool_link_lru(struct empanel_pool * pool, uint64_t budget_bytes, char * err, size_t err_size) {
    pool->budget.head = pool->budget.tail = -1;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        pool->layers[il].lru_base = pool->budget.n_entries;
        pool->budget.n_entries += pool->layers[il].n_slots;
        pool->budget.capacity_bytes += (uint64_t) pool->layers[il].n_slots * pool->layers[il].expert_bytes;
    }
    pool->budget.bytes = budget_bytes > 0 && budget_bytes < pool->budget.capacity_bytes ? budget_bytes
                                                                                      : pool->budget.capacity_bytes;
    pool->budget.lowest_bytes = pool->budget.bytes;
    pool->budget.prev    = malloc(sizeof(int32_t) * (pool->budget.n_entries + 1));
    pool->budget.next    = malloc(sizeof(int32_t) * (pool->budget.n_entries + 1));
    pool->budget.entry_layer = malloc(sizeof(int32_t) * (pool->budget.n_entries + 1));
    if (!pool->budget.prev || !pool->budget.next || !pool->budget.entry_layer) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: out of memory");
        return -1;
    }
    for (int32_t il = 0; il < pool->n_layer; il++) {
        for (int32_t s = 0; s < pool->layers[il].n_slots; s++) {
            pool->budget.entry_layer[pool->layers[il].lru_base + s] = il;
        }
    }
    return 0;
}

// expert tensor d of the plan into its layer of the pool; 0, or -1 with the reason in err
static int pool_add_tensor(struct empanel_pool * pool, const struct empanel_tensor_desc * d, const char * const * paths,
                           int verify, char * err, size_t err_size) {
    const int32_t n_expert = pool->n_expert;
    if (d->layer < 0 || d->layer >= pool->n_layer || pool->layers[d->layer].n_slots == 0) {
        empanel_util_format_err(err, err_size, "%s: layer %d is not paged", d->name, d->layer);
        return -1;
    }
    struct empanel_layer * layer = &pool->layers[d->layer];
    if (layer->n_tensors == EMPANEL_MAX_TENSORS) {
        empanel_util_format_err(err, err_size, "%s: more than %d expert tensors in layer %d", d->name, EMPANEL_MAX_TENSORS, d->layer);
        return -1;
    }
    // no sum wraps: offset + n_expert x expert_size <= size, checked by division
    const int      in_files  = d->file >= 0 && d->file < pool->files.n;
    const uint64_t file_size = in_files ? pool->files.list[d->file].size : 0;
    if (!in_files || d->expert_size == 0 || d->offset > file_size ||
        d->expert_size > (file_size - d->offset) / (uint64_t) n_expert) {
        empanel_util_format_err(err, err_size, "%s: experts lie outside %s (offset %llu + %d x %llu bytes > %llu)",
                   d->name, in_files ? paths[d->file] : "?", (unsigned long long) d->offset, n_expert,
                   (unsigned long long) d->expert_size, (unsigned long long) file_size);
        return -1;
    }
    struct empanel_tensor * t = &layer->tensors[layer->n_tensors++];
    snprintf(t->name, sizeof(t->name), "%s", d->name);
    t->file        = d->file;
    t->offset      = d->offset;
    t->expert_size = d->expert_size;
    t->held        = malloc(sizeof(int32_t) * layer->n_slots);                          // [n_slots]
    t->digest      = verify ? calloc((size_t) n_expert, sizeof(uint64_t)) : NULL;        // [n_expert], 0: not known yet
    if (t->held == NULL || (verify && t->digest == NULL)) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", d->layer);
        return -1;
    }
    for (int32_t s = 0; s < layer->n_slots; s++) {
        t->held[s] = -1;
    }
    layer->expert_bytes += d->expert_size;
    return 0;
}

struct empanel_pool * empanel_pool_init(
        const struct empanel_pool_params * params,
        const char * const * paths,
        int32_t              n_paths,
        int32_t              n_layer,
        const int32_t      * n_slots,
        int32_t              n_expert,
        const struct empanel_tensor_desc * tensors,
        int32_t              n_tensors,
        char               * err,
        size_t               err_size) {
    if (n_paths <= 0) {
        empanel_util_format_err(err, err_size, "empanel_pool_init: need files, layers and experts");
        return NULL;
    }
    const int32_t policy = params != NULL ? params->policy : EMPANEL_POLICY_LRU;
    struct empanel_pool * pool = pool_new(policy, n_layer, n_slots, n_expert, err, err_size);
    if (pool == NULL) {
        return NULL;
    }
    const int direct_io = params == NULL || params->direct_io >= 0;
    pool->config.prefetch    = params != NULL && params->prefetch > 0 ? params->prefetch : 0;
    pool->config.prompt_ahead = params != NULL && params->prompt_ahead > 0;
    pool->config.subst_ratio = params != NULL && params->subst_ratio > 0 ? params->subst_ratio : 0;
    pool->config.verify      = params != NULL && params->verify;
    const int32_t  n_threads   = params != NULL && params->n_threads  >= 0 ? params->n_threads   : EMPANEL_DEFAULT_READ_THREADS;
    const uint64_t chunk_bytes = params != NULL && params->chunk_bytes > 0 ? params->chunk_bytes : EMPANEL_DEFAULT_CHUNK_KB * 1024u;

    int rc = empanel_files_open(pool, paths, n_paths, direct_io, err, err_size);
    for (int32_t i = 0; rc == 0 && i < n_tensors; i++) {
        rc = pool_add_tensor(pool, &tensors[i], paths, pool->config.verify, err, err_size);
    }
    if (rc != 0 || pool_link_lru(pool, params != NULL ? params->budget_bytes : 0, err, err_size) != 0 ||
        empanel_reader_start(pool, n_threads, chunk_bytes, params != NULL ? params->read_io : EMPANEL_READ_IO_AUTO,
                             params != NULL ? params->queue_depth : 0, err, err_size) != 0) {
        empanel_pool_free(pool);
        return NULL;
    }
    return pool;
}

struct empanel_pool * empanel_lab_init(int32_t policy, int32_t n_layer, const int32_t * n_slots, int32_t n_expert,
                                       const uint64_t * expert_bytes, uint64_t budget_bytes,
                                       char * err, size_t err_size) {
    struct empanel_pool * pool = pool_new(policy, n_layer, n_slots, n_expert, err, err_size);
    if (pool == NULL) {
        return NULL;
    }
    pool->config.lab = 1;
    for (int32_t il = 0; il < n_layer; il++) {
        pool->layers[il].expert_bytes = expert_bytes[il];
    }
    if (pool_link_lru(pool, budget_bytes, err, err_size) != 0) {
        empanel_pool_free(pool);
        return NULL;
    }
    return pool;
}

void empanel_lab_free(struct empanel_pool * pool) {
    empanel_pool_free(pool); // a lab pool is a pool without files or reader threads
}

void empanel_pool_settle(struct empanel_pool * pool) {
    if (pool == NULL || pool->reader.pool == NULL) {
        return;
    }
    pthread_mutex_lock(&pool->lock);
    empanel_batch_finish(pool);
    pthread_mutex_unlock(&pool->lock);
}

void empanel_pool_free(struct empanel_pool * pool) {
    if (pool == NULL) {
        return;
    }
    empanel_pressure_stop(pool); // no budget moves from here on
    if (pool->reader.pool != NULL) {
        pthread_mutex_lock(&pool->lock);
        empanel_batch_finish(pool); // no reads may land after this
        pthread_mutex_unlock(&pool->lock);
    }
    empanel_reader_stop(pool);
    if (pool->layers != NULL) {
        for (int32_t il = 0; il < pool->n_layer; il++) {
            layer_free(&pool->layers[il]);
        }
        free(pool->layers);
    }
    empanel_files_close(pool);
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        free(pool->lanes.batch[lane].jobs);
        free(pool->lanes.batch[lane].chunks);
    }
    if (!empanel_reader_lost(pool)) { // (else the kernel may still read into it: kept)
        empanel_batch_staging_free(pool);
    }
    empanel_host_cache_free(pool);
    free(pool->trace.records);
    free(pool->budget.prev);
    free(pool->budget.next);
    free(pool->budget.entry_layer);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

int32_t empanel_pool_bind(struct empanel_pool * pool, const char * name, const struct llama_empanel_pool_info * info) {
    const char * repack = getenv("EMPANEL_REPACK");
    const int repack_ggml = repack != NULL && strcmp(repack, "ggml") == 0;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            struct empanel_tensor * t = &layer->tensors[i];
            if (strcmp(t->name, name) != 0) {
                continue;
            }
            if (info == NULL || info->tensor == NULL) {
                empanel_util_set_error(pool, "%s: llama.cpp made no slot pool for it", name);
                return -1;
            }
            // reads write expert_size bytes into a slot and host pools give back memory by it:
            // the tensor must be the plan's [.., .., n_slots] of expert_size bytes a slot
            if (info->n_slots != layer->n_slots || info->slot_bytes != t->expert_size) {
                empanel_util_set_error(pool, "%s: llama.cpp's slot pool has %lld slots of %llu bytes, the plan %d of %llu "
                                       "(a plan for another file or build: plan the load again)", name,
                                       (long long) info->n_slots, (unsigned long long) info->slot_bytes, layer->n_slots,
                                       (unsigned long long) t->expert_size);
                return -1;
            }
            void * pool_tensor = info->tensor;
            t->pool   = pool_tensor;
            t->direct = empanel_backend_slot_data(pool_tensor, 0) != NULL;
            t->masked = info->masked;
            t->host   = empanel_backend_host_data(pool_tensor);
            // a new tensor: the own repack is checked again (EMPANEL_REPACK=ggml: ggml's only, for A/B runs)
            atomic_store(&t->repack_own, repack_ggml ? 3 : 0);
            layer->device |= t->host == NULL;
            layer->pinned_host |= t->host != NULL && !empanel_backend_host_gives_back(pool_tensor);
            if (!empanel_rpc_tensor(pool_tensor)) {
                empanel_remote_free(t->remote);
                t->remote = NULL;
            } else if (t->remote == NULL && (t->remote = empanel_remote_init(pool->n_expert)) == NULL) {
                empanel_util_set_error(pool, "%s: out of memory", name);
                return -1;
            }
            if (t->host == NULL && pool->lanes.staging.owner == NULL) {
                empanel_batch_staging_free(pool);         // reads bound for device memory: pinned staging
                pool->lanes.staging.owner = pool_tensor;
            }
            if (t->host != NULL) {
                // zeros, and no memory until a slot is used
                empanel_backend_memory_release(t->host, (uint64_t) layer->n_slots * t->expert_size, 1);
            }
            return 0;
        }
    }
    empanel_util_set_error(pool, "%s: not an expert tensor of this pool", name);
    return -1;
}

int32_t empanel_pool_set_digests(struct empanel_pool * pool, const char * name, const uint64_t * digests,
                                 int32_t n_expert) {
    if (!pool->config.verify || n_expert != pool->n_expert) {
        return -1;
    }
    for (int32_t il = 0; il < pool->n_layer; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            struct empanel_tensor * t = &layer->tensors[i];
            if (strcmp(t->name, name) == 0) {
                pthread_mutex_lock(&pool->lock);
                memcpy(t->digest, digests, sizeof(uint64_t) * (size_t) n_expert);
                pthread_mutex_unlock(&pool->lock);
                return 0;
            }
        }
    }
    return -1;
}
