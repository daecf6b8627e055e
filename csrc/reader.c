// Reading experts: the workers that take the chunks of the posted batches (batch.c plans them,
// chunk.c reads and lands each one), and the two lanes they are posted in.
//
// Every expert tensor of every expert in a batch is cut into chunks, and the reader threads and
// the calling thread take chunks until none is left, so one expert keeps every thread (and the
// drive's queue) busy. Pools in plain host memory receive the bytes in their slots directly;
// others (CPU_REPACK, device memory) get them from a staging buffer through
// empanel_backend_slot_write (backend.c; CPU_REPACK: by the thread that lands an expert's last chunk; device
// memory: once the batch is read).
//
// Two paths issue the reads (struct empanel_pool_params.read_io, EMPANEL_READ_IO):
// - threads: n_threads reader threads and the caller each take a chunk, pread it, land it, take
//   the next; the drive sees as many requests as threads;
// - io_uring (ring.c): one reader thread keeps up to `depth` chunks in flight in its ring, submits
//   them in one system call and lands each as it completes (the same landing: hash, repack, edge
//   blocks), so the compute threads share the cores with one thread instead of n_threads; the
//   caller only waits. Where the build or the kernel has no io_uring, the threads, with a notice.
// Both take chunks in order from the same counter and land them through chunk.c.
//
// Two lanes (enum empanel_lane) may each hold a posted batch: a remap's reads (demand) and a
// read-ahead. The demand lane's chunks are always taken first: a thread reading ahead goes back to
// the demand lane at its next chunk once a batch is posted there, and the ring keeps at most a
// quarter of its depth of read-ahead in flight, so a demand read waits behind a few read-ahead
// chunks at most.

#include "reader.h"
#include "backend.h"
#include "chunk.h"
#include "ring.h"
#include "util.h"
#include "state.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum ring_state {
    RING_OK   = 0,
    RING_OFF  = 1, // the kernel refused a submission with nothing in flight: this thread preads
    RING_LOST = 2, // it stopped answering with reads in flight, which may still land: no read is
                   // safe any more, and the ring and its buffers are never freed (reader_stop)
};

// every chunk of a lane's posted batch not taken yet fails
static void fail_rest(struct empanel_reader * reader, struct empanel_posted * p) {
    for (int i = atomic_fetch_add(&p->next, 1); i < p->n_chunks; i = atomic_fetch_add(&p->next, 1)) {
        empanel_chunk_land(reader, p, i, EMPANEL_CHUNK_FAILED);
    }
}

// take chunks of a lane's posted batch until none is left (1), or (the read-ahead lane) until a
// batch is posted in the demand lane after demand_seen (0: chunks are left)
static int work_batch(struct empanel_reader * reader, int32_t lane, uint64_t demand_seen, uint8_t * bounce) {
    struct empanel_posted * p = &reader->posted[lane];
    const uint64_t cpu0 = empanel_util_thread_cpu_ns();
    int all = 1;
    for (;;) {
        if (lane != EMPANEL_LANE_DEMAND && atomic_load(&reader->posts[EMPANEL_LANE_DEMAND]) != demand_seen) {
            all = 0; // (the demand lane first)
            break;
        }
        const int i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n_chunks) {
            break;
        }
        empanel_chunk_read(reader, p, i, bounce);
    }
    // counted before this thread leaves the lane: empanel_batch_finish_lane waits for that (busy)
    atomic_fetch_add(&p->cpu_ns, empanel_util_thread_cpu_ns() - cpu0);
    return all;
}

// under the reader's mutex: the first lane with a batch this thread has not taken every chunk of
// (taken[lane]: the lane's batches it has), or -1
static int32_t lane_to_take(struct empanel_reader * reader, const uint64_t * taken) {
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        if (atomic_load(&reader->posts[lane]) != taken[lane]) {
            return lane;
        }
    }
    return -1;
}

// the thread leaves a lane (under the reader's mutex): a post waits for that to rewrite its fields
static void leave_lane(struct empanel_reader * reader, int32_t lane) {
    if (atomic_fetch_sub(&reader->posted[lane].busy, 1) == 1) {
        pthread_cond_broadcast(&reader->cond_done);
    }
}

// io_uring: the ring thread's lanes, as it works them
struct ring_lane {
    int      in;         // inside the lane (busy): it may take chunks and has reads of it in flight
    uint64_t batch;      // the lane's batch it is in (reader->posts[lane] when it went in)
    int32_t  in_flight;  // reads of the lane in the ring
};

// the kernel stopped answering with reads in flight: they and the chunks not taken fail
static void ring_lost(struct empanel_reader * reader, struct ring_lane * lanes, struct empanel_ring_read ** free_reads,
                      int32_t n_free) {
    struct empanel_ring * ring = reader->uring.ring;
    atomic_store(&reader->uring.state, RING_LOST);
    empanel_util_set_error(reader->pool, "empanel: io_uring stopped answering (%s) with %d reads in flight; no "
                           "read is safe in this process any more: reload the model with EMPANEL_READ_IO=threads",
                           strerror(empanel_ring_broken(ring)), empanel_ring_in_flight(ring));
    for (int32_t k = 0; k < reader->uring.depth; k++) {
        int is_free = 0;
        for (int32_t m = 0; m < n_free; m++) {
            is_free |= free_reads[m] == &reader->uring.ops[k];
        }
        if (!is_free) {
            struct empanel_ring_read * r = &reader->uring.ops[k];
            empanel_chunk_land(reader, &reader->posted[r->lane], r->chunk, EMPANEL_CHUNK_FAILED);
            lanes[r->lane].in_flight--;
        }
    }
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        if (lanes[lane].in) {
            fail_rest(reader, &reader->posted[lane]);
        }
    }
}

// a lane's posted batch has chunks no thread has taken yet (read by a thread inside the lane)
static int chunks_left(const struct empanel_posted * p) {
    return atomic_load(&p->next) < p->n_chunks;
}

// the next chunk for the ring: a lane it is in, the demand lane first, with room for it (the
// read-ahead lane keeps a quarter of the depth in flight at most, until its caller waits for it);
// -1 if none. *chunk: its index
static int32_t ring_next_chunk(struct empanel_reader * reader, struct ring_lane * lanes, int * chunk) {
    const int32_t ahead_max = reader->uring.depth / 4 > 0 ? reader->uring.depth / 4 : 1;
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        struct empanel_posted * p = &reader->posted[lane];
        if (!lanes[lane].in || !chunks_left(p) ||
            (lane == EMPANEL_LANE_AHEAD && lanes[lane].in_flight >= ahead_max && !atomic_load(&p->waited))) {
            continue;
        }
        const int i = atomic_fetch_add(&p->next, 1);
        if (i < p->n_chunks) {
            *chunk = i;
            return lane;
        }
    }
    return -1;
}

// the ring thread, under the mutex: leave the lanes done with, go into those with a new batch;
// whether it is in any lane
static int ring_enter_lanes(struct empanel_reader * reader, struct ring_lane * lanes) {
    int any = 0;
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        struct ring_lane * l = &lanes[lane];
        if (l->in && !chunks_left(&reader->posted[lane]) && l->in_flight == 0) {
            l->in = 0;
            leave_lane(reader, lane);
        }
        const uint64_t posts = atomic_load(&reader->posts[lane]);
        if (!l->in && posts != l->batch) {
            l->in     = 1;
            l->batch  = posts;
            atomic_fetch_add(&reader->posted[lane].busy, 1);
        }
        any |= l->in;
    }
    return any;
}

// the ring thread without its ring: broken (RING_OFF), pread, a lane at a time; lost
// (RING_LOST), every chunk fails
static void ring_off(struct empanel_reader * reader, const struct ring_lane * lanes, int state) {
    for (int32_t lane = 0; lane < EMPANEL_N_LANES; lane++) {
        if (lanes[lane].in && chunks_left(&reader->posted[lane]) && lanes[lane].in_flight == 0) {
            if (state == RING_LOST) {
                empanel_util_set_error(reader->pool, "empanel: io_uring lost reads earlier in this process (see "
                                       "the first error); reload the model with EMPANEL_READ_IO=threads");
                fail_rest(reader, &reader->posted[lane]);
            } else { // (it stops early if a demand batch comes: that one first)
                work_batch(reader, lane, atomic_load(&reader->posts[EMPANEL_LANE_DEMAND]), reader->bounce[0]);
            }
        }
    }
}

// queue the next chunks of the lanes into the free reads of the ring (the demand lane's first);
// chunks not to be read (skipped, failed) land at once
static void ring_fill(struct empanel_reader * reader, struct ring_lane * lanes, struct empanel_ring_read ** free_reads,
                      int32_t * n_free) {
    struct empanel_ring * ring = reader->uring.ring;
    int     i    = 0;
    int32_t lane = -1;
    while (*n_free > 0 && empanel_ring_room(ring) > 0 && (lane = ring_next_chunk(reader, lanes, &i)) >= 0) {
        struct empanel_posted * p = &reader->posted[lane];
        enum empanel_chunk_outcome outcome = empanel_chunk_before_read(reader, p, &p->chunks[i]);
        if (outcome == EMPANEL_CHUNK_READ &&
            empanel_chunk_ring_prepare(reader, lane, i, free_reads[*n_free - 1]) != 0) {
            outcome = EMPANEL_CHUNK_FAILED;
        }
        if (outcome != EMPANEL_CHUNK_READ) {
            empanel_chunk_land(reader, p, i, outcome);
            continue;
        }
        empanel_ring_queue(ring, free_reads[--*n_free]);
        lanes[lane].in_flight++;
    }
}

// wait for one read of the ring and land it (its thread's CPU since *cpu_mark counted to its
// batch); the ring lost: every read in flight fails
static void ring_land_one(struct empanel_reader * reader, struct ring_lane * lanes,
                          struct empanel_ring_read ** free_reads, int32_t * n_free, uint64_t * cpu_mark) {
    struct empanel_ring_read * r = empanel_ring_reap(reader->uring.ring);
    if (r == NULL) {
        ring_lost(reader, lanes, free_reads, *n_free);
        return;
    }
    struct empanel_posted * p = &reader->posted[r->lane];
    lanes[r->lane].in_flight--;
    empanel_chunk_land(reader, p, r->chunk, empanel_chunk_ring_landed(reader, r));
    free_reads[(*n_free)++] = r;
    // its CPU since the last landing: counted before the thread leaves the lane
    const uint64_t now = empanel_util_thread_cpu_ns();
    atomic_fetch_add(&p->cpu_ns, now - *cpu_mark);
    *cpu_mark = now;
}

// io_uring: the ring thread. It goes into a lane when a batch is posted there, keeps up to depth
// chunks in flight (the demand lane's first), lands each as it completes, and leaves a lane once
// it has no chunk left to take there and none in flight. A ring that broke (RING_OFF) reads with
// pread; a lost one (RING_LOST) fails every chunk
static void ring_thread(struct empanel_reader * reader) {
    struct empanel_ring * ring = reader->uring.ring;
    struct ring_lane lanes[EMPANEL_N_LANES];
    memset(lanes, 0, sizeof(lanes));
    struct empanel_ring_read * free_reads[EMPANEL_MAX_QUEUE_DEPTH];
    int32_t n_free = 0;
    for (int32_t k = reader->uring.depth - 1; k >= 0; k--) {
        free_reads[n_free++] = &reader->uring.ops[k];
    }
    uint64_t cpu_mark = empanel_util_thread_cpu_ns();
    pthread_mutex_lock(&reader->mutex);
    for (;;) {
        if (!ring_enter_lanes(reader, lanes)) {
            if (reader->stop) {
                break;
            }
            pthread_cond_wait(&reader->cond_work, &reader->mutex);
            continue;
        }
        pthread_mutex_unlock(&reader->mutex);

        const int state = atomic_load(&reader->uring.state);
        if (state != RING_OK) {
            ring_off(reader, lanes, state);
            cpu_mark = empanel_util_thread_cpu_ns();
            pthread_mutex_lock(&reader->mutex);
            continue;
        }
        ring_fill(reader, lanes, free_reads, &n_free);
        if (empanel_ring_in_flight(ring) > 0) {
            ring_land_one(reader, lanes, free_reads, &n_free, &cpu_mark);
        }
        if (atomic_load(&reader->uring.state) == RING_OK && empanel_ring_broken(ring) && empanel_ring_in_flight(ring) == 0) {
            atomic_store(&reader->uring.state, RING_OFF); // (its reads failed their batch; the next ones are preads)
        }
        pthread_mutex_lock(&reader->mutex);
    }
    pthread_mutex_unlock(&reader->mutex);
}

struct thread_arg {
    struct empanel_reader * reader;
    int32_t                 index;
};

// a reader thread (pread): it takes the chunks of the lanes' batches, the demand lane first
static void * reader_thread(void * arg_) {
    struct thread_arg * arg = arg_;
    struct empanel_reader * reader = arg->reader;
    uint8_t * bounce = reader->bounce[arg->index];
    free(arg);
    if (reader->uring.ring != NULL) {
        ring_thread(reader);
        return NULL;
    }

    uint64_t taken[EMPANEL_N_LANES] = { 0 }; // per lane: the batches it took every chunk of
    pthread_mutex_lock(&reader->mutex);
    for (;;) {
        int32_t lane = -1;
        while (!reader->stop && (lane = lane_to_take(reader, taken)) < 0) {
            pthread_cond_wait(&reader->cond_work, &reader->mutex);
        }
        if (reader->stop) {
            break;
        }
        const uint64_t batch  = atomic_load(&reader->posts[lane]);
        const uint64_t demand = atomic_load(&reader->posts[EMPANEL_LANE_DEMAND]);
        atomic_fetch_add(&reader->posted[lane].busy, 1);
        pthread_mutex_unlock(&reader->mutex);

        const int all = work_batch(reader, lane, demand, bounce);

        pthread_mutex_lock(&reader->mutex);
        taken[lane] = all ? batch : taken[lane];
        leave_lane(reader, lane);
    }
    pthread_mutex_unlock(&reader->mutex);
    return NULL;
}

// ------------------------------------------------------------------------------------------------
// threads

// the read path asked for: EMPANEL_READ_IO in the environment ("threads", "uring"), else the
// params' (auto: this build's default, docs/performance.md "Fast drives and reads")
static int32_t read_io_asked(int32_t read_io) {
    const char * env = getenv("EMPANEL_READ_IO");
    if (env != NULL && strcmp(env, "threads") == 0) {
        return EMPANEL_READ_IO_THREADS;
    }
    if (env != NULL && strcmp(env, "uring") == 0) {
        return EMPANEL_READ_IO_URING;
    }
    return read_io == EMPANEL_READ_IO_AUTO ? EMPANEL_READ_IO_DEFAULT : read_io;
}

// io_uring: the ring and its reads; 0, or -1 where there is none (the notice says why, and the
// threads read)
static int ring_start(struct empanel_reader * reader, int32_t depth) {
    char why[160];
    const char * fault = getenv("EMPANEL_FAULT_URING"); // tests: the kernel refuses io_uring
    if (fault != NULL && atoi(fault) != 0) {
        snprintf(why, sizeof(why), "refused: EMPANEL_FAULT_URING");
    } else if (empanel_ring_init(&reader->uring.ring, depth, why, sizeof(why)) == 0) {
        reader->uring.ops = calloc((size_t) depth, sizeof(*reader->uring.ops));
        if (reader->uring.ops != NULL) {
            reader->uring.depth = depth;
            return 0;
        }
        empanel_ring_free(reader->uring.ring);
        reader->uring.ring = NULL;
        snprintf(why, sizeof(why), "out of memory for %d reads", depth);
    }
    struct empanel_pool * pool = reader->pool;
    if (pool->notice[0] == '\0') {
        snprintf(pool->notice, sizeof(pool->notice), "io_uring is not available (%s): reading with threads", why);
    }
    return -1;
}

// the reader's settings are within their bounds; 0, or -1 with the reason in err
static int check_params(int32_t n_threads, uint64_t chunk_bytes, int32_t read_io, int32_t depth, char * err,
                        size_t err_size) {
    if (n_threads < 0 || n_threads > EMPANEL_MAX_READ_THREADS) {
        empanel_util_format_err(err, err_size, "empanel: %d reader threads (0 to %d)", n_threads, EMPANEL_MAX_READ_THREADS);
        return -1;
    }
    if (chunk_bytes > EMPANEL_MAX_CHUNK_BYTES) {
        empanel_util_format_err(err, err_size, "empanel: read chunks of %llu bytes (at most %u)",
                                (unsigned long long) chunk_bytes, EMPANEL_MAX_CHUNK_BYTES);
        return -1;
    }
    if (read_io < EMPANEL_READ_IO_AUTO || read_io > EMPANEL_READ_IO_URING || depth < 0 || depth > EMPANEL_MAX_QUEUE_DEPTH) {
        empanel_util_format_err(err, err_size, "empanel: read path %d at queue depth %d (0 to %d)", read_io, depth,
                                EMPANEL_MAX_QUEUE_DEPTH);
        return -1;
    }
    return 0;
}

// one bounce buffer per thread and the caller's (io_uring: per read of the ring, and the
// caller's); a chunk's aligned window can straddle one extra block at each end. 0, or -1 with
// the reason in err (what it made is freed by empanel_reader_stop)
static int bounce_alloc(struct empanel_reader * reader, int32_t n_threads, char * err, size_t err_size) {
    const int32_t n_bounce = (reader->uring.ring != NULL ? reader->uring.depth : n_threads) + 1;
    reader->bounce = calloc((size_t) n_bounce, sizeof(uint8_t *));
    if (reader->bounce == NULL) {
        empanel_util_format_err(err, err_size, "empanel: out of memory");
        return -1;
    }
    reader->n_bounce = n_bounce;
    for (int32_t i = 0; i < reader->n_bounce; i++) {
        if (posix_memalign((void **) &reader->bounce[i], EMPANEL_ALIGN, reader->chunk_bytes + 2*EMPANEL_ALIGN) != 0) {
            reader->bounce[i] = NULL;
            empanel_util_format_err(err, err_size, "empanel: out of memory for read buffers (%d of %llu bytes)",
                                    reader->n_bounce, (unsigned long long) (reader->chunk_bytes + 2*EMPANEL_ALIGN));
            return -1;
        }
    }
    for (int32_t k = 0; reader->uring.ring != NULL && k < reader->uring.depth; k++) {
        reader->uring.ops[k].bounce = reader->bounce[k];
    }
    return 0;
}

// start n_threads reader threads; 0, or -1 with the reason in err (the threads started are
// joined by empanel_reader_stop)
static int threads_start(struct empanel_reader * reader, int32_t n_threads, char * err, size_t err_size) {
    reader->threads = calloc(n_threads > 0 ? (size_t) n_threads : 1, sizeof(pthread_t));
    if (reader->threads == NULL) {
        empanel_util_format_err(err, err_size, "empanel: out of memory");
        return -1;
    }
    const char * fault = getenv("EMPANEL_FAULT_THREAD_START"); // tests: thread <n> fails to start (EAGAIN)
    const int32_t fault_at = fault != NULL ? atoi(fault) : -1;
    for (int32_t i = 0; i < n_threads; i++) {
        struct thread_arg * arg = malloc(sizeof(*arg));
        if (arg == NULL) {
            empanel_util_format_err(err, err_size, "empanel: out of memory");
            return -1;
        }
        arg->reader = reader;
        arg->index  = i;
        const int rc = i == fault_at ? EAGAIN : pthread_create(&reader->threads[i], NULL, reader_thread, arg);
        if (rc != 0) { // pthread_create returns its error; errno is not set
            free(arg);
            empanel_util_format_err(err, err_size, "empanel: cannot start reader thread %d of %d: %s", i, n_threads,
                                    strerror(rc));
            return -1;
        }
        reader->n_threads++;
    }
    return 0;
}

int empanel_reader_start(struct empanel_pool * pool, int32_t n_threads, uint64_t chunk_bytes, int32_t read_io,
                         int32_t depth, char * err, size_t err_size) {
    struct empanel_reader * reader = &pool->reader;
    if (check_params(n_threads, chunk_bytes, read_io, depth, err, err_size) != 0) {
        return -1;
    }
    reader->pool        = pool;
    atomic_store(&reader->uring.state, RING_OK);
    // (no reader thread asked for: the caller reads alone, with pread)
    if (n_threads > 0 && read_io_asked(read_io) == EMPANEL_READ_IO_URING &&
        ring_start(reader, depth > 0 ? depth : EMPANEL_DEFAULT_QUEUE_DEPTH) == 0) {
        n_threads = 1; // the ring's
    }
    reader->n_threads   = 0;
    reader->chunk_bytes = empanel_align_up(chunk_bytes > 0 ? chunk_bytes : EMPANEL_ALIGN);
    reader->direct      = 0;
    reader->bounce_all  = getenv("EMPANEL_READ_BOUNCE") != NULL && atoi(getenv("EMPANEL_READ_BOUNCE")) != 0;
    reader->drop_ahead  = getenv("EMPANEL_READ_AHEAD_KEEP") == NULL || atoi(getenv("EMPANEL_READ_AHEAD_KEEP")) == 0;
    reader->beside      = getenv("EMPANEL_READ_AHEAD_BESIDE") == NULL || atoi(getenv("EMPANEL_READ_AHEAD_BESIDE")) != 0;
    for (int32_t i = 0; i < pool->files.n; i++) {
        reader->direct |= pool->files.list[i].fd_direct >= 0;
    }
    pthread_mutex_init(&reader->mutex, NULL);
    pthread_cond_init(&reader->cond_work, NULL);
    pthread_cond_init(&reader->cond_done, NULL);
    if (bounce_alloc(reader, n_threads, err, err_size) != 0) {
        return -1;
    }
    return threads_start(reader, n_threads, err, err_size);
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
    if (atomic_load(&reader->uring.state) != RING_LOST) { // (lost: the kernel may still write into them, kept)
        empanel_ring_free(reader->uring.ring); // (after the join: no thread is in it, nothing in flight)
        free(reader->uring.ops);
        for (int32_t i = 0; reader->bounce != NULL && i < reader->n_bounce; i++) {
            free(reader->bounce[i]);
        }
        free(reader->bounce);
    }
    free(reader->threads);
    reader->uring.ring     = NULL;
    reader->uring.ops = NULL;
    reader->bounce   = NULL;
    reader->threads  = NULL;
    reader->n_bounce = 0;
    pthread_mutex_destroy(&reader->mutex);
    pthread_cond_destroy(&reader->cond_work);
    pthread_cond_destroy(&reader->cond_done);
    reader->pool = NULL;
}

// post the chunks to the reader threads in a lane
void empanel_reader_post(struct empanel_pool * pool, int32_t lane, struct empanel_read_job * jobs,
                         const struct empanel_chunk * chunks, int32_t n_chunks,
                         const struct empanel_layer * layer, int by_tensor, const int32_t * n_landing,
                         const int32_t * chunk_end) {
    struct empanel_reader * reader = &pool->reader;
    struct empanel_posted * p      = &reader->posted[lane];
    pthread_mutex_lock(&reader->mutex);
    // a thread that came late into the lane's previous batch must leave it before the fields change
    while (atomic_load(&p->busy) > 0) {
        pthread_cond_wait(&reader->cond_done, &reader->mutex);
    }
    atomic_store(&p->batch_failed, 0);
    atomic_store(&p->waited, 0);
    atomic_store(&p->cpu_ns, 0);
    atomic_store(&p->skipped_io, 0);
    atomic_store(&p->skipped_bounce, 0);
    p->jobs      = jobs;
    p->chunks    = chunks;
    p->n_chunks  = n_chunks;
    p->by_tensor = by_tensor;
    p->tensors   = layer->tensors;
    for (int32_t i = 0; i < EMPANEL_MAX_TENSORS; i++) {
        atomic_store(&p->tensor_left[i], i < layer->n_tensors ? n_landing[i] : 0);
        p->tensor_chunk_end[i] = i < layer->n_tensors ? chunk_end[i] : 0;
    }
    p->done_ns = 0;
    atomic_store(&p->next, 0);
    atomic_store(&p->done, 0);
    atomic_fetch_add(&reader->posts[lane], 1);
    pthread_cond_broadcast(&reader->cond_work);
    pthread_mutex_unlock(&reader->mutex);
}

// read a lane's posted chunks alongside the threads (io_uring: wait for the ring's thread) and
// return when every chunk is done
void empanel_reader_finish(struct empanel_pool * pool, int32_t lane) {
    struct empanel_reader * reader = &pool->reader;
    struct empanel_posted * p      = &reader->posted[lane];
    atomic_store(&p->waited, 1);
    if (reader->uring.ring == NULL) { // (io_uring: the ring's thread reads it all)
        // (the caller posts the demand lane's batches itself: none comes while it reads this one)
        work_batch(reader, lane, atomic_load(&reader->posts[EMPANEL_LANE_DEMAND]), reader->bounce[reader->n_bounce - 1]);
    }

    // every chunk done, and no thread still inside the lane (it reads the batch's fields)
    pthread_mutex_lock(&reader->mutex);
    while (atomic_load(&p->done) < p->n_chunks || atomic_load(&p->busy) > 0) {
        pthread_cond_wait(&reader->cond_done, &reader->mutex);
    }
    p->by_tensor = 0;
    pthread_mutex_unlock(&reader->mutex);
}

// wait until the demand lane's experts of tensor ti have landed, taking its chunks (and the ones
// before them) alongside the threads; 0, or -1 if a read of the batch failed
int empanel_reader_wait_tensor(struct empanel_pool * pool, int32_t ti) {
    struct empanel_reader * reader = &pool->reader;
    struct empanel_posted * p      = &reader->posted[EMPANEL_LANE_DEMAND];
    const int      limit = p->tensor_chunk_end[ti];
    const uint64_t cpu0  = empanel_util_thread_cpu_ns();
    int i = atomic_load(&p->next);
    while (reader->uring.ring == NULL && i < limit) { // (io_uring: the ring's thread reads it all)
        if (atomic_compare_exchange_weak(&p->next, &i, i + 1)) {
            empanel_chunk_read(reader, p, i, reader->bounce[reader->n_bounce - 1]);
            i = atomic_load(&p->next);
        }
    }
    atomic_fetch_add(&p->cpu_ns, empanel_util_thread_cpu_ns() - cpu0);

    pthread_mutex_lock(&reader->mutex);
    while (atomic_load(&p->tensor_left[ti]) > 0 && !atomic_load(&p->batch_failed)) {
        pthread_cond_wait(&reader->cond_done, &reader->mutex);
    }
    pthread_mutex_unlock(&reader->mutex);
    return atomic_load(&p->batch_failed) ? -1 : 0;
}

int empanel_reader_lost(const struct empanel_pool * pool) {
    return atomic_load(&pool->reader.uring.state) == RING_LOST;
}

// the path reads take now: io_uring, or the threads (asked for, or the ring broke)
int32_t empanel_reader_io(const struct empanel_pool * pool) {
    return pool->reader.uring.ring != NULL && atomic_load(&pool->reader.uring.state) == RING_OK
           ? EMPANEL_READ_IO_URING : EMPANEL_READ_IO_THREADS;
}
