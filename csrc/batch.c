// Batches of expert reads: a remap's misses (or a wave's, a read-ahead's, a preload's) planned
// as jobs (expert x tensor) cut into chunks, posted to the reader threads (reader.c), waited for
// and accounted for. A batch may stay in flight while the graph computes (the next wave's
// experts, a layer's overlapped reads, a read-ahead): empanel_batch_post* starts it,
// empanel_batch_finish_lane waits for it. Each lane holds one batch at most (enum empanel_lane):
// the demand lane a remap's reads, the read-ahead lane a guess's. Both are in flight at once only
// where empanel_batch_beside allows it (plain host pools that nothing else evicts from):
// there the reader takes the demand lane's chunks first, and a layer's reads never wait for a
// read-ahead to close, nor a read-ahead for the layer computing now.

#include "batch.h"
#include "backend.h"
#include "chunk.h"
#include "files.h"
#include "host_cache.h"
#include "reader.h"
#include "remote.h"
#include "slots.h"
#include "util.h"
#include "state.h"

#include <stdlib.h>
#include <string.h>

void empanel_batch_staging_free(struct empanel_pool * pool) {
    struct empanel_staging * st = &pool->lanes.staging;
    if (st->data != NULL) {
        if (st->buffer != NULL) {
            empanel_backend_host_buffer_free(st->buffer);
        } else {
            free(st->data);
        }
    }
    st->data   = NULL;
    st->buffer = NULL;
    st->size   = 0;
}

static int reserve(struct empanel_pool * pool, struct empanel_batch * batch, int32_t n_jobs, int32_t n_chunks,
                   uint64_t staging) {
    if (n_jobs > batch->jobs_cap) {
        void * p = realloc(batch->jobs, sizeof(*batch->jobs) * n_jobs);
        if (p == NULL) { return -1; }
        batch->jobs     = p;
        batch->jobs_cap = n_jobs;
    }
    if (n_chunks > batch->chunks_cap) {
        void * p = realloc(batch->chunks, sizeof(*batch->chunks) * n_chunks);
        if (p == NULL) { return -1; }
        batch->chunks     = p;
        batch->chunks_cap = n_chunks;
    }
    struct empanel_staging * st = &pool->lanes.staging;
    if (staging > st->size) {
        empanel_batch_staging_free(pool);
        st->data = st->owner ? empanel_backend_host_buffer_alloc(st->owner, staging, &st->buffer) : malloc(staging);
        st->size = st->data ? staging : 0;
        if (st->data == NULL) { return -1; }
    }
    return 0;
}

// cut [from, to) of job j's window into chunks of at most chunk_bytes; returns the number written
static int32_t cut_chunks(const struct empanel_reader * reader, const struct empanel_read_job * job, int32_t j,
                          uint64_t from, uint64_t to, int32_t in_place, struct empanel_chunk * out,
                          uint64_t * io_bytes, uint64_t * bounce_bytes) {
    const uint64_t begin = empanel_expert_begin(job->tensor, job->expert); // payload in the file
    const uint64_t end   = begin + job->tensor->expert_size;
    int32_t n = 0;
    for (uint64_t at = from; at < to; at += reader->chunk_bytes) {
        const uint64_t stop  = at + reader->chunk_bytes < to ? at + reader->chunk_bytes : to;
        const uint64_t p0    = at > begin ? at : begin;   // payload in this chunk: [p0, p1)
        const uint64_t p1    = stop < end ? stop : end;
        struct empanel_chunk * c = &out[n++];
        c->job        = j;
        c->file       = job->tensor->file;
        c->offset     = at;
        c->length     = stop - at;
        c->skip       = p0 - at;
        c->payload    = p1 - p0;
        c->dst_offset = p0 - begin;
        c->in_place   = in_place;
        *io_bytes    += reader->direct ? c->length : c->payload;
        *bounce_bytes += reader->direct && !in_place ? c->payload : 0;
    }
    return n;
}

// cut job j's file range into chunks (the header says which land in place); returns the number
// written to out
static int32_t plan_chunks(const struct empanel_reader * reader, struct empanel_read_job * job, int32_t j,
                           int staged, struct empanel_chunk * out, uint64_t * io_bytes, uint64_t * bounce_bytes) {
    const uint64_t begin = empanel_expert_begin(job->tensor, job->expert);
    const uint64_t end   = begin + job->tensor->expert_size;
    int32_t n = 0;
    if (!reader->direct) {
        n = cut_chunks(reader, job, j, begin, end, 0, out, io_bytes, bounce_bytes);
    } else {
        const uint64_t first = empanel_align_down(begin);
        const uint64_t last  = empanel_align_up(end);
        // [lo, hi): in place. Staging has room for the whole window; a slot only for the blocks
        // that hold nothing but its own payload
        const uint64_t lo    = staged ? first : empanel_align_up(begin);
        const uint64_t hi    = staged ? last  : empanel_align_down(end);
        const int      phase = ((uint64_t) (uintptr_t) job->dst - begin) % EMPANEL_ALIGN == 0;
        if (phase && lo < hi && !reader->bounce_all) {
            n += cut_chunks(reader, job, j, first, lo,   0, out + n, io_bytes, bounce_bytes);
            n += cut_chunks(reader, job, j, lo,    hi,   1, out + n, io_bytes, bounce_bytes);
            n += cut_chunks(reader, job, j, hi,    last, 0, out + n, io_bytes, bounce_bytes);
        } else {
            n = cut_chunks(reader, job, j, first, last, 0, out, io_bytes, bounce_bytes);
        }
    }
    atomic_store(&job->chunks_left, n);
    job->verify_ns = 0;
    job->repack_ns = 0;
    job->repack_own = 0;
    return n;
}

static int32_t chunks_per_job(const struct empanel_reader * reader, uint64_t size) {
    return (int32_t) ((size + 2*EMPANEL_ALIGN) / reader->chunk_bytes + 4);
}

uint64_t empanel_batch_staged_bytes(const struct empanel_tensor * t) {
    return t->direct ? 0 : empanel_window_bytes(t);
}

// bytes of staging one expert of tensors [t0, t1) takes (those whose pools take no direct reads),
// and the most chunks it is cut into
static void expert_needs(const struct empanel_reader * reader, const struct empanel_layer * layer,
                         int32_t t0, int32_t t1, uint64_t * staged, int32_t * max_chunks) {
    *staged     = 0;
    *max_chunks = 0;
    for (int32_t i = t0; i < t1; i++) {
        const struct empanel_tensor * t = &layer->tensors[i];
        *staged     += empanel_batch_staged_bytes(t);
        *max_chunks += chunks_per_job(reader, t->expert_size);
    }
}

// the totals of a batch being planned
struct batch_plan {
    uint8_t * staging;    // aligned start of the pool's staging
    uint64_t  stamp;      // the batch's stamp (host tier)
    int32_t   n_jobs;
    int32_t   n_chunks;
    uint64_t  staged;     // bytes of staging taken, a multiple of EMPANEL_ALIGN
    uint64_t  io_bytes;
    uint64_t  bounced;
    uint64_t  payload;
    int32_t   n_landing[EMPANEL_MAX_TENSORS]; // tensor i's jobs that land through the readers
    int32_t   chunk_end[EMPANEL_MAX_TENSORS]; // chunks up to tensor i's last
};

// the read of expert -> slot of tensor i into the plan: a job and its chunks (none if an RPC
// host's cache wrote its bytes already, by_hash, or the host tier has them)
static void plan_job(struct empanel_pool * pool, struct empanel_batch * batch, struct empanel_layer * layer, int32_t i,
                     int32_t expert, int32_t slot, int by_hash, struct batch_plan * bp) {
    struct empanel_tensor * t = &layer->tensors[i];
    if (by_hash) {
        t->held[slot] = expert; // in place, nothing to read
        return;
    }
    struct empanel_read_job * job = &batch->jobs[bp->n_jobs];
    job->tensor  = t;
    job->expert  = expert;
    job->slot    = slot;
    job->dst     = empanel_backend_slot_data(t->pool, slot);
    job->convert = 0;
    job->remote_hash = 0;
    job->landed  = 0;
    atomic_store(&job->dropped, 0);
    atomic_store(&job->skipped, 0);
    const int to_staging = !t->direct || job->dst == NULL;
    int tier_hit = 0;
    uint8_t * tier = empanel_host_cache_get(pool, layer, i, expert, bp->stamp, &tier_hit);
    job->tier = tier == NULL ? 0 : tier_hit ? 2 : 1;
    if (tier != NULL) { // device pools with a host tier: read into the entry, written from it
        job->dst     = tier;
        job->convert = 2;
    } else if (to_staging) { // the window's room, the payload at its phase in the file
        job->dst     = empanel_window_payload(bp->staging + bp->staged, t, expert);
        job->convert = t->host != NULL ? 1 : 2;
        bp->staged  += empanel_window_bytes(t);
    }
    t->held[slot] = -1; // being written
    if (job->tier == 2) { // written from the tier at the finish, nothing to read
        atomic_store(&job->chunks_left, 0);
        job->verify_ns = 0;
        job->repack_ns = 0;
        job->repack_own = 0;
        job->landed    = 1;
        bp->n_jobs++;
        return;
    }
    bp->n_chunks += plan_chunks(&pool->reader, job, bp->n_jobs, to_staging || tier != NULL,
                                batch->chunks + bp->n_chunks, &bp->io_bytes, &bp->bounced);
    bp->payload  += t->expert_size;
    bp->n_jobs++;
    bp->n_landing[i]++;
    bp->chunk_end[i] = bp->n_chunks;
}

int empanel_batch_beside(const struct empanel_pool * pool, const struct empanel_layer * layer) {
    if (pool->config.policy == EMPANEL_POLICY_GLRU || !pool->reader.beside) {
        return 0; // (another layer's remap may evict the slots being read into)
    }
    for (int32_t i = 0; i < layer->n_tensors; i++) {
        const struct empanel_tensor * t = &layer->tensors[i];
        if (!t->direct || t->remote != NULL || t->pool == NULL) {
            return 0;
        }
    }
    return 1;
}

int empanel_batch_can_post(const struct empanel_pool * pool, int32_t lane, const struct empanel_layer * layer) {
    const struct empanel_batch * other = &pool->lanes.batch[1 - lane];
    return !pool->lanes.batch[lane].inflight &&
           (!other->inflight || (other->beside && other->layer != layer && empanel_batch_beside(pool, layer)));
}

// RPC pools: which of the n experts of tensors [t0, t1) the hosts' caches wrote into their slots,
// asked all at once (one round trip per host, not one per expert tensor): [(i - t0) * n + m], or
// NULL where no tensor's pool is on a host (or out of memory: then every expert is read and sent)
static uint8_t * remote_by_hash(struct empanel_layer * layer, int32_t t0, int32_t t1, const int32_t * experts,
                                const int32_t * slots, int32_t n) {
    int remote = 0;
    for (int32_t i = t0; i < t1; i++) {
        remote |= layer->tensors[i].remote != NULL;
    }
    uint8_t * written = remote ? malloc((size_t) (t1 - t0) * (size_t) n) : NULL;
    if (written != NULL) {
        empanel_remote_by_hash(layer, t0, t1, experts, slots, n, written);
    }
    return written;
}

// plan and post the reads of experts[i] -> slots[i] for tensors [t0, t1) of a layer, tensor by
// tensor (order: their indices in the order to read them, each waited for on its own with
// empanel_batch_wait_tensor; NULL: in index order) in the demand lane, or (by_expert) expert after
// expert in the read-ahead lane; nothing may be in flight in that lane, nor in the other one
// unless the read-ahead may go beside it. Their slots hold nothing until
// empanel_batch_finish_lane succeeds. known: what the hosts' caches already wrote
// ([(i - t0) * known_stride + m], remote_by_hash), NULL: ask them here.
static int post_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t t0, int32_t t1,
                      const int32_t * experts, const int32_t * slots, int32_t n, const int32_t * order,
                      int by_expert, const uint8_t * known, int32_t known_stride) {
    const int32_t lane = by_expert ? EMPANEL_LANE_AHEAD : EMPANEL_LANE_DEMAND;
    struct empanel_batch * batch = &pool->lanes.batch[lane];
    if (!empanel_batch_can_post(pool, lane, layer)) {
        empanel_util_set_error(pool, "empanel: reads of layer %d posted while others are in flight",
                               (int) (layer - pool->layers));
        return -1;
    }
    for (int32_t i = t0; i < t1; i++) {
        if (layer->tensors[i].pool == NULL) {
            empanel_util_set_error(pool, "%s: no slot pool bound", layer->tensors[i].name);
            return -1;
        }
    }
    uint64_t staged_per_expert;
    int32_t  max_chunks_per_expert;
    expert_needs(&pool->reader, layer, t0, t1, &staged_per_expert, &max_chunks_per_expert);
    // (staging: plus a block to align its start)
    if (reserve(pool, batch, n * (t1 - t0), n * max_chunks_per_expert,
                staged_per_expert * (uint64_t) n + EMPANEL_ALIGN) != 0) {
        empanel_util_set_error(pool, "empanel: out of memory for reading %d experts", n);
        return -1;
    }

    struct batch_plan bp = {
        .staging = (uint8_t *) (uintptr_t) empanel_align_up((uint64_t) (uintptr_t) pool->lanes.staging.data),
        .stamp   = ++pool->lanes.n_batches,
    };
    const int32_t n_t = t1 - t0;
    uint8_t * asked = known == NULL ? remote_by_hash(layer, t0, t1, experts, slots, n) : NULL; // [n_t * n] or NULL
    const uint8_t * by_hash = known != NULL ? known : asked;
    const int32_t   stride  = known != NULL ? known_stride : n;
    for (int32_t q = 0; q < n_t * n; q++) { // tensor after tensor, or (by_expert) expert after expert
        const int32_t k = by_expert ? q % n_t : q / n;
        const int32_t m = by_expert ? q / n_t : q % n;
        const int32_t i = order != NULL ? order[k] : t0 + k;
        bp.chunk_end[i] = bp.n_chunks; // (tensor after tensor: up to its last chunk)
        plan_job(pool, batch, layer, i, experts[m], slots[m], by_hash != NULL && by_hash[(i - t0) * stride + m], &bp);
    }
    free(asked);
    batch->inflight     = 1;
    batch->beside       = empanel_batch_beside(pool, layer);
    batch->dropped      = 0;
    batch->ahead        = by_expert && pool->reader.drop_ahead;
    batch->layer        = layer;
    batch->n_jobs       = bp.n_jobs;
    batch->n_chunks     = bp.n_chunks;
    batch->payload      = bp.payload;
    batch->io_bytes     = bp.io_bytes;
    batch->bounce_bytes = bp.bounced;
    batch->t0           = empanel_util_now_ns();
    empanel_reader_post(pool, lane, batch->jobs, batch->chunks, bp.n_chunks, layer, order != NULL, bp.n_landing,
                        bp.chunk_end);
    return 0;
}

int empanel_batch_post(struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor,
                      const int32_t * experts, const int32_t * slots, int32_t n) {
    return n > 0 ? post_batch(pool, layer, tensor, tensor + 1, experts, slots, n, NULL, 0, NULL, 0) : 0;
}

int empanel_batch_post_layer(struct empanel_pool * pool, struct empanel_layer * layer,
                            const int32_t * experts, const int32_t * slots, int32_t n, const int32_t * order) {
    return n > 0 ? post_batch(pool, layer, 0, layer->n_tensors, experts, slots, n, order, 0, NULL, 0) : 0;
}

int empanel_batch_post_ahead(struct empanel_pool * pool, struct empanel_layer * layer,
                            const int32_t * experts, const int32_t * slots, int32_t n) {
    return n > 0 ? post_batch(pool, layer, 0, layer->n_tensors, experts, slots, n, NULL, 1, NULL, 0) : 0;
}

void empanel_batch_drop(struct empanel_pool * pool, struct empanel_layer * layer, const uint64_t * slot_mark,
                       uint64_t stamp) {
    struct empanel_batch * batch = &pool->lanes.batch[EMPANEL_LANE_AHEAD];
    if (!batch->inflight || !batch->ahead || batch->layer != layer) {
        return;
    }
    for (int32_t j = 0; j < batch->n_jobs; j++) {
        struct empanel_read_job * job = &batch->jobs[j];
        if (slot_mark[job->slot] != stamp && job->tier == 0) { // (a host-tier entry must be whole)
            atomic_store(&job->dropped, 1);
            batch->dropped = 1;
        }
    }
}

// the finished batch had experts dropped (empanel_batch_drop): those that did not land whole hold
// nothing (their slots are emptied by the remap's reconcile), what was read of them is wasted
static void account_dropped(const struct empanel_batch * batch, struct empanel_layer * layer) {
    const uint64_t stamp = ++layer->tables.mark_stamp; // slots whose expert did not land whole
    for (int32_t j = 0; j < batch->n_jobs; j++) {
        const struct empanel_read_job * job = &batch->jobs[j];
        if (atomic_load(&job->dropped) && !job->landed) {
            layer->tables.slot_mark[job->slot] = stamp;
        }
    }
    for (int32_t j = 0; j < batch->n_jobs; j++) {
        const struct empanel_read_job * job = &batch->jobs[j];
        if (layer->tables.slot_mark[job->slot] == stamp) {
            layer->stats.prefetch_wasted += job->tensor->expert_size - atomic_load(&job->skipped);
        }
    }
    for (int32_t s = 0; s < layer->n_slots; s++) {
        if (layer->tables.slot_mark[s] == stamp) {
            layer->stats.prefetch_dropped++;
            layer->guess.prefetch_mark[s] = 0; // accounted here, not as a whole expert wasted
        }
    }
}

int empanel_batch_wait_tensor(struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor) {
    if (!empanel_batch_inflight(pool, EMPANEL_LANE_DEMAND, layer) || !pool->reader.posted[EMPANEL_LANE_DEMAND].by_tensor) {
        return 0; // its reads are done (or were never posted so)
    }
    const uint64_t t0 = empanel_util_now_ns();
    pthread_mutex_unlock(&pool->lock);
    const int rc = empanel_reader_wait_tensor(pool, tensor);
    pthread_mutex_lock(&pool->lock);
    const uint64_t waited = empanel_util_now_ns() - t0;
    layer->stats.wait_ns  += waited;
    layer->stats.ready_ns += waited;
    return rc;
}

int empanel_batch_finish_lane(struct empanel_pool * pool, int32_t lane) {
    struct empanel_batch  * batch  = &pool->lanes.batch[lane];
    struct empanel_posted * posted = &pool->reader.posted[lane];
    if (!batch->inflight) {
        return 0;
    }
    const int      ready = posted->by_tensor; // (empanel_reader_finish clears it)
    const uint64_t t0    = empanel_util_now_ns();
    // the wait lets go of the pool's lock, so that a move down (pressure.c) or /metrics never waits
    // for reads: the batch stays in flight meanwhile, and a layer with reads in flight keeps its
    // slots (slots.c, evictable). Only this thread posts and finishes lanes: one graph computes
    // at a time on a model's pools (the registry's graph lock), and the preload runs at load
    pthread_mutex_unlock(&pool->lock);
    empanel_reader_finish(pool, lane);
    pthread_mutex_lock(&pool->lock);
    const uint64_t t1 = empanel_util_now_ns();
    batch->inflight = 0;

    struct empanel_layer * layer = batch->layer;
    if (atomic_load(&posted->batch_failed) || atomic_load(&pool->error.failed)) {
        empanel_host_cache_batch_landed(pool, batch, 0);
        return -1; // the batch's slots stay marked as holding nothing
    }
    // device pools: written here, between the reads and the next kernel; RPC hosts' together
    if (empanel_remote_write_jobs(pool, layer, batch->jobs, batch->n_jobs) != 0) {
        return -1;
    }
    for (int32_t j = 0; j < batch->n_jobs; j++) {
        const struct empanel_read_job * job = &batch->jobs[j];
        if (job->convert != 2 || !job->landed || job->tensor->remote != NULL) {
            continue;
        }
        if (empanel_chunk_convert(pool, job) != 0) {
            empanel_host_cache_batch_landed(pool, batch, 0);
            return -1;
        } else {
            layer->stats.copy_bytes += job->tensor->expert_size;
            layer->stats.host_hits  += job->tier == 2;
            layer->stats.host_bytes += job->tier == 2 ? job->tensor->expert_size : 0;
        }
    }
    if (atomic_load(&posted->batch_failed) || atomic_load(&pool->error.failed)) {
        empanel_host_cache_batch_landed(pool, batch, 0);
        return -1; // a reader thread's conversion failed
    }
    if (empanel_files_check(pool) != 0) {
        empanel_host_cache_batch_landed(pool, batch, 0);
        return -1; // written to while we read: the bytes may be torn
    }
    empanel_host_cache_batch_landed(pool, batch, 1); // the host tier's entries hold what was read
    layer->ready.reads_open = ready ? 0 : layer->ready.reads_open; // its tables hold from now on
    uint64_t skipped = 0; // payload of dropped read-ahead not read
    for (int32_t j = 0; j < batch->n_jobs; j++) {
        const struct empanel_read_job * job = &batch->jobs[j];
        skipped += atomic_load(&job->skipped);
        if (!job->landed) {
            continue; // dropped: its slot stays marked as holding nothing
        }
        job->tensor->held[job->slot] = job->expert;
        if (job->tensor->digest != NULL && job->tier != 2) { // (a host hit was checked when it was read)
            layer->stats.verified  += 1;
            layer->stats.verify_ns += job->verify_ns;
        }
        if (job->convert == 1) {
            layer->stats.repack_bytes += job->tensor->expert_size;
            layer->stats.repack_ns    += job->repack_ns;
            layer->stats.repack_own_bytes += job->repack_own ? job->tensor->expert_size : 0;
        }
    }
    const uint64_t done = posted->done_ns > batch->t0 ? posted->done_ns : t1;
    layer->stats.read_ns    += (done < t1 ? done : t1) - batch->t0;
    layer->stats.wait_ns    += t1 - t0;
    layer->stats.write_ns   += empanel_util_now_ns() - t1;
    if (batch->dropped) {
        account_dropped(batch, layer);
    }
    layer->stats.bytes_read += batch->payload - skipped;
    layer->stats.io_bytes   += batch->io_bytes - atomic_load(&posted->skipped_io);
    layer->stats.bounce_bytes += batch->bounce_bytes - atomic_load(&posted->skipped_bounce);
    layer->stats.read_cpu_ns  += atomic_load(&posted->cpu_ns);
    layer->stats.n_reads    += (uint64_t) batch->n_chunks;
    return 0;
}

// (the demand lane first: a read-ahead beside it is read after it anyway)
int empanel_batch_finish(struct empanel_pool * pool) {
    const int demand = empanel_batch_finish_lane(pool, EMPANEL_LANE_DEMAND);
    const int ahead  = empanel_batch_finish_lane(pool, EMPANEL_LANE_AHEAD);
    return demand == 0 && ahead == 0 ? 0 : -1;
}

int empanel_batch_read(struct empanel_pool * pool, struct empanel_layer * layer,
                         const int32_t * misses, const int32_t * slots, int32_t n_misses) {
    uint64_t staged_per_expert;
    int32_t  max_chunks_per_expert;
    expert_needs(&pool->reader, layer, 0, layer->n_tensors, &staged_per_expert, &max_chunks_per_expert);
    // RPC pools: the hosts' caches are asked for every miss at once (one round trip per host, not
    // one per group), and an expert they wrote whole takes no staging: [i * n_misses + m] or NULL
    const int32_t n_t = layer->n_tensors;
    uint8_t * known = remote_by_hash(layer, 0, n_t, misses, slots, n_misses);
    int status = 0;
    for (int32_t g0 = 0, n = 0; g0 < n_misses && status == 0; g0 += n) {
        // a group of misses fits in the staging (at least one)
        uint64_t staged = 0;
        for (n = 0; g0 + n < n_misses; n++) {
            int whole = known != NULL;
            for (int32_t i = 0; i < n_t && whole; i++) {
                whole = known[i * n_misses + g0 + n];
            }
            const uint64_t need = whole ? 0 : staged_per_expert;
            if (n > 0 && staged + need > EMPANEL_STAGING) {
                break;
            }
            staged += need;
        }
        status = post_batch(pool, layer, 0, n_t, misses + g0, slots + g0, n, NULL, 0, known != NULL ? known + g0 : NULL,
                            n_misses) != 0 || empanel_batch_finish_lane(pool, EMPANEL_LANE_DEMAND) != 0 ? -1 : 0;
    }
    free(known);
    return status;
}

// read experts layer->tables.misses[0, n) into the claimed, empty slots layer->tables.victims[0, n) and make
// them resident; if a read fails the slots stay empty (their bytes leave the budget)
int empanel_batch_fill_slots(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
    if (!pool->config.lab && empanel_batch_read(pool, layer, layer->tables.misses, layer->tables.victims, n) != 0) {
        pool->budget.resident_bytes -= (uint64_t) n * layer->expert_bytes;
        return -1;
    }
    empanel_slots_hold_misses(pool, layer, n);
    return 0;
}

// a read-ahead of this layer still in flight: the guessed experts the micro-batch does not route
// to are read no further (their slots are emptied by the reconcile that follows)
void empanel_batch_drop_unrouted(struct empanel_pool * pool, struct empanel_layer * layer, const int32_t * expert_ids,
                                 int64_t ids_row_stride, int32_t n_used, int32_t n_tokens) {
    if (!empanel_batch_inflight(pool, EMPANEL_LANE_AHEAD, layer) || !pool->lanes.batch[EMPANEL_LANE_AHEAD].ahead) {
        return;
    }
    const uint64_t stamp = ++layer->tables.mark_stamp; // slots of the experts routed to
    for (int32_t t = 0; t < n_tokens; t++) {
        const int32_t * row = expert_ids + (int64_t) t * ids_row_stride;
        for (int32_t j = 0; j < n_used; j++) {
            const int32_t e = row[j];
            if (e >= 0 && e < pool->n_expert && layer->tables.slot_of[e] >= 0) {
                layer->tables.slot_mark[layer->tables.slot_of[e]] = stamp;
            }
        }
    }
    empanel_batch_drop(pool, layer, layer->tables.slot_mark, stamp);
}

// (batch.h) into the slots the policy gives up, never a guessed expert's; an empty slot only where
// the budget has room: a guess evicts no other layer's expert
void empanel_batch_read_ahead(struct empanel_pool * pool, struct empanel_layer * layer, int32_t n) {
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
