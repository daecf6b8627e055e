// The host-RAM tier of device pools (moe_host_cache): experts read for a pool in device memory
// (a GPU's) stay in host memory, and a later miss of one is written to its slot from there
// instead of being read from the drive again.
//
// The tier is one block of host memory, pinned where the pools' device offers a pinned host
// buffer (the staging's kind, backend.c), cut into entries of one expert each: room for the
// O_DIRECT window of every expert tensor of a layer (as staging, so that reads land in place,
// reader.c). It is inclusive: every expert read for a device pool is read into an entry (the
// least recently used one not taken by the same batch), and that entry is what its slot is
// written from, so keeping it costs no copy. An entry's tensors count as held once their batch
// is read; a failed batch leaves them held by no one.
//
// Pools in host memory (CPU, CPU_REPACK) and pools on RPC hosts (their own cache, rpc.c) have no
// tier: their layers' experts never enter it.

#include "host_cache.h"
#include "backend.h"
#include "util.h"
#include "state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tiered(const struct empanel_tensor * t) {
    return t->pool != NULL && t->host == NULL && t->remote == NULL;
}

int empanel_host_cache_init(struct empanel_pool * pool, uint64_t bytes, char * err, size_t err_size) {
    struct empanel_host_cache * hc = &pool->host_cache;
    void * owner = NULL;
    hc->entry_bytes = 0;
    for (int32_t il = 0; il < pool->n_layer; il++) {
        const struct empanel_layer * layer = &pool->layers[il];
        uint64_t entry = 0;
        for (int32_t i = 0; i < layer->n_tensors; i++) {
            if (tiered(&layer->tensors[i])) {
                entry += empanel_window_bytes(&layer->tensors[i]);
                owner  = owner != NULL ? owner : layer->tensors[i].pool;
            }
        }
        hc->entry_bytes = entry > hc->entry_bytes ? entry : hc->entry_bytes;
    }
    if (hc->entry_bytes == 0) {
        empanel_util_format_err(err, err_size, "moe_host_cache: no pool is in device memory (the pools are in host "
                                "memory already, or on RPC hosts with their own cache); give the memory to moe_slots instead");
        return -1;
    }
    const uint64_t n = bytes / hc->entry_bytes;
    if (n < 1 || n > INT32_MAX) {
        empanel_util_format_err(err, err_size, "moe_host_cache: %llu bytes hold no expert (one takes %llu bytes)",
                                (unsigned long long) bytes, (unsigned long long) hc->entry_bytes);
        return -1;
    }
    hc->n_entries = (int32_t) n;
    // the block, aligned for O_DIRECT (a pinned buffer's base may not be)
    const uint64_t size = (uint64_t) hc->n_entries * hc->entry_bytes + EMPANEL_ALIGN;
    hc->raw = empanel_backend_host_buffer_alloc(owner, size, &hc->buffer);
    if (hc->raw == NULL) { // the backend could not pin that much: plain host memory, copies a little slower
        hc->buffer = NULL;
        if (posix_memalign((void **) &hc->raw, EMPANEL_ALIGN, size) != 0) {
            hc->raw = NULL;
        }
        fprintf(stderr, "empanel: moe_host_cache: %llu bytes could not be pinned; the tier is in plain host "
                "memory (copies to the device a little slower)\n", (unsigned long long) size);
    }
    hc->layer_of = malloc(sizeof(int32_t) * (size_t) hc->n_entries);
    hc->expert_of = malloc(sizeof(int32_t) * (size_t) hc->n_entries);
    hc->held      = calloc((size_t) hc->n_entries, sizeof(uint8_t));
    hc->batch     = calloc((size_t) hc->n_entries, sizeof(uint64_t));
    hc->prev      = malloc(sizeof(int32_t) * (size_t) hc->n_entries);
    hc->next      = malloc(sizeof(int32_t) * (size_t) hc->n_entries);
    hc->entry_of  = malloc(sizeof(int32_t) * (size_t) pool->n_layer * (size_t) pool->n_expert);
    if (hc->raw == NULL || hc->layer_of == NULL || hc->expert_of == NULL || hc->held == NULL || hc->batch == NULL ||
        hc->prev == NULL || hc->next == NULL || hc->entry_of == NULL) {
        empanel_host_cache_free(pool);
        empanel_util_format_err(err, err_size, "moe_host_cache: cannot allocate %llu bytes of host memory",
                                (unsigned long long) size);
        return -1;
    }
    hc->base = (uint8_t *) (((uintptr_t) hc->raw + EMPANEL_ALIGN - 1) / EMPANEL_ALIGN * EMPANEL_ALIGN);
    for (int32_t e = 0; e < hc->n_entries; e++) { // the recency list: 0 .. n_entries - 1
        hc->layer_of[e]  = -1;
        hc->expert_of[e] = -1;
        hc->prev[e]      = e - 1;
        hc->next[e]      = e + 1 < hc->n_entries ? e + 1 : -1;
    }
    hc->lru_head = 0;
    hc->lru_tail = hc->n_entries - 1;
    for (int64_t i = 0; i < (int64_t) pool->n_layer * pool->n_expert; i++) {
        hc->entry_of[i] = -1;
    }
    return 0;
}

void empanel_host_cache_free(struct empanel_pool * pool) {
    struct empanel_host_cache * hc = &pool->host_cache;
    if (hc->buffer != NULL) {
        empanel_backend_host_buffer_free(hc->buffer);
    } else {
        free(hc->raw);
    }
    free(hc->layer_of);
    free(hc->expert_of);
    free(hc->held);
    free(hc->batch);
    free(hc->prev);
    free(hc->next);
    free(hc->entry_of);
    memset(hc, 0, sizeof(*hc));
}

// entry e to the recent end of the list
static void touch(struct empanel_host_cache * hc, int32_t e) {
    if (hc->lru_tail == e) {
        return;
    }
    if (hc->prev[e] >= 0) { hc->next[hc->prev[e]] = hc->next[e]; } else { hc->lru_head = hc->next[e]; }
    hc->prev[hc->next[e]] = hc->prev[e]; // e is not the tail: it has a next
    hc->prev[e] = hc->lru_tail;
    hc->next[e] = -1;
    hc->next[hc->lru_tail] = e;
    hc->lru_tail = e;
}

// where tensor ti of an entry's expert sits: its window's room, the payload at its phase
static uint8_t * entry_tensor(const struct empanel_host_cache * hc, const struct empanel_layer * layer,
                              int32_t e, int32_t ti, int32_t expert) {
    uint64_t at = (uint64_t) e * hc->entry_bytes;
    for (int32_t i = 0; i < ti; i++) {
        at += tiered(&layer->tensors[i]) ? empanel_window_bytes(&layer->tensors[i]) : 0;
    }
    return empanel_window_payload(hc->base + at, &layer->tensors[ti], expert);
}

uint8_t * empanel_host_cache_get(struct empanel_pool * pool, struct empanel_layer * layer, int32_t ti,
                                 int32_t expert, uint64_t batch, int * hit) {
    struct empanel_host_cache * hc = &pool->host_cache;
    *hit = 0;
    if (hc->n_entries == 0 || !tiered(&layer->tensors[ti])) {
        return NULL;
    }
    const int32_t il = (int32_t) (layer - pool->layers);
    int32_t * slot = &hc->entry_of[(int64_t) il * pool->n_expert + expert];
    int32_t e = *slot;
    if (e < 0) {
        // the least recently used entry; the batch's own are the most recent
        e = hc->lru_head;
        if (hc->batch[e] == batch) {
            return NULL; // every entry is this batch's: the expert goes through staging
        }
        if (hc->expert_of[e] >= 0) {
            hc->entry_of[(int64_t) hc->layer_of[e] * pool->n_expert + hc->expert_of[e]] = -1;
        }
        hc->layer_of[e]  = il;
        hc->expert_of[e] = expert;
        hc->held[e]      = 0;
        *slot            = e;
    }
    hc->batch[e] = batch;
    touch(hc, e);
    *hit = (hc->held[e] >> ti) & 1;
    return entry_tensor(hc, layer, e, ti, expert);
}

void empanel_host_cache_landed(struct empanel_pool * pool, const struct empanel_layer * layer, int32_t ti,
                               int32_t expert, int ok) {
    struct empanel_host_cache * hc = &pool->host_cache;
    const int32_t il = (int32_t) (layer - pool->layers);
    const int32_t e  = hc->n_entries > 0 ? hc->entry_of[(int64_t) il * pool->n_expert + expert] : -1;
    if (e >= 0) {
        hc->held[e] = ok ? (uint8_t) (hc->held[e] | (1u << ti)) : (uint8_t) (hc->held[e] & ~(1u << ti));
    }
}

void empanel_host_cache_batch_landed(struct empanel_pool * pool, const struct empanel_batch * batch, int ok) {
    for (int32_t j = 0; j < batch->n_jobs; j++) {
        const struct empanel_read_job * job = &batch->jobs[j];
        if (job->tier == 1) {
            const struct empanel_layer * layer = batch->layer;
            empanel_host_cache_landed(pool, layer, (int32_t) (job->tensor - layer->tensors), job->expert, ok);
        }
    }
}
