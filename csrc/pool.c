// Expert slot pools: which expert of a layer sits in which slot, what to evict, what to read.
//
// One empanel_pool per model. Each paged layer has n_slots slots shared by its expert tensors
// (gate/up/down or gate_up/down): slot s of every tensor of the layer holds the same expert.
// A remap call handles one micro-batch of one layer: hits keep their slots, misses take the least
// recently used slots that this micro-batch does not use, and are read from the file.

#include "empanel.h"
#include "empanel-impl.h"

#include "llama-empanel.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int32_t empanel_sidecar_version(void) {
    return EMPANEL_SIDECAR_VERSION;
}

void empanel_set_error(struct empanel_pool * pool, const char * fmt, ...) {
    if (atomic_load(&pool->failed)) {
        return; // keep the first failure: it is the cause
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(pool->error, sizeof(pool->error), fmt, args);
    va_end(args);
    atomic_store(&pool->failed, 1);
}

static void format_err(char * err, size_t err_size, const char * fmt, ...) {
    if (err == NULL || err_size == 0) {
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_size, fmt, args);
    va_end(args);
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
    if (!layer->slot_of || !layer->miss_mark || !layer->expert_in || !layer->last_use ||
        !layer->call_mark || !layer->misses || !layer->victims || !layer->uses || !layer->wave_mark || !layer->order_key ||
        !layer->distinct || !layer->plan_wave || !layer->plan_slot || !layer->plan_order || !layer->plan_begin) {
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
    free(layer->plan_ids);
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        free(layer->tensors[i].held);
    }
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
    if (n_paths <= 0 || n_layer <= 0 || n_expert <= 0) {
        format_err(err, err_size, "empanel_pool_init: need files, layers and experts");
        return NULL;
    }
    struct empanel_pool * pool = calloc(1, sizeof(*pool));
    if (pool == NULL) {
        format_err(err, err_size, "empanel_pool_init: out of memory");
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    atomic_init(&pool->failed, 0);
    atomic_init(&pool->n_requests, 0);
    const char * fault = getenv("EMPANEL_FAULT_READ_AFTER");
    pool->fault_after = fault != NULL ? atoll(fault) : 0;
    pool->n_layer  = n_layer;
    pool->n_expert = n_expert;
    pool->policy   = params != NULL ? params->policy : EMPANEL_POLICY_LRU;
    if (pool->policy != EMPANEL_POLICY_LRU && pool->policy != EMPANEL_POLICY_LFU_DECAY &&
        pool->policy != EMPANEL_POLICY_GLRU) {
        format_err(err, err_size, "empanel_pool_init: unknown policy %d", pool->policy);
        pthread_mutex_destroy(&pool->lock);
        free(pool);
        return NULL;
    }
    pool->layers   = calloc(n_layer, sizeof(struct empanel_layer));
    if (pool->layers == NULL) {
        format_err(err, err_size, "empanel_pool_init: out of memory");
        empanel_pool_free(pool);
        return NULL;
    }

    const int direct_io = params == NULL || params->direct_io >= 0;
    if (empanel_files_open(pool, paths, n_paths, direct_io, err, err_size) != 0) {
        empanel_pool_free(pool);
        return NULL;
    }

    for (int32_t il = 0; il < n_layer; il++) {
        pool->layers[il].observe = n_slots[il] < 0;
        if (n_slots[il] <= 0) {
            continue;
        }
        if (n_slots[il] > n_expert) {
            format_err(err, err_size, "layer %d: %d slots for %d experts", il, n_slots[il], n_expert);
            empanel_pool_free(pool);
            return NULL;
        }
        if (layer_alloc(&pool->layers[il], n_slots[il], n_expert) != 0) {
            format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", il);
            empanel_pool_free(pool);
            return NULL;
        }
    }

    for (int32_t i = 0; i < n_tensors; i++) {
        const struct empanel_tensor_desc * d = &tensors[i];
        if (d->layer < 0 || d->layer >= n_layer || pool->layers[d->layer].n_slots == 0) {
            format_err(err, err_size, "%s: layer %d is not paged", d->name, d->layer);
            empanel_pool_free(pool);
            return NULL;
        }
        struct empanel_layer * layer = &pool->layers[d->layer];
        if (layer->n_tensors == EMPANEL_MAX_TENSORS) {
            format_err(err, err_size, "%s: more than %d expert tensors in layer %d", d->name, EMPANEL_MAX_TENSORS, d->layer);
            empanel_pool_free(pool);
            return NULL;
        }
        if (d->file < 0 || d->file >= n_paths ||
            d->offset + d->expert_size * (uint64_t) n_expert > pool->files[d->file].size) {
            format_err(err, err_size, "%s: experts lie outside %s (offset %llu + %d x %llu bytes > %llu)",
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
            format_err(err, err_size, "empanel_pool_init: out of memory for layer %d", d->layer);
            empanel_pool_free(pool);
            return NULL;
        }
        for (int32_t s = 0; s < layer->n_slots; s++) {
            t->held[s] = -1;
        }
    }

    // g-lru: one list over the slots of every layer
    pool->budget_bytes = params != NULL ? params->budget_bytes : 0;
    pool->lru_head = pool->lru_tail = -1;
    for (int32_t il = 0; il < n_layer; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        layer->lru_base = pool->n_entries;
        pool->n_entries += layer->n_slots;
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            layer->expert_bytes += layer->tensors[i].expert_size;
        }
    }
    pool->lru_prev    = malloc(sizeof(int32_t) * (pool->n_entries + 1));
    pool->lru_next    = malloc(sizeof(int32_t) * (pool->n_entries + 1));
    pool->entry_layer = malloc(sizeof(int32_t) * (pool->n_entries + 1));
    if (!pool->lru_prev || !pool->lru_next || !pool->entry_layer) {
        format_err(err, err_size, "empanel_pool_init: out of memory");
        empanel_pool_free(pool);
        return NULL;
    }
    for (int32_t il = 0; il < n_layer; il++) {
        for (int32_t s = 0; s < pool->layers[il].n_slots; s++) {
            pool->entry_layer[pool->layers[il].lru_base + s] = il;
        }
    }

    const int32_t  n_threads   = params != NULL && params->n_threads   > 0 ? params->n_threads   : 8;
    const uint64_t chunk_bytes = params != NULL && params->chunk_bytes > 0 ? params->chunk_bytes : 256u << 10;
    if (empanel_reader_start(pool, n_threads, chunk_bytes, err, err_size) != 0) {
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

static void release_slot(struct empanel_layer * layer, int32_t slot) {
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

static void lru_unlink(struct empanel_pool * pool, int32_t e) {
    const int32_t prev = pool->lru_prev[e];
    const int32_t next = pool->lru_next[e];
    if (prev >= 0) { pool->lru_next[prev] = next; } else { pool->lru_head = next; }
    if (next >= 0) { pool->lru_prev[next] = prev; } else { pool->lru_tail = prev; }
}

static void lru_push_recent(struct empanel_pool * pool, int32_t e) {
    pool->lru_prev[e] = pool->lru_tail;
    pool->lru_next[e] = -1;
    if (pool->lru_tail >= 0) { pool->lru_next[pool->lru_tail] = e; } else { pool->lru_head = e; }
    pool->lru_tail = e;
}

// evict least recently used experts of any layer (none that this call uses) until `need` more
// bytes fit in the budget; the budget yields when only this call's experts are left
static void glru_make_room(struct empanel_pool * pool, uint64_t need, uint64_t call) {
    int32_t e = pool->lru_head;
    while (e >= 0 && pool->resident_bytes + need > pool->budget_bytes) {
        const int32_t next = pool->lru_next[e];
        struct empanel_layer * layer = &pool->layers[pool->entry_layer[e]];
        const int32_t s = e - layer->lru_base;
        if (layer->call_mark[s] != call) {
            lru_unlink(pool, e);
            layer->slot_of[layer->expert_in[s]] = -1;
            layer->expert_in[s] = -1;
            layer->last_use[s]  = 0; // empty: taken first by its layer
            layer->uses[s]      = 0;
            pool->resident_bytes -= layer->expert_bytes;
            release_slot(layer, s);
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
            t->pool   = pool_tensor;
            t->direct = llama_empanel_slot_data(pool_tensor, 0) != NULL;
            t->masked = llama_empanel_pool_masked(pool_tensor);
            t->host   = llama_empanel_pool_host_data(pool_tensor);
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
// remap

// the slot in [begin, end) to evict, among those whose mark is not `taken`, -1 if none. Empty
// slots (last_use 0, uses 0) go first under every policy.
//   LRU:       least recently used
//   LFU_DECAY: fewest uses (counts halve every n_slots micro-batches of the layer), then least recent
static int32_t pick_victim(const struct empanel_layer * layer, int32_t policy, int32_t begin, int32_t end,
                           const uint64_t * mark, uint64_t taken) {
    int32_t  victim = -1;
    uint32_t fewest = UINT32_MAX;
    uint64_t oldest = UINT64_MAX;
    for (int32_t s = begin; s < end; s++) {
        if (mark[s] == taken) {
            continue;
        }
        const uint32_t uses = policy == EMPANEL_POLICY_LFU_DECAY ? layer->uses[s] : 0;
        if (uses < fewest || (uses == fewest && layer->last_use[s] < oldest)) {
            fewest = uses;
            oldest = layer->last_use[s];
            victim = s;
        }
    }
    return victim;
}

static void note_use(struct empanel_layer * layer, int32_t s, uint64_t call) {
    layer->call_mark[s] = call;
    layer->last_use[s]  = call;
    layer->uses[s]     += layer->uses[s] < UINT32_MAX;
}

// one micro-batch done: the decay clock ticks (the layer's own, not its statistics)
static void end_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n_waves) {
    layer->stats.n_remaps++;
    layer->stats.n_waves += (uint64_t) n_waves;
    layer->n_batches++;
    if (pool->policy == EMPANEL_POLICY_LFU_DECAY && layer->n_batches % (uint64_t) layer->n_slots == 0) {
        for (int32_t s = 0; s < layer->n_slots; s++) {
            layer->uses[s] /= 2;
        }
    }
}

static int trace_call(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                      int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const uint64_t need = pool->trace_len + 3 + (uint64_t) n_tokens * n_used;
    if (need > pool->trace_cap) {
        uint64_t cap = pool->trace_cap ? pool->trace_cap : 1 << 16;
        while (cap < need) {
            cap *= 2;
        }
        int32_t * grown = realloc(pool->trace, sizeof(int32_t) * cap);
        if (grown == NULL) {
            empanel_set_error(pool, "trace: out of memory for %llu entries", (unsigned long long) cap);
            return -1;
        }
        pool->trace     = grown;
        pool->trace_cap = cap;
    }
    int32_t * out = pool->trace + pool->trace_len;
    *out++ = il;
    *out++ = n_tokens;
    *out++ = n_used;
    for (int32_t t = 0; t < n_tokens; t++) {
        memcpy(out, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
        out += n_used;
    }
    pool->trace_len = need;
    return 0;
}

// read experts layer->misses[0, n) into the claimed, empty slots layer->victims[0, n) and make
// them resident; if a read fails the slots stay empty (g-lru: their bytes leave the budget)
static int fill_slots(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    if (empanel_read_experts(pool, layer, layer->misses, layer->victims, n) != 0) {
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            pool->resident_bytes -= (uint64_t) n * layer->expert_bytes;
        }
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        layer->expert_in[layer->victims[i]] = layer->misses[i];
        layer->slot_of[layer->misses[i]]    = layer->victims[i];
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            lru_push_recent(pool, layer->lru_base + layer->victims[i]);
        }
    }
    return 0;
}

// the layer, or NULL with the error recorded
static struct empanel_layer * remap_layer(struct empanel_pool * pool, int32_t il) {
    if (atomic_load(&pool->failed)) {
        return NULL;
    }
    if (il < 0 || il >= pool->n_layer || (pool->layers[il].n_slots == 0 && !pool->layers[il].observe)) {
        empanel_set_error(pool, "remap: layer %d has no slot pool", il);
        return NULL;
    }
    return &pool->layers[il];
}

// the distinct experts of a micro-batch in order of first use, into layer->distinct; their
// number, or -1 if an id is out of range
static int32_t collect_distinct(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call,
                                const int32_t * expert_ids, int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    int32_t n = 0;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e < 0 || e >= pool->n_expert) {
                empanel_set_error(pool, "remap: layer %d routed to expert %d of %d", il, e, pool->n_expert);
                return -1;
            }
            if (layer->miss_mark[e] != call) {
                layer->miss_mark[e] = call;
                layer->distinct[n++] = e;
            }
        }
    }
    layer->stats.n_ids += (uint64_t) n_tokens * (uint64_t) n_used;
    return n;
}

// a hit: the expert stays where it is, and is used now
static void use_hit(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call) {
    note_use(layer, s, call);
    layer->stats.hits++;
    if (pool->policy == EMPANEL_POLICY_GLRU) {
        lru_unlink(pool, layer->lru_base + s);
        lru_push_recent(pool, layer->lru_base + s);
    }
}

// claim slot s for an expert that comes: its expert leaves (g-lru: an empty slot takes room in
// the budget from the least recent expert of any layer)
static void claim_slot(struct empanel_pool * pool, struct empanel_layer * layer, int32_t s, uint64_t call) {
    if (layer->expert_in[s] >= 0) {
        // the layer's own expert goes (its bytes stay counted for the one that comes)
        layer->slot_of[layer->expert_in[s]] = -1;
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            lru_unlink(pool, layer->lru_base + s);
        }
    } else if (pool->policy == EMPANEL_POLICY_GLRU) {
        glru_make_room(pool, layer->expert_bytes, call);
        pool->resident_bytes += layer->expert_bytes;
    }
    layer->expert_in[s] = -1;
    layer->uses[s]      = 0;
    note_use(layer, s, call);
}

// the n distinct experts fit the pool: hits keep their slots, misses take the slots the policy
// gives up (none that this micro-batch uses) and are read, every tensor at once
// the n distinct experts: hits are used where they are, misses listed in layer->misses (the
// files checked before they are read); the number of misses, or -1
static int32_t split_hits(struct empanel_pool * pool, struct empanel_layer * layer, uint64_t call, int32_t n) {
    int32_t n_miss = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = layer->distinct[i];
        if (layer->slot_of[e] >= 0) {
            use_hit(pool, layer, layer->slot_of[e], call);
        } else {
            layer->misses[n_miss++] = e;
        }
    }
    return n_miss > 0 && empanel_files_check(pool) != 0 ? -1 : n_miss;
}

static int resolve_one_wave(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call, int32_t n) {
    const int32_t n_miss = split_hits(pool, layer, call, n);
    if (n_miss < 0) {
        return -1;
    }
    // victims first: every slot is empty until all misses are read (a failed read leaves no
    // slot claiming an expert it does not hold)
    for (int32_t i = 0; i < n_miss; i++) {
        const int32_t s = pick_victim(layer, pool->policy, 0, layer->n_slots, layer->call_mark, call);
        if (s < 0) {
            empanel_set_error(pool,
                "remap: layer %d: this micro-batch routes to more distinct experts than the %d slots "
                "(lower n_ubatch, or raise moe_slots)", il, layer->n_slots);
            return -1;
        }
        claim_slot(pool, layer, s, call);
        layer->victims[i] = s;
    }
    if (n_miss > 0 && fill_slots(pool, layer, n_miss) != 0) {
        return -1;
    }
    layer->stats.misses += (uint64_t) n_miss;
    return 0;
}

static int compare_int32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a;
    const int32_t y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

static int compare_uint64(const void * a, const void * b) {
    const uint64_t x = *(const uint64_t *) a;
    const uint64_t y = *(const uint64_t *) b;
    return (x > y) - (x < y);
}

// the n distinct experts exceed the pool: plan waves of at most half a pool each, alternating
// halves, so that one half is read while the other computes. Hits go in the first wave of their
// half (no read); the misses follow by their last use in the micro-batch, so the last two waves,
// which stay resident, hold the experts of its last tokens (decoding goes on from there), and
// each wave is read in file order (expert ids ascending). The tables are left as they will be
// after the last wave; the reads happen wave by wave (remap_wave_locked).
static int plan_waves(struct empanel_pool * pool, struct empanel_layer * layer, int32_t il, uint64_t call,
                      int32_t n, int32_t graph_waves, const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t n_used, int32_t n_tokens) {
    const int32_t n_slots = layer->n_slots;
    const int32_t n_half  = n_slots >= 2 ? 2 : 1;
    const int32_t split   = n_half == 2 ? llama_empanel_wave_experts(n_slots) : n_slots;
    const int32_t half_begin[2] = { 0, split };
    const int32_t half_end[2]   = { split, n_slots };

    for (int32_t i = 0; i < n; i++) {
        layer->plan_wave[layer->distinct[i]] = -1;
    }
    const int32_t n_miss = split_hits(pool, layer, call, n);
    if (n_miss < 0) {
        return -1;
    }
    // last use of every expert: the token index (victims is free scratch here)
    int32_t * last_use = layer->victims;
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            last_use[row[j]] = t;
        }
    }
    for (int32_t i = 0; i < n_miss; i++) {
        const int32_t e = layer->misses[i];
        layer->order_key[i] = (uint64_t) last_use[e] * (uint64_t) pool->n_expert + (uint64_t) e;
    }
    qsort(layer->order_key, (size_t) n_miss, sizeof(uint64_t), compare_uint64);
    for (int32_t i = 0; i < n_miss; i++) {
        layer->misses[i] = (int32_t) (layer->order_key[i] % (uint64_t) pool->n_expert);
    }
    layer->stats.misses += (uint64_t) n_miss;

    int32_t n_order = 0; // experts placed
    int32_t next    = 0; // next miss to place
    int32_t w       = 0;
    for (; next < n_miss || w < n_half; w++) {
        if (w >= graph_waves) {
            empanel_set_error(pool, "remap: layer %d: %d distinct experts need more than the graph's %d waves",
                              il, n, graph_waves);
            return -1;
        }
        const int32_t  h     = w % n_half;
        const uint64_t stamp = ++layer->wave_stamp;
        layer->plan_begin[w] = n_order;
        int32_t count = 0;
        for (int32_t i = 0; w < n_half && i < n; i++) {
            const int32_t e = layer->distinct[i];
            const int32_t s = layer->slot_of[e];
            if (layer->plan_wave[e] < 0 && s >= half_begin[h] && s < half_end[h]) {
                layer->plan_wave[e] = w;   // a hit of this half
                layer->plan_slot[e] = s;
                layer->wave_mark[s] = stamp;
                layer->plan_order[n_order++] = e;
                count++;
            }
        }
        for (; count < half_end[h] - half_begin[h] && next < n_miss; count++) {
            const int32_t s = pick_victim(layer, pool->policy, half_begin[h], half_end[h], layer->wave_mark, stamp);
            const int32_t e = layer->misses[next++];
            claim_slot(pool, layer, s, call);
            layer->expert_in[s] = e;
            layer->slot_of[e]   = s;
            if (pool->policy == EMPANEL_POLICY_GLRU) {
                lru_push_recent(pool, layer->lru_base + s);
            }
            layer->plan_wave[e] = w;
            layer->plan_slot[e] = s;
            layer->wave_mark[s] = stamp;
            layer->plan_order[n_order++] = e;
        }
        // read in file order
        qsort(layer->plan_order + layer->plan_begin[w], (size_t) (n_order - layer->plan_begin[w]),
              sizeof(int32_t), compare_int32);
    }
    layer->plan_begin[w] = n_order;
    layer->plan_waves    = w;
    return 0;
}

// a plan that did not run to its end (a failure, an aborted graph): slots whose tensors do not
// all hold the expert the tables say are emptied
static void reconcile(struct empanel_pool * pool, struct empanel_layer * layer) {
    for (int32_t s = 0; s < layer->n_slots; s++) {
        const int32_t e = layer->expert_in[s];
        int held = e >= 0;
        for (int32_t i = 0; held && i < layer->n_tensors; i++) {
            held = layer->tensors[i].held[s] == e;
        }
        if (e < 0 || held) {
            continue;
        }
        layer->slot_of[e]   = -1;
        layer->expert_in[s] = -1;
        layer->uses[s]      = 0;
        layer->last_use[s]  = 0;
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            lru_unlink(pool, layer->lru_base + s);
            pool->resident_bytes -= layer->expert_bytes;
            release_slot(layer, s); // the budget no longer counts it: neither does memory
        }
    }
    layer->plan_open = 0;
}

// pool == NULL: the micro-batch fits the pools; one remap for all the layer's tensors
static int32_t remap_locked(struct empanel_pool * pool, int32_t il, const int32_t * expert_ids,
                            int64_t ids_row_stride, int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_layer * layer = remap_layer(pool, il);
    if (layer == NULL || empanel_read_finish(pool) != 0) {
        return -1;
    }
    const uint64_t call = ++pool->call;
    if (pool->tracing && trace_call(pool, il, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
        return -1;
    }
    if (layer->observe) {
        for (int32_t t = 0; t < n_tokens; t++) {
            memcpy(slot_ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
        }
        layer->stats.n_remaps++;
        layer->stats.n_ids += (uint64_t) n_tokens * (uint64_t) n_used;
        return 0;
    }
    if (layer->plan_open) {
        reconcile(pool, layer);
    }
    const int32_t n = collect_distinct(pool, layer, il, call, expert_ids, ids_row_stride, n_used, n_tokens);
    if (n < 0 || resolve_one_wave(pool, layer, il, call, n) != 0) {
        return -1;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            slot_ids[(int64_t) t * n_used + j] = layer->slot_of[row[j]];
        }
    }
    end_batch(pool, layer, 1);
    return 0;
}

// the calls of a plan carry the micro-batch's expert ids: the same ids as the open plan's
static int same_ids(const struct empanel_layer * layer, const int32_t * expert_ids, int64_t ids_row_stride,
                    int32_t n_used, int32_t n_tokens) {
    if (layer->plan_n_ids != (int64_t) n_tokens * n_used) {
        return 0;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        if (memcmp(layer->plan_ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride,
                   sizeof(int32_t) * n_used) != 0) {
            return 0;
        }
    }
    return 1;
}

static int keep_ids(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                    int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    const int64_t n_ids = (int64_t) n_tokens * n_used;
    if (n_ids > layer->plan_ids_cap) {
        int32_t * grown = realloc(layer->plan_ids, sizeof(int32_t) * (size_t) n_ids);
        if (grown == NULL) {
            empanel_set_error(pool, "remap: out of memory for %lld expert ids", (long long) n_ids);
            return -1;
        }
        layer->plan_ids     = grown;
        layer->plan_ids_cap = n_ids;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        memcpy(layer->plan_ids + (int64_t) t * n_used, expert_ids + (int64_t) t * ids_row_stride, sizeof(int32_t) * n_used);
    }
    layer->plan_n_ids = n_ids;
    return 0;
}

// the experts of wave w that tensor ti's slots do not hold yet, into layer->misses / victims
static int32_t wave_missing(struct empanel_layer * layer, int32_t ti, int32_t w) {
    if (w >= layer->plan_waves) {
        return 0;
    }
    const int32_t * held = layer->tensors[ti].held;
    int32_t n = 0;
    for (int32_t k = layer->plan_begin[w]; k < layer->plan_begin[w + 1]; k++) {
        const int32_t e = layer->plan_order[k];
        const int32_t s = layer->plan_slot[e];
        if (held[s] != e) {
            layer->misses[n]  = e;
            layer->victims[n] = s;
            n++;
        }
    }
    return n;
}

// one wave of one pool tensor: plan the micro-batch at its layer's first call, make the wave's
// experts resident in this tensor, give their pairs slot ids (others -1), and start reading what
// comes next while this wave computes
static int32_t remap_wave_locked(struct empanel_pool * pool, int32_t il, const void * pool_tensor, int32_t wave,
                                 int32_t n_waves, const int32_t * expert_ids, int64_t ids_row_stride,
                                 int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_layer * layer = remap_layer(pool, il);
    if (layer == NULL || empanel_read_finish(pool) != 0) {
        return -1;
    }
    int32_t ti = 0;
    while (ti < layer->n_tensors && layer->tensors[ti].pool != pool_tensor) {
        ti++;
    }
    if (ti == layer->n_tensors || layer->observe) {
        empanel_set_error(pool, "remap: layer %d has no pool tensor %p", il, pool_tensor);
        return -1;
    }

    const int continues = layer->plan_open && layer->plan_graph_waves == n_waves && layer->plan_next[ti] == wave &&
                          same_ids(layer, expert_ids, ids_row_stride, n_used, n_tokens);
    if (!continues) {
        if (wave != 0) {
            empanel_set_error(pool, "remap: layer %d, %s: wave %d of %d out of order", il,
                              layer->tensors[ti].name, wave, n_waves);
            return -1;
        }
        if (layer->plan_open) {
            reconcile(pool, layer);
        }
        const uint64_t call = ++pool->call;
        if (pool->tracing && trace_call(pool, il, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
        if (keep_ids(pool, layer, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
        const int32_t n = collect_distinct(pool, layer, il, call, expert_ids, ids_row_stride, n_used, n_tokens);
        if (n < 0) {
            return -1;
        }
        layer->plan_open        = 1; // from here on the tables describe the plan's end
        layer->plan_graph_waves = n_waves;
        for (int32_t i = 0; i < EMPANEL_MAX_TENSORS; i++) {
            layer->plan_next[i] = 0;
        }
        if (n <= layer->n_slots) {
            // it fits: one wave, read for every tensor at once
            if (resolve_one_wave(pool, layer, il, call, n) != 0) {
                return -1;
            }
            for (int32_t i = 0; i < n; i++) {
                const int32_t e = layer->distinct[i];
                layer->plan_wave[e]  = 0;
                layer->plan_slot[e]  = layer->slot_of[e];
                layer->plan_order[i] = e;
            }
            layer->plan_begin[0] = 0;
            layer->plan_begin[1] = n;
            layer->plan_waves    = 1;
        } else if (plan_waves(pool, layer, il, call, n, n_waves, expert_ids, ids_row_stride, n_used, n_tokens) != 0) {
            return -1;
        }
        end_batch(pool, layer, layer->plan_waves);
    }

    // this wave's experts in this tensor's slots (normally read while the previous wave computed)
    const int32_t n_missing = wave_missing(layer, ti, wave);
    if (n_missing > 0 && (empanel_read_post(pool, layer, ti, layer->misses, layer->victims, n_missing) != 0 ||
                          empanel_read_finish(pool) != 0)) {
        return -1;
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            slot_ids[(int64_t) t * n_used + j] = layer->plan_wave[e] == wave ? layer->plan_slot[e] : -1;
        }
    }
    layer->plan_next[ti] = wave + 1;

    // read ahead: this tensor's next wave goes to the other half of its pool (free: the wave
    // before this one has computed), unless reads land in slots that this wave's masked kernel
    // reads; after its last wave, the first wave of a tensor that has not started (its pool is
    // idle)
    int32_t next_tensor = -1;
    int32_t next_wave   = 0;
    if (wave + 1 < layer->plan_waves) {
        if (layer->n_slots >= 2 && !(layer->tensors[ti].masked && layer->tensors[ti].direct)) {
            next_tensor = ti;
            next_wave   = wave + 1;
        }
    } else {
        for (int32_t i = 0; i < layer->n_tensors && next_tensor < 0; i++) {
            next_tensor = layer->plan_next[i] == 0 ? i : -1;
        }
    }
    if (next_tensor >= 0) {
        const int32_t n_ahead = wave_missing(layer, next_tensor, next_wave);
        if (n_ahead > 0 && empanel_read_post(pool, layer, next_tensor, layer->misses, layer->victims, n_ahead) != 0) {
            return -1;
        }
    }

    int open = 0;
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        open |= layer->plan_next[i] < layer->plan_graph_waves;
    }
    layer->plan_open = open;
    return 0;
}

// up to max_fill of one layer's empty slots, filled with the experts it lacks (lowest ids
// first); the experts read
static int32_t preload_layer(struct empanel_pool * pool, struct empanel_layer * layer, int32_t max_fill) {
    const uint64_t call = ++pool->call; // resident, least recent: the first victims of use
    int32_t n = 0;
    int32_t e = 0;
    for (int32_t s = 0; s < layer->n_slots && n < max_fill; s++) {
        if (layer->expert_in[s] >= 0) {
            continue;
        }
        while (e < pool->n_expert && layer->slot_of[e] >= 0) {
            e++;
        }
        if (e == pool->n_expert) {
            break;
        }
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            if (pool->resident_bytes + layer->expert_bytes > pool->budget_bytes) {
                break; // the budget is full: no eviction for a guess
            }
            pool->resident_bytes += layer->expert_bytes;
        }
        note_use(layer, s, call);
        layer->misses[n]  = e++;
        layer->victims[n] = s;
        n++;
    }
    if (n > 0 && fill_slots(pool, layer, n) != 0) {
        return -1;
    }
    layer->stats.preloaded += (uint64_t) n;
    return n;
}

int64_t empanel_pool_preload(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    int64_t n_read = 0;
    if (atomic_load(&pool->failed) || empanel_read_finish(pool) != 0 || empanel_files_check(pool) != 0) {
        n_read = -1;
    }
    // g-lru: each layer its even share of the budget, not the first layers all of it
    uint64_t per_layer_bytes = 0;
    if (pool->policy == EMPANEL_POLICY_GLRU) {
        int32_t n_paged = 0;
        for (int32_t il = 0; il < pool->n_layer; il++) {
            n_paged += pool->layers[il].n_slots > 0 && !pool->layers[il].observe;
        }
        per_layer_bytes = n_paged > 0 ? pool->budget_bytes / (uint64_t) n_paged : 0;
    }
    for (int32_t il = 0; il < pool->n_layer && n_read >= 0; il++) {
        struct empanel_layer * layer = &pool->layers[il];
        if (layer->n_slots == 0 || layer->observe) {
            continue;
        }
        int32_t max_fill = layer->n_slots;
        if (pool->policy == EMPANEL_POLICY_GLRU) {
            const uint64_t share = per_layer_bytes / layer->expert_bytes;
            max_fill = share < (uint64_t) max_fill ? (int32_t) share : max_fill;
        }
        const int32_t n = preload_layer(pool, layer, max_fill);
        n_read = n < 0 ? -1 : n_read + n;
    }
    pthread_mutex_unlock(&pool->lock);
    return n_read;
}

int32_t empanel_remap(void * user, int32_t il, const void * pool_tensor, int32_t wave, int32_t n_waves,
                      const int32_t * expert_ids, int64_t ids_row_stride,
                      int32_t * slot_ids, int32_t n_used, int32_t n_tokens) {
    struct empanel_pool * pool = user;
    const uint64_t t0 = empanel_now_ns();
    pthread_mutex_lock(&pool->lock);
    const int32_t rc = pool_tensor == NULL
        ? remap_locked(pool, il, expert_ids, ids_row_stride, slot_ids, n_used, n_tokens)
        : remap_wave_locked(pool, il, pool_tensor, wave, n_waves, expert_ids, ids_row_stride, slot_ids, n_used, n_tokens);
    if (rc != 0) {
        empanel_read_finish(pool); // nothing stays in flight after a failure
    }
    if (il >= 0 && il < pool->n_layer) {
        pool->layers[il].stats.remap_ns += empanel_now_ns() - t0;
    }
    pthread_mutex_unlock(&pool->lock);
    return rc;
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

void empanel_pool_clear_error(struct empanel_pool * pool) {
    pthread_mutex_lock(&pool->lock);
    // a batch still in flight (the graph stopped before waiting for it) ends here, its slots
    // holding nothing; plans cut short are closed, so the next micro-batch plans afresh
    empanel_read_finish(pool);
    for (int32_t il = 0; il < pool->n_layer; il++) {
        if (pool->layers[il].plan_open) {
            reconcile(pool, &pool->layers[il]);
        }
    }
    pool->error[0] = '\0';
    atomic_store(&pool->failed, 0);
    pthread_mutex_unlock(&pool->lock);
}

// ------------------------------------------------------------------------------------------------
// stats

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
