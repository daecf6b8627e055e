// Expert slot pools: their tables, the memory of host pools, the g-lru list, binding to
// llama.cpp's pool tensors, the routing trace and the statistics. Which expert goes where in a
// remap call is remap.c's.
//
// One empanel_pool per model. Each paged layer has n_slots slots shared by its expert tensors
// (gate/up/down or gate_up/down): slot s of every tensor of the layer holds the same expert.

#include "empanel.h"
#include "empanel-impl.h"

#include "llama-empanel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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
    return atomic_load(&pool->failed) != 0;
}

const char * empanel_pool_notice(struct empanel_pool * pool) {
    return pool->notice;
}

const char * empanel_pool_error(struct empanel_pool * pool) {
    return atomic_load(&pool->failed) ? pool->error : "";
}

// ------------------------------------------------------------------------------------------------
// init / free

static int layer_alloc(struct empanel_layer * layer, int32_t n_slots, int32_t n_expert) {
    layer->n_slots   = n_slots;
    layer->slot_of   = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] slot or -1
    layer->miss_mark = calloc(n_expert, sizeof(uint64_t));   // [n_expert] call that found it missing
    layer->expert_in = malloc(sizeof(int32_t)  * n_slots);   // [n_slots] expert or -1
    layer->last_use  = calloc(n_slots, sizeof(uint64_t));    // [n_slots] call of last use
    layer->call_mark = calloc(n_slots, sizeof(uint64_t));    // [n_slots] call that uses it now
    layer->misses    = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] scratch: this call's misses
    layer->victims   = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] scratch: their slots
    layer->uses      = calloc(n_slots, sizeof(uint32_t));    // [n_slots] LFU counts
    layer->wave_mark = calloc(n_slots, sizeof(uint64_t));    // [n_slots] wave that claimed it
    layer->order_key = malloc(sizeof(uint64_t) * n_expert);  // [n_expert] scratch: miss order
    layer->distinct  = malloc(sizeof(int32_t)  * n_expert);  // [n_expert] scratch: distinct experts
    layer->plan_wave  = malloc(sizeof(int32_t) * n_expert);  // [n_expert] wave of each expert
    layer->plan_slot  = malloc(sizeof(int32_t) * n_expert);  // [n_expert] its slot then
    layer->plan_order = malloc(sizeof(int32_t) * n_expert);  // [n_expert] experts wave by wave
    layer->plan_begin = malloc(sizeof(int32_t) * (n_expert + 2)); // [waves + 1] first of each wave
    layer->guess_mark    = calloc(n_expert, sizeof(uint64_t));   // [n_expert] guess that named it
    layer->prefetch_mark = calloc(n_slots, sizeof(uint64_t));    // [n_slots] micro-batch read ahead for
    if (!layer->slot_of || !layer->miss_mark || !layer->expert_in || !layer->last_use ||
        !layer->call_mark || !layer->misses || !layer->victims || !layer->uses || !layer->wave_mark || !layer->order_key ||
        !layer->distinct || !layer->plan_wave || !layer->plan_slot || !layer->plan_order || !layer->plan_begin ||
        !layer->guess_mark || !layer->prefetch_mark) {
        return -1;
    }
    for (int32_t e = 0; e < n_expert; e++) {
        layer->slot_of[e] = -1;
    }
    for (int32_t s = 0; s < n_slots; s++) {
        layer->expert_in[s] = -1;
    }
    return 0;
}

static void layer_free(struct empanel_layer * layer) {
    free(layer->slot_of);
    free(layer->miss_mark);
    free(layer->expert_in);
    free(layer->last_use);
    free(layer->call_mark);
    free(layer->misses);
    free(layer->victims);
    free(layer->uses);
    free(layer->wave_mark);
    free(layer->order_key);
    free(layer->distinct);
    free(layer->plan_wave);
    free(layer->plan_slot);
    free(layer->plan_order);
    free(layer->plan_begin);
    free(layer->guess_mark);
    free(layer->prefetch_mark);
    free(layer->plan_ids);
    free(layer->preload_order);
    free(layer->preload_uses);
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        free(layer->tensors[i].held);
        free(layer->tensors[i].digest);
        free(layer->tensors[i].remote_hash);
        free(layer->tensors[i].remote_sent);
    }
}

// the tables every pool has: layers with their slots, the policy; NULL with the reason in err
static struct empanel_pool * pool_new(int32_t policy, int32_t n_layer, const int32_t * n_slots, int32_t n_expert,
                                      char * err, size_t err_size) {
    if (n_layer <= 0 || n_expert <= 0) {
        empanel_format_err(err, err_size, "empanel_pool_init: need layers and experts");
        return NULL;
    }
    if (policy != EMPANEL_POLICY_LRU && policy != EMPANEL_POLICY_LFU_DECAY && policy != EMPANEL_POLICY_GLRU) {
        empanel_format_err(err, err_size, "empanel_pool_init: unknown policy %d", policy);
        return NULL;
    }
    struct empanel_pool * pool = calloc(1, sizeof(*pool));
    if (pool == NULL) {
        empanel_format_err(err, err_size, "empanel_pool_init: out of memory");
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    atomic_init(&pool->failed, 0);
    atomic_init(&pool->error_claimed, 0);
    atomic_init(&pool->n_requests, 0);
    const char * fault = getenv("EMPANEL_FAULT_READ_AFTER");
    pool->fault_after = fault != NULL ? atoll(fault) : 0;
    const char * fault_count = getenv("EMPANEL_FAULT_READ_COUNT");
    pool->fault_count = fault_count != NULL ? atoll(fault_count) : 0;
    pool->n_layer      = n_layer;
    pool->n_expert     = n_expert;
    pool->policy       = policy;
    pool->watch_fd     = -1;
    pool->changed_file = -1;
    pool->layers   = calloc(n_layer, sizeof(struct empanel_layer));
    if (pool->layers == NULL) {
        empanel_format_err(err, err_size, "empanel_pool_init: out of memory");
        empanel_pool_free(pool);
        return NULL;
    }
    for (int32_t il = 0; il < n_layer; il++) {
        pool->layers[il].observe = n_slots[il] < 0;
        if (n_slots[il] <= 0) {
            continue;
        }
        if (n_slots[il] > n_expert) {
            empanel_format_err(err, err_size, "layer %d: %d slots for %d experts", il, n_slots[il], n_expert);
            empanel_pool_free(pool);
            return NULL;
        }
        if (layer_alloc(&pool->layers[il], n_slots[il], n_expert) != 0) {
            empanel_format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", il);
            empanel_pool_free(pool);
            return NULL;
        }
    }
    return pool;
}

// g-lru: one list over the slots of every layer (made for every policy: it is small); 0 or -1
static int pool_link_lru(struct empanel_pool * pool, uint64_t budget_bytes, char * err, size_t err_size) {
    pool->budget_bytes = budget_bytes;
    pool->lru_head = pool->lru_tail = -1;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        pool->layers[il].lru_base = pool->n_entries;
        pool->n_entries += pool->layers[il].n_slots;
    }
    pool->lru_prev    = malloc(sizeof(int32_t) * (pool->n_entries + 1));
    pool->lru_next    = malloc(sizeof(int32_t) * (pool->n_entries + 1));
    pool->entry_layer = malloc(sizeof(int32_t) * (pool->n_entries + 1));
    if (!pool->lru_prev || !pool->lru_next || !pool->entry_layer) {
        empanel_format_err(err, err_size, "empanel_pool_init: out of memory");
        return -1;
    }
    for (int32_t il = 0; il < pool->n_layer; il++) {
        for (int32_t s = 0; s < pool->layers[il].n_slots; s++) {
            pool->entry_layer[pool->layers[il].lru_base + s] = il;
        }
    }
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
        empanel_format_err(err, err_size, "empanel_pool_init: need files, layers and experts");
        return NULL;
    }
    const int32_t policy = params != NULL ? params->policy : EMPANEL_POLICY_LRU;
    struct empanel_pool * pool = pool_new(policy, n_layer, n_slots, n_expert, err, err_size);
    if (pool == NULL) {
        return NULL;
    }
    const int direct_io = params == NULL || params->direct_io >= 0;
    if (empanel_files_open(pool, paths, n_paths, direct_io, err, err_size) != 0) {
        empanel_pool_free(pool);
        return NULL;
    }

    for (int32_t i = 0; i < n_tensors; i++) {
        const struct empanel_tensor_desc * d = &tensors[i];
        if (d->layer < 0 || d->layer >= n_layer || pool->layers[d->layer].n_slots == 0) {
            empanel_format_err(err, err_size, "%s: layer %d is not paged", d->name, d->layer);
            empanel_pool_free(pool);
            return NULL;
        }
        struct empanel_layer * layer = &pool->layers[d->layer];
        if (layer->n_tensors == EMPANEL_MAX_TENSORS) {
            empanel_format_err(err, err_size, "%s: more than %d expert tensors in layer %d", d->name, EMPANEL_MAX_TENSORS, d->layer);
            empanel_pool_free(pool);
            return NULL;
        }
        // no sum wraps: offset + n_expert x expert_size <= size, checked by division
        const uint64_t file_size = d->file >= 0 && d->file < n_paths ? pool->files[d->file].size : 0;
        if (d->file < 0 || d->file >= n_paths || d->expert_size == 0 || d->offset > file_size ||
            d->expert_size > (file_size - d->offset) / (uint64_t) n_expert) {
            empanel_format_err(err, err_size, "%s: experts lie outside %s (offset %llu + %d x %llu bytes > %llu)",
                       d->name, d->file >= 0 && d->file < n_paths ? paths[d->file] : "?",
                       (unsigned long long) d->offset, n_expert, (unsigned long long) d->expert_size,
                       d->file >= 0 && d->file < n_paths ? (unsigned long long) pool->files[d->file].size : 0ULL);
            empanel_pool_free(pool);
            return NULL;
        }
        struct empanel_tensor * t = &layer->tensors[layer->n_tensors++];
        snprintf(t->name, sizeof(t->name), "%s", d->name);
        t->file        = d->file;
        t->offset      = d->offset;
        t->expert_size = d->expert_size;
        t->held        = malloc(sizeof(int32_t) * layer->n_slots); // [n_slots]
        if (t->held == NULL) {
            empanel_format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", d->layer);
            empanel_pool_free(pool);
            return NULL;
        }
        for (int32_t s = 0; s < layer->n_slots; s++) {
            t->held[s] = -1;
        }
        if (params != NULL && params->verify) {
            t->digest = calloc((size_t) n_expert, sizeof(uint64_t)); // [n_expert], 0: not known yet
            if (t->digest == NULL) {
                empanel_format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", d->layer);
                empanel_pool_free(pool);
                return NULL;
            }
        }
        layer->expert_bytes += d->expert_size;
    }

    if (pool_link_lru(pool, params != NULL ? params->budget_bytes : 0, err, err_size) != 0) {
        empanel_pool_free(pool);
        return NULL;
    }
    pool->prefetch    = params != NULL && params->prefetch > 0 ? params->prefetch : 0;
    pool->subst_ratio = params != NULL && params->subst_ratio > 0 ? params->subst_ratio : 0;
    pool->verify      = params != NULL && params->verify;
    const int32_t  n_threads   = params != NULL && params->n_threads  >= 0 ? params->n_threads   : 8;
    const uint64_t chunk_bytes = params != NULL && params->chunk_bytes > 0 ? params->chunk_bytes : 256u << 10;
    if (empanel_reader_start(pool, n_threads, chunk_bytes, err, err_size) != 0) {
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
    pool->lab = 1;
    for (int32_t il = 0; il < n_layer; il++) {
        pool->layers[il].expert_bytes = expert_bytes[il];
    }
    if (pool_link_lru(pool, budget_bytes, err, err_size) != 0) {
        empanel_pool_free(pool);
        return NULL;
    }
    return pool;
}

void empanel_pool_free(struct empanel_pool * pool) {
    if (pool == NULL) {
        return;
    }
    if (pool->reader.pool != NULL) {
        empanel_read_finish(pool); // no reads may land after this
    }
    empanel_reader_stop(pool);
    if (pool->layers != NULL) {
        for (int32_t il = 0; il < pool->n_layer; il++) {
            layer_free(&pool->layers[il]);
        }
        free(pool->layers);
    }
    empanel_files_close(pool);
    free(pool->jobs);
    free(pool->chunks);
    empanel_staging_free(pool);
    empanel_host_cache_free(pool);
    free(pool->trace);
    free(pool->lru_prev);
    free(pool->lru_next);
    free(pool->entry_layer);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

// ------------------------------------------------------------------------------------------------
// memory of host pools: slots without an expert give their whole pages back

// give back the pages inside [ptr, ptr + size) (they read as zeros afterwards); with zero_edges
// also zero the bytes of the partial pages at both ends
static void release_memory(uint8_t * ptr, uint64_t size, int zero_edges) {
    const uint64_t page  = (uint64_t) sysconf(_SC_PAGESIZE);
    const uint64_t begin = ((uint64_t) (uintptr_t) ptr + page - 1) / page * page;
    const uint64_t end   = ((uint64_t) (uintptr_t) ptr + size) / page * page;
    if (begin >= end) {
        if (zero_edges) {
            memset(ptr, 0, size);
        }
        return;
    }
    if (zero_edges) {
        memset(ptr, 0, begin - (uintptr_t) ptr);
        memset((uint8_t *) (uintptr_t) end, 0, (uintptr_t) ptr + size - end);
    }
#if defined(__linux__)
    if (madvise((void *) (uintptr_t) begin, end - begin, MADV_DONTNEED) == 0) {
        return; // private anonymous memory: zero-filled on the next touch
    }
#endif
    if (zero_edges) {
        memset((void *) (uintptr_t) begin, 0, end - begin);
    }
}

void empanel_slot_release(struct empanel_layer * layer, int32_t slot) {
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        struct empanel_tensor * t = &layer->tensors[i];
        if (t->host != NULL) {
            release_memory(t->host + (uint64_t) slot * t->expert_size, t->expert_size, 0);
            t->held[slot] = -1;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// g-lru list

void empanel_lru_unlink(struct empanel_pool * pool, int32_t e) {
    const int32_t prev = pool->lru_prev[e];
    const int32_t next = pool->lru_next[e];
    if (prev >= 0) { pool->lru_next[prev] = next; } else { pool->lru_head = next; }
    if (next >= 0) { pool->lru_prev[next] = prev; } else { pool->lru_tail = prev; }
}

void empanel_lru_push_recent(struct empanel_pool * pool, int32_t e) {
    pool->lru_prev[e] = pool->lru_tail;
    pool->lru_next[e] = -1;
    if (pool->lru_tail >= 0) { pool->lru_next[pool->lru_tail] = e; } else { pool->lru_head = e; }
    pool->lru_tail = e;
}

void empanel_prefetch_drop(struct empanel_layer * layer, int32_t s) {
    if (layer->prefetch_mark[s] != 0) {
        layer->stats.prefetch_wasted += layer->expert_bytes;
        layer->prefetch_mark[s] = 0;
    }
}

// evict least recently used experts of any layer (none that this call uses) until `need` more
// bytes fit in the budget; the budget yields when only this call's experts are left
void empanel_glru_make_room(struct empanel_pool * pool, uint64_t need, uint64_t call) {
    int32_t e = pool->lru_head;
    while (e >= 0 && pool->resident_bytes + need > pool->budget_bytes) {
        const int32_t next = pool->lru_next[e];
        struct empanel_layer * layer = &pool->layers[pool->entry_layer[e]];
        const int32_t s = e - layer->lru_base;
        if (layer->call_mark[s] != call) {
            empanel_lru_unlink(pool, e);
            layer->slot_of[layer->expert_in[s]] = -1;
            layer->expert_in[s] = -1;
            layer->last_use[s]  = 0; // empty: taken first by its layer
            layer->uses[s]      = 0;
            pool->resident_bytes -= layer->expert_bytes;
            empanel_prefetch_drop(layer, s);
            empanel_slot_release(layer, s);
        }
        e = next;
    }
}

void empanel_trace_enable(struct empanel_pool * pool, int32_t on) {
    pthread_mutex_lock(&pool->lock);
    pool->tracing = on != 0;
    pthread_mutex_unlock(&pool->lock);
}

uint64_t empanel_trace_size(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    const uint64_t n = pool->trace_len;
    pthread_mutex_unlock(&pool->lock);
    return n;
}

uint64_t empanel_trace_take(struct empanel_pool * pool, int32_t * out, uint64_t max) {
    pthread_mutex_lock(&pool->lock);
    const uint64_t n = pool->trace_len < max ? pool->trace_len : max;
    if (n > 0) {
        memcpy(out, pool->trace, sizeof(int32_t) * n);
        memmove(pool->trace, pool->trace + n, sizeof(int32_t) * (pool->trace_len - n));
        pool->trace_len -= n;
    }
    pthread_mutex_unlock(&pool->lock);
    return n;
}

uint64_t empanel_pool_resident_bytes(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    uint64_t bytes = 0;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        const struct empanel_layer * layer = &pool->layers[il];
        for (int32_t s = 0; s < layer->n_slots; s++) {
            bytes += layer->expert_in[s] >= 0 ? layer->expert_bytes : 0;
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
        expert_in[s] = layer->expert_in[s];
    }
    pthread_mutex_unlock(&pool->lock);
    return layer->n_slots;
}

int32_t empanel_pool_bind(struct empanel_pool * pool, const char * name, void * pool_tensor) {
    for (int32_t il = 0; il < pool->n_layer; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            struct empanel_tensor * t = &layer->tensors[i];
            if (strcmp(t->name, name) != 0) {
                continue;
            }
            if (pool_tensor == NULL) {
                empanel_set_error(pool, "%s: llama.cpp made no slot pool for it", name);
                return -1;
            }
            // reads write expert_size bytes into a slot and host pools give back memory by it:
            // the tensor must be the plan's [.., .., n_slots] of expert_size bytes a slot
            int64_t  tensor_slots = 0;
            uint64_t slot_bytes   = 0;
            empanel_pool_tensor_shape(pool_tensor, &tensor_slots, &slot_bytes);
            if (tensor_slots != layer->n_slots || slot_bytes != t->expert_size) {
                empanel_set_error(pool, "%s: llama.cpp's slot pool has %lld slots of %llu bytes, the plan %d of %llu "
                                  "(a plan for another file or build: plan the load again)", name,
                                  (long long) tensor_slots, (unsigned long long) slot_bytes, layer->n_slots,
                                  (unsigned long long) t->expert_size);
                return -1;
            }
            t->pool   = pool_tensor;
            t->direct = empanel_slot_data(pool_tensor, 0) != NULL;
            t->masked = llama_empanel_pool_masked(pool_tensor);
            t->host   = empanel_pool_host_data(pool_tensor);
            layer->device |= t->host == NULL;
            t->remote = empanel_rpc_tensor(pool_tensor);
            if (t->remote && t->remote_hash == NULL) {
                t->remote_cache = 1;
                t->remote_hash  = calloc((size_t) pool->n_expert, sizeof(uint64_t)); // [n_expert]
                t->remote_sent  = calloc((size_t) pool->n_expert, sizeof(uint8_t));  // [n_expert]
                if (t->remote_hash == NULL || t->remote_sent == NULL) {
                    empanel_set_error(pool, "%s: out of memory", name);
                    return -1;
                }
            }
            if (t->host == NULL && pool->staging_owner == NULL) {
                empanel_staging_free(pool);         // reads bound for device memory: pinned staging
                pool->staging_owner = pool_tensor;
            }
            if (t->host != NULL) {
                // zeros, and no memory until a slot is used
                release_memory(t->host, (uint64_t) layer->n_slots * t->expert_size, 1);
            }
            return 0;
        }
    }
    empanel_set_error(pool, "%s: not an expert tensor of this pool", name);
    return -1;
}

// ------------------------------------------------------------------------------------------------
// stats

int32_t empanel_pool_set_digests(struct empanel_pool * pool, const char * name, const uint64_t * digests,
                                 int32_t n_expert) {
    if (!pool->verify || n_expert != pool->n_expert) {
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
        out->n_resident += layer->expert_in[s] >= 0;
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
