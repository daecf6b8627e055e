// Reading experts: reader threads, chunked O_DIRECT reads, verified bytes (the files: files.c).
//
// All misses of one remap are read as one batch: every expert tensor of every missing expert is
// cut into chunks, and the reader threads and the calling thread take chunks until none is left,
// so one expert keeps every thread (and the drive's queue) busy. Pools in plain host memory
// receive the bytes in their slots directly; others (CPU_REPACK, device memory) get them from a
// staging buffer through llama_empanel_slot_write (CPU_REPACK: by the thread that lands an
// expert's last chunk; device memory: once the batch is read). A batch may stay in flight while
// the graph computes (the next wave's experts): empanel_read_post starts it, empanel_read_finish
// waits for it.
//
// With O_DIRECT a read is an aligned window around the payload (GGUF data is only 32-byte
// aligned), and it lands in place, copied by no one, wherever its destination sits at the
// payload's file offset modulo EMPANEL_ALIGN:
// - staging: always; each expert gets room for its whole window at that phase;
// - a plain host pool's slot: when the hook placed the pool at its tensor's phase (llama-empanel
//   .cpp) and the expert size is a multiple of EMPANEL_ALIGN (then every expert of the tensor
//   sits at one phase). The window's first and last blocks hold a neighbouring slot's bytes, so
//   those two go through the bounce buffer (at most EMPANEL_ALIGN bytes of payload copied per
//   expert); the rest lands in the slot.
// Anything else lands in the thread's bounce buffer and its payload is copied (stats.bounce_bytes).

#include "empanel-impl.h"

#include "llama-empanel.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t align_down(uint64_t x) { return x / EMPANEL_ALIGN * EMPANEL_ALIGN; }
static uint64_t align_up  (uint64_t x) { return (x + EMPANEL_ALIGN - 1) / EMPANEL_ALIGN * EMPANEL_ALIGN; }


// ------------------------------------------------------------------------------------------------
// one chunk

// read at least `need` bytes of [offset, offset + length) into dst; a read may end early only at
// the end of the file, which holds no payload
static int pread_chunk(struct empanel_pool * pool, const struct empanel_file * f, int fd, uint8_t * dst,
                       uint64_t length, uint64_t offset, uint64_t need) {
    uint64_t done = 0;
    while (done < length) {
        const ssize_t n = pread(fd, dst + done, length - done, (off_t) (offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            empanel_set_error(pool, "%s: read of %llu bytes at offset %llu failed: %s", f->path,
                              (unsigned long long) (length - done), (unsigned long long) (offset + done), strerror(errno));
            return -1;
        }
        if (n == 0) {
            break;
        }
        done += (uint64_t) n;
    }
    if (done < need) {
        empanel_set_error(pool, "%s: short read at offset %llu (%llu of %llu bytes): file truncated?",
                          f->path, (unsigned long long) offset, (unsigned long long) done, (unsigned long long) need);
        return -1;
    }
    return 0;
}

// moe_verify: the expert's bytes, all landed in job->dst (the slot, or staging before the
// conversion), against its digest; an unknown digest is taken from this first read
static int verify_job(struct empanel_pool * pool, struct empanel_read_job * job) {
    const uint64_t t0 = empanel_now_ns();
    const uint64_t h = empanel_hash64(job->dst, job->tensor->expert_size);
    uint64_t * want = &job->tensor->digest[job->expert];
    job->verify_ns = empanel_now_ns() - t0;
    if (*want == 0) {
        *want = h;
        return 0;
    }
    if (h != *want) {
        empanel_set_error(pool,
            "%s: expert %d read from %s does not match its digest (XXH3-64 %016llx, expected %016llx): "
            "the file changed or the drive returned other bytes; reload the model, and check the file "
            "with empanel-gguf verify", job->tensor->name, job->expert, pool->files[job->tensor->file].path,
            (unsigned long long) h, (unsigned long long) *want);
        return -1;
    }
    return 0;
}

// staging -> a slot on an RPC host (rpc.c): by hash if the host's cache holds these bytes (from
// an earlier run), else the bytes, for the host to keep; sent bytes count in copy_bytes. With
// moe_verify the very bytes checked here are sent.
static int remote_write_job(struct empanel_pool * pool, struct empanel_layer * layer, const struct empanel_read_job * job) {
    struct empanel_tensor * t = job->tensor;
    if (job->remote_hash != 0) { // taken when it landed (not with moe_verify)
        t->remote_hash[job->expert] = job->remote_hash;
        if (empanel_rpc_write_by_hash(t->pool, job->slot, job->remote_hash)) {
            layer->stats.remote_by_hash += 1;
            return 0;
        }
    }
    const int sent = t->remote_cache ? empanel_rpc_write_cached(t->pool, job->slot, job->dst, t->expert_size)
                                     : empanel_slot_write(t->pool, job->slot, job->dst, t->expert_size);
    if (sent == 0) {
        t->remote_sent[job->expert] |= t->remote_cache;
        layer->stats.copy_bytes += t->expert_size;
        return 0;
    }
    empanel_set_error(pool, "%s: writing expert %d into slot %d on its RPC host failed", t->name, job->expert, job->slot);
    return -1;
}

// a miss on an RPC host's pool whose bytes the host may hold (sent before, or hashed at an
// earlier read): 1 if the host wrote them into the slot from its cache, so nothing is read
static int remote_by_hash(struct empanel_layer * layer, struct empanel_tensor * t, int32_t expert, int32_t slot) {
    if (!t->remote || !t->remote_cache || t->remote_hash[expert] == 0) { // (never known with moe_verify)
        return 0;
    }
    if (empanel_rpc_write_by_hash(t->pool, slot, t->remote_hash[expert])) {
        layer->stats.remote_by_hash += 1;
        return 1;
    }
    if (t->remote_sent[expert]) {
        t->remote_cache = 0; // sent with the cache flag, yet unknown: the host keeps no cache
    }
    return 0;
}

// staging -> slot (repack, or a copy to the device)
static int convert_job(struct empanel_pool * pool, const struct empanel_read_job * job) {
    if (empanel_slot_write(job->tensor->pool, job->slot, job->dst, job->tensor->expert_size) != 0) {
        empanel_set_error(pool, "%s: writing expert %d into slot %d failed", job->tensor->name, job->expert, job->slot);
        return -1;
    }
    return 0;
}

static int read_chunk(struct empanel_reader * reader, const struct empanel_chunk * c, uint8_t * bounce) {
    struct empanel_pool * pool = reader->pool;
    const struct empanel_file * f = &pool->files[c->file];
    const int64_t request = pool->fault_after > 0 ? atomic_fetch_add(&pool->n_requests, 1) + 1 : 0;
    if (pool->fault_after > 0 && request >= pool->fault_after &&
        (pool->fault_count <= 0 || request < pool->fault_after + pool->fault_count)) {
        empanel_set_error(pool, "%s: read of %llu bytes at offset %llu failed: %s (EMPANEL_FAULT_READ_AFTER)",
                          f->path, (unsigned long long) c->length, (unsigned long long) c->offset, strerror(EIO));
        return -1;
    }
    uint8_t * dst = reader->jobs[c->job].dst + c->dst_offset;
    if (reader->direct && f->fd_direct >= 0) {
        if (c->in_place) { // the whole window, at an aligned address of the job's own
            return pread_chunk(pool, f, f->fd_direct, dst - c->skip, c->length, c->offset, c->skip + c->payload);
        }
        if (pread_chunk(pool, f, f->fd_direct, bounce, c->length, c->offset, c->skip + c->payload) != 0) {
            return -1;
        }
        memcpy(dst, bounce + c->skip, c->payload);
        return 0;
    }
    return pread_chunk(pool, f, f->fd, dst, c->payload, c->offset + c->skip, c->payload);
}

// read chunk i of the posted batch; the thread finishing a job's last chunk lands the expert (hash
// check, repack). Waiters are woken by the batch's last chunk, a failure, and (batches waited for
// tensor by tensor) a tensor's last expert landed
static void work_chunk(struct empanel_reader * reader, int i, uint8_t * bounce) {
    struct empanel_pool        * pool = reader->pool;
    const struct empanel_chunk * c    = &reader->chunks[i];
    struct empanel_read_job    * job  = &reader->jobs[c->job];
    int failed = 0;
    int landed = 0; // the last expert of its tensor in this batch
    if (atomic_load(&pool->failed) || read_chunk(reader, c, bounce) != 0) {
        failed = 1; // skipped or failed: the batch is incomplete
    } else if (atomic_fetch_sub(&job->chunks_left, 1) == 1) { // the expert is complete
        if (job->tensor->remote && job->tensor->remote_cache && job->tensor->digest == NULL) {
            job->remote_hash = empanel_rpc_hash(job->dst, job->tensor->expert_size); // its name on the host
        }
        if ((job->tensor->digest != NULL && verify_job(pool, job) != 0) ||
            (job->convert == 1 && convert_job(pool, job) != 0)) { // repack it now
            failed = 1;
        } else if (pool->inflight_ready) {
            const int32_t ti = (int32_t) (job->tensor - pool->inflight_layer->tensors);
            landed = atomic_fetch_sub(&pool->inflight_left[ti], 1) == 1;
        }
    }
    if (failed) {
        atomic_store(&reader->batch_failed, 1);
    }
    const int last = atomic_fetch_add(&reader->done, 1) + 1 == reader->n_chunks;
    if (last || failed || landed) {
        pthread_mutex_lock(&reader->mutex);
        if (last) {
            reader->done_ns = empanel_now_ns();
        }
        pthread_cond_broadcast(&reader->cond_done);
        pthread_mutex_unlock(&reader->mutex);
    }
}

// take chunks of the posted batch until none is left
static void work_batch(struct empanel_reader * reader, uint8_t * bounce) {
    const uint64_t cpu0 = empanel_thread_cpu_ns();
    for (;;) {
        const int i = atomic_fetch_add(&reader->next, 1);
        if (i >= reader->n_chunks) {
            break;
        }
        work_chunk(reader, i, bounce);
    }
    // counted before this thread leaves the batch: empanel_read_finish waits for that (busy)
    atomic_fetch_add(&reader->cpu_ns, empanel_thread_cpu_ns() - cpu0);
}

struct thread_arg {
    struct empanel_reader * reader;
    int32_t                 index;
};

static void * reader_thread(void * arg_) {
    struct thread_arg * arg = arg_;
    struct empanel_reader * reader = arg->reader;
    uint8_t * bounce = reader->bounce[arg->index];
    free(arg);

    uint64_t seen = 0;
    pthread_mutex_lock(&reader->mutex);
    for (;;) {
        while (!reader->stop && reader->generation == seen) {
            pthread_cond_wait(&reader->cond_work, &reader->mutex);
        }
        if (reader->stop) {
            break;
        }
        seen = reader->generation;
        atomic_fetch_add(&reader->busy, 1);
        pthread_mutex_unlock(&reader->mutex);

        work_batch(reader, bounce);

        pthread_mutex_lock(&reader->mutex);
        if (atomic_fetch_sub(&reader->busy, 1) == 1) {
            pthread_cond_broadcast(&reader->cond_done);
        }
    }
    pthread_mutex_unlock(&reader->mutex);
    return NULL;
}

// ------------------------------------------------------------------------------------------------
// threads

int empanel_reader_start(struct empanel_pool * pool, int32_t n_threads, uint64_t chunk_bytes, char * err, size_t err_size) {
    struct empanel_reader * reader = &pool->reader;
    reader->pool        = pool;
    reader->n_threads   = 0;
    reader->chunk_bytes = align_up(chunk_bytes > 0 ? chunk_bytes : EMPANEL_ALIGN);
    reader->direct      = 0;
    reader->bounce_all  = getenv("EMPANEL_READ_BOUNCE") != NULL && atoi(getenv("EMPANEL_READ_BOUNCE")) != 0;
    for (int32_t i = 0; i < pool->n_files; i++) {
        reader->direct |= pool->files[i].fd_direct >= 0;
    }
    pthread_mutex_init(&reader->mutex, NULL);
    pthread_cond_init(&reader->cond_work, NULL);
    pthread_cond_init(&reader->cond_done, NULL);

    // a chunk's aligned window can straddle one extra block at each end
    reader->bounce = calloc(n_threads + 1, sizeof(uint8_t *));
    if (reader->bounce == NULL) {
        snprintf(err, err_size, "empanel: out of memory");
        return -1;
    }
    for (int32_t i = 0; i <= n_threads; i++) {
        if (posix_memalign((void **) &reader->bounce[i], EMPANEL_ALIGN, reader->chunk_bytes + 2*EMPANEL_ALIGN) != 0) {
            snprintf(err, err_size, "empanel: out of memory for read buffers");
            return -1;
        }
    }
    reader->threads = calloc(n_threads > 0 ? n_threads : 1, sizeof(pthread_t));
    if (reader->threads == NULL) {
        snprintf(err, err_size, "empanel: out of memory");
        return -1;
    }
    for (int32_t i = 0; i < n_threads; i++) {
        struct thread_arg * arg = malloc(sizeof(*arg));
        if (arg == NULL) {
            snprintf(err, err_size, "empanel: out of memory");
            return -1;
        }
        arg->reader = reader;
        arg->index  = i;
        if (pthread_create(&reader->threads[i], NULL, reader_thread, arg) != 0) {
            free(arg);
            snprintf(err, err_size, "empanel: cannot start reader thread %d: %s", i, strerror(errno));
            return -1;
        }
        reader->n_threads++;
    }
    return 0;
}

void empanel_reader_stop(struct empanel_pool * pool) {
    struct empanel_reader * reader = &pool->reader;
    if (reader->pool == NULL) {
        return; // never started
    }
    pthread_mutex_lock(&reader->mutex);
    reader->stop = 1;
    pthread_cond_broadcast(&reader->cond_work);
    pthread_mutex_unlock(&reader->mutex);
    for (int32_t i = 0; i < reader->n_threads; i++) {
        pthread_join(reader->threads[i], NULL);
    }
    if (reader->bounce != NULL) {
        for (int32_t i = 0; i <= reader->n_threads; i++) {
            free(reader->bounce[i]);
        }
    }
    free(reader->bounce);
    free(reader->threads);
    pthread_mutex_destroy(&reader->mutex);
    pthread_cond_destroy(&reader->cond_work);
    pthread_cond_destroy(&reader->cond_done);
    reader->pool = NULL;
}

// post the chunks to the reader threads
static void reader_post(struct empanel_pool * pool, struct empanel_read_job * jobs,
                        const struct empanel_chunk * chunks, int32_t n_chunks) {
    struct empanel_reader * reader = &pool->reader;
    pthread_mutex_lock(&reader->mutex);
    // a thread that woke late for the previous batch must leave it before the fields change
    while (atomic_load(&reader->busy) > 0) {
        pthread_cond_wait(&reader->cond_done, &reader->mutex);
    }
    atomic_store(&reader->batch_failed, 0);
    atomic_store(&reader->cpu_ns, 0);
    reader->jobs     = jobs;
    reader->chunks   = chunks;
    reader->n_chunks = n_chunks;
    reader->done_ns  = 0;
    atomic_store(&reader->next, 0);
    atomic_store(&reader->done, 0);
    reader->generation++;
    pthread_cond_broadcast(&reader->cond_work);
    pthread_mutex_unlock(&reader->mutex);
}

// read the posted batch's chunks alongside the threads and return when every chunk is done
static void reader_finish(struct empanel_pool * pool) {
    struct empanel_reader * reader = &pool->reader;
    work_batch(reader, reader->bounce[reader->n_threads]);

    // every chunk done, and no thread still inside work_batch (it reads the batch's fields)
    pthread_mutex_lock(&reader->mutex);
    while (atomic_load(&reader->done) < reader->n_chunks || atomic_load(&reader->busy) > 0) {
        pthread_cond_wait(&reader->cond_done, &reader->mutex);
    }
    pthread_mutex_unlock(&reader->mutex);
}

// wait until the posted batch's experts of tensor ti have landed, taking its chunks (and the ones
// before them) alongside the threads; 0, or -1 if a read of the batch failed
static int reader_wait_tensor(struct empanel_pool * pool, int32_t ti) {
    struct empanel_reader * reader = &pool->reader;
    const int      limit = pool->inflight_chunk_end[ti];
    const uint64_t cpu0  = empanel_thread_cpu_ns();
    int i = atomic_load(&reader->next);
    while (i < limit) {
        if (atomic_compare_exchange_weak(&reader->next, &i, i + 1)) {
            work_chunk(reader, i, reader->bounce[reader->n_threads]);
            i = atomic_load(&reader->next);
        }
    }
    atomic_fetch_add(&reader->cpu_ns, empanel_thread_cpu_ns() - cpu0);

    pthread_mutex_lock(&reader->mutex);
    while (atomic_load(&pool->inflight_left[ti]) > 0 && !atomic_load(&reader->batch_failed)) {
        pthread_cond_wait(&reader->cond_done, &reader->mutex);
    }
    pthread_mutex_unlock(&reader->mutex);
    return atomic_load(&reader->batch_failed) ? -1 : 0;
}

// ------------------------------------------------------------------------------------------------
// a batch of experts

void empanel_staging_free(struct empanel_pool * pool) {
    if (pool->staging != NULL) {
        if (pool->staging_buffer != NULL) {
            empanel_staging_release(pool->staging_buffer);
        } else {
            free(pool->staging);
        }
    }
    pool->staging        = NULL;
    pool->staging_buffer = NULL;
    pool->staging_size   = 0;
}

static int reserve(struct empanel_pool * pool, int32_t n_jobs, int32_t n_chunks, uint64_t staging) {
    if (n_jobs > pool->jobs_cap) {
        void * p = realloc(pool->jobs, sizeof(*pool->jobs) * n_jobs);
        if (p == NULL) { return -1; }
        pool->jobs     = p;
        pool->jobs_cap = n_jobs;
    }
    if (n_chunks > pool->chunks_cap) {
        void * p = realloc(pool->chunks, sizeof(*pool->chunks) * n_chunks);
        if (p == NULL) { return -1; }
        pool->chunks     = p;
        pool->chunks_cap = n_chunks;
    }
    if (staging > pool->staging_size) {
        empanel_staging_free(pool);
        pool->staging      = pool->staging_owner ? empanel_staging_alloc(pool->staging_owner, staging, &pool->staging_buffer)
                                                 : malloc(staging);
        pool->staging_size = pool->staging ? staging : 0;
        if (pool->staging == NULL) { return -1; }
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
        const uint64_t first = align_down(begin);
        const uint64_t last  = align_up(end);
        // [lo, hi): in place. Staging has room for the whole window; a slot only for the blocks
        // that hold nothing but its own payload
        const uint64_t lo    = staged ? first : align_up(begin);
        const uint64_t hi    = staged ? last  : align_down(end);
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
    return n;
}

static int32_t chunks_per_job(const struct empanel_reader * reader, uint64_t size) {
    return (int32_t) ((size + 2*EMPANEL_ALIGN) / reader->chunk_bytes + 4);
}

uint64_t empanel_staged_bytes(const struct empanel_tensor * t) {
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
        *staged     += empanel_staged_bytes(t);
        *max_chunks += chunks_per_job(reader, t->expert_size);
    }
}

// plan and post the reads of experts[i] -> slots[i] for tensors [t0, t1) of a layer, tensor by
// tensor (order: their indices in the order to read them, each waited for on its own with
// empanel_read_wait_tensor; NULL: in index order); nothing may be in flight. Their slots hold
// nothing until empanel_read_finish succeeds.
static int post_batch(struct empanel_pool * pool, struct empanel_layer * layer, int32_t t0, int32_t t1,
                      const int32_t * experts, const int32_t * slots, int32_t n, const int32_t * order) {
    struct empanel_reader * reader = &pool->reader;
    if (pool->inflight) {
        empanel_set_error(pool, "empanel: reads posted while others are in flight");
        return -1;
    }
    for (int32_t i = t0; i < t1; i++) {
        if (layer->tensors[i].pool == NULL) {
            empanel_set_error(pool, "%s: no slot pool bound", layer->tensors[i].name);
            return -1;
        }
    }
    uint64_t staged_per_expert;
    int32_t  max_chunks_per_expert;
    expert_needs(reader, layer, t0, t1, &staged_per_expert, &max_chunks_per_expert);
    // (staging: plus a block to align its start)
    if (reserve(pool, n * (t1 - t0), n * max_chunks_per_expert, staged_per_expert * (uint64_t) n + EMPANEL_ALIGN) != 0) {
        empanel_set_error(pool, "empanel: out of memory for reading %d experts", n);
        return -1;
    }

    uint8_t * staging = (uint8_t *) (uintptr_t) align_up((uint64_t) (uintptr_t) pool->staging);
    const uint64_t batch = ++pool->n_batches_posted;
    int32_t  n_jobs   = 0;
    int32_t  n_chunks = 0;
    uint64_t staged   = 0; // bytes of staging taken, a multiple of EMPANEL_ALIGN
    uint64_t io_bytes = 0;
    uint64_t bounced  = 0;
    uint64_t payload  = 0;
    for (int32_t k = 0; k < t1 - t0; k++) {
        const int32_t i = order != NULL ? order[k] : t0 + k;
        int32_t n_landing = 0; // its jobs that land through the readers
        for (int32_t m = 0; m < n; m++) {
            struct empanel_tensor * t = &layer->tensors[i];
            if (remote_by_hash(layer, t, experts[m], slots[m])) {
                t->held[slots[m]] = experts[m]; // in place, nothing to read
                continue;
            }
            struct empanel_read_job * job = &pool->jobs[n_jobs];
            job->tensor  = t;
            job->expert  = experts[m];
            job->slot    = slots[m];
            job->dst     = empanel_slot_data(t->pool, slots[m]);
            job->convert = 0;
            job->remote_hash = 0;
            const int to_staging = !t->direct || job->dst == NULL;
            int tier_hit = 0;
            uint8_t * tier = empanel_host_cache_get(pool, layer, i, experts[m], batch, &tier_hit);
            job->tier = tier == NULL ? 0 : tier_hit ? 2 : 1;
            if (tier != NULL) { // device pools with a host tier: read into the entry, written from it
                job->dst     = tier;
                job->convert = 2;
            } else if (to_staging) { // the window's room, the payload at its phase in the file
                job->dst     = empanel_window_payload(staging + staged, t, experts[m]);
                job->convert = t->host != NULL ? 1 : 2;
                staged      += empanel_window_bytes(t);
            }
            t->held[slots[m]] = -1; // being written
            if (job->tier == 2) { // written from the tier at the finish, nothing to read
                atomic_store(&job->chunks_left, 0);
                job->verify_ns = 0;
                n_jobs++;
                continue;
            }
            n_chunks += plan_chunks(reader, job, n_jobs, to_staging || tier != NULL, pool->chunks + n_chunks,
                                    &io_bytes, &bounced);
            payload  += t->expert_size;
            n_jobs++;
            n_landing++;
        }
        atomic_store(&pool->inflight_left[i], n_landing);
        pool->inflight_chunk_end[i] = n_chunks;
    }

    pool->inflight          = 1;
    pool->inflight_ready    = order != NULL;
    pool->inflight_layer    = layer;
    pool->inflight_jobs     = n_jobs;
    pool->inflight_chunks   = n_chunks;
    pool->inflight_payload  = payload;
    pool->inflight_io_bytes = io_bytes;
    pool->inflight_bounce_bytes = bounced;
    pool->inflight_t0       = empanel_now_ns();
    reader_post(pool, pool->jobs, pool->chunks, n_chunks);
    return 0;
}

int empanel_read_post(struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor,
                      const int32_t * experts, const int32_t * slots, int32_t n) {
    return n > 0 ? post_batch(pool, layer, tensor, tensor + 1, experts, slots, n, NULL) : 0;
}

int empanel_read_post_layer(struct empanel_pool * pool, struct empanel_layer * layer,
                            const int32_t * experts, const int32_t * slots, int32_t n, const int32_t * order) {
    return n > 0 ? post_batch(pool, layer, 0, layer->n_tensors, experts, slots, n, order) : 0;
}

int empanel_read_wait_tensor(struct empanel_pool * pool, struct empanel_layer * layer, int32_t tensor) {
    if (!pool->inflight || !pool->inflight_ready || pool->inflight_layer != layer) {
        return 0; // its reads are done (or were never posted so)
    }
    const uint64_t t0 = empanel_now_ns();
    const int rc = reader_wait_tensor(pool, tensor);
    const uint64_t waited = empanel_now_ns() - t0;
    layer->stats.wait_ns  += waited;
    layer->stats.ready_ns += waited;
    return rc;
}

int empanel_read_finish(struct empanel_pool * pool) {
    if (!pool->inflight) {
        return 0;
    }
    const uint64_t t0 = empanel_now_ns();
    reader_finish(pool);
    const uint64_t t1 = empanel_now_ns();
    const int ready = pool->inflight_ready;
    pool->inflight       = 0;
    pool->inflight_ready = 0;

    struct empanel_layer * layer = pool->inflight_layer;
    if (atomic_load(&pool->reader.batch_failed) || atomic_load(&pool->failed)) {
        empanel_host_cache_batch_landed(pool, 0);
        return -1; // the batch's slots stay marked as holding nothing
    }
    for (int32_t j = 0; j < pool->inflight_jobs; j++) {
        const struct empanel_read_job * job = &pool->jobs[j];
        if (job->convert != 2) {
            continue;
        }
        // device pools: written here, between the reads and the next kernel
        if (job->tensor->remote) {
            if (remote_write_job(pool, layer, job) != 0) {
                return -1;
            }
        } else if (convert_job(pool, job) != 0) {
            empanel_host_cache_batch_landed(pool, 0);
            return -1;
        } else {
            layer->stats.copy_bytes += job->tensor->expert_size;
            layer->stats.host_hits  += job->tier == 2;
            layer->stats.host_bytes += job->tier == 2 ? job->tensor->expert_size : 0;
        }
    }
    if (atomic_load(&pool->reader.batch_failed) || atomic_load(&pool->failed)) {
        empanel_host_cache_batch_landed(pool, 0);
        return -1; // a reader thread's conversion failed
    }
    if (empanel_files_check(pool) != 0) {
        empanel_host_cache_batch_landed(pool, 0);
        return -1; // written to while we read: the bytes may be torn
    }
    empanel_host_cache_batch_landed(pool, 1); // the host tier's entries hold what was read
    layer->reads_open = ready ? 0 : layer->reads_open; // its tables hold from now on
    for (int32_t j = 0; j < pool->inflight_jobs; j++) {
        const struct empanel_read_job * job = &pool->jobs[j];
        job->tensor->held[job->slot] = job->expert;
        if (job->tensor->digest != NULL && job->tier != 2) { // (a host hit was checked when it was read)
            layer->stats.verified  += 1;
            layer->stats.verify_ns += job->verify_ns;
        }
    }
    const uint64_t done = pool->reader.done_ns > pool->inflight_t0 ? pool->reader.done_ns : t1;
    layer->stats.read_ns    += (done < t1 ? done : t1) - pool->inflight_t0;
    layer->stats.wait_ns    += t1 - t0;
    layer->stats.write_ns   += empanel_now_ns() - t1;
    layer->stats.bytes_read += pool->inflight_payload;
    layer->stats.io_bytes   += pool->inflight_io_bytes;
    layer->stats.bounce_bytes += pool->inflight_bounce_bytes;
    layer->stats.read_cpu_ns  += atomic_load(&pool->reader.cpu_ns);
    layer->stats.n_reads    += (uint64_t) pool->inflight_chunks;
    return 0;
}

int empanel_read_experts(struct empanel_pool * pool, struct empanel_layer * layer,
                         const int32_t * misses, const int32_t * slots, int32_t n_misses) {
    // a group of misses fits in the staging
    uint64_t staged_per_expert;
    int32_t  max_chunks_per_expert;
    expert_needs(&pool->reader, layer, 0, layer->n_tensors, &staged_per_expert, &max_chunks_per_expert);
    int32_t group = n_misses;
    if (staged_per_expert > 0 && staged_per_expert * (uint64_t) group > EMPANEL_STAGING) {
        group = (int32_t) (EMPANEL_STAGING / staged_per_expert);
        group = group > 0 ? group : 1;
    }
    for (int32_t g0 = 0; g0 < n_misses; g0 += group) {
        const int32_t n = g0 + group < n_misses ? group : n_misses - g0;
        if (post_batch(pool, layer, 0, layer->n_tensors, misses + g0, slots + g0, n, NULL) != 0 ||
            empanel_read_finish(pool) != 0) {
            return -1;
        }
    }
    return 0;
}
